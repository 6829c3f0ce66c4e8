"""Shared-memory staging arena: the "shm" data plane (docs/protocol.md, "Data planes at a glance").

Contract
========

A client that shares a host with the daemon moves block bytes through an
*arena* instead of ZMQ frames: one file in ``/dev/shm`` cut into ``num_slots``
equal slots of ``slot_bytes`` each (slot ``i`` is the byte range
``[i * slot_bytes, (i + 1) * slot_bytes)``). Messages carry slot numbers, never
bytes.

- The **client** calls ``ShmArena.create(num_slots, slot_bytes)``. The file is
  named ``kvtier-<session prefix>-<random>``, created exclusively with mode
  0600, and its pages are reserved up front (``reserve_pages``:
  ``posix_fallocate``) so that a full ``/dev/shm`` fails here with
  ``ShmSpaceError``, whose message gives the bytes asked, the bytes
  ``/dev/shm`` has free and the ways out (a smaller arena; a larger
  ``/dev/shm``: ``mount -o remount,size=...``, docker's ``--shm-size``), not
  later with SIGBUS far from the cause.
- The **daemon** calls ``ShmArena.attach(name, num_slots, slot_bytes)`` with
  what the client announced. Attach refuses any name that is not a plain
  ``kvtier-...`` file name (no ``/``, no ``..``, no other prefix), refuses
  symlinks and non-regular files, refuses a file whose size is not exactly
  ``num_slots * slot_bytes``, and refuses a *sparse* file (``ShmSparseError``:
  fewer blocks allocated than its size, rounded up to pages, needs; made by
  ``ftruncate`` without ``posix_fallocate``): a store into a hole that tmpfs
  cannot back is SIGBUS. The daemon never allocates a client's pages itself,
  which would let a client make it allocate memory on its behalf.
- ``check_intact()`` (the daemon, before a copy to or from the file)
  refuses a file now shorter than its mapping: one ``fstat`` on the
  mapping's own descriptor (``mmap.size()``, no extra descriptor), 1.4 µs
  on a loaded 2-core VM.
- Either side may ``unlink()`` (the client when it is done, the daemon when
  the session's lease expires); unlinking twice is harmless. A mapping stays
  valid after unlink until it is closed.
- ``close()`` never unmaps memory that a live view still points at: the
  mapping is released when the last view (``buffer``, ``slot_view``,
  ``as_numpy``, a tensor made with ``torch.frombuffer``) is gone. Closing
  therefore can never turn a view into a dangling pointer.
- Used as a context manager, an arena closes on exit, and the creator also
  unlinks.
- The creator holds a shared ``flock`` on the file for as long as it maps
  it; a crashed creator's file that nobody could unlink (a daemon of
  another user may not, in sticky ``/dev/shm``) is removed by the next
  arena its user opens on the host (``client.shm_orphans``, called by
  ``Client.open_arena`` and ``allocate_shared_kv``).

Implementation: ``os.open`` on ``/dev/shm`` plus ``mmap``, not
``multiprocessing.shared_memory``. The latter registers every segment with a
resource tracker that unlinks it when *any* attaching process exits (and
warns about "leaked" segments), which is wrong for a daemon that attaches to
clients' arenas.

Trust: the daemon maps memory a client controls. A client can scribble over
its own slots at any time (the daemon copies, then validates nothing about
content), and it can truncate the file under the daemon's mapping:
``/dev/shm`` files cannot be sealed. The daemon therefore never loads or
stores through an attached arena directly: it moves bytes with
``kvtier.daemon.shared_memory.client_memory`` (process_vm_readv/writev), which fail on a
vanished page instead of raising SIGBUS. Whoever else maps an arena
(``buffer``, ``as_numpy``) faults as usual when it is truncated.

What is guarded, and how: a sparse file is refused at attach (the common
mistake, and a hostile client's cheapest trick); a file shrunk after attach
is refused by ``check_intact`` before a copy (a clear error, and the only
guard where process_vm_readv/writev are not permitted; the daemon checks up
to 8 files before each copy, the rest after a failed one:
``daemon/handling/session_memory.py``, ``INTACT_CHECK_MAX_FILES``). Neither check can
close the window between it and the copy (a client may shrink the file or
punch a hole, ``FALLOC_FL_PUNCH_HOLE``, in between): there the fault-safe
copies are the guard, and without them (``client_memory.available()`` False)
such a race can still SIGBUS the daemon.

Linux only. Imports no torch (numpy only inside ``as_numpy``).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "SHM_DIR",
    "NAME_PREFIX",
    "ShmArena",
    "ShmArenaError",
    "ShmSpaceError",
    "ShmSparseError",
    "no_room_message",
    "reserve_pages",
    "shm_free_bytes",
    "unallocated_bytes",
    "validate_arena_name",
]

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "kvtier"

# Plain file names only: letters, digits, '_' and '-' after the fixed prefix.
# No '.', so neither '..' nor hidden files; no '/', so no path traversal.
_NAME_RE = re.compile(r"kvtier-[A-Za-z0-9_-]{1,200}")
_PREFIX_RE = re.compile(r"kvtier(-[A-Za-z0-9_]{1,64})*")
_RANDOM_HEX_CHARS = 16
PAGE_BYTES = mmap.PAGESIZE
ST_BLOCK_BYTES = 512  # st_blocks counts 512-byte units on Linux, whatever the file system's block size


class ShmArenaError(Exception):
    """A bad name, size or slot, or a shared-memory file that cannot be made or used."""


class ShmAccessError(ShmArenaError):
    """The file exists but this process may not open it (its mode, owner or group)."""


class ShmSpaceError(ShmArenaError):
    """``/dev/shm`` (or the memory limit it is charged to) has no room for the pages asked for."""


class ShmSparseError(ShmArenaError):
    """A client's file has pages not allocated (``ftruncate`` without ``posix_fallocate``); the daemon refuses it."""


