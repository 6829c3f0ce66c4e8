"""A disk tier's catalog: which key each slot holds, in LRU order, and which slots are free or being read.

The in-memory side of ``kvtier.tiers.disk_tier``: the records on disk
(``kvtier.tiers.slot_index``) say the same for a process that starts later;
this says it for this one, and decides which slot a new block takes.

A slot is in one of four states: *free*; *writing* (taken by the writer,
no key yet); *held* (an entry: a key, the checksum of its bytes); or
*retired* (its entry was dropped, and the writer must invalidate its record
before the slot is free again). Only held slots are ever read.

Contract (thread-safe: one lock, held for no I/O):

- ``load(records)``: the entries found on disk at start, oldest first (the
  LRU order they are given in); a key found twice keeps its newest slot and
  retires the other. Returns the slots retired.
- ``prefix(keys)``: how many leading keys are held. ``contains(key)``.
- ``begin_read(keys)``: the entries of the leading held run, each marked
  read (never taken for a write while read). ``end_read(entries, ok)``
  unmarks them; an ``ok`` one becomes most recent, a bad one is dropped.
  Returns the slots retired (dropped entries no read holds any more).
- ``take_slot()``: a slot for a new block, and the key whose entry it held
  (None for a free slot): a free slot first, else the least recent entry
  no read holds, which is dropped. None when every slot is held by a read
  or being written (or there are none). The slot is *writing* until
  ``add`` or ``release``.
- ``add(key, slot, checksum)``: a written slot holds ``key`` (most recent).
  A key held already keeps its entry, and ``slot`` is retired (returned).
- ``release(slot)``: a writing or retired slot is free again.
- ``drop(key)``: the key's entry goes; its slot is retired now (returned)
  or, while read, by the last ``end_read``.
- ``touch(key)``: most recent, if held.
- ``drop_matching(match)``: ``drop`` of every held key ``match`` accepts;
  returns how many went and the slots retired now.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DiskCatalog", "DiskEntry"]


@dataclass(slots=True, eq=False)
class DiskEntry:
    key: bytes
    slot: int
    checksum: int  # xxh3-64 of the block's bytes (kvtier.tiers.slot_index.block_checksum)
    readers: int = 0
    dropped: bool = False  # no longer held: the last reader retires the slot


class DiskCatalog:
    """See the module docstring."""

    def __init__(self, slots: int) -> None:
        if slots < 0:
            raise ValueError(f"slots must be >= 0, got {slots}")
        self.slots = slots
        self.lock = threading.Lock()
        self._entries: OrderedDict[bytes, DiskEntry] = OrderedDict()  # least recent first
        self._free = list(range(slots - 1, -1, -1))  # pop() takes low slots first
        self.evictions = 0  # entries dropped to make room for a new block

    def __len__(self) -> int:
        return len(self._entries)

    def load(self, records: Iterable[tuple[bytes, int, int]]) -> list[int]:
        retired: list[int] = []
        with self.lock:
            taken: set[int] = set()
            for key, slot, checksum in records:
                if not 0 <= slot < self.slots or slot in taken:
                    raise ValueError(f"slot {slot} is outside the catalog or given twice")
                taken.add(slot)
                old = self._entries.pop(key, None)
                if old is not None:
                    retired.append(old.slot)
                self._entries[key] = DiskEntry(key, slot, checksum)
            self._free = [s for s in range(self.slots - 1, -1, -1) if s not in taken]
        return retired

    def prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self.lock:
            entries = self._entries
            for key in keys:
                if key not in entries:
                    break
                n += 1
        return n

    def contains(self, key: bytes) -> bool:
        with self.lock:
            return key in self._entries

    def begin_read(self, keys: Sequence[bytes]) -> list[DiskEntry]:
        found: list[DiskEntry] = []
        with self.lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    break
                entry.readers += 1
                found.append(entry)
        return found

    def end_read(self, entries: Sequence[DiskEntry], ok: Sequence[bool]) -> list[int]:
        retired: list[int] = []
        with self.lock:
            for entry, good in zip(entries, ok):
                entry.readers -= 1
                if not entry.dropped:
                    if good:
                        self._entries.move_to_end(entry.key)
                        continue
                    self._entries.pop(entry.key, None)
                    entry.dropped = True
                if entry.readers == 0:
                    retired.append(entry.slot)
        return retired

    def take_slot(self) -> tuple[int, bytes | None] | None:
        with self.lock:
            if self._free:
                return self._free.pop(), None
            for key, entry in self._entries.items():
                if entry.readers == 0:
                    del self._entries[key]
                    entry.dropped = True
                    self.evictions += 1
                    return entry.slot, key
        return None

    def add(self, key: bytes, slot: int, checksum: int) -> int | None:
        with self.lock:
            if key in self._entries:
                return slot
            self._entries[key] = DiskEntry(key, slot, checksum)
        return None

    def release(self, slot: int) -> None:
        with self.lock:
            self._free.append(slot)

    def drop(self, key: bytes) -> int | None:
        with self.lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            entry.dropped = True
            return entry.slot if entry.readers == 0 else None

    def drop_matching(self, match: Callable[[bytes], bool]) -> tuple[int, list[int]]:
        retired: list[int] = []
        with self.lock:
            gone = [entry for key, entry in self._entries.items() if match(key)]
            for entry in gone:
                del self._entries[entry.key]
                entry.dropped = True
                if entry.readers == 0:
                    retired.append(entry.slot)
        return len(gone), retired

    def touch(self, key: bytes) -> None:
        with self.lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def keys(self) -> list[bytes]:
        """The held keys, least recent first (tests, tools)."""
        with self.lock:
            return list(self._entries)
