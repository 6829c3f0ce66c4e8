"""Lent restores: the worker copies CPU-tier blocks kvtierd lends it, in its own process.

Contract
========

``LentRestore(engines, always=False)`` serves ``RegisteredPlane`` on KV tensors in host
memory (``engines``: the engine's KV-cache group id -> the ``BlockLayout`` of its tensors).

- ``ask(client) -> bool``: whether a restore should ask for a lend: the
  daemon lists feature ``"lend"`` (it does for clients of its own user), no
  lent file failed to map before, and (unless ``always``: setting ``lend =
  true``) every group's tensors take a block in runs of at least ``MIN_RUN_BYTES`` (vLLM's CPU backend: one run per layer;
  a layout of many small runs per block copies slower here, a memmove call
  from Python each, than kvtierd's one kernel copy of them all).
- ``copy(client, lent, block_ids, group) -> int | None``: copies the lent
  blocks (``kvtier.client.arena_map.Lent``) from the worker's read-only
  mapping of kvtierd's CPU-tier file into ``block_ids`` of the group's
  tensors: memmoves of the runs ``RunTable`` expands from one block's
  plan (``plan_block_copy``, made once per mapping and group). Returns the blocks restored: all of them, or 0 when the copy ended past
  the lend's lease (the daemon may have reused the slots: vLLM recomputes
  them). None where the file cannot be mapped (another user's, replaced):
  lends are not asked for again; the caller restores the usual way.
- The lend is not ended at once (a round trip the forward would wait for,
  or a thread hand-off that costs as much on a busy host): its id waits in
  ``take_pending()``, which the plane sends along with its next restore
  (``restore``'s ``release``), or ``flush(client)`` ends them (the plane's
  store, on the store thread). A worker that goes quiet leaves its last
  lend to end with its lease (``lend_lease_s``, 2 s by default).
- ``close()`` unmaps the files (the session's end ends its lends).
- ``copies`` / ``copy_seconds_total``: lent copies made and the seconds they
  took, mapping lookup to lease check (where a restore's time goes: the rest is
  the round trip).
- ``copy_engine`` (``"auto"``): how a copy moves its bytes: ``"strided"``,
  one ``np.copyto`` per run and group of slots that follow each other
  (``strided_copy.StridedCopy``); ``"memmove"``, one memmove per run and
  block (``RunTable.copy``); ``"auto"``, strided where its pieces average
  ``STRIDED_MIN_PIECE_BYTES`` or more. bench/vllm_restore.py times them side by side.
- ``copy_threads`` (1): 2 shares each copy's pieces with a helper thread
  (``TwoThreadCopy``); bench/vllm_restore.py times both.
- ``layers`` (None): a ``LayerCopies``; while it is ``active()`` on the
  calling thread, a strided copy copies the pieces of its group's first
  tensor at once and defers the rest (``defer``): the lease check and the
  lend's end run after its last piece, and ``copy`` counts the blocks restored
  (a deferred failure comes back through ``LayerCopies.settle``).
- ``run_tables`` (True): False plans every copy anew (``copy_host_blocks``), as
  before run tables: bench/vllm_restore.py times both in one run.

Why: kvtierd copying into vLLM's tensors is a copy by another process,
~0.4-0.6x of a memcpy on a loaded host (bench/vllm_restore.py); here the
copy runs in the process that owns the destination. Why a run table: a
restore's full ``plan_block_copy`` (slot checks, both layouts' templates, overlap
checks, a sort) took ~0.25 ms of a ~3.7 ms 32 MiB restore on the 2-core VM;
the lent source is always a slab row per slot, so one block's runs, shifted
per slot, are the plan (~0.05 ms).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.client.arena_map import ArenaMaps, Lent, LendUnavailable
from kvtier.client.client import Client
from kvtier.client.protocol import FEATURE_LEND, KvtierError
from kvtier.blocks.copy_plan import NotPlannable, copy_host_blocks, plan_block_copy
from kvtier.blocks.layout import BlockLayout
from kvtier.integrations.adapter.layer_copies import LayerCopies
from kvtier.integrations.adapter.strided_copy import StridedCopy

log = logging.getLogger("kvtier.integrations")

RELEASE_TIMEOUT_S = 5.0
# A memmove call from Python costs ~1-2 us on the 2-core VM. bench/protocol.py's vLLM layout (64 runs per
# block) ran lent at 0.16x memcpy against kvtierd's 0.24x with 4 KiB runs, at 0.41x against 0.35x with 32 KiB.
MIN_RUN_BYTES = 16 * 1024
# A strided piece costs ~2-3 us from Python (two slices and an np.copyto call), a memmove ~1-2 us after a
# ~0.2 ms numpy plan per copy: small pieces (many small runs, scattered slots) stay with memmoves.
STRIDED_MIN_PIECE_BYTES = 64 * 1024


class LentRestore:
    """See the module docstring."""

    def __init__(self, engines: Mapping[int, BlockLayout], *, always: bool = False) -> None:
        self._engines = dict(engines)
        self.min_run_bytes = min(_smallest_run(e) for e in self._engines.values())
        self._runs_ok = always or self.min_run_bytes >= MIN_RUN_BYTES
        self._maps = ArenaMaps(BlockLayout.from_buffer)
        self._tables: dict[int, RunTable | None] = {}  # group -> runs from the mapped file (None: not plannable)
        self._strided: dict[int, StridedCopy | None] = {}  # group -> its table's strided copies (None: memmoves)
        self._pending: list[int] = []  # lends copied, not yet ended
        self._pending_lock = threading.Lock()  # the loads thread and the forward's thread both restore
        self._off = False
        self.run_tables = True
        self.copy_threads = 1
        self.layers: LayerCopies | None = None
        self.copy_engine = "auto"
        self._two: TwoThreadCopy | None = None
        self.copies = 0
        self.copy_seconds_total = 0.0
        self.lent_blocks = 0
        self.late_copies = 0

    def ask(self, client: Client) -> bool:
        return not self._off and self._runs_ok and FEATURE_LEND in client.features

    def copy(self, client: Client, lent: Lent, block_ids: list[int], group: int) -> int | None:
        t0 = time.perf_counter()
        try:
            src = self._maps.layout(lent)
        except LendUnavailable as exc:
            self._off = True
            log.warning("kvtier: cannot read the CPU-tier blocks kvtierd lends (%s); kvtierd copies them from now on",
                        exc)
            self._done(lent.id)
            return None
        n = len(lent.slots)
        dst_slots = block_ids[:n]
        table = self._tables.get(group)
        if self.run_tables and (table is None or table.src is not src):
            table = self._tables[group] = RunTable.build(src, self._engines[group])
            self._strided[group] = StridedCopy.build(table) if table is not None else None
        strided = self._strided.get(group) if table is not None and self.run_tables else None
        by_strides = strided is not None and self._strides(strided, lent.slots, dst_slots)
        layers = self.layers
        if by_strides and layers is not None and self.copy_threads == 1 and layers.active():
            assert strided is not None
            return self._copy_by_layers(layers, strided, lent, dst_slots, group, t0)
        if table is not None and self.run_tables and self.copy_threads > 1:
            if self._two is None:
                self._two = TwoThreadCopy()
            if by_strides:
                assert strided is not None
                self._two.copy_arrays(strided.arrays(lent.slots, dst_slots, max_piece_bytes=TwoThreadCopy.PIECE_BYTES))
            else:
                self._two.copy(*table.runs(lent.slots, dst_slots, max_run_bytes=TwoThreadCopy.PIECE_BYTES))
        elif by_strides:
            assert strided is not None
            strided.copy(lent.slots, dst_slots)
        elif table is not None and self.run_tables:
            table.copy(lent.slots, dst_slots)
        else:
            copy_host_blocks(src, lent.slots, self._engines[group], dst_slots)
        intact = lent.intact()
        self.copies += 1
        self.copy_seconds_total += time.perf_counter() - t0
        self._done(lent.id)
        if not intact:
            # The lease ran out during the copy: kvtierd may have reused a slot under it.
            self.late_copies += 1
            log.info("kvtier: a lent restore of %d blocks ended past its lease; the engine recomputes them", n)
            return 0
        self.lent_blocks += n
        return n

    def _copy_by_layers(self, layers: LayerCopies, strided: StridedCopy, lent: Lent, dst_slots: list[int],
                        group: int, t0: float) -> int:
        """The first tensor's pieces now, the rest deferred (the contract's ``layers``)."""
        pieces = strided.tensor_arrays(lent.slots, dst_slots)
        first = min(t for t, _, _ in pieces)
        later = [p for p in pieces if p[0] != first]
        for tensor, dst, src in pieces:
            if tensor == first:
                np.copyto(dst, src)
        n = len(lent.slots)

        def finish() -> bool:
            intact = lent.intact()
            self._done(lent.id)
            if not intact:
                self.late_copies += 1
                log.info("kvtier: a lent restore of %d blocks ended past its lease; the engine recomputes them", n)
            return intact

        self.copies += 1
        self.copy_seconds_total += time.perf_counter() - t0
        self.lent_blocks += n
        if later:
            layers.defer(group, list(dst_slots), later, finish)
        elif not finish():
            return 0
        return n

    def _strides(self, strided: StridedCopy, src_slots: list[int], dst_slots: list[int]) -> bool:
        """Whether this copy goes by strided copies (``copy_engine``; ``auto``: pieces of at least
        ``STRIDED_MIN_PIECE_BYTES`` on average) rather than memmoves."""
        if self.copy_engine != "auto":
            return self.copy_engine == "strided"
        pieces = strided.pieces(src_slots, dst_slots)
        return pieces > 0 and len(dst_slots) * strided.block_bytes >= pieces * STRIDED_MIN_PIECE_BYTES

    def _done(self, lend_id: int) -> None:
        with self._pending_lock:
            self._pending.append(lend_id)

    def take_pending(self) -> list[int]:
        with self._pending_lock:
            ids, self._pending = self._pending, []
        return ids

    def flush(self, client: Client) -> None:
        ids = self.take_pending()
        if ids:
            try:
                client.release_lends(ids, timeout_s=RELEASE_TIMEOUT_S)
            except KvtierError:
                pass  # the daemon ends them at their lease's end, or with the session

    def close(self) -> None:
        if self._two is not None:
            self._two.close()
        self._tables.clear()
        self._strided.clear()
        self._maps.close()


def _smallest_run(engine: BlockLayout) -> int:
    """The smallest memmove a block of a contiguous slab copied into ``engine`` takes."""
    one = BlockLayout.contiguous(1, engine.block_bytes)
    return int(plan_block_copy(one, [0], engine, [0], merge=False).sizes.min())


@dataclass(frozen=True, slots=True)
class RunTable:
    """One block's runs from a slab (``src``: the mapped tier file) into an engine's layout, by slot.

    Block ``s`` of the slab lies at ``src_off + s * row_bytes``; the same runs land at
    ``dst_addr + d * dst_stride`` for engine block ``d``. ``copy`` shifts them per slot,
    merges runs that continue each other in both memories, and memmoves them (ctypes drops
    the GIL for each): byte for byte what ``copy_host_blocks`` does, without planning anew.
    """

    src: BlockLayout
    dst: BlockLayout
    src_off: np.ndarray  # int64 [R]: where each run starts in slot 0 of src
    dst_addr: np.ndarray  # int64 [R]: where it lands for engine block 0
    dst_stride: np.ndarray  # int64 [R]: bytes from engine block d to d + 1, per run
    sizes: np.ndarray  # int64 [R]
    row_bytes: int

    @classmethod
    def build(cls, src: BlockLayout, dst: BlockLayout) -> RunTable | None:
        """The table, or None where ``plan_block_copy`` cannot plan the pair (the caller copies the usual way)."""
        if not src.is_slab or src.device.type != "cpu" or dst.device.type != "cpu" or dst.num_blocks < 1:
            return None
        try:
            # Unmerged and from the same source slot, both plans list the runs in one order (by source address).
            first = plan_block_copy(src, [0], dst, [0], merge=False)
            second = plan_block_copy(src, [0], dst, [1], merge=False) if dst.num_blocks > 1 else first
        except NotPlannable:
            return None
        base = src.slab().data_ptr()
        return cls(src, dst, first.src_ptrs - base, first.dst_ptrs, second.dst_ptrs - first.dst_ptrs, first.sizes,
                   src.block_bytes)

    def copy(self, src_slots: Sequence[int], dst_slots: Sequence[int]) -> int:
        """Copy blocks ``src_slots`` of the slab into engine blocks ``dst_slots``; returns the bytes copied.
        Raises ``ValueError`` (duplicate engine blocks, lengths that differ, engine runs that overlap) or
        ``IndexError`` (a slot out of range) before any byte moves."""
        src, dst, sizes = self.runs(src_slots, dst_slots)
        move = ctypes.memmove
        for s, d, k in zip(src, dst, sizes):
            move(d, s, k)
        return len(src_slots) * self.row_bytes

    def runs(self, src_slots: Sequence[int], dst_slots: Sequence[int], *,
             max_run_bytes: int | None = None) -> tuple[list[int], list[int], list[int]]:
        """The copy's runs: source addresses, destination addresses, bytes (``copy``'s checks and errors);
        ``max_run_bytes``: none longer (cut into pieces, for sharing between threads)."""
        n = len(src_slots)
        if n != len(dst_slots):
            raise ValueError(f"{n} source slots but {len(dst_slots)} engine blocks")
        if not n:
            return [], [], []
        if min(src_slots) < 0 or max(src_slots) >= self.src.num_blocks:
            raise IndexError(f"slab slots must be in [0, {self.src.num_blocks})")
        if min(dst_slots) < 0 or max(dst_slots) >= self.dst.num_blocks:
            raise IndexError(f"engine blocks must be in [0, {self.dst.num_blocks})")
        if len(set(dst_slots)) != n:
            raise ValueError("duplicate engine blocks: the copy would write one block twice")
        ss = np.fromiter(src_slots, np.int64, n)
        ds = np.fromiter(dst_slots, np.int64, n)
        base = self.src.slab().data_ptr()
        src = ((base + self.src_off)[None, :] + (ss * self.row_bytes)[:, None]).reshape(-1)
        dst = (self.dst_addr[None, :] + ds[:, None] * self.dst_stride[None, :]).reshape(-1)
        sizes = np.tile(self.sizes, n)
        order = np.argsort(dst)
        if np.any(dst[order[1:]] < dst[order[:-1]] + sizes[order[:-1]]):
            raise ValueError("engine runs overlap: the layout aliases its own memory")
        if sizes.size > 1:
            # Runs that continue each other in both memories (consecutive slots of a block-major engine
            # tensor, say) become one memmove.
            cont = (src[1:] == src[:-1] + sizes[:-1]) & (dst[1:] == dst[:-1] + sizes[:-1])
            if cont.any():
                starts = np.flatnonzero(np.concatenate(([True], ~cont)))
                sizes = np.add.reduceat(sizes, starts)
                src, dst = src[starts], dst[starts]
        if max_run_bytes is not None and int(sizes.max()) > max_run_bytes:
            pieces = (sizes + max_run_bytes - 1) // max_run_bytes
            run = np.repeat(np.arange(sizes.size), pieces)
            off = (np.arange(run.size, dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * max_run_bytes
            src, dst, sizes = src[run] + off, dst[run] + off, np.minimum(sizes[run] - off, max_run_bytes)
        return src.tolist(), dst.tolist(), sizes.tolist()


class TwoThreadCopy:
    """Copies a copy's pieces (memmoves, or ``np.copyto`` of strided views) on the calling thread and a helper
    thread together.

    Both take the next run from one counter, so a helper that wakes late (a
    busy host) just takes fewer; ``copy`` returns once every run is done, none
    still being copied by the helper. ``close()`` ends the helper.
    """

    PIECE_BYTES = 1 << 20  # runs longer than this are cut, so both threads get a share

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._job: _Runs | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvtier-lent-copy", daemon=True)
        self._thread.start()

    def copy(self, src: list[int], dst: list[int], sizes: list[int]) -> None:
        """Memmove ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]``, every i."""
        move = ctypes.memmove
        self._run(_Runs(len(sizes), lambda i: move(dst[i], src[i], sizes[i])))

    def copy_arrays(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """``np.copyto(dst, src)`` for every (dst, src) pair."""
        copyto = np.copyto
        self._run(_Runs(len(pairs), lambda i: copyto(*pairs[i])))

    def _run(self, job: _Runs) -> None:
        with self._cv:
            self._job = job
            self._cv.notify()
        job.work()
        job.finished.wait()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job, self._job = self._job, None
            assert job is not None
            job.work()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5.0)


class _Runs:
    """One copy's pieces (``step(i)`` copies piece i) and who copied how many of them (``TwoThreadCopy``)."""

    __slots__ = ("count", "step", "_next", "_done", "_lock", "finished")

    def __init__(self, count: int, step: Callable[[int], object]) -> None:
        self.count, self.step = count, step
        self._next = itertools.count()  # next() on it is atomic under the GIL: each run goes to one thread
        self._done = 0
        self._lock = threading.Lock()
        self.finished = threading.Event()
        if not count:
            self.finished.set()

    def work(self) -> None:
        n, step, claim, took = self.count, self.step, self._next, 0
        while (i := next(claim)) < n:
            step(i)
            took += 1
        with self._lock:
            self._done += took
            if self._done == n:
                self.finished.set()