def shm_free_bytes() -> int | None:
    """Bytes ``/dev/shm`` has free for an unprivileged writer (``statvfs``); None when it cannot say."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 20):.1f} MiB"


def no_room_message(what: str, asked_bytes: int, why: str) -> str:
    """Why ``what`` (``asked_bytes``) did not fit in ``/dev/shm``, with the free space and what to do."""
    free_bytes = shm_free_bytes()
    free = "an unknown amount" if free_bytes is None else f"{free_bytes} bytes ({_mib(free_bytes)})"
    msg = (f"cannot reserve {asked_bytes} bytes ({_mib(asked_bytes)}) in {SHM_DIR} for {what}: {why}; "
           f"{SHM_DIR} has {free} free. Ask for less (a smaller arena or KV cache), or give {SHM_DIR} more room: "
           f"`mount -o remount,size=<bytes> {SHM_DIR}` (as root), docker run's `--shm-size=<bytes>`, or in "
           "Kubernetes an emptyDir with medium: Memory mounted on /dev/shm")
    if free_bytes is not None and free_bytes >= asked_bytes:
        # statvfs says it fits: what refused is the memory cgroup tmpfs pages are charged to.
        msg += ("; since that would fit, the limit is this process's memory limit (tmpfs pages count against "
                "the container's or cgroup's memory)")
    return msg


def reserve_pages(fd: int, size_bytes: int, what: str) -> None:
    """Give the file ``fd`` the size ``size_bytes`` with every page allocated now; ``ShmSpaceError`` if no room.

    A sparse tmpfs file that cannot be backed later kills whoever stores into
    it with SIGBUS (the engine, or the daemon): refusing here puts the error
    where the cause is.
    """
    try:
        os.posix_fallocate(fd, 0, size_bytes)
        return
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise ShmSpaceError(no_room_message(what, size_bytes, exc.strerror or str(exc))) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise ShmArenaError(f"cannot size {what}: {exc.strerror}") from None
    # No fallocate here (an old kernel, a sandbox's file system): write every
    # page instead; pwrite fails with ENOSPC where a store would SIGBUS.
    chunk_bytes = 1 << 20
    zeros = bytes(chunk_bytes)
    try:
        os.ftruncate(fd, size_bytes)
        for offset in range(0, size_bytes, chunk_bytes):
            n = min(chunk_bytes, size_bytes - offset)
            if os.pwrite(fd, zeros[:n], offset) != n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise ShmSpaceError(no_room_message(what, size_bytes, exc.strerror or str(exc))) from None
        raise ShmArenaError(f"cannot size {what}: {exc.strerror}") from None


def unallocated_bytes(st: os.stat_result) -> int:
    """How many bytes of the file ``st`` describes have no page allocated (0 for a fully allocated file).

    tmpfs counts allocated (and swapped-out) pages in ``st_blocks``; a file
    needs its size rounded up to whole pages.
    """
    needed_bytes = -(-st.st_size // PAGE_BYTES) * PAGE_BYTES
    return max(0, needed_bytes - st.st_blocks * ST_BLOCK_BYTES)


def _access_message(path: Path, exc: OSError) -> str:
    try:
        st = os.stat(path)
        who = f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, group gid {st.st_gid}"
    except OSError:
        who = "its mode unknown"
    return (f"kvtierd (uid {os.getuid()}, gid {os.getgid()}) may not open {path} ({who}): {exc.strerror}. "
            "A client of a daemon running as another user gives the file the daemon's group, mode 0660 "
            "(kvtier's client does so when it is a member of the group that owns the daemon's socket)")



def validate_arena_name(name: str) -> str:
    """Return ``name`` if it is an acceptable arena file name, else raise ``ShmArenaError``."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ShmArenaError(
            f"bad arena name {name!r}: must be 'kvtier-' followed by 1-200 letters, digits, '_' or '-'"
        )
    return name


