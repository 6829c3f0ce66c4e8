"""A restart-safe index of which slot of a block store holds which key: fixed-size records in a file.

A block store that outlives its process (the CPU tier's shared-memory arena,
``kvtier.tiers.persistent_arena``; a disk tier's directory later) keeps its
bytes in one file and this index in another. A process killed at any
instant (SIGKILL, a crash) leaves the index consistent or *detectably* torn,
never wrong, because of the order its owner writes in:

1. ``invalidate(slot)`` before the slot's bytes are overwritten (and when its
   block leaves the store);
2. the bytes land;
3. ``write(slot, seq, key, checksum)`` with the checksum of those bytes.

A record is *complete* when its own checksum (over its other fields)
verifies; a record whose write a kill cut short fails it and is counted as
torn. A complete record still names bytes that must be checked against its
``checksum`` (xxh3-64) before they are served: the owner does that, lazily
(``kvtier.tiers.pool.adoption``).

Contract
========

- ``SlotIndex.create(path, slots=, block_bytes=, identity=)`` writes a new
  index (all slots empty) under a temporary name and renames it over
  ``path``; ``SlotIndex.open(path)`` opens an existing one. Both take an
  exclusive ``flock`` on the file, held until ``close()`` or the process's
  death (the kernel drops it then, SIGKILL included): a second owner gets
  ``SlotIndexBusy``. A file that is not an index, or of another format,
  raises ``SlotIndexFormatError`` (with whatever identity could be read, for
  the one log line that says why a store starts empty).
- ``identity`` is a JSON object the owner chooses (what the store is: pool,
  layout, version); it is fixed at creation and checksummed with the header.
- ``scan()`` returns the complete records, oldest ``seq`` first, and how many
  slots held a torn one. Sequence numbers are the owner's (strictly
  increasing per write); 0 means empty.
- ``write`` / ``invalidate`` / ``checksum_of`` address one slot; keys are
  1..``MAX_KEY_BYTES`` bytes. Single writer (the owner's thread); other
  threads may call ``checksum_of`` (a racing write makes it return a stale
  or no value, which its callers treat as "not verified").
- ``resized(slots)`` replaces the file by one with ``slots`` records (the
  first ``min(old, new)`` records copied) atomically (rename) and returns the
  new index; the old one is closed. Records past a shrunk end must have been
  moved or dropped first.
- ``events_reserved``: one mutable word the owner may use (the pool's key
  journal reserves its event numbers here, so a later process numbers past
  them).
- Files are created with mode 0600.
- ``read_identity(path)`` reads a header without locking (tools): its
  slots, block bytes and identity, or raises ``SlotIndexFormatError``;
  ``is_held(path)`` says whether a live process holds the index's lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

MAGIC = b"KVTSLOTS"
FORMAT = 1
HEADER_BYTES = 4096
RECORD_BYTES = 64
MAX_KEY_BYTES = 32
MAX_IDENTITY_BYTES = 3000

# Header: magic, format, record size, slots, block bytes, identity length, then
# the header checksum (over those fields and the identity); the identity JSON
# at IDENTITY_OFFSET. Magic and format stay where they are in every format,
# so a newer kvtier's file is recognised as such.
_HEADER = struct.Struct("<8sIIQQI4x")  # 40 bytes
_HEADER_SUM_OFFSET = 40
IDENTITY_OFFSET = 64
EVENTS_RESERVED_OFFSET = 3072  # mutable, outside the checksummed part
# Record: seq, data checksum, key length, 6 reserved bytes, the key (zero padded), record checksum.
_RECORD = struct.Struct("<QQH6x32s")  # 56 bytes
_U64 = struct.Struct("<Q")


class SlotIndexError(Exception):
    """The index cannot be used."""


class SlotIndexBusy(SlotIndexError):
    """A live process holds the index (its flock)."""


class SlotIndexFormatError(SlotIndexError):
    """Not an index of this format; ``found_format`` and ``identity`` say what could be read."""

    def __init__(self, message: str, *, found_format: int | None = None,
                 identity: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.found_format = found_format
        self.identity = identity


@dataclass(slots=True)
class SlotRecord:
    slot: int
    seq: int
    key: bytes
    checksum: int


def block_checksum(data: memoryview | bytes) -> int:
    """The checksum a record carries for a block's bytes (xxh3-64; releases the GIL on large inputs)."""
    return xxhash.xxh3_64_intdigest(data)


