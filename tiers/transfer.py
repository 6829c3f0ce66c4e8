"""Transfer engines: batched block copies that complete asynchronously, in order.

Contract (the pool is the only caller of ``submit`` and ``poll``):

- ``submit(kind, src, src_slots, dst, dst_slots) -> Transfer`` queues one
  batched copy between two ``BlockLayout``s and returns at once. It never
  blocks on the copy. Copies of one priority class complete in submission
  order; restores and client loads (``HIGH``) never wait behind demotions
  and client stores (``LOW``).
- ``poll() -> list[Transfer]`` returns the transfers that finished since the
  last call (successfully or not; ``Transfer.error`` says which). The pool
  applies its bookkeeping only then, on its own thread.
- ``set_wakeup(fn)`` registers a callable that worker threads call after a
  transfer finishes, so an event loop can stop sleeping early. It must be
  cheap and thread-safe (e.g. write a byte to a socket pair).
- ``close(timeout_s)`` lets queued copies finish, then stops the workers.
  Submitting after close raises ``TransferError``.
- A failed copy fails its transfer only (``TransferError`` in ``error``);
  the engine keeps serving.

Two implementations behind one interface:

- ``ThreadTransferEngine``: copies run on worker threads (torch releases
  the GIL in its copy kernels). Used without CUDA and for host-to-host
  copies, so every pool code path runs in the test suite without a GPU.
- ``CudaTransferEngine``: restores on a high-priority stream, demotions on a
  low-priority stream, one event per transfer; device-side gather/scatter is
  one indexing op per tensor, and the host side moves whole blocks.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.tiers.layout import BlockLayout, copy_blocks

log = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """A copy failed, or the engine is closed."""


class CopyKind(enum.Enum):
    DEMOTE = "demote"  # GPU tier -> CPU tier
    RESTORE = "restore"  # CPU tier -> GPU tier
    STORE = "store"  # client -> a tier
    LOAD = "load"  # a tier -> client

    @property
    def high_priority(self) -> bool:
        # Restores and loads sit on the engine's critical path (time to first
        # token); demotions and stores can wait.
        return self in (CopyKind.RESTORE, CopyKind.LOAD)


@dataclass(eq=False)
class Transfer:
    transfer_id: int
    kind: CopyKind
    num_blocks: int
    nbytes: int
    high_priority: bool
    submitted_s: float = field(default_factory=time.monotonic)
    finished_s: float | None = None
    error: BaseException | None = None
    _event: threading.Event = field(default_factory=threading.Event, repr=False)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._event.wait(timeout_s)

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self.finished_s = time.monotonic()
        self._event.set()


@dataclass(slots=True)
class _Job:
    transfer: Transfer
    src: BlockLayout
    src_slots: Sequence[int]
    dst: BlockLayout
    dst_slots: Sequence[int]


class TransferEngine(ABC):
    """See the module docstring."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._finished: deque[Transfer] = deque()
        self._wakeup: Callable[[], None] | None = None
        self._closed = False
        self.bytes_by_kind: dict[CopyKind, int] = {k: 0 for k in CopyKind}
        self.seconds_by_kind: dict[CopyKind, float] = {k: 0.0 for k in CopyKind}

    def set_wakeup(self, fn: Callable[[], None] | None) -> None:
        self._wakeup = fn

    def submit(
        self,
        kind: CopyKind,
        src: BlockLayout,
        src_slots: Sequence[int],
        dst: BlockLayout,
        dst_slots: Sequence[int],
        *,
        high_priority: bool | None = None,
    ) -> Transfer:
        """Queue a copy; ``high_priority`` overrides the kind's class (an
        eviction that blocks an allocation is a demotion on the critical path)."""
        if self._closed:
            raise TransferError("transfer engine is closed")
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} destination slots")
        if src.block_bytes != dst.block_bytes:
            raise ValueError(f"block sizes differ: {src.block_bytes} != {dst.block_bytes} bytes")
        high = kind.high_priority if high_priority is None else high_priority
        transfer = Transfer(next(self._ids), kind, len(src_slots), len(src_slots) * src.block_bytes, high)
        self._enqueue(_Job(transfer, src, list(src_slots), dst, list(dst_slots)))
        return transfer

    def poll(self) -> list[Transfer]:
        done = []
        while self._finished:
            done.append(self._finished.popleft())
        return done

    def _complete(self, transfer: Transfer, error: BaseException | None) -> None:
        transfer._finish(error)
        if error is None:
            self.bytes_by_kind[transfer.kind] += transfer.nbytes
            self.seconds_by_kind[transfer.kind] += (transfer.finished_s or 0.0) - transfer.submitted_s
        self._finished.append(transfer)  # deque.append is atomic under the GIL
        wakeup = self._wakeup
        if wakeup is not None:
            wakeup()

    @abstractmethod
    def _enqueue(self, job: _Job) -> None: ...

    @abstractmethod
    def close(self, timeout_s: float = 10.0) -> None: ...


