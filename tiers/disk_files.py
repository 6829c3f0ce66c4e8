"""A disk tier's files: a directory per pool, and one data file of fixed-size slots read with direct I/O.

``kvtier.tiers.disk_tier`` owns one ``BlockFile`` and one ``SlotIndex``
(``kvtier.tiers.slot_index``) in its pool's directory; this module holds the
data file and the directory's name, nothing of keys or records.

Contract:

- ``pool_dir_name(name, identity)``: the directory of a pool under the
  configured ``disk_dir``: ``<name, filename-safe>.<8 hex of the name>-<16
  hex of the identity>``. ``dir_family(name)`` is the part before the last
  ``-``: directories of one family are one pool's under other layouts
  (``stale_dirs`` lists them).
- ``slot_bytes_for(block_bytes)``: a slot is the block rounded up to
  ``ALIGN_BYTES`` (4 KiB), so every slot's offset and length suit direct I/O.
- ``BlockFile.open(path, slots=, slot_bytes=, block_bytes=, direct=True)``:
  opens (creating, mode 0600) the data file at ``slots * slot_bytes`` bytes,
  preallocated with ``posix_fallocate`` where the filesystem has room
  (``preallocated`` says whether it did; without it writes may meet ENOSPC,
  which the tier counts). ``direct`` is whether reads and writes bypass the
  page cache: tried with ``O_DIRECT`` (probed with one aligned read; tmpfs and
  some filesystems refuse it), else buffered with
  ``POSIX_FADV_RANDOM`` (no read-ahead past a block).
- ``read(slot, dest)``: ``block_bytes`` bytes of the slot into the writable
  buffer ``dest``: straight into it when direct I/O is on and ``dest``'s
  address and the block size are aligned, else through an aligned
  per-thread bounce buffer. Releases the GIL (``os.preadv``); safe from
  many threads at once. Raises ``OSError`` (a short read is ``EIO``).
- ``write(slot, buf)``: one slot from an aligned buffer of ``slot_bytes``
  (``aligned_buffer``). ``sync()``: the data on the device (``fdatasync``).
  Both raise ``OSError``. One writer thread.
- ``close()``.
- ``faults``: a test's seam, ``faults(op, slot)`` called before each
  ``"read"`` / ``"write"`` / ``"sync"`` (slot -1), may raise ``OSError``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import mmap
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ALIGN_BYTES", "BlockFile", "aligned_buffer", "dir_family", "pool_dir_name", "slot_bytes_for",
           "stale_dirs"]

# Direct I/O needs offsets, lengths and memory aligned to the device's logical block
# (512 B or 4 KiB); 4 KiB suits both, and is the page size mmap aligns buffers to.
ALIGN_BYTES = 4096

Faults = Callable[[str, int], None]

_SAFE = re.compile(r"[^A-Za-z0-9._]")


def slot_bytes_for(block_bytes: int) -> int:
    return -(-block_bytes // ALIGN_BYTES) * ALIGN_BYTES


def dir_family(name: str) -> str:
    """The part of a pool's directory name that depends on its name only."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{_SAFE.sub('_', name)[:48]}.{digest}"


def pool_dir_name(name: str, identity: dict[str, Any]) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=repr).encode()
    return f"{dir_family(name)}-{hashlib.sha256(canonical).hexdigest()[:16]}"


def stale_dirs(parent: Path, name: str, keep: str) -> list[Path]:
    """Directories under ``parent`` of pool ``name``'s family other than ``keep`` (other layouts)."""
    family = dir_family(name)
    try:
        found = list(parent.iterdir())
    except OSError:
        return []
    return [d for d in found if d.name != keep and d.is_dir() and d.name.rpartition("-")[0] == family
            and re.fullmatch(r"[0-9a-f]{16}", d.name.rpartition("-")[2])]


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Zeroed, page-aligned memory (an anonymous mapping), as direct I/O needs."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def address_of(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class BlockFile:
    """See the module docstring."""

    def __init__(self, path: Path, fd: int, slots: int, slot_bytes: int, block_bytes: int, direct: bool,
                 preallocated: bool) -> None:
        self.path = path
        self._fd = fd
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.block_bytes = block_bytes
        self.direct = direct
        self.preallocated = preallocated
        self.faults: Faults | None = None
        self._local = threading.local()  # each reader thread's bounce buffer

    @classmethod
    def open(cls, path: Path, *, slots: int, slot_bytes: int, block_bytes: int, direct: bool = True) -> BlockFile:
        if slot_bytes % ALIGN_BYTES or not 0 < block_bytes <= slot_bytes:
            raise ValueError(f"slot_bytes {slot_bytes} must be a multiple of {ALIGN_BYTES} holding {block_bytes}")
        path = Path(path)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        direct = fd >= 0
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(fd, slots * slot_bytes)
            preallocated = _preallocate(fd, slots * slot_bytes)
            if direct and not _direct_reads_work(fd, slots * slot_bytes):
                os.close(fd)
                fd = os.open(path, flags, 0o600)
                direct = False
            if not direct and hasattr(os, "posix_fadvise"):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, slots, slot_bytes, block_bytes, direct, preallocated)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---- I/O ------------------------------------------------------------------------

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} outside 0..{self.slots - 1}")
        return slot * self.slot_bytes

    def _bounce(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(aligned_buffer(self.slot_bytes))
        return buf  # type: ignore[no-any-return]

    def read(self, slot: int, dest: memoryview) -> None:
        offset = self._offset(slot)
        if self.faults is not None:
            self.faults("read", slot)
        n = self.block_bytes
        if dest.nbytes != n:
            raise ValueError(f"dest holds {dest.nbytes} bytes, blocks are {n}")
        if not self.direct:
            _read_fully(self._fd, dest, offset)
            return
        if n == self.slot_bytes and address_of(dest) % ALIGN_BYTES == 0:
            _read_fully(self._fd, dest, offset)
            return
        bounce = self._bounce()
        _read_fully(self._fd, bounce, offset)
        # ctypes calls release the GIL: the other readers' copies and syscalls go on meanwhile.
        ctypes.memmove(address_of(dest), address_of(bounce), n)

    def write(self, slot: int, buf: memoryview) -> None:
        offset = self._offset(slot)
        if self.faults is not None:
            self.faults("write", slot)
        if buf.nbytes != self.slot_bytes:
            raise ValueError(f"write of {buf.nbytes} bytes, slots are {self.slot_bytes}")
        done = 0
        while done < buf.nbytes:
            n = os.pwritev(self._fd, [buf[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.path} at slot {slot}")
            done += n

    def sync(self) -> None:
        if self.faults is not None:
            self.faults("sync", -1)
        os.fdatasync(self._fd)

    def drop_cached(self) -> None:
        """Buffered mode: let the kernel drop the file's clean pages (written blocks need no page cache)."""
        if not self.direct and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _read_fully(fd: int, dest: memoryview, offset: int) -> None:
    done = 0
    total = dest.nbytes
    while done < total:
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read at offset {offset + done}")
        done += n


def _preallocate(fd: int, nbytes: int) -> bool:
    if nbytes == 0 or not hasattr(os, "posix_fallocate"):
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EOPNOTSUPP, errno.EINVAL, errno.EFBIG):
            return False
        raise
    return True


def _direct_reads_work(fd: int, size: int) -> bool:
    """Some filesystems open with O_DIRECT and refuse the reads (EINVAL): try one."""
    if size < ALIGN_BYTES:
        return True
    buf = aligned_buffer(ALIGN_BYTES)
    try:
        os.preadv(fd, [memoryview(buf)], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        buf.close()
    return True
