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
  ``daemon.planes.lent``).
- Only host layouts are client memory in this sense; CUDA IPC memory cannot
  SIGBUS the daemon and is copied by the transfer engines as before
  (``is_client_host_memory``).
- Where the kernel refuses the calls (a seccomp profile without
  ``process_vm_readv``), ``available()`` is False and the copies fall back to
  plain memory copies, which fault as before; the daemon logs this once.

Canonical block bytes follow ``kvtier.blocks.layout``: tensor by tensor, the
bytes of ``t.select(block_dim, s)`` in C order, decomposed here into
contiguous runs (one per block for a slab such as an arena).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
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


# layout -> the runs of block 0's canonical bytes, in order, as arrays: address, length, and the
# bytes between blocks of the tensor each run is in. Block s is block 0 shifted by s strides, so the
# runs are worked out once per layout, and every copy builds its runs with a few array operations
# whatever the number of blocks and fragments (4,096 fragments of a vLLM layout were 20 ms of Python
# per restore as lists of tuples, loaded 2-core VM).
_TEMPLATES: weakref.WeakKeyDictionary[Any, tuple[np.ndarray, np.ndarray, np.ndarray]] = weakref.WeakKeyDictionary()


def _template(layout: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    parts = _TEMPLATES.get(layout)
    if parts is None:
        addrs: list[int] = []
        lens: list[int] = []
        strides: list[int] = []
        for t, d in zip(layout.tensors, layout.block_dims):
            runs: list[tuple[int, int]] = []
            _tensor_runs(t.select(d, 0), runs)
            addrs += [a for a, _ in runs]
            lens += [n for _, n in runs]
            strides += [t.stride(d) * t.element_size()] * len(runs)
        parts = (np.array(addrs, dtype=np.int64), np.array(lens, dtype=np.int64), np.array(strides, dtype=np.int64))
        _TEMPLATES[layout] = parts
    return parts


def _merge_runs(addrs: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs that continue the one before them joined to it."""
    keep = lens > 0
    addrs, lens = addrs[keep], lens[keep]
    if len(addrs) < 2:
        return addrs, lens
    first = np.empty(len(addrs), dtype=bool)
    first[0] = True
    np.not_equal(addrs[1:], addrs[:-1] + lens[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return addrs[starts], np.add.reduceat(lens, starts)


def client_runs(layout: Any, slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, lengths) of the canonical bytes of blocks ``slots`` of ``layout``, in order, adjacent runs merged."""
    s = np.asarray(slots, dtype=np.int64)
    if layout.is_slab:
        slab = layout.slab()
        return _merge_runs(slab.data_ptr() + s * slab.stride(0), np.full(len(s), slab.shape[1], dtype=np.int64))
    addrs, lens, strides = _template(layout)
    return _merge_runs((addrs[None, :] + s[:, None] * strides[None, :]).ravel(),
                       np.broadcast_to(lens, (len(s), len(lens))).ravel())


def _pieces(own: tuple[np.ndarray, np.ndarray], client: tuple[np.ndarray, np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(daemon addresses, client addresses, lengths): both run lists cut at each other's boundaries,
    then pieces that continue each other on both sides joined."""
    own_a, own_n = own
    cli_a, cli_n = client
    own_end = np.cumsum(own_n)
    cli_end = np.cumsum(cli_n)
    if own_end[-1] != cli_end[-1]:
        raise ValueError(f"{int(own_end[-1])} bytes of the daemon's against {int(cli_end[-1])} of the client's")
    if len(own_n) == 1:  # one buffer of the daemon's (a staging slab, one lent run): no cuts
        lens = cli_n
        own_addr = own_a[0] + (cli_end - cli_n)
        cli_addr = cli_a
    else:
        # The daemon's few run ends that fall inside a client run cut it (both lists are sorted).
        cuts = own_end[:-1]
        at = np.searchsorted(cli_end, cuts)
        inside = cli_end[at] != cuts
        ends = np.insert(cli_end, at[inside], cuts[inside])
        starts = np.concatenate(([0], ends[:-1]))
        oi = np.searchsorted(own_end, starts, side="right")
        ci = np.searchsorted(cli_end, starts, side="right")
        own_addr = own_a[oi] + (starts - (own_end[oi] - own_n[oi]))
        cli_addr = cli_a[ci] + (starts - (cli_end[ci] - cli_n[ci]))
        lens = ends - starts
    if len(lens) < 2:
        return own_addr, cli_addr, lens
    first = np.empty(len(lens), dtype=bool)
    first[0] = True
    first[1:] = (own_addr[1:] != own_addr[:-1] + lens[:-1]) | (cli_addr[1:] != cli_addr[:-1] + lens[:-1])
    at = np.flatnonzero(first)
    return own_addr[at], cli_addr[at], np.add.reduceat(lens, at)


def _own_runs(pairs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([a for a, _ in pairs], dtype=np.int64), np.array([n for _, n in pairs], dtype=np.int64))


def _move_runs(to_client: bool, what: str, own: tuple[np.ndarray, np.ndarray],
               client: tuple[np.ndarray, np.ndarray]) -> None:
    """Move the bytes of the ``own`` runs (daemon memory, in order) to (``to_client``) or from the ``client``
    runs (client memory), equal in total, on the calling thread.

    One thread: with the daemon's side pinned in huge pages the copy is
    memory-bound, and a second thread gained nothing on the 2-core VM while
    its hand-off cost a scheduling delay under load (32 MiB: p10 3.5 ms on
    one thread, 6.5-7.6 ms split over two, load average 7-8). It was kept
    while the client's 4 KiB pages were pinned, which bound the copy to the
    CPU (7.4 ms on one thread, 5.0 ms on two).
    """
    if not len(client[0]):
        return
    own = _merge_runs(*own)
    if len(own[0]) <= IOV_MAX and len(client[0]) <= IOV_MAX:
        # One call: the kernel consumes both iovec lists as streams, so neither needs cutting at
        # the other's run ends (fewer pinned iovecs: 32 MiB into vLLM's layout ~3% faster).
        _call(to_client, what, client, own)
        return
    own_a, cli_a, lens = _pieces(own, client)
    for i in range(0, len(lens), IOV_MAX):
        j = min(len(lens), i + IOV_MAX)
        _call(to_client, what, (cli_a[i:j], lens[i:j]), (own_a[i:j], lens[i:j]))


def _iovecs(addrs: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, Any]:
    """An iovec array over ``addrs``/``lens`` (struct iovec is two 64-bit words), and its pointer."""
    iov = np.empty((len(addrs), 2), dtype=np.uint64)
    iov[:, 0] = addrs
    iov[:, 1] = lens
    return iov, iov.ctypes.data_as(ctypes.POINTER(_IoVec))


def _call(to_client: bool, what: str, client: tuple[np.ndarray, np.ndarray], own: tuple[np.ndarray, np.ndarray]) -> None:
    """One process_vm_readv/writev (at most IOV_MAX iovecs a side, equal totals).

    The client's memory is the local side (copy_to_user / copy_from_user: a
    fault is a short count), the daemon's the remote side (pinned): readv
    moves remote -> local, writev local -> remote.
    """
    fn = _readv if to_client else _writev
    total = int(client[1].sum())
    client_iov, client_ptr = _iovecs(*client)
    own_iov, own_ptr = _iovecs(*own)
    got = fn(os.getpid(), client_ptr, len(client_iov), own_ptr, len(own_iov), 0)
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
    runs = client_runs(layout, slots)
    _move_runs(False, "reading", _own_runs([(dst.data_ptr(), len(slots) * layout.block_bytes)]), runs)


def write_blocks(staging: Any, count: int, layout: Any, slots: Sequence[int]) -> None:
    """Copy rows 0..count of ``staging`` (a host slab) into blocks ``slots`` of client memory ``layout``."""
    src = staging.slab()
    if not available():
        layout.scatter(list(slots[:count]), src[:count])
        return
    runs = client_runs(layout, slots[:count])
    _move_runs(True, "writing", _own_runs([(src.data_ptr(), count * layout.block_bytes)]), runs)


def write_views(views: Sequence[Any], layout: Any, slots: Sequence[int]) -> None:
    """Copy the blocks lent as ``views`` (uint8 arrays, blocks in order) into blocks ``slots`` of client memory."""
    if not slots:
        return
    if not available():
        rows = torch.cat([torch.from_numpy(v).reshape(v.shape[0], -1) for v in views])
        layout.scatter(list(slots), rows)
        return
    _move_runs(True, "writing", _own_runs([(v.ctypes.data, v.nbytes) for v in views]), client_runs(layout, slots))
