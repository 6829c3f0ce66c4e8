"""The GPU data path: copy plans executed in one launch, pacing, pinned-memory and IPC-event helpers.

Everything CUDA here is imported lazily: the module imports (and its
CPU-side logic runs) on machines without CuPy or a GPU.

Contract:

- ``CudaPlanExecutor(device, method=...)`` moves a ``copy_plan.CopyPlan``
  on a given torch CUDA stream and returns at once, with the objects that
  must stay alive until the stream passes that point (record an event after
  it and keep them until the event completes). Methods:

  - ``"kernel"``: one CuPy RawKernel launch for the whole plan. Runs are cut
    into pieces of at most ``piece_bytes`` (64 KiB) so the work balances over
    the grid; one CUDA block copies one piece, with 16-byte vector loads and
    stores when source and destination are equally aligned modulo 16 (8/4/2/1
    bytes otherwise), a byte head up to alignment and a byte tail. Pinned
    host memory is read and written directly through its unified (UVA)
    address: no staging buffer, no copy engine.
  - ``"memcpy"``: the copy engines, one ``cudaMemcpyAsync`` per merged run
    (``cudaMemcpyDefault``: UVA tells the direction). Uses no SMs, so it
    interferes less with compute, but costs a few microseconds of CPU per
    run.
  - ``"batch"``: the copy engines through one ``cudaMemcpyBatchAsync``
    (CUDA 12.8+, via the ``cuda-python`` bindings where installed).

  ``available_methods()`` lists what this machine can run. ``accessible(layout)``
  says whether a layout's memory can be addressed by the executor: device
  tensors on its GPU, or host tensors in pinned memory mapped at the same
  address on the device (``cudaPointerGetAttributes``). Callers fall back to
  the staging path when it is False. ``self_test()`` copies a few runs with
  every alignment and compares the bytes; engines run it once before trusting
  a method.
- ``BandwidthPacer(rate_bytes_per_s, burst_bytes)`` is a token bucket: call
  ``wait_s(nbytes)`` before launching ``nbytes``; it returns how long to wait
  first so that launches average at most the rate. Pure logic (testable with
  a fake clock).
- ``host_register``/``host_unregister``: page-lock an existing host range
  (``cudaHostRegister``, CuPy or torch's cudart), used by
  ``host_memory`` to pin the CPU tier in chunks.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier.blocks.copy_plan import CopyPlan, plan_block_copy
from kvtier.blocks.layout import BlockLayout

log = logging.getLogger(__name__)

METHODS = ("kernel", "memcpy", "batch")
# One CUDA block copies at most this much: big enough that the per-block
# descriptor read is noise, small enough that a 2 MiB block spreads over 32 SMs.
PIECE_BYTES = 64 * 1024
THREADS_PER_BLOCK = 256
MAX_GRID = 1 << 20  # grid-stride beyond this (never reached by realistic batches)

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from UVA addresses
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2
# cudaMemoryType (cudaPointerAttributes.type)
_MEM_UNREGISTERED, _MEM_HOST, _MEM_DEVICE, _MEM_MANAGED = 0, 1, 2, 3


@functools.cache
def cupy_module() -> Any | None:
    """CuPy if it imports and sees a GPU, else None (cached)."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency, imported on first use

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception as exc:  # ImportError, or a CuPy that cannot load libcuda
        log.debug("CuPy unavailable: %s", exc)
        return None


@functools.cache
def _cuda_bindings_runtime() -> Any | None:
    """cuda-python's runtime bindings if they offer cudaMemcpyBatchAsync, else None."""
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            module = __import__(name, fromlist=["runtime"])
        except Exception:
            continue
        if hasattr(module, "cudaMemcpyBatchAsync"):
            return module
    return None


