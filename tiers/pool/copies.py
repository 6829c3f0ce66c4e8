"""The pool's copy scheduler: ops, batched copies, and the order they run in.

This is the one place that enforces the pool's safety rule: **no slot is
handed out, overwritten or read while a copy touches it.**

- An ``Op`` is a pool call whose copies may still be in flight. It is done
  when every copy it waits for is done; it fails (``Op.error``) only with the
  copies ``attach``-ed to it, not with those it merely ``wait_for``-s (a
  demotion that vacates a slot the op reuses orders the op, but its loss is
  not the op's failure).
- A ``Copy`` names its source and destination slots and the copies it must
  follow (``after``). It is submitted to the transfer engine only when those
  are finished; a failed write into its source slots fails it too.
- ``gpu_busy`` lists, per GPU block, the copies in flight that touch it
  (``mark_gpu_busy``); ``busy_copies`` is what a new copy of those blocks
  must follow. ``cpu_writes`` lists, per CPU slot, the copy writing it
  (``track_cpu_write``): a CPU entry is not ready exactly while its slot is
  listed there (the state-machine test checks it), and the entry is committed
  or aborted when that copy finishes. The CPU tier's own reader and pin
  counts keep its slots from being reused under a read.
- A copy of a client's memory may carry its client's deadline: one with
  ``start_by_ns`` (a write into that memory) is not submitted past it; one
  with ``read_by_ns`` (a read of it) is not submitted past it and fails if
  it finishes past it, since the client may have reused the memory under
  the read. Both fail with ``DeadlinePassed``, and fail their ops as any
  failed copy does (a store's keys are dropped again).
- Copies finish only in ``submit_ready`` (bookkeeping mode, empty copies,
  submit errors) or ``poll`` (the transfer engine's results), both on the
  pool's thread. A finished copy drops its callbacks, and a finished op
  its own: they close over the copy, the tiers and the op, and would
  otherwise keep them in cycles only the cyclic collector frees.
- An ``Op`` knows its pool only as an ``OpDriver`` (``polling.Poller``):
  what ``wait`` polls and what collects the ops a poll completed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.tiers.cpu_tier import CpuEntry, CpuTier
from kvtier.tiers.copy_types import CopyKind, DeadlinePassed, Transfer, TransferEngine, TransferError

if TYPE_CHECKING:
    from kvtier.blocks.layout import BlockLayout
    from kvtier.tiers.pool.counters import Counters

log = logging.getLogger("kvtier.tiers.pool")


class OpDriver(Protocol):
    """What an op needs of its pool (``polling.Poller``)."""

    def poll(self, wait_s: float = 0.0) -> object: ...

    def note_completed(self, op: Op) -> None: ...


class Op:
    """A pool call whose copies may still be in flight."""

    def __init__(self, driver: OpDriver, name: str, result: Any = None) -> None:
        self._driver = driver
        self.name = name
        self.result = result
        self.error: BaseException | None = None
        self.done = False
        self._waiting: set[Copy] = set()
        self._on_done: list[Callable[[Op], None]] = []
        self._finalizers: list[Callable[[bool], None]] = []
        # Keys the call protects from eviction (see the contract), also in the
        # clean-ahead poll() runs when the op completes (its finalizers may
        # have released its blocks into the free queue).
        self.protected: frozenset[bytes] = frozenset()

    def wait(self, timeout_s: float | None = None) -> Op:
        """Poll the pool until this op is done (owner thread only)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} still has {len(self._waiting)} copies in flight")
            self._driver.poll(wait_s=0.01)
        return self

    def add_done_callback(self, fn: Callable[[Op], None]) -> None:
        if self.done:
            fn(self)
        else:
            self._on_done.append(fn)

    def _finish(self) -> None:
        ok = self.error is None
        for fin in self._finalizers:
            fin(ok)
        self.done = True
        self._driver.note_completed(self)
        on_done = self._on_done
        self._finalizers = []
        self._on_done = []
        for fn in on_done:
            fn(self)


