"""The connector's worker half: restores and stores blocks of vLLM's KV tensors.

Contract
========

Runs in each vLLM worker process (one per TP rank), with its own kvtierd
session on the rank's pool.

- ``register_kv_caches``: describes vLLM's KV tensors (whatever the attention
  backend's shape; the block dimension is found, not assumed), group by
  group (``PoolChoice.groups``: each KV-cache group's layers; a layer the
  pool names that vLLM did not hand over is a start-up error), picks a data
  plane (``planes.py``) and connects (``link.py``: in the background;
  start-up waits for the first attempt). A daemon that is not up is not
  fatal: every load and store is skipped at once (vLLM computes) until the
  link's background thread reaches it.
- ``start_load_kv``: restores this step's loads before the forward reads
  them; a ``background`` load is queued instead, on a thread of its own,
  and ``get_finished`` reports its request once it ran (done or failed):
  vLLM runs steps without that request until then. A background load first
  waits for the stores queued before it, as a synchronous one does: its
  blocks may be ones a finished request's store is still reading. Blocks
  it could not restore (evicted since the lookup, daemon down) are reported
  by ``get_block_ids_with_load_errors``, no later than the step whose
  ``get_finished`` reports the request, and vLLM recomputes them (the
  scheduler half sets vLLM's ``kv_load_failure_policy`` to ``recompute``).
  A background load marked ``inline`` (the scheduler half's choice where a
  synchronous load would have been right) runs in ``start_load_kv`` itself,
  which vLLM calls after the step's forward when it has no synchronous load,
  and is reported as any background load is.
  With ``layer_overlap`` (one KV-cache group, lent restores: ``layer_copies.py``) a synchronous
  load's first layer is copied before the forward and the others beside it:
  ``wait_for_layer_load`` waits for one layer's, and ``wait_for_save`` (or,
  at the latest, ``get_block_ids_with_load_errors``) waits for all and reports
  the blocks of a deferred copy that failed, in the same step: vLLM drops
  that step's output for their requests and recomputes.
  A hybrid engine's (several KV-cache groups) are reported by request
  instead, with the request (``take_failed`` after ``get_finished``: vLLM's
  ``failed_recving``), since vLLM takes no failed block ids from such an
  engine; its loads are all background loads (the scheduler half's rule).
- ``wait_for_save``: hands this step's newly full blocks to a background
  thread and returns: kvtierd copies them while vLLM schedules the next step.
  A rank whose shard another rank stores (``PoolChoice.stores`` False:
  MLA's one copy of the KV) stores nothing; it loads as every rank does.
  ``handle_preemptions``, which vLLM calls at the start of the next step
  before any KV block is zeroed, copied or written, waits for those stores:
  a block is never reused while kvtierd reads it. A store that fails is a
  future miss, nothing else; while kvtierd is unavailable a step's stores
  are dropped at once, without a job for the store thread.
- ``take_loaded``: the requests whose loads ran, so the scheduler half
  drops their pins; ``take_load_timing``: the blocks restored and the
  seconds it took, for the scheduler half's ``load_mode`` (the connector
  wraps both in vLLM's worker metadata).
- ``take_stats``: the transfer counters (``adapter.stats.STAT_NAMES``) since the last
  call, for vLLM's own stats (``stats.KvtierStats``). ``blocks_loaded``,
  ``blocks_stored`` and ``load_s`` are also kept as running totals.

Engine-free: the step's transfers come as ``transfers.StepTransfers`` and
nothing here imports vLLM, so this data path runs, and is tested on CUDA
tensors shaped like vLLM's, where vLLM is not installed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from typing import TYPE_CHECKING

from kvtier.integrations.adapter.background import Background
from kvtier.integrations.adapter.layer_copies import LayerCopies
from kvtier.integrations.adapter.link import DaemonLink
from kvtier.integrations.adapter.planes import CopyDeadline, Plane, make_plane
from kvtier.integrations.adapter.stats import STAT_NAMES
from kvtier.integrations.adapter.transfers import BlockTransfer, StepTransfers
from kvtier.integrations.vllm.pool import PoolChoice, block_dim_of
from kvtier.integrations.vllm.settings import (CLIENT_NAME, REGISTRATION, SETTING_PREFIX, SOCKET_SETTING,
                                              ConnectorSettings)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtier.integrations.vllm")

STORE_DRAIN_TIMEOUT_S = 60.0


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, pool: PoolChoice, num_blocks: int) -> None:
        self._settings = settings
        self._pool = pool
        self._num_blocks = num_blocks
        self._plane: Plane | None = None
        self._link: DaemonLink | None = None
        self._stores = Background("kvtier-stores")
        self._layers: LayerCopies | None = None  # layer_overlap: lent copies finished beside the forward
        self._layer_of: dict[str, tuple[int, int]] = {}  # vLLM's layer name -> (group, tensor index)
        self._loads = Background("kvtier-loads")  # background loads, in order
        # What loads left for vLLM to collect; the loads thread adds to them.
        self._results_lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()  # for the scheduler half: pins to drop
        self._received: set[str] = set()  # background loads that ran, for get_finished
        self._failed: set[str] = set()  # of those, a hybrid engine's that did not restore every block
        self._failed_taken: set[str] = set()  # the failed of the last get_finished, for take_failed
        self._fail_by_request = pool.hybrid  # vLLM takes no failed block ids from a hybrid engine
        self.blocks_loaded = 0
        self.blocks_load_failed = 0
        self.loads_background = 0
        self.blocks_stored = 0
        self.blocks_loaded_by_layer = 0
        self.load_s = 0.0  # the forward waited this long for loads, in all
        # Restores since the last take_load_timing (both kinds): the scheduler's load mode weighs them.
        self._timed_blocks = 0
        self._timed_s = 0.0
        self._stats_taken = dict.fromkeys(STAT_NAMES, 0.0)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self._pool.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"kvtier: vLLM handed no KV tensor for layers {missing[:4]} of its own KV cache "
                             f"config (it handed {sorted(kv_caches)[:4]}...); kvtier cannot tell which bytes "
                             "are which: run this model without the kvtier connector")
        by_group = {g.index: [kv_caches[n] for n in g.layer_names] for g in self._pool.groups}
        dims_by_group = {g: [block_dim_of(t, self._num_blocks) for t in ts] for g, ts in by_group.items()}
        tensors = [t for ts in by_group.values() for t in ts]
        dims = [d for ds in dims_by_group.values() for d in ds]
        deadline = CopyDeadline(self._settings.timeout_s, self._pool.layout.block_bytes)
        if self._settings.layer_overlap and not self._pool.hybrid:
            self._layers = LayerCopies()
            self._layer_of = {n: (g.index, i) for g in self._pool.groups for i, n in enumerate(g.layer_names)}
        self._plane = plane = make_plane(self._settings.data_plane, by_group, dims_by_group,
                                         self._settings.staging_blocks, deadline, registration=REGISTRATION,
                                         setting_prefix=SETTING_PREFIX, lend=self._settings.lend, layers=self._layers)
        self._link = DaemonLink(self._settings.socket, self._pool.name, self._pool.layout,
                                retry_s=self._settings.retry_s, client_kwargs=self._settings.client_kwargs(),
                                on_connect=plane.connect, client_name=CLIENT_NAME, socket_setting=SOCKET_SETTING)
        log.info("kvtier: %d KV tensors in %d KV-cache groups (block dim %s, %d blocks) on the %s plane, pool %s%s",
                 len(tensors), len(by_group), sorted(set(dims)), self._num_blocks, plane.name, self._pool.name,
                 "" if self._pool.stores else f" (the KV of {self._pool.replicas} ranks: another rank stores it)")
        # Start-up, not a request: a daemon that answers is connected before the first step (milliseconds);
        # one that is missing costs nothing here when its socket file is absent, at most timeout_s otherwise.
        self._link.wait_first_attempt(self._settings.timeout_s)

    # ---- loads -------------------------------------------------------------------------

    def start_load_kv(self, meta: StepTransfers) -> None:
        if not meta.loads:
            return
        now = [load for load in meta.loads if not load.background]
        if now:
            self.wait_for_stores()
            t0 = time.perf_counter()
            with self._layers.deferring() if self._layers is not None else nullcontext():
                failed = sum(self._load(load) for load in now)
            self.load_s += time.perf_counter() - t0
            if failed:
                log.info("kvtier: %d of %d blocks to load were not restored; vLLM recomputes them",
                         failed, sum(len(x.keys) for x in now))
        inline = [load for load in meta.loads if load.background and load.inline]
        if inline:
            # Reported as a background load is (get_finished; a hybrid engine's failures per request), but
            # restored now, after this step's forward: the engine had nothing else to run, so no thread
            # hand-off and no empty engine steps spinning beside the copy.
            self._load_in_background(inline, self._stores.submit(lambda: None))
        later = [load for load in meta.loads if load.background and not load.inline]
        if later:
            # Done once every store queued so far is (one thread, in order).
            stores_before = self._stores.submit(lambda: None)
            self._loads.submit(lambda: self._load_in_background(later, stores_before))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Until that layer's deferred copies landed (``layer_overlap``; at once otherwise)."""
        key = self._layer_of.get(layer_name)
        if self._layers is None or key is None:
            return
        t0 = time.perf_counter()
        self._layers.wait(*key)
        self.load_s += time.perf_counter() - t0

    def _settle_layers(self) -> None:
        """Every deferred copy of the step landed; the blocks of those that failed are load errors now."""
        if self._layers is None:
            return
        failed = self._layers.settle()
        self.blocks_loaded_by_layer = self._layers.blocks_landed
        if failed:
            with self._results_lock:
                self._load_errors |= failed
                self.blocks_loaded -= len(failed)
                self.blocks_load_failed += len(failed)
            log.info("kvtier: %d blocks restored beside the forward did not land intact; vLLM recomputes them",
                     len(failed))

    def _load_in_background(self, loads: list[BlockTransfer], stores_before: Future[None]) -> None:
        failed = 0
        failed_requests: set[str] = set()
        try:
            stores_before.result(STORE_DRAIN_TIMEOUT_S)
        except Exception:
            # The stores hang: restoring now could race one still reading a
            # block it overwrites. Every block of these loads is recomputed.
            failed = self._fail(loads)
            failed_requests = {load.req_id for load in loads}
        else:
            for load in loads:
                missed = self._load(load)
                failed += missed
                if missed:
                    failed_requests.add(load.req_id)
        finally:
            with self._results_lock:
                self._received.update(load.req_id for load in loads)
                if self._fail_by_request:
                    self._failed |= failed_requests
        if failed:
            log.info("kvtier: %d of %d blocks to load in the background were not restored; vLLM recomputes them",
                     failed, sum(len(x.keys) for x in loads))

    def _load(self, load: BlockTransfer) -> int:
        """Restore one request's blocks; returns how many were not restored (reported as load errors)."""
        got = 0
        t0 = time.perf_counter()
        if self._plane is not None and self._link is not None:
            plane = self._plane
            got = self._link.call(lambda c: plane.restore(c, load.keys, load.block_ids, load.group)) or 0
        elapsed_s = time.perf_counter() - t0
        with self._results_lock:
            if got:  # a skipped call (daemon down) says nothing about a restore's time
                self._timed_blocks += got
                self._timed_s += elapsed_s
            if not self._fail_by_request:
                self._load_errors.update(load.block_ids[got:])
            self.blocks_loaded += got
            self.blocks_load_failed += len(load.keys) - got
            self.loads_background += load.background
            self._loaded.add(load.req_id)
        return len(load.keys) - got

    def _fail(self, loads: list[BlockTransfer]) -> int:
        with self._results_lock:
            for load in loads:
                if not self._fail_by_request:
                    self._load_errors.update(load.block_ids)
                self._loaded.add(load.req_id)
                self.blocks_load_failed += len(load.keys)
                self.loads_background += load.background
        return sum(len(load.keys) for load in loads)

    def get_finished(self) -> set[str]:
        """The requests whose background loads ran since the last call (done or failed)."""
        with self._results_lock:
            received, self._received = self._received, set()
            # Taken with them, so a request is never reported failed before it is reported done.
            self._failed_taken, self._failed = self._failed, set()
        return received

    def take_failed(self) -> set[str]:
        """Of the requests the last ``get_finished`` reported, a hybrid engine's whose load failed: vLLM
        recomputes them whole (a single-group engine's failed blocks are ``get_block_ids_with_load_errors``')."""
        failed, self._failed_taken = self._failed_taken, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Taken after get_finished in each step (vLLM's order): a request it
        # reported has its errors in here already.
        self._settle_layers()
        with self._results_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, float]:
        """``STAT_NAMES``' growth since the last call."""
        with self._results_lock:
            now = {name: getattr(self, name) for name in STAT_NAMES}
        delta = {name: now[name] - self._stats_taken[name] for name in STAT_NAMES}
        self._stats_taken = now
        return delta

    def take_load_timing(self) -> tuple[int, float]:
        """Blocks restored since the last call, and the seconds their restores took."""
        with self._results_lock:
            timing = (self._timed_blocks, self._timed_s)
            self._timed_blocks, self._timed_s = 0, 0.0
        return timing

    def take_loaded(self) -> set[str]:
        """The requests whose loads ran since the last call (done or failed): their pins can go."""
        with self._results_lock:
            loaded, self._loaded = self._loaded, set()
        return loaded

    # ---- stores ------------------------------------------------------------------------

    def wait_for_save(self, meta: StepTransfers) -> None:
        self._settle_layers()  # the forward is over: no store may read a block still being restored
        if not meta.stores or self._plane is None or self._link is None or not self._pool.stores:
            return
        if not self._link.is_up():
            # Skipped here, not on the store thread: a job per step would cost the next step's
            # handle_preemptions a thread hand-off for nothing while kvtierd is unavailable.
            return
        plane, link = self._plane, self._link
        for st in meta.stores:
            self._stores.submit(lambda st=st: link.call(lambda c: plane.store(c, st.keys, st.block_ids, st.hints,
                                                                              st.group)))
        self.blocks_stored += sum(len(st.keys) for st in meta.stores)

    def wait_for_stores(self) -> None:
        if not self._stores.wait_idle(STORE_DRAIN_TIMEOUT_S):
            raise RuntimeError(f"kvtier: stores to kvtierd did not finish in {STORE_DRAIN_TIMEOUT_S} s")

    def shutdown(self) -> None:
        self._loads.wait_idle(self._settings.timeout_s * 4)
        self._stores.wait_idle(self._settings.timeout_s * 4)
        self._loads.close(timeout_s=1.0)
        self._stores.close(timeout_s=1.0)
        if self._link is not None:
            self._link.close()
        if self._layers is not None:
            self._layers.settle()
            self._layers.close()
        close = getattr(self._plane, "close", None)  # RegisteredPlane's lent restores: their thread, mappings
        if close is not None:
            close()