def available_methods() -> list[str]:
    """The executor methods this machine can run (empty without CUDA or CuPy)."""
    if not torch.cuda.is_available():
        return []
    methods = []
    if cupy_module() is not None:
        methods += ["kernel", "memcpy"]
    if _cuda_bindings_runtime() is not None:
        methods.append("batch")
    return methods


KERNEL_SOURCE = r"""
// kvtier: copy a list of (src, dst, nbytes) runs, one CUDA block per run.
// Host-side plans cut runs to <= 64 KiB pieces; the grid-stride loop over runs
// only matters if the grid is capped below the number of pieces.
struct alignas(16) kv_vec16 { unsigned long long lo, hi; };

template <typename V>
__device__ __forceinline__ void kv_copy_span(const unsigned char* __restrict__ src,
                                             unsigned char* __restrict__ dst,
                                             unsigned long long n) {
    // Precondition: src and dst are congruent modulo sizeof(V), so once src is
    // aligned dst is too. Bytes [0, head) and [done, n) go one by one, the
    // middle as V-sized words.
    const unsigned long long W = sizeof(V);
    unsigned long long head = (W - (reinterpret_cast<unsigned long long>(src) & (W - 1))) & (W - 1);
    if (head > n) head = n;
    if (threadIdx.x < head) dst[threadIdx.x] = src[threadIdx.x];  // head < 16 <= blockDim.x
    const unsigned long long nv = (n - head) / W;
    const V* __restrict__ vs = reinterpret_cast<const V*>(src + head);
    V* __restrict__ vd = reinterpret_cast<V*>(dst + head);
    const unsigned long long stride = blockDim.x;
    unsigned long long i = threadIdx.x;
    // Four loads in flight per thread before the stores: reads of pinned host
    // memory cross PCIe/NVLink-C2C and take microseconds each.
    for (; i + 3 * stride < nv; i += 4 * stride) {
        const V a = vs[i], b = vs[i + stride], c = vs[i + 2 * stride], d = vs[i + 3 * stride];
        vd[i] = a; vd[i + stride] = b; vd[i + 2 * stride] = c; vd[i + 3 * stride] = d;
    }
    for (; i < nv; i += stride) vd[i] = vs[i];
    for (unsigned long long j = head + nv * W + threadIdx.x; j < n; j += stride) dst[j] = src[j];
}

extern "C" __global__ void kvtier_copy_runs(const unsigned long long* __restrict__ srcs,
                                            const unsigned long long* __restrict__ dsts,
                                            const unsigned long long* __restrict__ sizes,
                                            long long num_runs) {
    for (long long r = blockIdx.x; r < num_runs; r += gridDim.x) {
        const unsigned long long s = srcs[r], d = dsts[r], n = sizes[r];
        const unsigned char* src = reinterpret_cast<const unsigned char*>(s);
        unsigned char* dst = reinterpret_cast<unsigned char*>(d);
        const unsigned long long mis = s ^ d;  // uniform over the block: no divergence
        if ((mis & 15) == 0) kv_copy_span<kv_vec16>(src, dst, n);
        else if ((mis & 7) == 0) kv_copy_span<unsigned long long>(src, dst, n);
        else if ((mis & 3) == 0) kv_copy_span<unsigned int>(src, dst, n);
        else if ((mis & 1) == 0) kv_copy_span<unsigned short>(src, dst, n);
        else kv_copy_span<unsigned char>(src, dst, n);
    }
}
"""


@functools.cache
def _kernel(device_index: int) -> Any:
    """The compiled copy kernel for one device (NVRTC compiles on first use, then CuPy caches on disk)."""
    cp = cupy_module()
    if cp is None:
        raise RuntimeError("the kernel copy path needs CuPy (pip install 'kvtier[cuda]')")
    with cp.cuda.Device(device_index):
        kernel = cp.RawKernel(KERNEL_SOURCE, "kvtier_copy_runs")
        if hasattr(kernel, "compile"):  # compile now, not inside the first transfer's launch
            kernel.compile()
    return kernel


