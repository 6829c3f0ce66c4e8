"""A CPU tier a later kvtierd can adopt: its bytes and its slot index in files, in ``arena_dir`` (/dev/shm).

A kvtierd that is killed, crashes, is stopped or upgraded leaves its CPU
tiers' memory behind in shared-memory files; the next kvtierd with the same
socket adopts them (``kvtier.tiers.pool.adoption``) and serves what verifies.

Contract
========

- Files, per pool of one daemon instance (named by ``arena_files``): ``<arena_dir>/kvtierd-<uid>-<instance>-<pool>.index``
  (a ``kvtier.tiers.slot_index.SlotIndex``: which slot holds which key, with a
  checksum of its bytes) and ``....data`` (the slab: one row of
  ``block_bytes`` per slot). ``instance`` is a digest of the daemon's
  endpoint (its socket), ``pool`` one of the pool's key (``tenant/name``):
  two daemons never share a file, and a pool finds its own after a restart.
  The index's ``identity`` holds the pool key, its layout (block size and
  bytes, dtype, hash algorithm, mode: everything a hello fixes), the
  endpoint and the kvtier version that wrote it.
- ``ArenaDirectory(path, endpoint).open(pool_key, layout, slots, block_bytes)``
  returns a ``PersistentArena`` whose ``opened`` says what happened:
  ``adopted`` (the files were this pool's, same layout and format: their
  complete records are ``opened.records``, oldest first, ready to adopt),
  ``created`` (no files) or ``reset`` (files of another format, another
  layout or damaged: removed, and the tier starts empty; ``opened.reason``
  says why in words for the one log line). Changed capacity is applied on
  adoption: a larger tier grows its files; a smaller one keeps the newest
  blocks that fit (moved into the low slots, crash-safe: a block is written
  to its new slot and recorded there before its old record goes) and drops
  the rest (``opened.unfit``). Torn records are counted (``opened.torn``) and
  cleared; so are duplicates of one key (the newest record wins).
- Raises ``HostMemoryError`` when the directory cannot hold the tier (tmpfs
  full: the message says what to do), ``SlotIndexBusy`` when a live process
  holds the files (a second daemon on the same socket).
- ``PersistentArena`` is the CPU tier's ``SlotRecorder``: ``record(slot, key,
  checksum)``, ``invalidate(slot)``, ``verify(slot, key)`` (the pool's
  thread) and ``checksums(slots)`` (any thread: the copy workers, the
  verifier). ``layout`` is the slab (pinned on CUDA: registration is per
  process, so an adopting daemon registers again). ``events_reserved`` is the
  key journal's reserved numbering. ``close(remove=False)`` releases the lock
  and keeps the files for the next daemon; ``remove=True`` deletes them
  (the memory goes once the last mapping does).
- ``ArenaDirectory.instance_arenas()`` lists this instance's arenas
  (``kvtier.tiers.arena_files``: names, listing, removal, no torch) and
  clears leftovers of interrupted creations.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.tiers.arena_files import (
    DATA_SUFFIX,
    INDEX_SUFFIX,
    PREFIX,
    ArenaInfo,
    allocated_bytes,
    arena_stem,
    instance_id,
    list_arenas,
)
from kvtier.tiers.host_memory import HostMemoryError, map_shared_slab
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.slot_index import (
    FORMAT,
    MAX_KEY_BYTES,
    SlotIndex,
    SlotIndexFormatError,
    SlotRecord,
    block_checksum,
)
from kvtier.tiers.units import format_gib
from kvtier.tiers.version import kvtier_version

log = logging.getLogger(__name__)

# fallocate this much at a time, reporting progress between (a large tier takes seconds).
ALLOCATE_CHUNK_BYTES = 256 * 1024**2
# A copy's checksums are split over threads from this many bytes on (smaller: one thread is as fast).
PARALLEL_CHECKSUM_BYTES = 2 * 1024**2
_CHECKSUM_THREADS = max(1, min(4, os.cpu_count() or 1))
_checksum_pool: ThreadPoolExecutor | None = None
_checksum_pool_lock = threading.Lock()


def _checksum_workers() -> ThreadPoolExecutor | None:
    """The threads every arena's copies hash on (None on a one-core host)."""
    global _checksum_pool
    if _CHECKSUM_THREADS < 2:
        return None
    with _checksum_pool_lock:
        if _checksum_pool is None:
            _checksum_pool = ThreadPoolExecutor(_CHECKSUM_THREADS, thread_name_prefix="kvtier-checksum")
        return _checksum_pool


