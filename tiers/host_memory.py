"""Host memory for the CPU tier: capacity checks and (pinned) slab allocation.

Contract:

- ``check_host_capacity(nbytes)`` raises ``HostMemoryError`` with the numbers
  when ``nbytes`` exceeds what the machine can give now (psutil's available
  memory less a reserve), and, when the memory is to be pinned, the process's
  RLIMIT_MEMLOCK. Callers check before allocating so a daemon refuses at
  start-up instead of being killed later.
- ``allocate_host_slab(num_blocks, block_bytes, pin=None)`` returns a
  ``BlockLayout`` over one ``[num_blocks, block_bytes]`` uint8 host tensor,
  pinned when CUDA is available (``pin=None`` means "pin if CUDA is there").
- Pinned slabs are allocated in chunks (``chunk_bytes``, default 1 GiB): one
  anonymous mapping, page-locked chunk by chunk with ``cudaHostRegister``
  (mapped, so kernels address it through UVA), because one huge
  ``cudaHostAlloc`` fails or takes tens of seconds, and torch's pinned
  allocator rounds sizes up to a power of two. ``progress(done, total)`` is
  called after each chunk. With ``numa=True`` the allocating thread is bound
  to the CPUs of the GPU's NUMA node while the pages are first touched
  (the kernel places pages where they are first touched), and the node is
  reported. If chunked pinning fails, the slab falls back to torch's
  ``pin_memory`` allocation, with a warning. The layout's ``host_info``
  dict says what happened (``pinned``: "chunked", "torch" or False,
  ``numa_node``, ``chunks``, ``seconds``).
- ``map_shared_slab(fd, num_blocks, block_bytes)`` is the slab of a
  persistent CPU tier (``kvtier.tiers.persistent_arena``): a shared mapping
  of a file whose pages outlive the process, pinned chunk by chunk as above
  when CUDA is there (each process that maps it registers it again).
- Without CUDA nothing here touches CUDA: the unpinned path is unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import resource
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import torch

from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.units import format_gib

log = logging.getLogger(__name__)

# Leave the OS and the engine room: never take the last 512 MiB.
RESERVE_BYTES = 512 * 1024**2
# Page-lock the CPU tier this much at a time (see the module docstring).
PIN_CHUNK_BYTES = 1 << 30


class HostMemoryError(MemoryError):
    """A host allocation that the machine cannot (or may not) satisfy."""


def check_host_capacity(nbytes: int, *, pin: bool = False, what: str = "CPU tier") -> None:
    available = psutil.virtual_memory().available
    usable = max(0, available - RESERVE_BYTES)
    if nbytes > usable:
        raise HostMemoryError(
            f"{what} needs {format_gib(nbytes)} but only {format_gib(available)} is available "
            f"({format_gib(usable)} after a {format_gib(RESERVE_BYTES)} reserve); lower cpu_bytes"
        )
    if pin:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and nbytes > soft:
            raise HostMemoryError(
                f"{what} wants {format_gib(nbytes)} of pinned memory but RLIMIT_MEMLOCK is {format_gib(soft)}; "
                "raise it (systemd: LimitMEMLOCK=infinity; shell: ulimit -l unlimited) or lower cpu_bytes"
            )


def _pre_touch(layout: BlockLayout, progress: Callable[[int, int], None] | None,
               chunk_bytes: int = 256 * 1024**2) -> None:
    """Fault every page in now: otherwise the first demotions into the tier pay
    the page faults (measured 0.3 GB/s for first-touch copies against 5 GB/s)."""
    flat = layout.slab().view(-1)
    total = flat.numel()
    for start in range(0, total, chunk_bytes):
        flat[start : start + chunk_bytes].zero_()
        if progress is not None:
            progress(min(start + chunk_bytes, total), total)


def allocate_host_slab(
    num_blocks: int,
    block_bytes: int,
    *,
    pin: bool | None = None,
    chunk_bytes: int | None = PIN_CHUNK_BYTES,
    numa: bool = True,
    device: torch.device | str | int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BlockLayout:
    """The CPU tier's slab; see the module docstring. ``chunk_bytes=None`` pins in one torch allocation."""
    if pin is None:
        pin = torch.cuda.is_available()
    check_host_capacity(num_blocks * block_bytes, pin=pin)
    if not pin:
        started = time.monotonic()
        layout = BlockLayout.contiguous(num_blocks, block_bytes, "cpu", pin=False, hugepages=True)
        _pre_touch(layout, progress)
        layout.host_info = {"pinned": False, "numa_node": None, "chunks": 0,
                            "seconds": time.monotonic() - started}
        return layout
    node = None
    if numa:
        try:
            node = gpu_numa_node(device)
        except Exception as exc:  # the NUMA hint is best effort
            log.debug("no NUMA node for the GPU: %s", exc)
    if chunk_bytes and num_blocks * block_bytes > 0:
        from kvtier.tiers import cuda_copy  # CUDA-only helpers, imported when pinning

        try:
            return allocate_pinned_in_chunks(
                num_blocks, block_bytes, chunk_bytes, register=cuda_copy.host_register,
                unregister=cuda_copy.host_unregister, numa_node=node, progress=progress,
            )
        except Exception as exc:
            log.warning("chunked pinning of %s failed (%s); falling back to one pinned allocation",
                        format_gib(num_blocks * block_bytes), exc)
    started = time.monotonic()
    with _bound_to_node(node):
        layout = BlockLayout.contiguous(num_blocks, block_bytes, "cpu", pin=True)
    layout.host_info = {"pinned": "torch", "numa_node": node, "chunks": 1, "seconds": time.monotonic() - started}
    return layout


