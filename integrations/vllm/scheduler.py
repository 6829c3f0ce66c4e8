"""The connector's scheduler half: which tokens kvtierd holds, and what to move.

Contract
========

Runs in vLLM's scheduler (engine-core) process, one instance per engine.
Talks to kvtierd through ``DaemonLink`` on one background thread, so the
scheduler never waits on a round trip:

- What may be loaded or stored at all is ``prefix_support.py``'s call, made
  once per engine (``support``, from the connector) and once per request: a
  request that may not load is answered 0 without a lookup; one that may
  not store stores nothing.
- ``on_new_request`` queues the request's lookup at once (hash the prompt's
  full blocks, ``lookup(pin=True)``); the background thread sends every
  lookup queued since its last round trip in one pipelined batch
  (``Client.lookup_many``), so a burst of arrivals costs one round trip, not
  one each. The blocks found stay pinned in kvtierd, bound to this engine's
  session lease. With vLLM's hybrid KV-cache manager (several KV-cache
  groups: ``groups.py``), the hit is the prefix every group can serve by
  vLLM's rules, and only the blocks it needs are looked up and pinned
  (``hits.py``: a sliding-window group's window at the hit's end; one more
  round trip).
- ``get_num_new_matched_tokens`` answers from that lookup: ``None`` ("ask me
  again") while it is in flight, then the tokens kvtierd holds beyond vLLM's
  own hit, block-aligned and always leaving the last prompt token to compute.
  Asked for the first time while the engine is idle (the last step
  scheduled no tokens), it may wait for the lookup, at most
  ``lookup_wait_ms`` per scheduler step in all: a lookup takes ~1.5 ms, and
  answering at once would cost the request a whole (empty) engine step.
  With requests running it never waits: their next step goes first. Repeated
  calls for a waiting request cost a dict lookup.
- Each answer also says whether the load runs beside the forward
  (``load_mode``, ``load_modes.py``): ``sync`` loads before the step's
  forward, which then waits for it; ``async`` loads while vLLM runs steps
  without the request (it waits in WAITING_FOR_REMOTE_KVS until the worker
  reports it loaded, at least one step later); ``adaptive`` (the default)
  loads sync on an idle engine, where waiting a step would only add
  latency, and on a busy one whichever costs less: the running requests'
  stall under a sync load (the measured restore rate times the blocks,
  times the requests running) or the request's own extra steps under an
  async one.
- ``update_state_after_alloc`` turns an answer into loads (keys + vLLM block
  ids, one per group) for the next ``build_connector_meta``: the blocks
  vLLM allocated for the hit in each group, skipping the null blocks vLLM
  puts where a sliding window does not reach; pins of blocks not loaded go.
  A hybrid engine's loads always run beside the forward (``background``):
  vLLM takes a failed load of such an engine only as a failed request
  (``failed_recving``: it recomputes it), never as failed blocks, and only
  for a request that waited for its load. Where ``load_mode`` would have
  loaded synchronously, the load is ``inline``: the worker runs it right
  after the step's forward, and the request waits one engine step.
- ``build_connector_meta`` hands the worker this step's loads, and the full
  blocks this step computes for every scheduled request that kvtierd did not
  hold (write-through: prompt and generated blocks alike), in every group
  (a sliding-window group's blocks too: a later hit may end anywhere).
  Where ranks share one copy of the KV (``PoolChoice.stores``), only the
  storing rank's worker copies them.
- A request's hints (session, retain_s, priority: ``hints.py`` says how a
  vLLM user sets them) go with its lookup and its stores; its stores also
  carry the tokens it generated so far (``output_tokens``), which a
  session-aware policy reads as a sign of how long it will be silent.
  A request without hints sends none.
- Every pin is taken under the request's pin tag (``pin_tag``: its id).
  Pins of a load are dropped when the worker reports it ran
  (``update_connector_output``); when the request finishes or is aborted
  (``request_finished``) every pin of its tag goes (``Client.unpin_tag``),
  those of a lookup whose answer was lost (a timed-out batch) too: a pin
  the connector never heard of does not outlive its request. A release the
  daemon could not take (it was down) is retried by the next call that
  reaches it, unless the session it was taken in is gone (with its pins).
  A daemon that is down or missing answers every lookup with 0 at once:
  vLLM computes, nothing waits (``link.py`` reconnects in the background).
  A lookup the daemon refuses (``TOO_MANY_PINS``, ...) is that request's 0
  only: ``lookup_many`` answers each request on its own.
- With vLLM's KV cache events on (``--kv-events-config``), the blocks this
  engine stores or loads are announced to vLLM's publisher as held in
  kvtierd's tier (medium ``CPU``) while kvtierd's journal says they are
  (``kv_events.py``); ``take_events`` hands them to vLLM.
- ``get_external_cache_hit_sources`` splits a load's tokens by the kvtier
  tier that held them at lookup (gpu: ``device``, cpu: ``host``, remote:
  ``external_unspecified``), for vLLM's ``prompt_tokens_cached_by_source``.
- ``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``, which
  RL frameworks call after a weight update) makes every KV block from before
  it unreachable to this engine: keys from then on carry a new random epoch
  (``keys.py``). Waiting requests look up again under the new keys, and
  their old pins go. A request that already computed tokens keeps its old
  keys and stores nothing more: its KV is from before the reset (so does one
  whose load is still running: what it loads is old). Nothing is
  deleted in kvtierd: other engines on the pool may still run the old
  weights, and stores in flight land under keys no one asks for again; the
  old blocks age out of the LRU first. The epoch is random, not counted, so
  two engines can never share an epoch over different weights; the price is
  that engines stop sharing prefixes with each other until they restart.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvtier.client.hashing import BlockHasher
from kvtier.client.protocol import MAX_STR_LEN, Hints, KvtierError
from kvtier.integrations.adapter.background import Background
from kvtier.integrations.adapter.hits import HitQuery, find_hits
from kvtier.integrations.adapter.link import DaemonLink
from kvtier.integrations.adapter.load_modes import make_load_mode
from kvtier.integrations.adapter.transfers import BlockTransfer
from kvtier.integrations.vllm.hints import hints_of
from kvtier.integrations.vllm.keys import RequestKeys
from kvtier.integrations.vllm.kv_events import KvEvents
from kvtier.integrations.vllm.metadata import KvtierMetadata, KvtierWorkerMetadata
from kvtier.integrations.vllm.pool import PoolChoice
from kvtier.integrations.vllm.prefix_support import SUPPORTED, PrefixSupport, request_support
from kvtier.integrations.vllm.settings import CLIENT_NAME, SOCKET_SETTING, ConnectorSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.integrations.vllm")


@dataclass(slots=True)
class _Tracked:
    """The connector's view of one request."""

    keys: RequestKeys
    request: Request
    hints: Hints | None = None  # what the request says about its reuse (integrations.vllm.hints)
    lookup: Future[int] | None = None  # blocks kvtierd holds (and pinned) from block 0
    held_blocks: int = 0  # the answer handed to the scheduler, in blocks
    asked: bool = False  # the scheduler asked about it since its lookup started
    background: bool = False  # the answer's load runs beside the forward (load_mode)
    inline: bool = False  # ... but in the worker's start_load_kv, after the forward (a hybrid engine's sync choice)
    pinned: list[bytes] = field(default_factory=list)  # keys this request holds pinned
    tiers: Sequence[str] = ()  # the lookup's answer: the tier of each block held
    stored_blocks: int = 0  # blocks [0, stored_blocks) are in kvtierd or on their way
    stores: bool = True  # False once it ran across a reset_cache (its KV is from before it), or prefix_support says so
    loads: bool = True  # False where prefix_support says it may not be handed a prefix
    # kvtierd may hold pins under its tag (a lookup found blocks, or its answer was lost): its end releases the tag
    may_hold_pins: bool = False

    @property
    def tag(self) -> str:
        return pin_tag(self.request.request_id)