@dataclass(eq=False)
class Copy:
    """One batched copy, submitted when the copies it must follow are done."""

    kind: CopyKind
    src: BlockLayout | None
    src_slots: list[int]
    dst: BlockLayout | None
    dst_slots: list[int]
    after: set[Copy] = field(default_factory=set)
    ops: list[Op] = field(default_factory=list)
    on_done: list[Callable[[bool], None]] = field(default_factory=list)
    high_priority: bool = False
    start_by_ns: int | None = None  # CLOCK_MONOTONIC: not submitted at or after it (see the module docstring)
    read_by_ns: int | None = None  # ... nor finished at or after it
    transfer: Transfer | None = None
    then: Callable[[], object] | None = None  # run on the copy's worker once it succeeded (TransferEngine.submit)
    finished: bool = False
    error: BaseException | None = None


class CopyScheduler:
    """See the module docstring. ``gpu`` is the GPU tier's layout (set by the pool as it attaches one)."""

    def __init__(self, *, data: bool, transfer: TransferEngine | None, counters: Counters) -> None:
        self.data = data
        self.transfer = transfer
        self.counters = counters
        self.gpu: BlockLayout | None = None
        # Copies in flight per GPU block: a block listed here is not handed
        # out, overwritten or read before they finish.
        self.gpu_busy: dict[int, set[Copy]] = {}
        # The copy writing each CPU slot whose entry is reserved, not yet ready.
        self.cpu_writes: dict[int, Copy] = {}
        self.deferred: list[Copy] = []
        self.inflight: dict[Transfer, Copy] = {}

    @property
    def busy(self) -> bool:
        return bool(self.inflight or self.deferred)

    def __len__(self) -> int:
        """Copies not finished yet (in flight or waiting for others)."""
        return len(self.inflight) + len(self.deferred)

    def detach_gpu(self) -> None:
        self.gpu = None
        self.gpu_busy.clear()

    # ---- building copies --------------------------------------------------------------

    def copy(self, kind: CopyKind, src: BlockLayout | None, src_slots: Sequence[int], dst: BlockLayout | None,
             dst_slots: Sequence[int], *, after: set[Copy] | None = None, high_priority: bool | None = None,
             start_by_ns: int | None = None, read_by_ns: int | None = None) -> Copy:
        copy = Copy(kind, src, list(src_slots), dst, list(dst_slots), {c for c in (after or ()) if not c.finished},
                    high_priority=kind.high_priority if high_priority is None else high_priority,
                    start_by_ns=start_by_ns, read_by_ns=read_by_ns)
        self.deferred.append(copy)
        return copy

    def attach(self, op: Op, copy: Copy) -> None:
        """The op waits for the copy and fails if it fails."""
        op._waiting.add(copy)
        copy.ops.append(op)

    def wait_for(self, op: Op, copies: set[Copy]) -> None:
        """The op waits for the copies but does not share their failure."""
        for c in copies:
            if c.finished or c in op._waiting:
                continue
            op._waiting.add(c)
            c.on_done.append(lambda ok, o=op, cc=c: self._release_op(o, cc))

    def _release_op(self, op: Op, copy: Copy) -> None:
        if copy in op._waiting:
            op._waiting.discard(copy)
            if not op._waiting and not op.done:
                op._finish()

    def busy_copies(self, block_ids: Sequence[int], *, writes_only: bool = False) -> set[Copy]:
        """The copies in flight that touch these GPU blocks (``writes_only``: that write them)."""
        found: set[Copy] = set()
        for b in block_ids:
            for c in self.gpu_busy.get(b, ()):
                if not writes_only or c.dst is self.gpu and b in c.dst_slots:
                    found.add(c)
        return found

    def mark_gpu_busy(self, copy: Copy, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self.gpu_busy.setdefault(b, set()).add(copy)

        def unmark(ok: bool) -> None:
            for b in block_ids:
                busy = self.gpu_busy.get(b)
                if busy is not None:
                    busy.discard(copy)
                    if not busy:
                        del self.gpu_busy[b]

        copy.on_done.append(unmark)

    def track_cpu_write(self, copy: Copy, cpu: CpuTier, entries: list[CpuEntry]) -> None:
        """The copy writes these reserved entries: committed when it succeeds, aborted when it fails.

        With a persistent CPU tier the copy's worker also checksums the slots it
        wrote (``then``), so the pool's thread only writes the records.
        """
        writes = self.cpu_writes
        for e in entries:
            writes[e.slot] = copy
        recorder = cpu.slot_recorder
        if recorder is not None and copy.dst is cpu.storage and copy.dst_slots == [e.slot for e in entries]:
            slots = list(copy.dst_slots)
            copy.then = lambda: recorder.checksums(slots)

        def settle(ok: bool) -> None:
            sums = copy.transfer.then_result if copy.transfer is not None else None
            if not isinstance(sums, list) or len(sums) != len(entries):
                sums = [None] * len(entries)  # no worker checksummed them: the recorder does
            for e, checksum in zip(entries, sums):
                if writes.get(e.slot) is copy:
                    del writes[e.slot]
                if ok:
                    cpu.commit(e, checksum)
                else:
                    cpu.abort(e)

        copy.on_done.append(settle)

    # ---- running them -----------------------------------------------------------------

    def settle(self, op: Op) -> None:
        """Submit what can go now; finish the op at once if nothing is pending."""
        self.submit_ready()
        if not op._waiting and not op.done:
            op._finish()

    def submit_ready(self) -> None:
        progress = True
        while progress:
            progress = False
            for copy in list(self.deferred):
                if any(not c.finished for c in copy.after):
                    continue
                self.deferred.remove(copy)
                progress = True
                # Only a failed write into this copy's source slots spoils it; the
                # other dependencies just order the reuse of slots.
                failed = [c for c in copy.after if c.error is not None and c.dst is copy.src
                          and not set(c.dst_slots).isdisjoint(copy.src_slots)]
                late = _late_to_start(copy)
                if failed:
                    self.finish_copy(copy, TransferError(f"a copy it depends on failed: {failed[0].error}"))
                elif late is not None:
                    self.finish_copy(copy, late)
                elif not self.data or not copy.src_slots:
                    self.finish_copy(copy, None)
                else:
                    assert self.transfer is not None and copy.src is not None and copy.dst is not None
                    try:
                        transfer = self.transfer.submit(copy.kind, copy.src, copy.src_slots, copy.dst,
                                                        copy.dst_slots, high_priority=copy.high_priority,
                                                        then=copy.then)
                    except (TransferError, ValueError) as exc:
                        self.finish_copy(copy, exc)
                        continue
                    copy.transfer = transfer
                    self.inflight[transfer] = copy

    def poll(self, wait_s: float = 0.0) -> None:
        """Finish the copies the transfer engine has completed (waiting up to ``wait_s`` for the oldest), then
        submit those that can go now."""
        if wait_s > 0 and self.inflight and self.transfer is not None:
            first = next(iter(self.inflight))
            first.wait(wait_s)
        if self.transfer is not None:
            for transfer in self.transfer.poll():
                copy = self.inflight.pop(transfer, None)
                if copy is not None:
                    self.finish_copy(copy, transfer.error)
        self.submit_ready()

    def finish_copy(self, copy: Copy, error: BaseException | None) -> None:
        if error is None and copy.read_by_ns is not None:
            late_ns = time.monotonic_ns() - copy.read_by_ns
            if late_ns >= 0:
                error = DeadlinePassed(f"{copy.kind.value} read its client's memory until {late_ns / 1e6:.1f} ms "
                                       "past the client's deadline; not kept")
        copy.finished = True
        copy.error = error
        ok = error is None
        if not ok:
            if not isinstance(error, DeadlinePassed):  # a late client is not a failing copy engine
                self.counters.copy_failures += 1
            log.warning("%s of %d blocks failed: %s", copy.kind.value, len(copy.src_slots), error)
        on_done, copy.on_done, copy.then = copy.on_done, [], None
        for fn in on_done:
            fn(ok)
        for op in copy.ops:
            op._waiting.discard(copy)
            if not ok and op.error is None:
                op.error = error
            if not op._waiting and not op.done:
                op._finish()


def _late_to_start(copy: Copy) -> DeadlinePassed | None:
    """Why a copy of a client's memory may no longer start, or None."""
    by_ns = min((t for t in (copy.start_by_ns, copy.read_by_ns) if t is not None), default=None)
    if by_ns is None:
        return None
    late_ns = time.monotonic_ns() - by_ns
    if late_ns < 0:
        return None
    return DeadlinePassed(f"{copy.kind.value} of {len(copy.src_slots)} blocks would start {late_ns / 1e6:.1f} ms past "
                          "its client's deadline; not run")