def allocate_pinned_in_chunks(
    num_blocks: int,
    block_bytes: int,
    chunk_bytes: int,
    *,
    register: Callable[[int, int], None],
    unregister: Callable[[int], None],
    numa_node: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    sysfs: str | Path = "/sys",
) -> BlockLayout:
    """A slab over one anonymous mapping, page-locked with ``register(ptr, nbytes)`` chunk by chunk.

    Chunks start on page boundaries (registrations never share a page) and,
    where the block size allows (``lcm(block_bytes, page) <= chunk_bytes``),
    on block boundaries too, so no slab row straddles two registrations (a
    copy-engine memcpy of one row then stays inside one pinned range). If a
    registration fails, the earlier ones are undone and the error raised.
    The chunks are unregistered when the layout is garbage collected.
    """
    nbytes = num_blocks * block_bytes
    if nbytes <= 0:
        raise ValueError("nothing to pin")
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    started = time.monotonic()
    with _bound_to_node(numa_node, sysfs):
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _advise(buf)
        layout = _register_in_chunks(buf, size, num_blocks, block_bytes, chunk_bytes, register=register,
                                     unregister=unregister, progress=progress)
    seconds = time.monotonic() - started
    assert layout.host_info is not None
    layout.host_info.update(numa_node=numa_node, seconds=seconds)
    log.info("pinned %s in %d chunks in %.1f s (NUMA node %s)", format_gib(nbytes), layout.host_info["chunks"],
             seconds, numa_node)
    return layout


def _advise(buf: mmap.mmap) -> None:
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # fewer pages to pin and to map; an optimisation only
            buf.madvise(mmap.MADV_HUGEPAGE)
    if hasattr(mmap, "MADV_DONTFORK"):
        # A forked child must not share (copy-on-write) pages a DMA engine writes to.
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_DONTFORK)


def _register_in_chunks(
    buf: mmap.mmap,
    size: int,
    num_blocks: int,
    block_bytes: int,
    chunk_bytes: int,
    *,
    register: Callable[[int, int], None],
    unregister: Callable[[int], None],
    progress: Callable[[int, int], None] | None,
) -> BlockLayout:
    """A slab over ``buf`` (``size`` bytes, page-rounded), page-locked chunk by chunk (see
    ``allocate_pinned_in_chunks``); unregistered when the layout is garbage collected."""
    page = mmap.PAGESIZE
    unit = math.lcm(block_bytes, page)
    if unit > chunk_bytes:
        unit = page
    chunk = max(unit, chunk_bytes // unit * unit)
    # torch.frombuffer keeps a reference to the mapping for the tensor's lifetime.
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=size)
    base = flat.data_ptr()
    registered: list[int] = []
    try:
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            register(base + off, n)  # faults the pages in from this (NUMA-bound) thread
            registered.append(base + off)
            if progress is not None:
                progress(off + n, size)
    except BaseException:
        for ptr in registered:
            with contextlib.suppress(Exception):
                unregister(ptr)
        raise
    layout = BlockLayout([flat[:num_blocks * block_bytes].view(num_blocks, block_bytes)], [0])
    owner = _PinnedChunks(buf, registered)
    weakref.finalize(owner, _unregister_all, unregister, list(registered))
    layout.owners.append(owner)  # unregistered when the layout goes
    layout.host_info = {"pinned": "chunked", "numa_node": None, "chunks": len(registered), "seconds": 0.0}
    return layout