def _check_geometry(num_slots: int, slot_bytes: int) -> int:
    for what, value in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
        # bool is an int subclass; True slots is a caller bug, not 1 slot.
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ShmArenaError(f"{what} must be a positive int, got {value!r}")
    return num_slots * slot_bytes


class ShmArena:
    """A ``/dev/shm`` file mapped read-write and cut into equal slots. See the module docstring."""

    def __init__(self, *, name: str, num_slots: int, slot_bytes: int, mapping: mmap.mmap, owner: bool) -> None:
        # Use create() or attach(); this constructor trusts its arguments.
        self._name = name
        self._num_slots = num_slots
        self._slot_bytes = slot_bytes
        self._mmap: mmap.mmap | None = mapping
        self._view: memoryview | None = memoryview(mapping)
        self._owner = owner
        # (st_dev, st_ino) and st_uid of the file, as fstat saw it when mapped
        # (the daemon tells which session owns which file by inode, not name).
        self.inode: tuple[int, int] | None = None
        self.file_uid: int | None = None

    # -- construction ---------------------------------------------------------------

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int, *, name_prefix: str = NAME_PREFIX) -> ShmArena:
        """Create a new arena file of ``num_slots * slot_bytes`` bytes and map it.

        ``name_prefix`` is ``"kvtier"`` or ``"kvtier-<something>"`` (e.g. the
        session id's first characters); a random suffix makes the name unique.
        """
        size_bytes = _check_geometry(num_slots, slot_bytes)
        if not isinstance(name_prefix, str) or not _PREFIX_RE.fullmatch(name_prefix):
            raise ShmArenaError(
                f"bad name_prefix {name_prefix!r}: must be 'kvtier' or 'kvtier-<letters, digits, _>'"
            )
        name = validate_arena_name(f"{name_prefix}-{secrets.token_hex(_RANDOM_HEX_CHARS // 2)}")
        path = SHM_DIR / name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise ShmArenaError(f"cannot create shared-memory file {path}: {exc.strerror}") from exc
        try:
            # "Alive while mapped" (client/shm_orphans.py): the lock belongs to this
            # open file description, which the mmap keeps through its own duplicate
            # of fd, so it is held exactly as long as the mapping (or a view of it).
            fcntl.flock(fd, fcntl.LOCK_SH)
            # Reserve the pages now: a sparse tmpfs file that cannot be
            # backed later kills the writer with SIGBUS instead, and the
            # daemon refuses sparse files.
            reserve_pages(fd, size_bytes, f"arena {name} ({num_slots} slots x {slot_bytes} bytes)")
            mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        # The mmap keeps its own reference to the file; our descriptor is not needed.
        os.close(fd)
        arena = cls(name=name, num_slots=num_slots, slot_bytes=slot_bytes, mapping=mapping, owner=True)
        arena.inode, arena.file_uid = (st.st_dev, st.st_ino), st.st_uid
        return arena

    @classmethod
    def attach(cls, name: str, num_slots: int, slot_bytes: int) -> ShmArena:
        """Map an existing arena created by another process (the daemon side)."""
        size_bytes = _check_geometry(num_slots, slot_bytes)
        validate_arena_name(name)
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise ShmArenaError(f"arena {name} does not exist in {SHM_DIR}") from exc
        except PermissionError as exc:
            raise ShmAccessError(_access_message(path, exc)) from exc
        except OSError as exc:
            # ELOOP from O_NOFOLLOW means the name is a symlink: refuse it.
            raise ShmArenaError(f"cannot open arena {name}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmArenaError(f"arena {name} is not a regular file")
            if st.st_size != size_bytes:
                raise ShmArenaError(
                    f"arena {name} is {st.st_size} bytes, expected {num_slots} slots x {slot_bytes} bytes = {size_bytes}"
                )
            if (missing_bytes := unallocated_bytes(st)) > 0:
                raise ShmSparseError(
                    f"shared-memory file {name} is sparse: {missing_bytes} of its {size_bytes} bytes have no page "
                    "allocated, and a copy into a page /dev/shm cannot back would crash the daemon. Allocate the "
                    "whole file when creating it (posix_fallocate(fd, 0, size), as ShmArena.create and "
                    "allocate_shared_kv do), not just ftruncate it"
                )
            try:
                mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (ValueError, OSError) as exc:  # e.g. shrunk between the fstat and the mmap
                raise ShmArenaError(f"cannot map arena {name}: {exc}") from None
        finally:
            os.close(fd)
        arena = cls(name=name, num_slots=num_slots, slot_bytes=slot_bytes, mapping=mapping, owner=False)
        arena.inode, arena.file_uid = (st.st_dev, st.st_ino), st.st_uid
        return arena

    # -- geometry -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def path(self) -> Path:
        return SHM_DIR / self._name

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def size_bytes(self) -> int:
        return self._num_slots * self._slot_bytes

    @property
    def owner(self) -> bool:
        """True in the process that created the arena."""
        return self._owner

    @property
    def closed(self) -> bool:
        return self._view is None

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` from the start of the arena."""
        return self._check_slot(slot) * self._slot_bytes

    def check_intact(self) -> None:
        """Raise ``ShmArenaError`` if the file is now shorter than this mapping (a client truncated it).

        One fstat on the descriptor the mapping keeps (``mmap.size()``): no
        extra descriptor per file. Call it right before touching the memory.
        """
        mapping = self._mmap
        if mapping is None:
            raise ShmArenaError(f"arena {self._name} is closed")
        try:
            file_bytes = mapping.size()
        except (OSError, ValueError) as exc:
            raise ShmArenaError(f"cannot check the size of shared-memory file {self._name}: {exc}") from None
        if file_bytes < self.size_bytes:
            raise ShmArenaError(
                f"shared-memory file {self._name} shrank to {file_bytes} bytes after it was mapped "
                f"({self.size_bytes} bytes): it was truncated"
            )

    # -- views ----------------------------------------------------------------------

    @property
    def buffer(self) -> memoryview:
        """A writable memoryview over the whole arena (``size_bytes`` unsigned bytes)."""
        # A fresh view each time: close() releases our own view, and must not
        # invalidate views already handed out.
        return self._live_view()[:]

    def slot_view(self, slot: int) -> memoryview:
        """A writable memoryview over one slot."""
        start = self._check_slot(slot) * self._slot_bytes
        return self._live_view()[start : start + self._slot_bytes]

    def as_numpy(self) -> np.ndarray:
        """The arena as a writable uint8 numpy array of shape ``[num_slots, slot_bytes]``, no copy."""
        import numpy as np

        return np.frombuffer(self._live_view(), dtype=np.uint8).reshape(self._num_slots, self._slot_bytes)

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Drop this object's mapping. Idempotent.

        If views handed out earlier are still alive, the memory stays mapped
        until the last of them is released; it is never unmapped under a view.
        """
        view, mapping = self._view, self._mmap
        self._view = None
        self._mmap = None
        if view is not None:
            try:
                view.release()
            except BufferError:
                # Something (numpy, torch.frombuffer) holds a buffer exported
                # from this very view; it keeps the view, and so the mapping, alive.
                pass
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                # Exported views are alive; the mmap object is freed (and the
                # memory unmapped) when the last of them goes away.
                pass

    def unlink(self) -> None:
        """Remove the arena's file name. Idempotent; existing mappings stay valid."""
        _unlink_quietly(self.path)

    @staticmethod
    def unlink_name(name: str) -> None:
        """Remove the file of arena ``name`` without mapping it (e.g. a dead session's). Idempotent."""
        _unlink_quietly(SHM_DIR / validate_arena_name(name))

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        if self._owner:
            self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        role = "owner" if self._owner else "attached"
        return f"ShmArena({self._name!r}, {self._num_slots} x {self._slot_bytes} bytes, {role}, {state})"

    # -- internals ------------------------------------------------------------------

    def _live_view(self) -> memoryview:
        if self._view is None:
            raise ShmArenaError(f"arena {self._name} is closed")
        return self._view

    def _check_slot(self, slot: Any) -> int:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self._num_slots:
            raise IndexError(f"slot {slot!r} out of range for arena {self._name} with {self._num_slots} slots")
        return slot


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