def device_pointer(ptr: int) -> int | None:
    """The address a kernel uses for ``ptr``, or None if the device cannot address it.

    Device and managed memory are addressed as is. Pinned host memory
    (``cudaHostAlloc``, which torch's ``pin_memory`` uses, or
    ``cudaHostRegister``) is mapped into the device's address space on every
    64-bit platform with unified virtual addressing, and
    ``cudaPointerGetAttributes`` returns its device-side address (equal to the
    host address when the device can use host pointers for registered
    memory, which is the case on Linux x86-64 and Grace). Pageable memory is
    not addressable: None.
    """
    cp = cupy_module()
    if cp is None:
        return None
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(ptr)
    except Exception:
        return None
    kind = getattr(attrs, "type", getattr(attrs, "memoryType", _MEM_UNREGISTERED))
    if kind in (_MEM_DEVICE, _MEM_MANAGED):
        return ptr
    if kind == _MEM_HOST and attrs.devicePointer:
        return int(attrs.devicePointer)
    return None


class BandwidthPacer:
    """A token bucket for launches: ``wait_s(nbytes)`` says how long to wait before launching them.

    ``rate_bytes_per_s`` None or <= 0 means no cap (always 0). Tokens refill at
    the rate up to ``burst_bytes``; a launch may take the bucket into debt, and
    the next one waits until the debt is repaid. Over any long interval the
    launched bytes average at most the rate, whatever the chunk sizes.
    """

    def __init__(self, rate_bytes_per_s: float | None, burst_bytes: int = 8 << 20,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_bytes_per_s = rate_bytes_per_s if rate_bytes_per_s and rate_bytes_per_s > 0 else None
        self.burst_bytes = max(0, burst_bytes)
        self._clock = clock
        self._tokens = float(self.burst_bytes)
        self._last_s = clock()
        self._lock = threading.Lock()

    def wait_s(self, nbytes: int) -> float:
        """Seconds to wait before launching ``nbytes`` (and charge them to the bucket)."""
        if self.rate_bytes_per_s is None:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst_bytes), self._tokens + (now - self._last_s) * self.rate_bytes_per_s)
            self._last_s = now
            wait = max(0.0, -self._tokens / self.rate_bytes_per_s)
            self._tokens -= nbytes
            return wait

    def pace(self, nbytes: int, sleep: Callable[[float], None] = time.sleep) -> float:
        """Sleep as ``wait_s`` says; returns the seconds slept."""
        wait = self.wait_s(nbytes)
        if wait > 0:
            sleep(wait)
        return wait