class ThreadTransferEngine(TransferEngine):
    """Copies on two worker threads: one per priority class, each in order."""

    def __init__(self, *, fault_hook: Callable[[Transfer], None] | None = None) -> None:
        super().__init__()
        # Tests inject copy failures through this hook (it may raise).
        self.fault_hook = fault_hook
        self._queues = {True: queue.SimpleQueue(), False: queue.SimpleQueue()}
        self._threads = [
            threading.Thread(target=self._run, args=(high,), name=f"kvtier-copy-{'hi' if high else 'lo'}", daemon=True)
            for high in (True, False)
        ]
        for t in self._threads:
            t.start()

    def _enqueue(self, job: _Job) -> None:
        self._queues[job.transfer.high_priority].put(job)

    def _run(self, high: bool) -> None:
        q = self._queues[high]
        while True:
            job = q.get()
            if job is None:
                return
            error: BaseException | None = None
            try:
                if self.fault_hook is not None:
                    self.fault_hook(job.transfer)
                copy_blocks(job.src, job.src_slots, job.dst, job.dst_slots)
            except Exception as exc:  # a failed copy fails its transfer, not the engine
                error = TransferError(f"{job.transfer.kind.value} of {job.transfer.num_blocks} blocks failed: {exc}")
            self._complete(job.transfer, error)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class CudaTransferEngine(TransferEngine):
    """Copies on CUDA streams: restores high priority, demotions low priority.

    Device-side: one index_select / index_copy_ per tensor per batch into a
    device staging buffer. Host-side: one async memcpy per whole block
    between the staging buffer and the pinned slab rows (never per layer).
    Completion: an event per transfer, waited on by one thread per stream so
    each stream's transfers finish in order.
    """

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__()
        self.device = torch.device(device)
        low, high = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
        self._streams = {
            True: torch.cuda.Stream(self.device, priority=high),
            False: torch.cuda.Stream(self.device, priority=low),
        }
        self._host = ThreadTransferEngine()  # host-to-host copies need no stream
        self._host.set_wakeup(self._drain_host)
        self._pending: dict[bool, queue.SimpleQueue] = {True: queue.SimpleQueue(), False: queue.SimpleQueue()}
        self._waiters = [
            threading.Thread(target=self._wait_events, args=(high,), name="kvtier-cuda-wait", daemon=True)
            for high in (True, False)
        ]
        for t in self._waiters:
            t.start()

    def _drain_host(self) -> None:
        for transfer in self._host.poll():
            self._finished.append(transfer)
        if self._wakeup is not None:
            self._wakeup()

    def _enqueue(self, job: _Job) -> None:
        if job.src.device.type != "cuda" and job.dst.device.type != "cuda":
            self._host._enqueue(job)
            return
        high = job.transfer.high_priority
        stream = self._streams[high]
        try:
            with torch.cuda.stream(stream):
                staging_refs = self._launch(job)
            event = torch.cuda.Event()
            event.record(stream)
        except Exception as exc:
            self._complete(job.transfer, TransferError(f"{job.transfer.kind.value} launch failed: {exc}"))
            return
        self._pending[high].put((job.transfer, event, staging_refs))

    def _launch(self, job: _Job) -> list[torch.Tensor]:
        """Enqueue the copy on the current stream; return tensors to keep alive until it ends."""
        src, dst = job.src, job.dst
        if src.device.type == "cuda" and dst.device.type == "cuda":
            copy_blocks(src, job.src_slots, dst, job.dst_slots)
            return []
        if src.device.type == "cuda":  # device -> host slab
            staged = src.gather(job.src_slots)
            rows = dst.slab()
            for i, slot in enumerate(job.dst_slots):
                rows[slot].copy_(staged[i], non_blocking=True)
            return [staged]
        # host slab -> device
        rows = src.slab()
        staged = torch.empty((len(job.src_slots), src.block_bytes), dtype=torch.uint8, device=dst.device)
        for i, slot in enumerate(job.src_slots):
            staged[i].copy_(rows[slot], non_blocking=True)
        dst.scatter(job.dst_slots, staged)
        return [staged]

    def _wait_events(self, high: bool) -> None:
        q = self._pending[high]
        while True:
            item = q.get()
            if item is None:
                return
            transfer, event, _keep_alive = item
            error: BaseException | None = None
            try:
                event.synchronize()
            except Exception as exc:
                error = TransferError(f"{transfer.kind.value} failed on the device: {exc}")
            self._complete(transfer, error)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        for q in self._pending.values():
            q.put(None)
        for t in self._waiters:
            t.join(max(0.0, deadline - time.monotonic()))
        self._host.close(max(0.0, deadline - time.monotonic()))


def make_transfer_engine(device: torch.device | str = "cpu") -> TransferEngine:
    """The engine for a GPU tier on ``device``: CUDA streams on a GPU, threads otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransferEngine(device)
    return ThreadTransferEngine()
