"""Copies between the daemon's own buffers and memory a client owns, that never fault the daemon.

Why: an arena (``attach_arena``) and a ``/dev/shm`` KV registration
(``register_kv``) are files the client created and can truncate, shrink or
leave sparse at any time. ``/dev/shm`` files cannot be sealed (only memfds
can), so a size check at attach time proves nothing later: a plain load or
store through the daemon's mapping of a page past the file's new end, or of
a hole tmpfs cannot back, is SIGBUS, and SIGBUS kills the whole daemon with
every other client's pools.

How: the daemon never lets its copy engines (``tiers``) touch a client's
host memory. A store first copies the named slots into a daemon-owned
staging buffer; a restore is copied out to the client's slots from the
tier memory the pool lends (or from a staging buffer). Those copies are
``process_vm_readv`` / ``process_vm_writev`` on the daemon's own pid, with
the client's memory always on the *local* side and the daemon's own on the
*remote* side: the kernel pins the remote pages (get_user_pages) and moves
the bytes to or from the local ones with ``copy_to_user`` /
``copy_from_user``, and a local page that is gone or cannot be backed makes
the call return a short count or ``EFAULT`` instead of raising a signal.
There is no check-then-copy window: the copy itself is the check.

Why that way round: pinning costs per 4 KiB page, and a client's
``/dev/shm`` file is mapped in 4 KiB pages (tmpfs gives no huge pages
unless mounted with ``huge=``), while the daemon's tiers are huge pages
where it allocates them (``BlockLayout.contiguous(hugepages=True)``).
Pinning the client's side made a 32 MiB restore 2.5x slower than a
memcpy on the 2-core VM; pinning the tier's side runs at memcpy speed
(``bench/protocol.py``, ``bench/vllm_restore.py``).

Contract:

- ``read_blocks(layout, slots, staging)`` fills row ``i`` of ``staging`` (a
  contiguous ``[n, block_bytes]`` host layout) with the canonical bytes of
  block ``slots[i]`` of ``layout``; ``write_blocks(staging, layout, slots)``
  is the reverse. Both raise ``ClientMemoryFault`` when any byte could not
  be moved (then the destination is partly written, and the caller fails the
  request and drops the session's client memory).
- ``write_views(views, layout, slots)`` writes blocks straight from tier
  memory the pool lent (``TieredPool.borrow``: uint8 arrays whose
  concatenation is the blocks in order) into the client's slots: one copy,
  where a staging buffer would cost a second one and a copy worker's round
  trip (a 32 MiB restore into vLLM: 13-88 ms through staging, see
  ``handlers.restore``).
- Only host layouts are client memory in this sense; CUDA IPC memory cannot
  SIGBUS the daemon and is copied by the transfer engines as before
  (``is_client_host_memory``).
- Where the kernel refuses the calls (a seccomp profile without
  ``process_vm_readv``), ``available()`` is False and the copies fall back to
  plain memory copies, which fault as before; the daemon logs this once.

Canonical block bytes follow ``kvtier.tiers.layout``: tensor by tensor, the
bytes of ``t.select(block_dim, s)`` in C order, decomposed here into
contiguous runs (one per block for a slab such as an arena).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

IOV_MAX = 1024  # Linux UIO_MAXIOV: iovecs per call


class ClientMemoryFault(Exception):
    """Client memory could not be read or written (truncated file, unbackable page)."""


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_SIG = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
_readv = getattr(_libc, "process_vm_readv", None)
_writev = getattr(_libc, "process_vm_writev", None)
for _fn in (_readv, _writev):
    if _fn is not None:
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = _SIG

_available: bool | None = None


def available() -> bool:
    """Whether fault-safe copies work in this process (probed once)."""
    global _available
    if _available is None:
        _available = False
        if _readv is not None and _writev is not None:
            src = ctypes.create_string_buffer(b"kvtier", 8)
            dst = ctypes.create_string_buffer(8)
            local, remote = _IoVec(ctypes.addressof(dst), 8), _IoVec(ctypes.addressof(src), 8)
            n = _readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            _available = n == 8 and dst.raw[:6] == b"kvtier"
            if not _available:
                log.warning("process_vm_readv is not permitted here (%s): copies from clients' shared memory are "
                            "plain memory copies, and a client that truncates its file can crash the daemon",
                            os.strerror(ctypes.get_errno()) if n < 0 else f"returned {n}")
    return _available


def is_client_host_memory(layout: Any) -> bool:
    return layout.device.type == "cpu"


def _tensor_runs(t: Any, out: list[tuple[int, int]]) -> None:
    if t.numel() == 0:
        return
    if t.is_contiguous():
        out.append((t.data_ptr(), t.numel() * t.element_size()))
        return
    for i in range(t.shape[0]):
        _tensor_runs(t[i], out)


# layout -> per tensor (bytes between blocks, runs of block 0): block s is
# block 0 shifted by s strides, so the runs are worked out once per layout.
_TEMPLATES: weakref.WeakKeyDictionary[Any, list[tuple[int, list[tuple[int, int]]]]] = weakref.WeakKeyDictionary()


def _template(layout: Any) -> list[tuple[int, list[tuple[int, int]]]]:
    parts = _TEMPLATES.get(layout)
    if parts is None:
        parts = []
        for t, d in zip(layout.tensors, layout.block_dims):
            runs: list[tuple[int, int]] = []
            _tensor_runs(t.select(d, 0), runs)
            parts.append((t.stride(d) * t.element_size(), runs))
        _TEMPLATES[layout] = parts
    return parts


def block_runs(layout: Any, slot: int) -> list[tuple[int, int]]:
    """(address, length) runs of block ``slot``'s canonical bytes, in order, adjacent runs merged."""
    if layout.is_slab:
        slab = layout.slab()
        bb = slab.shape[1]
        return [(slab.data_ptr() + slot * slab.stride(0), bb)]
    runs: list[tuple[int, int]] = []
    for stride, template in _template(layout):
        shift = slot * stride
        for addr, n in template:
            addr += shift
            if runs and runs[-1][0] + runs[-1][1] == addr:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((addr, n))
    return runs


