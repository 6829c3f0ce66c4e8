"""A disk tier's write-back: a bounded queue of blocks, and the thread that writes them durably.

``DiskTier`` owns one once its files are open; the pool never sees it.

Order of a batch, which is what makes the index restart-safe (a kill or a
power loss at any instant leaves every record complete and naming durable
bytes, or detectably torn, or empty):

1. a slot for each block (``DiskCatalog.take_slot``); the record of a slot
   whose block is evicted is invalidated before anything is written there;
2. the blocks are written, and made durable (``fdatasync``);
3. their records (key, sequence number, xxh3 checksum) are written;
4. the index file is synced at most every ``index_sync_interval_s`` (and
   when the writer stops), so a power loss forgets at most that much of the
   newest write-backs; a SIGKILL forgets none (the index is a shared mapping
   of the file: its pages outlive the process).

A power loss may keep a record whose invalidation had not reached the
device while its slot was rewritten: its checksum then fails, and every read
verifies it, so such a block is a miss, never served.

Contract:

- ``offer(key, view) -> bool``: copy one block into a free aligned buffer
  and queue it; False (counted ``writes_dropped_full``) when the queue is
  full. A key already queued is not queued twice (True). The pool's thread.
- ``cancel(match)``: queued blocks whose key ``match`` accepts are not
  written (a clear); returns how many.
- ``retire(slots)``: slots whose entries were dropped (a bad read): their
  records are invalidated and the slots freed by the writer thread.
- ``run(stopping)``: the writer thread's loop; returns once ``stopping()``
  is true and the queue is empty (or past ``drain_deadline``, dropping the
  rest), after a last index sync.
- ``flush(timeout_s) -> bool``: waits until every queued block was written,
  failed or dropped. ``counters()``; ``depth_blocks``; ``queued(key)``.
- Errors: an ``OSError`` writing or syncing fails the batch's blocks
  (``write_errors``; their slots are free again) and calls
  ``on_error(exc)``, which rests writes for a while (the tier decides).
  The thread never dies of one.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.tiers.disk_catalog import DiskCatalog
from kvtier.tiers.disk_files import BlockFile, aligned_buffer
from kvtier.tiers.disk_settings import DiskTierSettings
from kvtier.tiers.slot_index import SlotIndex, block_checksum

__all__ = ["COUNTERS", "DiskWriter"]

log = logging.getLogger("kvtier.tiers.disk_tier")  # one logger for the whole disk tier

COUNTERS = (
    "writes_queued",
    "writes_done",
    "writes_dropped_full",  # the queue was full (or every slot was being read)
    "writes_dropped_unavailable",  # taken while writes rested after an error, or past the drain deadline
    "write_errors",  # blocks whose write or sync failed (EIO, ENOSPC): not on disk
    "bytes_written",
    "data_syncs",
    "index_syncs",
)


@dataclass(slots=True)
class _Block:
    key: bytes
    buf: memoryview  # aligned, slot_bytes long: the block, then zeros


class DiskWriter:
    def __init__(self, *, file: BlockFile, index: SlotIndex, catalog: DiskCatalog, settings: DiskTierSettings,
                 next_seq: int, on_error: Callable[[OSError], None], resting: Callable[[], bool],
                 name: str) -> None:
        self._file = file
        self._index = index
        self._catalog = catalog
        self._settings = settings
        self._seq = next_seq
        self._on_error = on_error
        self._resting = resting  # writes rest after an error: what is queued then is dropped
        self._name = name
        self._block_bytes = file.block_bytes
        self._slot_bytes = file.slot_bytes
        self.capacity_blocks = max(1, settings.write_queue_bytes // file.slot_bytes)
        self._queue: queue.Queue[_Block] = queue.Queue(maxsize=self.capacity_blocks)
        self._lock = threading.Lock()  # guards the counters, the buffers, the queued keys and retired slots
        self._buffers: list[memoryview] = []  # free aligned buffers
        self._allocated = 0
        self._queued: set[bytes] = set()
        self._cancelled: set[bytes] = set()  # queued, then cleared: not written
        self._retired: deque[int] = deque()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._write_s = 0.0
        self._index_fd = os.open(index.path, os.O_RDONLY | os.O_CLOEXEC)  # to fsync the index's shared mapping
        self._index_dirty = False
        self._last_index_sync = time.monotonic()
        self.drain_deadline: float | None = None

    # ---- counters ----------------------------------------------------------------------

    def counters(self) -> dict[str, int | float]:
        with self._lock:
            return {**self._counters, "write_seconds": round(self._write_s, 6)}

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._counters[name] += n

    @property
    def depth_blocks(self) -> int:
        return self._queue.qsize()

    def queued(self, key: bytes) -> bool:
        with self._lock:
            return key in self._queued

    # ---- the pool's side --------------------------------------------------------------

    def offer(self, key: bytes, view: memoryview) -> bool:
        with self._lock:
            if key in self._queued:
                return True
            if self._buffers:
                buf = self._buffers.pop()
            elif self._allocated < self.capacity_blocks:
                buf = memoryview(aligned_buffer(self._slot_bytes))
                self._allocated += 1
            else:
                self._counters["writes_dropped_full"] += 1
                return False
            self._queued.add(key)
        buf[: self._block_bytes] = view  # the tail past the block stays zero: buffers only ever hold blocks
        self._queue.put_nowait(_Block(key, buf))  # never full: a block holds a buffer, and there are no more
        self._count(writes_queued=1)
        return True

    def drop_unavailable(self) -> None:
        """Count one write-back the tier refused while writes rest."""
        self._count(writes_dropped_unavailable=1)

    def cancel(self, match: Callable[[bytes], bool]) -> int:
        with self._lock:
            found = [key for key in self._queued if match(key)]
            self._cancelled.update(found)
        return len(found)

    def retire(self, slots: list[int]) -> None:
        if slots:
            with self._lock:
                self._retired.extend(slots)

    # ---- the writer thread ------------------------------------------------------------

    def run(self, stopping: Callable[[], bool]) -> None:
        try:
            while True:
                self._retire_pending()
                batch = self._take_batch()
                if batch:
                    try:
                        self._write(batch)
                    finally:
                        self._done(batch)
                elif stopping():
                    break
                self._sync_index(force=False)
        finally:
            self._retire_pending()
            self._sync_index(force=True)
            os.close(self._index_fd)

    def _take_batch(self) -> list[_Block]:
        try:
            first = self._queue.get(timeout=0.05)
        except queue.Empty:
            return []
        batch = [first]
        while len(batch) < self._settings.write_batch_blocks:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _done(self, batch: list[_Block]) -> None:
        with self._lock:
            for block in batch:
                self._queued.discard(block.key)
                self._cancelled.discard(block.key)
                self._buffers.append(block.buf)
        for _ in batch:
            self._queue.task_done()

    def _retire_pending(self) -> None:
        with self._lock:
            slots = list(self._retired)
            self._retired.clear()
        for slot in slots:
            self._index.invalidate(slot)
            self._catalog.release(slot)
        if slots:
            self._index_dirty = True

    def _write(self, batch: list[_Block]) -> None:
        deadline = self.drain_deadline
        if self._resting() or (deadline is not None and time.monotonic() > deadline):
            self._count(writes_dropped_unavailable=len(batch))
            return
        t0 = time.perf_counter()
        self._retire_pending()  # slots retired while this batch was awaited are free first
        catalog, index = self._catalog, self._index
        planned: list[tuple[_Block, int]] = []
        dropped = 0
        with self._lock:
            cancelled = [block.key in self._cancelled for block in batch]
        for block, gone in zip(batch, cancelled):
            if gone or catalog.contains(block.key):
                continue  # cleared while queued; or written meanwhile (a key is queued once, but may be held)
            taken = catalog.take_slot()
            if taken is None:
                dropped += 1  # every slot is being read: rare, and a miss at worst
                continue
            slot, evicted = taken
            if evicted is not None:
                index.invalidate(slot)  # before the slot's bytes change (see the module docstring)
                self._index_dirty = True
            planned.append((block, slot))
        written: list[tuple[_Block, int, int]] = []
        failed: list[int] = []
        try:
            for i, (block, slot) in enumerate(planned):
                checksum = block_checksum(block.buf[: self._block_bytes])
                try:
                    self._file.write(slot, block.buf)
                except OSError:
                    failed += [s for _, s in planned[i:]]
                    raise
                written.append((block, slot, checksum))
            if written:
                self._file.sync()
                self._count(data_syncs=1)
        except OSError as exc:
            failed += [s for _, s, _ in written]
            written = []
            self._on_error(exc)
            log.warning("disk tier %s: writing %d blocks failed (%s); they are not kept", self._name,
                        len(planned), exc)
        for block, slot, checksum in written:
            self._seq += 1
            index.write(slot, self._seq, block.key, checksum)
            extra = catalog.add(block.key, slot, checksum)
            if extra is not None:  # the key was written twice: keep one
                index.invalidate(extra)
                catalog.release(extra)
        if written:
            self._index_dirty = True
            self._file.drop_cached()
        for slot in failed:
            catalog.release(slot)
        with self._lock:
            c = self._counters
            c["writes_done"] += len(written)
            c["write_errors"] += len(failed)
            c["writes_dropped_full"] += dropped
            c["bytes_written"] += len(written) * self._block_bytes
            self._write_s += time.perf_counter() - t0

    def _sync_index(self, *, force: bool) -> None:
        if not self._index_dirty:
            return
        now = time.monotonic()
        if not force and now - self._last_index_sync < self._settings.index_sync_interval_s:
            return
        self._index_dirty = False
        self._last_index_sync = now
        try:
            # fsync of the file writes back the dirty pages of its shared mapping too (Linux).
            os.fsync(self._index_fd)
        except OSError as exc:
            self._index_dirty = True
            log.warning("disk tier %s: syncing the index failed (%s)", self._name, exc)
            return
        self._count(index_syncs=1)

    # ---- draining ------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True