def pin_tag(request_id: str) -> str:
    """The tag of a request's pins in kvtierd: its id, or a digest of an id the protocol would refuse."""
    if 0 < len(request_id) <= MAX_STR_LEN:
        return request_id
    return "sha256:" + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()


def _with_output(hints: Hints | None, output_tokens: int) -> Hints | None:
    return replace(hints, output_tokens=output_tokens) if hints is not None and output_tokens > 0 else hints


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, pool: PoolChoice, *, kv_events: bool = False,
                 support: PrefixSupport = SUPPORTED) -> None:
        self._bs = pool.block_size
        self._groups = pool.groups
        # The first full-attention group stands for the prefix (events, hit sources); a pool always has a group.
        self._ref = next((g for g in pool.groups if not g.is_window), pool.groups[0])
        # vLLM takes a hybrid engine's failed loads per request, from background loads only (see the contract).
        self._loads_in_background = pool.hybrid
        self._null_block_id: int | None = None  # vLLM's null block, read from its block pool when first needed
        self._support = support
        self._refusals_logged: set[str] = set()  # request_support's reasons, each logged once
        if support != SUPPORTED:
            log.warning("kvtier: this engine: %s, because %s", support.effect(), support.why)
        self._hasher = BlockHasher(pool.block_size, settings.hash_algo)
        self._link = DaemonLink(settings.socket, pool.name, pool.layout, retry_s=settings.retry_s,
                                client_kwargs=settings.client_kwargs(), client_name=CLIENT_NAME,
                                socket_setting=SOCKET_SETTING)
        self._link.wait_first_attempt(settings.timeout_s)  # start-up: the first requests may hit
        self._jobs = Background("kvtier-scheduler")
        # vLLM publishes KV cache events: kvtierd's go with them (kv_events.py).
        self._events = KvEvents(self._link, self._jobs, self._bs, interval_s=settings.events_interval_s,
                                max_blocks=settings.events_max_blocks) if kv_events else None
        self._batch: list[tuple[_Tracked, int, Future[int]]] = []  # lookups not yet sent
        self._batch_lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._epoch: bytes | None = None  # set by reset_cache; mixed into every key from then on
        # reset_cache re-keys requests while the background thread hands out lookup answers.
        self._reset_lock = threading.Lock()
        self._loads: list[BlockTransfer] = []  # decided by update_state_after_alloc, sent by the next meta
        self._load_pins: dict[str, tuple[str, list[bytes]]] = {}  # req_id -> (tag, pins to drop once its load ran)
        # (session id, tag) of finished requests whose release kvtierd has not confirmed (it was down)
        self._unreleased: deque[tuple[str | None, str]] = deque()
        self._retrying = False  # a job retrying _unreleased is queued
        self._refusals_logged_s = -float("inf")
        self.kv_cache_manager: KVCacheManager | None = None
        self._load_mode = make_load_mode(settings.load_mode, float(settings.async_extra_steps))
        self._wait_per_step_s = settings.lookup_wait_ms / 1e3
        self._wait_left_s = self._wait_per_step_s  # refilled by build_connector_meta (once a step)
        self._engine_busy = False  # the last step scheduled tokens: a wait would delay running requests
        self.waited_s = 0.0  # of calls_s, time spent waiting for lookups (bench/vllm.py reads it)
        self.calls_s = 0.0  # time spent in get_num_new_matched_tokens (bench/vllm.py reads it)
        self.calls = 0

    # ---- lookups -----------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._start_lookup(self._track(request))

    def _track(self, request: Request) -> _Tracked:
        t = self._tracked.get(request.request_id)
        if t is None:
            t = self._tracked[request.request_id] = _Tracked(RequestKeys(self._hasher, request, self._epoch),
                                                             request, hints_of(request))
            support = request_support(request)
            t.loads = self._support.loads and support.loads
            t.stores = self._support.stores and support.stores
            if support != SUPPORTED and support.why not in self._refusals_logged:
                self._refusals_logged.add(support.why)
                log.warning("kvtier: a request: %s, because %s (logged once per reason)", support.effect(), support.why)
        return t

    def _start_lookup(self, t: _Tracked) -> None:
        # Never the whole prompt: vLLM must compute at least its last token.
        max_blocks = (t.request.num_tokens - 1) // self._bs
        if max_blocks <= 0 or not t.loads or not self._link.is_up():
            done: Future[int] = Future()
            done.set_result(0)
            t.lookup = done
            return
        fut: Future[int] = Future()
        t.lookup = fut
        t.asked = False
        with self._batch_lock:
            self._batch.append((t, max_blocks, fut))
            first = len(self._batch) == 1
        if first:
            self._jobs.submit(self._flush_lookups)

    def _flush_lookups(self) -> None:
        """Every lookup queued since the last flush, in one pipelined round trip (hybrid: one per round)."""
        with self._batch_lock:
            batch, self._batch = self._batch, []
        self._release_unreleased()
        with self._reset_lock:
            # The keys as of now: reset_cache may re-key a request while its lookup is out.
            queries = [HitQuery(t.keys.of_group, max_blocks, t.hints, t.tag) for t, max_blocks, _ in batch]
        hits = find_hits(self._link.call, self._groups, queries)
        refused = [r for h in hits for r in h.refusals]
        if refused:
            self._log_refusals(sum(1 for h in hits if h.refusals), len(batch), refused[0])
        stale: list[tuple[str, list[bytes]]] = []
        for (t, _, fut), q, hit in zip(batch, queries, hits):
            held = hit.blocks
            if hit.pinned or hit.lost:
                t.may_hold_pins = True
            with self._reset_lock:
                current = t.lookup is fut  # else reset_cache replaced it while this one was out
                if current:
                    t.pinned, t.tiers = hit.pinned, hit.tiers
            if not current:
                if hit.pinned:
                    stale.append((q.tag, hit.pinned))
                held = 0
            fut.set_result(held)
        if stale:
            self._link.call(lambda c: [c.unpin(ks, pin_tag=tag) for tag, ks in stale])

    def _log_refusals(self, refused: int, batch: int, first: KvtierError) -> None:
        # Logs per minute, not per batch: a pool at its pin limit refuses every batch.
        now = time.monotonic()
        if now - self._refusals_logged_s >= 60.0:
            self._refusals_logged_s = now
            log.warning("kvtier: kvtierd refused %d of a batch of %d lookups (those requests compute): %s "
                        "(logged once a minute)", refused, batch, first)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        try:
            t = self._track(request)
            if t.lookup is None:  # resumed after preemption, or never announced
                self._start_lookup(t)
            assert t.lookup is not None
            if not t.lookup.done() and not t.asked and self._wait_left_s > 0 and not self._engine_busy:
                w0 = time.monotonic()
                concurrent.futures.wait([t.lookup], timeout=self._wait_left_s)
                waited = time.monotonic() - w0
                self._wait_left_s -= waited
                self.waited_s += waited
            t.asked = True
            if not t.lookup.done():
                return None, False
            try:
                t.held_blocks = t.lookup.result()
            except Exception:
                t.held_blocks = 0
            tokens = max(0, t.held_blocks * self._bs - num_computed_tokens)
            background = tokens > 0 and self._load_mode.background(-(-tokens // self._bs))
            # A hybrid engine loads in the background always; where load_mode chose a synchronous load, the
            # worker runs it right after the step's forward (inline), so the request waits one step, not more.
            t.inline = tokens > 0 and self._loads_in_background and not background
            t.background = background or t.inline
            return tokens, t.background
        finally:
            self.calls_s += time.perf_counter() - t0
            self.calls += 1

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        t = self._tracked.get(request.request_id)
        if t is None:
            return
        t.lookup = None  # consumed: a preempted request looks up again when it returns
        pinned, t.pinned = t.pinned, []
        t.stored_blocks = max(t.stored_blocks, t.held_blocks)
        if num_external_tokens <= 0:
            self._unpin(t.tag, pinned)
            return
        end = t.held_blocks
        start = end - num_external_tokens // self._bs
        ids_by_group = blocks.get_block_ids()
        null = self._null_id()
        loading: set[bytes] = set()
        for g in self._groups:
            ids, keys = ids_by_group[g.index], t.keys.of_group(g.domain, end)
            # Every block vLLM allocated for the hit (not its null block: outside a sliding window).
            sel = [i for i in range(start, end) if ids[i] != null]
            if sel:
                self._loads.append(BlockTransfer([keys[i] for i in sel], [ids[i] for i in sel], request.request_id,
                                                 background=t.background, group=g.index, inline=t.inline))
                loading.update(keys[i] for i in sel)
        # Pins of blocks not loaded (past the hit, windows tried and not taken) go now; the rest once loaded.
        self._unpin(t.tag, [k for k in pinned if k not in loading])
        self._load_pins[request.request_id] = (t.tag, [k for k in pinned if k in loading])
        if self._events is not None:
            self._events.note(request, start, t.keys.of_group(self._ref.domain, end)[start:end], held=True)

    # ---- each step ---------------------------------------------------------------------

    def build_connector_meta(self, out: SchedulerOutput) -> KvtierMetadata:
        meta = KvtierMetadata(loads=self._loads)
        self._loads = []
        self.begin_step()
        self._engine_busy = bool(out.num_scheduled_tokens)
        self._load_mode.observe_step(len(out.num_scheduled_tokens), time.monotonic())
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, before in computed.items():
            t = self._tracked.get(req_id)
            if t is None or not t.stores:
                continue
            done_tokens = min(before + out.num_scheduled_tokens.get(req_id, 0), t.request.num_tokens)
            full = done_tokens // self._bs
            if full <= t.stored_blocks:
                continue
            ids_by_group = self._block_ids(req_id)
            full = min([full] + [len(ids) for ids in ids_by_group])
            if full <= t.stored_blocks:
                continue
            hints = _with_output(t.hints, t.request.num_output_tokens)
            null = self._null_id()
            for g in self._groups:
                ids, keys = ids_by_group[g.index], t.keys.of_group(g.domain, full)
                # A sliding window's blocks vLLM already let go (its null block) were stored when computed.
                sel = [i for i in range(t.stored_blocks, full) if ids[i] != null]
                if sel:
                    meta.stores.append(BlockTransfer([keys[i] for i in sel], [ids[i] for i in sel], req_id, hints,
                                                     group=g.index))
            if self._events is not None:
                self._events.note(t.request, t.stored_blocks,
                                  t.keys.of_group(self._ref.domain, full)[t.stored_blocks:full], held=False)
            t.stored_blocks = full
        if self._events is not None:
            self._events.poll()
        if self._unreleased and not self._retrying and self._link.is_up():
            # Releases kvtierd missed while down: an idle engine sends no lookup to carry them.
            self._retrying = True
            self._jobs.submit(self._retry_releases)
        return meta

    def _retry_releases(self) -> None:
        try:
            self._release_unreleased()
        finally:
            self._retrying = False

    def begin_step(self) -> None:
        """A new scheduler step: its budget for waiting on lookups starts afresh.

        vLLM ends every step with ``build_connector_meta``, which calls this;
        a driver without vLLM's scheduler (bench/vllm.py) calls it per step.
        """
        self._wait_left_s = self._wait_per_step_s

    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block ids in every group (vLLM's null block where a sliding window let go)."""
        assert self.kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        return tuple(list(ids) for ids in self.kv_cache_manager.get_block_ids(req_id))

    def _null_id(self) -> int:
        """vLLM's null block id (its block pool's first block; 0 in vLLM 0.32), -1 before a manager is bound."""
        if self._null_block_id is None:
            pool = getattr(self.kv_cache_manager, "block_pool", None)
            if pool is None:
                return -1  # bench/vllm.py drives the scheduler half without vLLM's manager: no null blocks
            self._null_block_id = int(pool.null_block.block_id)
        return self._null_block_id

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KvtierWorkerMetadata):
            for req_id in meta.loaded_req_ids:
                tag, pins = self._load_pins.pop(req_id, ("", []))
                self._unpin(tag, pins)
            self._load_mode.observe_load(meta.load_blocks, meta.load_s)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """``num_external_tokens`` (the load planned for ``request``) by the tier each block was in at lookup."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        t = self._tracked.get(request.request_id)
        if num_external_tokens <= 0:
            return {}
        n = num_external_tokens // self._bs
        tiers = list(t.tiers[t.held_blocks - n: t.held_blocks]) if t is not None and t.held_blocks >= n else []
        if len(tiers) != n or n * self._bs != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        by_tier = {"gpu": CacheHitSource.DEVICE, "cpu": CacheHitSource.HOST}
        sources: dict[CacheHitSource, int] = {}
        for tier in tiers:
            source = by_tier.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            sources[source] = sources.get(source, 0) + self._bs
        return sources

    def reset_cache(self) -> bool:
        """Nothing cached before this call is found or stored by this engine again (see the contract)."""
        drop: list[tuple[str, list[bytes]]] = []
        rekeyed = kept = 0
        with self._reset_lock:
            self._epoch = os.urandom(16)
            for req_id, t in self._tracked.items():
                if t.request.num_computed_tokens > 0 or req_id in self._load_pins:
                    t.stores = False  # it runs on over KV from before the reset (computed or loading)
                    kept += 1
                    continue
                # Waiting (or preempted by this very reset): it computes from scratch.
                drop.append((t.tag, t.pinned))
                t.keys = RequestKeys(self._hasher, t.request, self._epoch)
                t.pinned, t.tiers, t.lookup = [], (), None
                t.held_blocks = t.stored_blocks = 0
                rekeyed += 1
        for tag, pins in drop:
            self._unpin(tag, pins)
        if self._events is not None:
            self._events.forget_all()  # this engine asks for none of those keys again
        log.info("kvtier: cache reset: new key epoch; %d waiting requests look up again, %d running ones "
                 "store no more", rekeyed, kept)
        return True

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        t = self._tracked.pop(request.request_id, None)
        self._load_pins.pop(request.request_id, None)
        if t is not None:
            # Every pin of its tag, known here or not. The background thread runs jobs in order,
            # and a lookup still out was submitted before this: it has pinned (and said so) by then.
            self._jobs.submit(lambda: self._release(t.tag) if t.may_hold_pins else None)
        # Stores still in flight are waited for by the worker before vLLM
        # reuses any block (handle_preemptions), so the blocks may go now.
        return False, None

    def _release(self, tag: str) -> None:
        """Background thread: drop every pin of ``tag`` (a finished request), now or once kvtierd answers."""
        client = self._link.client
        self._unreleased.append((client.sid if client is not None else None, tag))
        self._release_unreleased()

    def _release_unreleased(self) -> None:
        """Background thread: the releases kvtierd has not confirmed, oldest first, while it answers."""
        while self._unreleased:
            sid, tag = self._unreleased[0]
            client = self._link.client
            if client is not None and sid is not None and client.sid != sid:
                self._unreleased.popleft()  # taken in a session that is gone, and its pins with it
                continue
            if self._link.call(lambda c: c.unpin_tag(tag)) is None and not self._link.is_up():
                return  # down: the next call to reach kvtierd tries again
            self._unreleased.popleft()  # done, or refused (logged by the link): not retried forever

    def take_events(self) -> list[Any]:
        """vLLM KV cache events of kvtierd's tier since the last call (``kv_events.py``); [] when off."""
        return self._events.take() if self._events is not None else []

    def _unpin(self, tag: str, keys: list[bytes]) -> None:
        if keys:
            self._jobs.submit(lambda: self._link.call(lambda c: c.unpin(keys, pin_tag=tag)))

    def close(self) -> None:
        self._jobs.close(timeout_s=2.0)
        self._link.close()