@dataclass
class Opened:
    """What ``ArenaDirectory.open`` found (see the module docstring)."""

    state: str  # "adopted", "created" or "reset"
    reason: str = ""  # why a reset started empty; what an adoption changed
    records: list[SlotRecord] = field(default_factory=list)  # adopted: complete records, oldest first
    torn: int = 0  # records a kill cut short: dropped
    unfit: int = 0  # blocks a smaller tier had no room for: dropped
    duplicates: int = 0  # older records of a key recorded twice: dropped
    previous_version: str = ""  # the kvtier that wrote the files
    seconds: float = 0.0

    @property
    def dropped(self) -> int:
        return self.torn + self.unfit + self.duplicates



def _identity_mismatch(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> str:
    """Why files of ``found`` cannot serve ``wanted`` ("" if they can)."""
    if found.get("pool") != wanted["pool"] or found.get("endpoint") != wanted["endpoint"]:
        return f"they belong to pool {found.get('pool')!r} of {found.get('endpoint')!r}"
    old, new = found.get("layout") or {}, wanted["layout"]
    diffs = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if diffs:
        return "the layout changed (" + ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diffs) + ")"
    return ""


class ArenaDirectory:
    """One daemon instance's arenas in ``path`` (see the module docstring)."""

    def __init__(self, path: Path, endpoint: str, *, uid: int | None = None) -> None:
        self.path = Path(path)
        self.endpoint = endpoint
        self.uid = os.getuid() if uid is None else uid
        self._prefix = f"{PREFIX}{self.uid}-{instance_id(endpoint)}-"

    def stem(self, pool_key: str) -> str:
        return arena_stem(self.uid, self.endpoint, pool_key)

    def instance_arenas(self, *, tidy: bool = True) -> list[ArenaInfo]:
        """This instance's arenas; leftovers of interrupted creations (a data file without an index,
        temporary files) are removed on the way unless ``tidy`` is False (a standby daemon: the creation may be
        the live primary's, in progress)."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        for name in names if tidy else ():
            if name.startswith(self._prefix) and not name.endswith((INDEX_SUFFIX, DATA_SUFFIX)):
                with contextlib.suppress(OSError):
                    (self.path / name).unlink()  # SlotIndex.create's temporary files
        mine = []
        for info in list_arenas(self.path, uid=self.uid):
            if not info.stem.startswith(self._prefix):
                continue
            if not info.index_path.exists() and not info.held:
                if tidy:
                    with contextlib.suppress(FileNotFoundError):
                        info.data_path.unlink()
                continue
            mine.append(info)
        return mine

    def memory_bytes(self, pool_key: str | None = None, *, tidy: bool = True) -> int:
        """Memory this instance's arena files hold (one pool's, or all): what reopening them reuses."""
        stems = [self.stem(pool_key)] if pool_key is not None else [i.stem for i in self.instance_arenas(tidy=tidy)]
        return sum(allocated_bytes(self.path / (s + suffix)) for s in stems for suffix in (INDEX_SUFFIX, DATA_SUFFIX))

    def remove(self, pool_key: str) -> None:
        self.remove_stem(self.stem(pool_key))

    def remove_stem(self, stem: str) -> None:
        for suffix in (INDEX_SUFFIX, DATA_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                (self.path / (stem + suffix)).unlink()

    def identity(self, pool_key: str, layout: Mapping[str, Any], *, tenant: str = "",
                 name: str | None = None) -> dict[str, Any]:
        """What the files record about their pool: ``pool`` (its key), ``tenant`` and bare ``name`` (how a
        daemon re-creates it), ``layout``, ``endpoint``, and the ``kvtier`` version and ``format`` that wrote them."""
        return {"pool": pool_key, "tenant": tenant, "name": pool_key if name is None else name,
                "layout": dict(layout), "endpoint": self.endpoint, "kvtier": kvtier_version(), "format": FORMAT}

    def open(self, pool_key: str, layout: Mapping[str, Any], slots: int, block_bytes: int, *,
             pin: bool | None = None, progress: Callable[[int, int], None] | None = None, tenant: str = "",
             name: str | None = None) -> PersistentArena:
        """See the module docstring."""
        if slots <= 0 or block_bytes <= 0:
            raise ValueError(f"an arena needs slots and bytes, got {slots} x {block_bytes}")
        started = time.monotonic()
        stem = self.stem(pool_key)
        index_path, data_path = self.path / (stem + INDEX_SUFFIX), self.path / (stem + DATA_SUFFIX)
        wanted = self.identity(pool_key, layout, tenant=tenant, name=name)
        opened: Opened | None = None
        index: SlotIndex | None = None
        if index_path.exists():
            try:
                index = SlotIndex.open(index_path)  # SlotIndexBusy: a live daemon holds it
            except SlotIndexFormatError as exc:
                version = (exc.identity or {}).get("kvtier", "an unknown kvtier")
                why = (f"they are format {exc.found_format} (written by kvtier {version}), this kvtierd reads "
                       f"format {FORMAT}" if exc.found_format not in (None, FORMAT) else f"{exc}")
                opened = Opened("reset", why, previous_version=str(version))
            else:
                mismatch = _identity_mismatch(index.identity, wanted)
                data_size = os.stat(data_path).st_size if data_path.exists() else -1
                if not mismatch and index.block_bytes != block_bytes:
                    mismatch = f"their blocks are {index.block_bytes} bytes, the pool's {block_bytes}"
                if not mismatch and data_size < index.slots * block_bytes:
                    mismatch = "the data file is missing or shorter than the index says"
                if mismatch:
                    opened = Opened("reset", mismatch, previous_version=str(index.identity.get("kvtier", "")))
                    index.close()
                    index = None
        elif data_path.exists():
            opened = Opened("reset", "the data file has no index (its creation was interrupted)")
        fd = -1
        try:
            if index is None:
                for p in (index_path, data_path):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                _allocate(fd, 0, slots * block_bytes, self.path, progress)
                index = SlotIndex.create(index_path, slots=slots, block_bytes=block_bytes, identity=wanted)
                opened = opened or Opened("created")
                records: list[SlotRecord] = []
            else:
                fd = os.open(data_path, os.O_RDWR | os.O_CLOEXEC)
                opened = Opened("adopted", previous_version=str(index.identity.get("kvtier", "")))
                index, records = _adopt_records(index, fd, slots, block_bytes, opened, self.path, progress)
                opened.records = records
            layout_ = map_shared_slab(fd, slots, block_bytes, pin=pin, populate=opened.state != "adopted",
                                      progress=progress)
        except BaseException:
            if index is not None:
                index.close()
            if fd >= 0:
                os.close(fd)
            raise
        data_inode = os.fstat(fd).st_ino
        os.close(fd)  # the mapping keeps the pages; the index's descriptor keeps the lock
        opened.seconds = time.monotonic() - started
        arena = PersistentArena(index, layout_, opened, next_seq=max((r.seq for r in records), default=0) + 1)
        arena.data_path, arena.data_inode = data_path, data_inode
        return arena


def _allocate(fd: int, start: int, end: int, where: Path, progress: Callable[[int, int], None] | None) -> None:
    """Give the file real pages for ``[start, end)`` now, so a full tmpfs fails here, not with SIGBUS later."""
    size = -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
    os.ftruncate(fd, size)
    try:
        for off in range(start, size, ALLOCATE_CHUNK_BYTES):
            os.posix_fallocate(fd, off, min(ALLOCATE_CHUNK_BYTES, size - off))
            if progress is not None:
                progress(min(off + ALLOCATE_CHUNK_BYTES, size), size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        free = os.statvfs(where)
        raise HostMemoryError(
            f"arena_dir {where} cannot hold a {format_gib(size)} CPU tier ({format_gib(free.f_bavail * free.f_frsize)} "
            "free there): enlarge it (tmpfs: mount -o remount,size=... /dev/shm), remove old arenas "
            "(kvtier arenas remove), lower cpu_bytes, or set persist_cpu_tier = false"
        ) from None


def _adopt_records(index: SlotIndex, fd: int, slots: int, block_bytes: int, opened: Opened, where: Path,
                   progress: Callable[[int, int], None] | None) -> tuple[SlotIndex, list[SlotRecord]]:
    """The complete records to adopt, the index resized to ``slots``; torn and duplicate records cleared."""
    records, opened.torn = index.scan()
    if opened.torn:
        for slot in range(index.slots):
            if index.record(slot) is None:
                index.invalidate(slot)
    newest: dict[bytes, SlotRecord] = {}
    for rec in records:  # oldest first: a later record of a key replaces an earlier one
        old = newest.get(rec.key)
        if old is not None:
            index.invalidate(old.slot)
            opened.duplicates += 1
        newest[rec.key] = rec
    records = sorted(newest.values(), key=lambda r: r.seq)
    old_slots = index.slots
    if slots < old_slots:
        records = _shrink(index, fd, records, slots, block_bytes, opened)
        index = index.resized(slots)
        os.ftruncate(fd, -(-slots * block_bytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        opened.reason = f"the CPU tier shrank from {old_slots} to {slots} blocks"
    elif slots > old_slots:
        _allocate(fd, old_slots * block_bytes, slots * block_bytes, where, progress)
        index = index.resized(slots)
        opened.reason = f"the CPU tier grew from {old_slots} to {slots} blocks"
    return index, records


def _shrink(index: SlotIndex, fd: int, records: list[SlotRecord], slots: int, block_bytes: int,
            opened: Opened) -> list[SlotRecord]:
    """Keep the newest ``slots`` blocks, moved below ``slots``; returns them, oldest first."""
    keep = records[-slots:] if slots else []
    for rec in records[:len(records) - len(keep)]:
        index.invalidate(rec.slot)  # first: their slots may receive moved blocks
        opened.unfit += 1
    taken = {r.slot for r in keep if r.slot < slots}
    free = [s for s in range(slots - 1, -1, -1) if s not in taken]
    movers = [r for r in keep if r.slot >= slots]
    if movers:
        buf = mmap.mmap(fd, index.slots * block_bytes, mmap.MAP_SHARED)
        try:
            view = memoryview(buf)
            for rec in movers:
                dst = free.pop()
                # Bytes, then the new record, then the old one goes: a kill in between leaves two
                # complete records of one key, and adoption keeps one (the duplicates rule).
                view[dst * block_bytes:(dst + 1) * block_bytes] = view[rec.slot * block_bytes:(rec.slot + 1) * block_bytes]
                index.write(dst, rec.seq, rec.key, rec.checksum)
                index.invalidate(rec.slot)
                rec.slot = dst
            view.release()
        finally:
            buf.close()
    return keep


class PersistentArena:
    """The CPU tier's files, opened; its ``SlotRecorder`` (see the module docstring)."""

    def __init__(self, index: SlotIndex, layout: BlockLayout, opened: Opened, *, next_seq: int) -> None:
        self.index = index
        self.layout = layout
        self.opened = opened
        self.block_bytes = layout.block_bytes
        # The slab's file, and its inode: a same-user client maps it to read lent slots (kvtier.daemon.clients.lends)
        # and tells a file re-created under the same name (a reset) by the inode.
        self.data_path: Path | None = None
        self.data_inode = 0
        self._rows = layout.slab().numpy()  # per-slot buffers for the checksums (any thread)
        self._next_seq = next_seq

    @property
    def path(self) -> Path:
        return self.index.path

    @property
    def slots(self) -> int:
        return self.index.slots

    # ---- the CPU tier's SlotRecorder ---------------------------------------------------

    def checksums(self, slots: Sequence[int]) -> list[int]:
        rows = self._rows
        nbytes = len(slots) * self.block_bytes
        workers = _checksum_workers()
        if nbytes < PARALLEL_CHECKSUM_BYTES or workers is None:
            return [block_checksum(rows[s]) for s in slots]
        # A copy's worker waits for these before the blocks count as stored: hashed in parallel
        # (xxhash lets go of the GIL), a batch costs about a memmove's time, not twice it.
        n = len(slots)
        parts = min(_CHECKSUM_THREADS, -(-nbytes // PARALLEL_CHECKSUM_BYTES))
        bounds = [n * i // parts for i in range(parts + 1)]
        chunks = workers.map(lambda ab: [block_checksum(rows[s]) for s in slots[ab[0]:ab[1]]],
                             zip(bounds, bounds[1:]))
        return [c for chunk in chunks for c in chunk]

    def record(self, slot: int, key: bytes, checksum: int | None) -> None:
        if len(key) > MAX_KEY_BYTES:
            self.index.invalidate(slot)  # a key this format cannot hold: the block does not persist
            return
        if checksum is None:
            checksum = block_checksum(self._rows[slot])
        self.index.write(slot, self._next_seq, key, checksum)
        self._next_seq += 1

    def invalidate(self, slot: int) -> None:
        self.index.invalidate(slot)

    def verify(self, slot: int, key: bytes) -> bool:
        want = self.index.checksum_of(slot, key)
        return want is not None and block_checksum(self._rows[slot]) == want

    # ---- the rest ----------------------------------------------------------------------

    @property
    def events_reserved(self) -> int:
        return self.index.events_reserved

    @events_reserved.setter
    def events_reserved(self, value: int) -> None:
        self.index.events_reserved = value

    def close(self, *, remove: bool = False) -> None:
        """Release the files (kept for the next daemon unless ``remove``); the mapping goes with the layout."""
        if self.index.closed:
            return
        path = self.index.path
        self.index.close()
        if remove:
            for p in (path, path.with_suffix(DATA_SUFFIX)):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

    def describe(self) -> str:
        """One line for the log: what opening found."""
        o = self.opened
        size = format_gib(self.slots * self.block_bytes)
        if o.state == "created":
            return f"new persistent CPU tier of {self.slots} blocks ({size}) in {self.path.parent}"
        if o.state == "reset":
            return (f"persistent CPU tier starts empty ({self.slots} blocks, {size}): the previous files were "
                    f"not adopted because {o.reason}")
        parts = [f"adopted {len(o.records)} blocks (verified before they are served)"]
        if o.dropped:
            parts.append(f"dropped {o.dropped} ({o.torn} torn records, {o.unfit} did not fit, "
                         f"{o.duplicates} duplicates)")
        if o.reason:
            parts.append(o.reason)
        return f"persistent CPU tier of {self.slots} blocks ({size}): " + "; ".join(parts) + f" in {o.seconds:.2f} s"
