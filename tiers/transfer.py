"""Transfer engines: batched block copies that complete asynchronously, in order.

The interface and its contract are in ``kvtier.tiers.copy_types`` (torch-free);
this module holds the engines.

Two implementations behind one interface:

- ``ThreadTransferEngine``: copies run on worker threads (torch releases
  the GIL in its copy kernels). Used without CUDA and for host-to-host
  copies, so every pool code path runs in the test suite without a GPU.
- ``CudaTransferEngine``: restores on a high-priority stream, demotions on a
  low-priority stream (paced, optionally capped), timing events per
  transfer. With CuPy, a batch is one copy-plan launch straight between the
  engine's fragments and pinned CPU-tier slots (``copy_plan``,
  ``cuda_copy``); otherwise device-side gather/scatter is one indexing op
  per tensor and the host side moves runs of whole blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.tiers.copy_types import CopyKind, Transfer, TransferEngine, TransferError, CopyJob

__all__ = ["CopyKind", "CudaTransferEngine", "ThreadTransferEngine", "Transfer", "TransferEngine", "TransferError",
           "BACKGROUND", "make_transfer_engine"]
from kvtier.blocks.copy_plan import copy_host_blocks
from kvtier.blocks.layout import copy_blocks

if TYPE_CHECKING:
    from kvtier.tiers.cuda_copy import CudaPlanExecutor

log = logging.getLogger(__name__)


class ThreadTransferEngine(TransferEngine):
    """Copies on two worker threads: one per priority class, each in order."""

    def __init__(self) -> None:
        super().__init__()
        self._queues = {True: queue.SimpleQueue(), False: queue.SimpleQueue()}
        self._threads = [
            threading.Thread(target=self._run, args=(high,), name=f"kvtier-copy-{'hi' if high else 'lo'}", daemon=True)
            for high in (True, False)
        ]
        for t in self._threads:
            t.start()

    def _enqueue(self, job: CopyJob) -> None:
        self._queues[job.transfer.high_priority].put(job)

    def _run(self, high: bool) -> None:
        q = self._queues[high]
        while True:
            job = q.get()
            if job is None:
                return
            error: BaseException | None = None
            try:
                self._copy(job)
            except Exception as exc:  # a failed copy fails its transfer, not the engine
                error = TransferError(f"{job.transfer.kind.value} of {job.transfer.num_blocks} blocks failed: {exc}")
            self._complete(job.transfer, error)
            # Not kept while waiting for the next: its layouts (a detached GPU tier, a client's buffer) would live on.
            job = None

    def _copy(self, job: CopyJob) -> None:
        """One transfer's copy, on its priority class's worker thread; what it raises fails that transfer only.

        The engine's one seam for tests: a subclass that wraps it may delay or
        fail copies (``kvtier.daemon.faults`` for a real kvtierd, reached through
        ``ServeOptions.transfer_factory``; ``kvtier.testing.HookedTransferEngine``
        for the pool's own tests). Production code never overrides it.
        """
        copy_host_blocks(job.src, job.src_slots, job.dst, job.dst_slots)

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

    Data path, per transfer, the first that applies:

    - Planned (``kvtier.blocks.copy_plan`` + ``kvtier.tiers.cuda_copy``): when
      CuPy is present and both layouts are addressable from this GPU (device
      tensors here, pinned host memory through its UVA mapping), the whole
      batch is one kernel launch (``copy_method="kernel"``) or a run of
      copy-engine memcpys (``"memcpy"``/``"batch"``), straight between the
      engine's fragments and the CPU-tier slots: no staging buffer.
    - Staging (no CuPy, pageable memory, unplannable layouts): device-side
      one index_select / index_copy_ per tensor into a device staging
      buffer; host-side one async memcpy per run of consecutive slab rows.

    QoS: high-priority transfers (restores, loads) launch on the caller's
    thread onto the high-priority stream. Low-priority ones (demotions,
    stores) launch from a pacing thread onto the low-priority stream, cut
    into ``demote_chunk_bytes`` pieces:

    - at most ``low_priority_queue_parts`` pieces are queued on the device
      at a time, and no piece is launched while a high-priority transfer is
      in flight (for at most ``restore_yield_max_s`` per piece, so a stream
      of restores cannot starve demotions). Stream priorities order kernels'
      blocks, not the copy engines or the PCIe link: on an H100 a restore
      took 1.64x as long while demotions queued back to back
      (``bench/gpu_qos.py``), so restores are given the link by not feeding
      it demotions while they run;
    - with ``demote_bandwidth_cap_bytes_per_s`` a token bucket spaces the
      pieces' launches out, and ``low_priority_max_blocks`` caps the kernel's
      grid, so decode steps keep their SMs and copy bandwidth.

    None of it ever blocks the caller.

    Completion: timing events around each transfer, waited on by one thread
    per stream so each stream's transfers finish in order; ``device_stats()``
    reports bytes, device seconds and GB/s per direction from those events.
    A transfer whose launch failed part-way completes (with its error) only
    after what was launched has finished, so no copy is left writing into a
    slot the pool frees.
    """

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        copy_method: str = "auto",
        demote_method: str | None = None,
        demote_bandwidth_cap_bytes_per_s: float | None = None,
        demote_chunk_bytes: int = 8 << 20,
        low_priority_max_blocks: int | None = None,
        low_priority_queue_parts: int = 2,
        restore_yield_max_s: float = 0.02,
    ) -> None:
        super().__init__()
        if demote_chunk_bytes < 1:
            raise ValueError(f"demote_chunk_bytes must be >= 1, got {demote_chunk_bytes}")
        if low_priority_queue_parts < 1 or restore_yield_max_s < 0:
            raise ValueError("need low_priority_queue_parts >= 1 and restore_yield_max_s >= 0, got "
                             f"{low_priority_queue_parts} and {restore_yield_max_s}")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        low, high = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
        self._streams = {
            True: torch.cuda.Stream(self.device, priority=high),
            False: torch.cuda.Stream(self.device, priority=low),
        }
        # Imported here so that the module (and the thread engine) never needs CuPy.
        from kvtier.tiers import cuda_copy

        made: dict[str, CudaPlanExecutor | None] = {}
        for method in {copy_method, demote_method or copy_method}:
            made[method] = self._make_executor(method)
        self._executors = {True: made[copy_method], False: made[demote_method or copy_method]}
        # What each class actually runs ("kernel", "memcpy", "batch" or "staging"), for stats and logs.
        self.copy_methods = {
            "high": self._executors[True].method if self._executors[True] is not None else "staging",
            "low": self._executors[False].method if self._executors[False] is not None else "staging",
        }
        # Long runs go faster on the copy engines than through the kernel. On an
        # H100 (bench/gpu.py): runs of 2 MiB, batch 89-91% of peak, kernel 70-75%;
        # runs of 32-64 KiB, kernel 74-82%, batch 31-47%. So with "auto", a
        # high-priority plan whose runs average BULK_RUN_BYTES or more takes the
        # copy engines (the crossover between 64 KiB and 2 MiB is unmeasured).
        self._bulk_executor: CudaPlanExecutor | None = None
        if copy_method == "auto" and self.copy_methods["high"] == "kernel":
            low = self._executors[False]
            self._bulk_executor = (low if low is not None and low.method in ("batch", "memcpy")
                                   else self._make_executor(COPY_ENGINES))
        self.bulk_method = self._bulk_executor.method if self._bulk_executor is not None else None
        self.demote_chunk_bytes = demote_chunk_bytes
        self.low_priority_max_blocks = low_priority_max_blocks
        self.low_priority_queue_parts = low_priority_queue_parts
        self.restore_yield_max_s = restore_yield_max_s
        # High-priority transfers launched and not yet seen complete; the
        # launcher of low-priority pieces waits on this condition.
        self._high_in_flight = 0
        self._high_cv = threading.Condition()
        # End events of the low-priority pieces queued on the device (launcher thread only).
        self._low_marks: deque = deque()
        self.pacer = cuda_copy.BandwidthPacer(demote_bandwidth_cap_bytes_per_s, burst_bytes=demote_chunk_bytes)
        self._stats_lock = threading.Lock()
        self._device_stats = {d: {"bytes": 0, "seconds": 0.0, "transfers": 0} for d in ("h2d", "d2h", "d2d")}
        self._host = ThreadTransferEngine()  # host-to-host copies need no stream
        self._host.set_wakeup(self._drain_host)
        self._draining = False
        self._low_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[bool, queue.SimpleQueue] = {True: queue.SimpleQueue(), False: queue.SimpleQueue()}
        self._launcher = threading.Thread(target=self._launch_low, name="kvtier-cuda-launch-lo", daemon=True)
        self._waiters = [
            threading.Thread(target=self._wait_events, args=(high,), name="kvtier-cuda-wait", daemon=True)
            for high in (True, False)
        ]
        self._launcher.start()
        for t in self._waiters:
            t.start()

    def _make_executor(self, method: str) -> CudaPlanExecutor | None:
        """The plan executor for ``method``, or None for the staging path.

        "auto": the fastest, kernel then memcpy. "background": the copy
        engines, batch then memcpy, then the kernel (see ``BACKGROUND``).

        Every candidate must pass its byte-exact self-test on this GPU first;
        one that fails is logged and skipped, never used. A pass holds for the
        process: a daemon makes an engine per pool, and a hello that opens a
        pool should not wait for the tests again.
        """
        from kvtier.tiers import cuda_copy

        valid = ("auto", BACKGROUND, COPY_ENGINES, "staging", *cuda_copy.METHODS)
        if method not in valid:
            raise ValueError(f"copy method must be one of {valid}, got {method!r}")
        if method == "staging":
            return None
        available = cuda_copy.available_methods()
        order = {"auto": ("kernel", "memcpy"), BACKGROUND: ("batch", "memcpy", "kernel"),
                 COPY_ENGINES: ("batch", "memcpy")}.get(method)
        candidates = [m for m in order if m in available] if order else [method]
        for m in candidates:
            try:
                executor = cuda_copy.CudaPlanExecutor(self.device, method=m)
                if (str(self.device), m) not in _SELF_TESTED:
                    executor.self_test()
                    _SELF_TESTED.add((str(self.device), m))
                return executor
            except Exception as exc:
                log.warning("copy method %r unusable on %s (%s); falling back", m, self.device, exc)
        if order is None:
            log.warning("copy method %r unavailable on %s; using the staging path", method, self.device)
        return None

    def stream(self, high_priority: bool) -> torch.cuda.Stream:
        """The stream one priority class launches on (to record or wait for events on it)."""
        return self._streams[high_priority]

    def wait_event(self, event: torch.cuda.Event, *, high_priority: bool) -> None:
        """Make every copy of that class launched from now on wait for ``event`` (GPU-side, no CPU wait).

        For "the engine's writes to these blocks are done" events (an
        imported CUDA IPC event) before a demotion reads them.
        """
        self._streams[high_priority].wait_event(event)

    def device_stats(self) -> dict[str, dict[str, float]]:
        """Per direction (h2d, d2h, d2d): bytes, device seconds, transfers and achieved GB/s."""
        with self._stats_lock:
            out = {d: dict(v) for d, v in self._device_stats.items()}
        for v in out.values():
            v["gbps"] = v["bytes"] / v["seconds"] / 1e9 if v["seconds"] > 0 else 0.0
        return out

    def _drain_host(self) -> None:
        for transfer in self._host.poll():
            # The host engine counted it in its own totals; the pool reads this engine's.
            if transfer.error is None:
                self.bytes_by_kind[transfer.kind] += transfer.nbytes
                self.seconds_by_kind[transfer.kind] += (transfer.finished_s or 0.0) - transfer.submitted_s
            self._finished.append(transfer)
        if self._wakeup is not None:
            self._wakeup()

    def _enqueue(self, job: CopyJob) -> None:
        if job.src.device.type != "cuda" and job.dst.device.type != "cuda":
            self._host._enqueue(job)
        elif job.transfer.high_priority:
            self._pending[True].put(self._launch_job(job, True))
        else:
            self._low_jobs.put(job)

    def _launch_low(self) -> None:
        while True:
            job = self._low_jobs.get()
            if job is None:
                return
            self._pending[False].put(self._launch_job(job, False))
            job = None  # as in ThreadTransferEngine._run: the waiter keeps what the copy needs, not this thread

    def _launch_job(self, job: CopyJob, high: bool) -> tuple:
        """Enqueue the copy on its stream between two timing events.

        Returns ``(transfer, start, end, keep_alive, error, direction)`` for the
        waiter; ``end`` is None when nothing could be recorded at all.
        """
        stream = self._streams[high]
        if high:
            with self._high_cv:
                self._high_in_flight += 1  # _wait_events takes it off: every high launch reaches it
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        keep: list = []
        error: BaseException | None = None
        direction = ("d2d" if job.dst.device.type == "cuda" else "d2h") if job.src.device.type == "cuda" else "h2d"
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                start.record(stream)
                self._launch(job, stream, high, keep)
        except Exception as exc:
            error = TransferError(f"{job.transfer.kind.value} launch failed: {exc}")
        try:
            end.record(stream)
        except Exception as exc:  # the stream itself is broken: nothing to wait for
            log.error("cannot record a CUDA event on %s: %s", self.device, exc)
            return job.transfer, None, None, keep, error or TransferError(str(exc)), direction
        return job.transfer, start, end, keep, error, direction

    def _launch(self, job: CopyJob, stream: torch.cuda.Stream, high: bool, keep: list) -> None:
        """Enqueue the copy on ``stream`` (the current stream).

        Appends to ``keep`` what must stay alive until the stream passes the
        copy, as it goes: after a failure part-way, what was launched is kept.
        """
        from kvtier.blocks.copy_plan import NotPlannable, plan_block_copy

        src, dst = job.src, job.dst
        executor = self._executors[high]
        plan = None
        if executor is not None and executor.plannable(src, dst):
            try:
                plan = plan_block_copy(src, job.src_slots, dst, job.dst_slots)
            except NotPlannable as exc:
                log.debug("staging path for %s: %s", job.transfer.kind.value, exc)
        if plan is not None:
            assert executor is not None
            if high:
                bulk = self._bulk_executor
                if bulk is not None and plan.nbytes >= BULK_RUN_BYTES * plan.num_runs and bulk.plannable(src, dst):
                    executor = bulk
                keep += executor.launch(plan, stream, max_blocks=None)
                return
            for part in plan.split(self.demote_chunk_bytes):
                self._before_low_piece(part.nbytes, stream)
                keep += executor.launch(part, stream, max_blocks=self.low_priority_max_blocks)
                self._after_low_piece(stream)
            return
        if high:
            keep += self._launch_staged(job)
            return
        self._before_low_piece(job.transfer.nbytes, stream)
        keep += self._launch_staged(job)
        self._after_low_piece(stream)

    def _before_low_piece(self, nbytes: int, stream: torch.cuda.Stream) -> None:
        """On the launcher thread, before a low-priority piece: queue depth, restores in flight, the cap."""
        if self._draining:
            return
        while len(self._low_marks) >= self.low_priority_queue_parts:
            self._low_marks.popleft().synchronize()
        with self._high_cv:
            self._high_cv.wait_for(lambda: self._high_in_flight == 0 or self._draining,
                                   timeout=self.restore_yield_max_s)
        if self.pacer.rate_bytes_per_s is not None:
            self.pacer.pace(nbytes)

    def _after_low_piece(self, stream: torch.cuda.Stream) -> None:
        mark = torch.cuda.Event()
        mark.record(stream)
        self._low_marks.append(mark)

    def _launch_staged(self, job: CopyJob) -> list[torch.Tensor]:
        src, dst = job.src, job.dst
        if src.device.type == "cuda" and dst.device.type == "cuda":
            copy_blocks(src, job.src_slots, dst, job.dst_slots)
            return []
        if src.device.type == "cuda":  # device -> host slab
            staged = src.gather(job.src_slots)
            rows = dst.slab()
            for i, slot, n in _row_runs(job.dst_slots):
                rows[slot : slot + n].copy_(staged[i : i + n], non_blocking=True)
            return [staged]
        # host slab -> device
        rows = src.slab()
        staged = torch.empty((len(job.src_slots), src.block_bytes), dtype=torch.uint8, device=dst.device)
        for i, slot, n in _row_runs(job.src_slots):
            staged[i : i + n].copy_(rows[slot : slot + n], non_blocking=True)
        dst.scatter(job.dst_slots, staged)
        return [staged]

    def _wait_events(self, high: bool) -> None:
        q = self._pending[high]
        while True:
            item = q.get()
            if item is None:
                return
            transfer, start, end, keep_alive, error, direction = item
            del item
            seconds = None
            if end is not None:
                try:
                    end.synchronize()
                    seconds = start.elapsed_time(end) / 1e3
                except Exception as exc:
                    error = error or TransferError(f"{transfer.kind.value} failed on the device: {exc}")
            if error is None and seconds is not None:
                with self._stats_lock:
                    s = self._device_stats[direction]
                    s["bytes"] += transfer.nbytes
                    s["seconds"] += seconds
                    s["transfers"] += 1
            del keep_alive  # the copy is done (or never ran): staging and descriptor buffers may go
            if high:
                with self._high_cv:
                    self._high_in_flight -= 1
                    self._high_cv.notify_all()
            self._complete(transfer, error)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._draining = True  # queued demotions launch without pacing or yielding
        with self._high_cv:
            self._high_cv.notify_all()
        deadline = time.monotonic() + timeout_s
        self._low_jobs.put(None)
        self._launcher.join(max(0.0, deadline - time.monotonic()))
        for q in self._pending.values():
            q.put(None)
        for t in self._waiters:
            t.join(max(0.0, deadline - time.monotonic()))
        self._host.close(max(0.0, deadline - time.monotonic()))