class CudaPlanExecutor:
    """Launches copy plans on torch CUDA streams; see the module docstring."""

    def __init__(self, device: torch.device | str | int = "cuda", *, method: str = "kernel",
                 piece_bytes: int = PIECE_BYTES, threads_per_block: int = THREADS_PER_BLOCK) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        if self.device.type != "cuda":
            raise ValueError(f"CudaPlanExecutor needs a CUDA device, got {self.device}")
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        self.method = method
        if piece_bytes < 16 or piece_bytes & (piece_bytes - 1):
            raise ValueError(f"piece_bytes must be a power of two >= 16 (keeps alignment), got {piece_bytes}")
        self.piece_bytes = piece_bytes
        if threads_per_block < 32 or threads_per_block > 1024 or threads_per_block % 32:
            raise ValueError(f"threads_per_block must be a multiple of 32 in [32, 1024], got {threads_per_block}")
        self.threads_per_block = threads_per_block
        if method in ("kernel", "memcpy") and cupy_module() is None:
            raise RuntimeError(f"method {method!r} needs CuPy")
        if method == "batch" and _cuda_bindings_runtime() is None:
            raise RuntimeError("method 'batch' needs cuda-python with cudaMemcpyBatchAsync (CUDA 12.8+)")
        self._accessible: weakref.WeakKeyDictionary[BlockLayout, bool] = weakref.WeakKeyDictionary()
        self._batch_attrs: Any = None

    # ---- which layouts can go through here --------------------------------------------------

    def accessible(self, layout: BlockLayout) -> bool:
        """Whether every byte of ``layout`` is addressable at the same address from this GPU."""
        known = self._accessible.get(layout)
        if known is None:
            known = self._check_accessible(layout)
            self._accessible[layout] = known
        return known

    def _check_accessible(self, layout: BlockLayout) -> bool:
        if layout.device.type == "cuda":
            # Another GPU's memory would need peer access; keep that on the staging path.
            return layout.device.index == self.index
        if layout.device.type != "cpu":
            return False
        for t in layout.tensors:
            if t.numel() == 0:
                continue
            lo, hi = _byte_span(t)
            # The plan's addresses are host addresses: the kernel may use them
            # only where the device address is the same one. Check both ends
            # of the span (a chunk-registered slab registers every page of it).
            for p in {lo, hi - 1}:
                if device_pointer(p) != p:
                    return False
        return True

    def plannable(self, src: BlockLayout, dst: BlockLayout) -> bool:
        return self.accessible(src) and self.accessible(dst)

    # ---- launching ---------------------------------------------------------------------------

    def launch(self, plan: CopyPlan, stream: torch.cuda.Stream, *, max_blocks: int | None = None) -> list[Any]:
        """Enqueue ``plan`` on ``stream``; returns the objects to keep alive until the stream passes it.

        ``max_blocks`` caps the kernel's grid (fewer SMs taken from concurrent
        compute; the grid-stride loop covers the rest). Raises on launch
        errors; the copy's own failures surface at the stream's next sync.
        """
        keep: list[Any] = [plan]
        if plan.num_runs == 0:
            return keep
        with torch.cuda.device(self.index), torch.cuda.stream(stream):
            if self.method == "kernel":
                keep += self._launch_kernel(plan, stream, max_blocks)
            elif self.method == "memcpy":
                self._launch_memcpy(plan, stream)
            else:
                keep += self._launch_batch(plan, stream)
        return keep

    def _launch_kernel(self, plan: CopyPlan, stream: torch.cuda.Stream, max_blocks: int | None) -> list[Any]:
        cp = cupy_module()
        pieces = plan.chunked(self.piece_bytes)
        runs = pieces.num_runs
        # Descriptors go host -> device on the same stream, from torch's pinned
        # caching allocator: truly asynchronous (a pageable upload could make
        # the driver wait for the stream, i.e. for earlier demotions), and
        # torch records the stream use so the pinned block is not reused early.
        host = torch.from_numpy(pieces.descriptors().view(np.int64)).pin_memory()
        desc = host.to(self.device, non_blocking=True)
        base = desc.data_ptr()
        grid = min(runs, MAX_GRID, max_blocks if max_blocks and max_blocks > 0 else MAX_GRID)
        kernel = _kernel(self.index)
        with cp.cuda.Device(self.index), cp.cuda.ExternalStream(stream.cuda_stream, self.index):
            kernel((grid,), (self.threads_per_block,),
                   (np.uint64(base), np.uint64(base + 8 * runs), np.uint64(base + 16 * runs), np.int64(runs)))
        return [host, desc, pieces]

    def _launch_memcpy(self, plan: CopyPlan, stream: torch.cuda.Stream) -> None:
        memcpy_async = cupy_module().cuda.runtime.memcpyAsync
        handle = stream.cuda_stream
        for s, d, n in zip(plan.src_ptrs.tolist(), plan.dst_ptrs.tolist(), plan.sizes.tolist()):
            memcpy_async(d, s, n, CUDA_MEMCPY_DEFAULT, handle)

    def _launch_batch(self, plan: CopyPlan, stream: torch.cuda.Stream) -> list[Any]:
        rt = _cuda_bindings_runtime()
        if self._batch_attrs is None:
            attrs = rt.cudaMemcpyAttributes()
            # Stream order for the sources: they were written by earlier work on
            # this stream (or waited for through events).
            attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            self._batch_attrs = attrs
        srcs, dsts, sizes = plan.src_ptrs.tolist(), plan.dst_ptrs.tolist(), plan.sizes.tolist()
        result = rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [self._batch_attrs], [0], 1, stream.cuda_stream)
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            raise RuntimeError(f"cudaMemcpyBatchAsync failed: {result}")
        return [srcs, dsts, sizes]

    # ---- trust, but verify --------------------------------------------------------------------

    def self_test(self) -> None:
        """Copy runs of every alignment class host->device->host and compare; raise on any mismatch.

        Each case is one block of three pieces launched with a grid of two
        CUDA blocks, so the grid-stride loop, the vector widths 16/8/4/2/1, the
        byte head and the byte tail all run.
        """
        # (source offset, device offset): source ^ device modulo 16 selects the path.
        cases = [(0, 0), (1, 1), (2, 6), (4, 12), (8, 24), (1, 3), (3, 16)]
        block = 2 * self.piece_bytes + 48
        stride = block + 64
        total = len(cases) * stride + 64
        gen = torch.Generator().manual_seed(7)
        host_src = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen).pin_memory()
        host_dst = torch.full((total,), 0x5A, dtype=torch.uint8).pin_memory()
        dev = torch.full((total,), 0xA5, dtype=torch.uint8, device=self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the fills above
        keep = []
        for i, (so, do) in enumerate(cases):
            src = BlockLayout([host_src[i * stride + so :][:block].view(1, block)], [0])
            mid = BlockLayout([dev[i * stride + do :][:block].view(1, block)], [0])
            out = BlockLayout([host_dst[i * stride + so :][:block].view(1, block)], [0])
            for a, b in ((src, mid), (mid, out)):
                if not self.plannable(a, b):
                    raise RuntimeError("self-test memory is not addressable from the device (no UVA mapping?)")
                keep += self.launch(plan_block_copy(a, [0], b, [0], min_fragment_bytes=1), stream, max_blocks=2)
        stream.synchronize()
        for i, (so, _do) in enumerate(cases):
            lo = i * stride + so
            if not torch.equal(host_dst[lo : lo + block], host_src[lo : lo + block]):
                raise RuntimeError(f"{self.method} copy self-test produced wrong bytes (case {cases[i]})")
            if bool((host_dst[lo - 1 : lo] != 0x5A).any()) or bool((host_dst[lo + block : lo + block + 1] != 0x5A).any()):
                raise RuntimeError(f"{self.method} copy self-test wrote outside its runs (case {cases[i]})")
        del keep


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[lowest, highest + 1) byte address any element of ``t`` occupies."""
    item = t.element_size()
    lo = hi = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        if size > 1:
            extent = (size - 1) * stride * item
            if extent >= 0:
                hi += extent
            else:
                lo += extent
    return lo, hi + item


# ---- page-locking existing host memory --------------------------------------------------------


def host_register(ptr: int, nbytes: int, flags: int = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED) -> None:
    """``cudaHostRegister``: page-lock ``[ptr, ptr + nbytes)`` and map it for every device (UVA)."""
    cp = cupy_module()
    if cp is not None:
        cp.cuda.runtime.hostRegister(ptr, nbytes, flags)
        return
    err = torch.cuda.cudart().cudaHostRegister(ctypes.c_void_p(ptr).value, nbytes, flags)
    torch.cuda.check_error(err)


def host_unregister(ptr: int) -> None:
    """``cudaHostUnregister`` of a range registered with ``host_register`` (its start address)."""
    cp = cupy_module()
    if cp is not None:
        cp.cuda.runtime.hostUnregister(ptr)
        return
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ctypes.c_void_p(ptr).value))