def _pieces(own_runs: Sequence[tuple[int, int]], runs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(daemon address, client address, length): both run lists cut at each other's boundaries."""
    out: list[tuple[int, int, int]] = []
    li, loff = 0, 0
    for addr, n in runs:
        off = 0
        while off < n:
            laddr, ln = own_runs[li]
            take = min(ln - loff, n - off)
            out.append((laddr + loff, addr + off, take))
            off += take
            loff += take
            if loff == ln:
                li, loff = li + 1, 0
    return out


def _merged(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent pieces that continue each other on both sides as one (fewer iovecs, fewer calls)."""
    out: list[tuple[int, int, int]] = []
    for own, client, n in pieces:
        if out and out[-1][0] + out[-1][2] == own and out[-1][1] + out[-1][2] == client:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((own, client, n))
    return out


def _move_runs(to_client: bool, what: str, own_runs: Sequence[tuple[int, int]], runs: Sequence[tuple[int, int]]) -> None:
    """Move the bytes of ``own_runs`` (daemon memory, in order) to (``to_client``) or from ``runs``
    (client memory), equal in total.

    A large move is split in two halves, the second on a helper thread: the
    engine waiting on a restore is idle, and where memory bandwidth allows
    two copies at once the restore takes less than one memcpy.
    """
    pieces = _merged(_pieces(own_runs, runs))
    total = sum(n for _, _, n in pieces)
    if total >= PARALLEL_MIN_BYTES and len(pieces) < 2:
        pieces = _split(pieces[0])
    if total < PARALLEL_MIN_BYTES or len(pieces) < 2:
        _move_pieces(to_client, what, pieces)
        return
    half, acc = 0, 0
    while acc < total // 2 and half < len(pieces) - 1:
        acc += pieces[half][2]
        half += 1
    second = _helper().submit(_move_pieces, to_client, what, pieces[half:])
    try:
        _move_pieces(to_client, what, pieces[:half])
    finally:
        second.result()  # waited for even when the first half failed: no copy outlives the call


def _split(piece: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    own, client, n = piece
    half = n // 2 // 4096 * 4096 or n // 2
    return [(own, client, half), (own + half, client + half, n - half)]


PARALLEL_MIN_BYTES = 8 * 1024 * 1024
_HELPER: concurrent.futures.ThreadPoolExecutor | None = None


def _helper() -> concurrent.futures.ThreadPoolExecutor:
    global _HELPER
    if _HELPER is None:
        _HELPER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-client-copy")
    return _HELPER


def _move_pieces(to_client: bool, what: str, pieces: Sequence[tuple[int, int, int]]) -> None:
    # The client's memory is the local side (copy_to_user / copy_from_user: a fault is a short
    # count), the daemon's the remote side (pinned): readv moves remote -> local, writev local -> remote.
    fn = _readv if to_client else _writev
    pid = os.getpid()
    for i in range(0, len(pieces), IOV_MAX):
        part = pieces[i : i + IOV_MAX]
        total = sum(n for _, _, n in part)
        client_iov = (_IoVec * len(part))(*[(c, n) for _, c, n in part])
        own_iov = (_IoVec * len(part))(*[(o, n) for o, _, n in part])
        got = fn(pid, client_iov, len(part), own_iov, len(part), 0)
        if got != total:
            err = ctypes.get_errno() if got < 0 else 0
            why = os.strerror(err) if err else f"{got} of {total} bytes moved"
            if err == errno.EPERM:
                why += " (not permitted)"
            raise ClientMemoryFault(f"{what} the client's shared memory failed: {why} "
                                    "(was its file truncated, or can /dev/shm not back it?)")


def read_blocks(layout: Any, slots: Sequence[int], staging: Any) -> None:
    """Copy blocks ``slots`` of client memory ``layout`` into rows 0.. of ``staging`` (a host slab)."""
    dst = staging.slab()
    if not available():
        dst[: len(slots)].copy_(layout.gather(list(slots)))
        return
    runs = [r for s in slots for r in block_runs(layout, s)]
    _move_runs(False, "reading", [(dst.data_ptr(), sum(n for _, n in runs))], runs)


def write_blocks(staging: Any, count: int, layout: Any, slots: Sequence[int]) -> None:
    """Copy rows 0..count of ``staging`` (a host slab) into blocks ``slots`` of client memory ``layout``."""
    src = staging.slab()
    if not available():
        layout.scatter(list(slots[:count]), src[:count])
        return
    runs = [r for s in slots[:count] for r in block_runs(layout, s)]
    _move_runs(True, "writing", [(src.data_ptr(), sum(n for _, n in runs))], runs)


def write_views(views: Sequence[Any], layout: Any, slots: Sequence[int]) -> None:
    """Copy the blocks lent as ``views`` (uint8 arrays, blocks in order) into blocks ``slots`` of client memory."""
    if not slots:
        return
    if not available():
        rows = torch.cat([torch.from_numpy(v).reshape(v.shape[0], -1) for v in views])
        layout.scatter(list(slots), rows)
        return
    local = [(v.ctypes.data, v.nbytes) for v in views]
    runs = [r for s in slots for r in block_runs(layout, s)]
    _move_runs(True, "writing", local, runs)