def map_shared_slab(
    fd: int,
    num_blocks: int,
    block_bytes: int,
    *,
    pin: bool | None = None,
    populate: bool = False,
    chunk_bytes: int = PIN_CHUNK_BYTES,
    progress: Callable[[int, int], None] | None = None,
    register: Callable[[int, int], None] | None = None,
    unregister: Callable[[int], None] | None = None,
) -> BlockLayout:
    """A slab over a shared mapping of the file ``fd`` (a persistent CPU tier: its bytes outlive the process).

    The file must hold at least ``num_blocks * block_bytes`` bytes (page-rounded).
    ``populate`` maps every page now (MAP_POPULATE: one call instead of a fault
    per page on first use). Pinned as ``allocate_pinned_in_chunks`` pins
    (``register``/``unregister`` default to ``cudaHostRegister``/``Unregister``),
    and pinned again by every process that maps the file: a registration lives
    with its process. If pinning fails, the slab stays pageable, with a warning
    (copies work, slower); ``host_info["pinned"]`` says which.
    """
    if pin is None:
        pin = torch.cuda.is_available()
    nbytes = num_blocks * block_bytes
    size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    started = time.monotonic()
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    buf = mmap.mmap(fd, size, flags=flags)
    _advise(buf)
    if pin and nbytes > 0:
        if register is None or unregister is None:
            from kvtier.tiers import cuda_copy  # CUDA-only helpers, imported when pinning

            register, unregister = cuda_copy.host_register, cuda_copy.host_unregister
        try:
            layout = _register_in_chunks(buf, size, num_blocks, block_bytes, chunk_bytes, register=register,
                                         unregister=unregister, progress=progress)
        except Exception as exc:
            log.warning("pinning the %s shared CPU tier failed (%s); it stays pageable (slower copies)",
                        format_gib(nbytes), exc)
        else:
            assert layout.host_info is not None
            layout.host_info["seconds"] = time.monotonic() - started
            return layout
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=size)
    layout = BlockLayout([flat[:nbytes].view(num_blocks, block_bytes)], [0])
    layout.owners.append(buf)
    layout.host_info = {"pinned": False, "numa_node": None, "chunks": 0, "seconds": time.monotonic() - started}
    return layout


class _PinnedChunks:
    """Keeps the mapping alive while the layout lives; its finalizer unregisters the chunks."""

    def __init__(self, buf: mmap.mmap, ptrs: list[int]) -> None:
        self.buf = buf
        self.ptrs = ptrs


def _unregister_all(unregister: Callable[[int], None], ptrs: list[int]) -> None:
    for ptr in ptrs:
        try:
            unregister(ptr)
        except Exception as exc:  # at interpreter exit CUDA may already be gone
            log.debug("cudaHostUnregister(%#x) failed: %s", ptr, exc)


# ---- NUMA locality -----------------------------------------------------------------------------


def gpu_pci_bus_id(device: torch.device | str | int | None = None) -> str | None:
    """The GPU's PCI address as sysfs spells it ("0000:3b:00.0"), or None if unknown."""
    if not torch.cuda.is_available():
        return None
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        d = torch.device(device)
        index = d.index if d.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, int):
        return f"{getattr(props, 'pci_domain_id', 0) or 0:04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0) or 0:02x}.0"
    from kvtier.tiers.cuda_copy import cupy_module

    cp = cupy_module()
    if cp is None:
        return None
    return normalize_pci_bus_id(cp.cuda.runtime.deviceGetPCIBusId(index))


def normalize_pci_bus_id(bus_id: str) -> str:
    """"00000000:3B:00.0" (CUDA, nvidia-smi) -> "0000:3b:00.0" (sysfs)."""
    domain, bus, devfn = bus_id.strip().lower().split(":")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{devfn}"


def numa_node_of_pci(bus_id: str, sysfs: str | Path = "/sys") -> int | None:
    """The NUMA node sysfs gives for a PCI device, or None (-1, absent, unreadable)."""
    try:
        node = int((Path(sysfs) / "bus/pci/devices" / bus_id / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_numa_node(device: torch.device | str | int | None = None, sysfs: str | Path = "/sys") -> int | None:
    """The NUMA node the GPU hangs off, or None where the machine does not say."""
    bus_id = gpu_pci_bus_id(device)
    return numa_node_of_pci(bus_id, sysfs) if bus_id else None


def parse_cpulist(text: str) -> set[int]:
    """"0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus(node: int, sysfs: str | Path = "/sys") -> set[int]:
    """The CPUs of NUMA node ``node`` (empty if sysfs does not say)."""
    try:
        return parse_cpulist((Path(sysfs) / f"devices/system/node/node{node}/cpulist").read_text())
    except OSError:
        return set()


@contextlib.contextmanager
def _bound_to_node(node: int | None, sysfs: str | Path = "/sys") -> Iterator[None]:
    """Run the block on ``node``'s CPUs (this thread only), so pages it first touches are node-local."""
    if node is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    wanted = node_cpus(node, sysfs) & os.sched_getaffinity(0)
    if not wanted:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, wanted)  # pid 0: the calling thread on Linux
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