def _row_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index into slots, first slot, length) for each run of consecutive slots: one memcpy per run."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            j, first, n = runs[-1]
            runs[-1] = (j, first, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs


# (device, method) pairs whose self-test passed in this process.
_SELF_TESTED: set[tuple[str, str]] = set()


# The method choice for low-priority copies (demotions, stores): the copy
# engines first. The copy kernel is the fastest path for fragmented blocks, but
# it runs on the SMs the model needs. Measured on an H100 (bench/gpu.py,
# bench/results/gpu-NVIDIA-H100-80GB-HBM3.json): kernel demotions at full speed
# slowed a bf16 matmul loop 2.3x, batch (cudaMemcpyBatchAsync, copy engines) not
# measurably, at 21 GB/s of 32 KiB fragments. Background copies have time; the
# model's forward does not.
BACKGROUND = "background"
COPY_ENGINES = "copy-engines"  # batch, then memcpy: the bulk executor of "auto" (see CudaTransferEngine)
# A high-priority plan whose runs average this many bytes or more goes to the copy engines under "auto".
BULK_RUN_BYTES = 512 << 10


def make_transfer_engine(device: torch.device | str = "cpu") -> TransferEngine:
    """The engine for a GPU tier on ``device``: CUDA streams on a GPU, threads otherwise.

    On CUDA, critical-path copies (restores, loads, urgent demotions) use the
    fastest method ("auto": the copy kernel); background ones the copy engines
    (``BACKGROUND``), so they take no SMs from the model.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransferEngine(device, demote_method=BACKGROUND)
    return ThreadTransferEngine()


def warm_up(device: torch.device | str) -> dict[str, str]:
    """Do now what a process's first CUDA transfer engine does once: returns its copy methods.

    The CUDA context, the copy kernel's compilation and each method's
    self-test happen once per process, and took seconds on a busy GPU
    machine. Left to the first pool, they fell inside an engine's first hello,
    past the connector's timeout_s: the connector then served without
    kvtierd. kvtierd calls this before it answers anyone. A no-op off CUDA.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    engine = make_transfer_engine(device)
    try:
        return dict(engine.copy_methods)
    finally:
        engine.close()