def _record_sum(body: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(body)


def _header_bytes(slots: int, block_bytes: int, identity: dict[str, Any]) -> bytes:
    ident = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    if len(ident) > MAX_IDENTITY_BYTES:
        raise ValueError(f"identity is {len(ident)} bytes, at most {MAX_IDENTITY_BYTES}")
    fixed = _HEADER.pack(MAGIC, FORMAT, RECORD_BYTES, slots, block_bytes, len(ident))
    return fixed + _U64.pack(xxhash.xxh3_64_intdigest(fixed + ident)) + bytes(IDENTITY_OFFSET - 48) + ident


def _parse_header(head: bytes) -> tuple[int, int, dict[str, Any]]:
    """(slots, block_bytes, identity) of a header, or SlotIndexFormatError."""
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise SlotIndexFormatError("not a kvtier slot index")
    magic, fmt, record_bytes, slots, block_bytes, ident_len = _HEADER.unpack_from(head)
    identity = None
    if 0 < ident_len <= MAX_IDENTITY_BYTES:
        with contextlib.suppress(ValueError):
            identity = json.loads(head[IDENTITY_OFFSET:IDENTITY_OFFSET + ident_len])
    if fmt != FORMAT:
        raise SlotIndexFormatError(f"slot index format {fmt}, this kvtier reads format {FORMAT}",
                                   found_format=fmt, identity=identity if isinstance(identity, dict) else None)
    want = _U64.unpack_from(head, _HEADER_SUM_OFFSET)[0]
    got = xxhash.xxh3_64_intdigest(head[:_HEADER.size] + head[IDENTITY_OFFSET:IDENTITY_OFFSET + ident_len])
    if record_bytes != RECORD_BYTES or want != got or not isinstance(identity, dict):
        raise SlotIndexFormatError("slot index header is damaged", found_format=fmt)
    return slots, block_bytes, identity


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise SlotIndexBusy(f"{path} is held by another live process") from None
        raise


class SlotIndex:
    """See the module docstring."""

    def __init__(self, path: Path, fd: int, slots: int, block_bytes: int, identity: dict[str, Any]) -> None:
        self.path = path
        self._fd = fd
        self.slots = slots
        self.block_bytes = block_bytes
        self.identity = identity
        self._map = mmap.mmap(fd, HEADER_BYTES + slots * RECORD_BYTES, mmap.MAP_SHARED)
        self._view = memoryview(self._map)

    # ---- opening -------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, *, slots: int, block_bytes: int, identity: dict[str, Any]) -> SlotIndex:
        path = Path(path)
        header = _header_bytes(slots, block_bytes, identity)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _lock(fd, tmp)
            os.ftruncate(fd, HEADER_BYTES + slots * RECORD_BYTES)  # zeros: every slot empty
            os.pwrite(fd, header, 0)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return cls(path, fd, slots, block_bytes, identity)

    @classmethod
    def open(cls, path: Path) -> SlotIndex:
        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            _lock(fd, path)
            head = os.pread(fd, HEADER_BYTES, 0)
            slots, block_bytes, identity = _parse_header(head)
            if os.fstat(fd).st_size < HEADER_BYTES + slots * RECORD_BYTES:
                raise SlotIndexFormatError("slot index is shorter than its header says", found_format=FORMAT)
            return cls(path, fd, slots, block_bytes, identity)
        except BaseException:
            os.close(fd)
            raise

    def resized(self, slots: int) -> SlotIndex:
        """See the module docstring."""
        new = SlotIndex.create(self.path.with_name(self.path.name + ".resize"), slots=slots,
                               block_bytes=self.block_bytes, identity=self.identity)
        try:
            n = min(slots, self.slots) * RECORD_BYTES
            new._view[HEADER_BYTES:HEADER_BYTES + n] = self._view[HEADER_BYTES:HEADER_BYTES + n]
            new.events_reserved = self.events_reserved
            os.rename(new.path, self.path)
        except BaseException:
            new.close()
            with contextlib.suppress(OSError):
                os.unlink(new.path)
            raise
        new.path = self.path
        self.close()
        return new

    def close(self) -> None:
        if self._fd < 0:
            return
        self._view.release()
        self._map.close()
        os.close(self._fd)  # drops the flock
        self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0

    # ---- records -------------------------------------------------------------------

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} outside 0..{self.slots - 1}")
        return HEADER_BYTES + slot * RECORD_BYTES

    def write(self, slot: int, seq: int, key: bytes, checksum: int) -> None:
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"keys are 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        if seq <= 0:
            raise ValueError(f"seq must be > 0, got {seq}")
        body = _RECORD.pack(seq, checksum, len(key), key)
        off = self._offset(slot)
        self._view[off:off + RECORD_BYTES] = body + _U64.pack(_record_sum(body))

    def invalidate(self, slot: int) -> None:
        # One aligned 8-byte store: seq 0 is "empty", whatever the rest says.
        _U64.pack_into(self._view, self._offset(slot), 0)

    def _read(self, slot: int) -> tuple[SlotRecord | None, bool]:
        """(the complete record, None if none; whether the slot held a torn one)."""
        off = self._offset(slot)
        raw = self._view[off:off + RECORD_BYTES]
        seq, checksum, key_len, key = _RECORD.unpack_from(raw)
        if seq == 0:
            return None, False
        if (not 0 < key_len <= MAX_KEY_BYTES or _U64.unpack_from(raw, _RECORD.size)[0] != _record_sum(raw[:_RECORD.size])):
            return None, True
        return SlotRecord(slot, seq, key[:key_len], checksum), False

    def record(self, slot: int) -> SlotRecord | None:
        """The slot's complete record, or None (empty or torn)."""
        return self._read(slot)[0]

    def checksum_of(self, slot: int, key: bytes) -> int | None:
        """The data checksum of the slot's complete record for ``key``, or None."""
        rec = self._read(slot)[0]
        return rec.checksum if rec is not None and rec.key == key else None

    def scan(self) -> tuple[list[SlotRecord], int]:
        """(the complete records, oldest seq first; the number of torn ones)."""
        found: list[SlotRecord] = []
        torn = 0
        view = self._view
        for slot in range(self.slots):
            off = HEADER_BYTES + slot * RECORD_BYTES
            if view[off:off + 8] == b"\0" * 8:  # empty: most slots of a young store
                continue
            rec, bad = self._read(slot)
            if rec is not None:
                found.append(rec)
            torn += bad
        found.sort(key=lambda r: r.seq)
        return found, torn

    @property
    def events_reserved(self) -> int:
        return _U64.unpack_from(self._view, EVENTS_RESERVED_OFFSET)[0]

    @events_reserved.setter
    def events_reserved(self, value: int) -> None:
        _U64.pack_into(self._view, EVENTS_RESERVED_OFFSET, value)


def read_identity(path: Path) -> tuple[int, int, dict[str, Any]]:
    """(slots, block_bytes, identity) of an index file, without locking it; SlotIndexFormatError otherwise."""
    with open(path, "rb") as f:
        return _parse_header(f.read(HEADER_BYTES))


def is_held(path: Path) -> bool:
    """Whether a live process holds the index's lock (False for a missing file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        return False
    finally:
        os.close(fd)  # also releases the probe's own lock
