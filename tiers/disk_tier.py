"""A disk tier below the CPU tier: KV blocks in a directory (local NVMe), kept across restarts and reboots.

A ``DiskTier`` is self-contained, like the remote tier: it knows block
hashes, bytes and one directory, nothing of the pool. The pool asks it
which blocks after its CPU-held prefix it holds, reads them into CPU-tier
slots, and hands it the blocks the CPU tier evicts.

Its parts: the data file and the directory's name
(``kvtier.tiers.disk_files``), opening and adopting a directory
(``kvtier.tiers.disk_open``), the records (``kvtier.tiers.slot_index``: one
64-byte record per slot, restart-safe), the in-memory catalog and LRU order
(``kvtier.tiers.disk_catalog``), the write-back queue and its thread
(``kvtier.tiers.disk_writer``, which also says the order that makes the
records safe and the sync policy), the settings
(``kvtier.tiers.disk_settings``).

Contract:

- ``DiskTier(root, pool_name, identity, block_bytes=, capacity_blocks=,
  settings=DiskTierSettings(), admission=None)``: the pool's directory is
  ``root / disk_files.pool_dir_name(pool_name, identity)``; ``identity``
  (a JSON object: layout, tenant, ...) is recorded in the index, and a
  directory whose index records another identity, format or block size
  starts empty (one log line says why). The files are opened, and the
  blocks a previous process left adopted, on the tier's own thread: until
  then (``wait_ready``) the tier is unavailable (lookups miss, write-backs
  are dropped). Never raises for a directory it cannot use (permissions, a
  full disk, another live kvtierd holding it): it logs one line and stays
  unavailable. Directories of the same pool name with another identity
  (an earlier layout) are removed when no live process holds them.
- Capacity: ``capacity_blocks`` slots of the block rounded up to 4 KiB. A
  directory of another capacity keeps the records of the slots that still
  fit. Eviction is LRU (a hit or a repeated write-back makes a block most
  recent; at start, write order).
- ``exists_prefix(hashes) -> int``: how many leading hashes the tier holds
  (in memory, no I/O). 0 while unavailable or while reads rest.
- ``read_into(hashes, dests) -> int``: reads the leading held run into
  ``dests`` (writable buffers of ``block_bytes``, e.g. CPU-tier slots), in
  parallel on ``settings.reader_threads`` threads (direct I/O where the
  filesystem takes it), verifies each block's xxh3 checksum against its
  record, and returns how many leading blocks are good. A block whose
  checksum fails (``disk_corrupt``) or whose read fails (``read_errors``;
  reads then rest ``error_backoff_s``) is dropped and ends the run. Buffers
  past the returned count hold garbage. Never raises for I/O. The caller's
  thread waits for the reads.
- ``write_back(key, data, copy=True) -> bool``: never blocks on the disk. A
  block the tier holds (or has queued) is made most recent (True,
  ``writes_present``); else admission (if given) is asked, the block is
  copied into an aligned buffer (always: ``copy`` is accepted for the
  ``RemoteStore`` signature) and queued. Unavailable, writes resting after
  an error, or a full queue: dropped and counted, False. The caller's
  thread (one: the admission object need not be thread-safe).
- ``clear(match=None) -> int``: drops the blocks held (those whose key
  ``match`` accepts), and the queued ones are not written; returns how many
  held blocks went. Their records are invalidated by the tier's thread.
- ``stats() -> dict``: ``COUNTERS`` plus ``available``, sizes, the
  directory, whether it uses direct I/O and was preallocated.
- ``flush(timeout_s)``: waits until every queued block was written, failed
  or dropped (tests, benchmarks). ``close(timeout_s)``: stops taking
  writes, writes what is queued until the deadline (dropping the rest),
  syncs the index and closes the files (releasing the directory's lock).
- ``faults``: a test's seam (``disk_files.BlockFile.faults``), applied once
  the files are open.
- Thread safety: every public method may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvtier.tiers import disk_writer
from kvtier.tiers.disk_catalog import DiskCatalog, DiskEntry
from kvtier.tiers.disk_files import BlockFile, Faults, pool_dir_name, slot_bytes_for
from kvtier.tiers.disk_open import DATA_NAME, DISK_FORMAT, INDEX_NAME, DirectoryBusy, open_directory
from kvtier.tiers.disk_settings import DiskTierError, DiskTierSettings
from kvtier.tiers.disk_writer import DiskWriter
from kvtier.tiers.remote.values import byte_view
from kvtier.tiers.slot_index import MAX_KEY_BYTES, SlotIndex, block_checksum

__all__ = ["COUNTERS", "DATA_NAME", "DISK_FORMAT", "INDEX_NAME", "Admission", "DiskTier", "DiskTierError",
           "DiskTierSettings"]

log = logging.getLogger(__name__)

COUNTERS = (
    "exists_calls",
    "exists_blocks",  # hashes asked about
    "exists_hit_blocks",  # hashes reported held (the returned prefixes)
    "disk_hits",  # blocks read and verified
    "disk_corrupt",  # blocks read whose checksum failed: dropped, never served
    "read_errors",  # blocks whose read failed (EIO, ...): dropped
    "skipped_unavailable",  # exists/read calls answered "miss": not open, closed, or reads resting
    "bytes_read",  # bytes of disk_hits
    "writes_present",  # write-backs of blocks the tier held or had queued: made most recent
    "writes_not_admitted",
    *disk_writer.COUNTERS,
    "evictions",  # blocks dropped to make room for newer ones
    "adopted_blocks",  # records found complete when the directory was opened
    "torn_records",  # records found torn then (a kill mid-write): their slots are free
)


class Admission(Protocol):
    """What the disk tier needs of an admission filter (``policies.admit2.SecondSightingAdmission`` fits)."""

    def admit(self, key: bytes) -> bool: ...


class DiskTier:
    """Blocks of one pool in a directory. See the module docstring."""

    def __init__(self, root: Path, pool_name: str, identity: dict[str, Any], *, block_bytes: int,
                 capacity_blocks: int, settings: DiskTierSettings = DiskTierSettings(),
                 admission: Admission | None = None, faults: Faults | None = None) -> None:
        if not isinstance(settings, DiskTierSettings):
            raise DiskTierError(f"settings must be a DiskTierSettings, got {type(settings).__name__}")
        if block_bytes < 1:
            raise DiskTierError(f"block_bytes must be >= 1, got {block_bytes}")
        if capacity_blocks < 1:
            raise DiskTierError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.root = Path(root)
        self.pool_name = pool_name
        self.identity = {"format": DISK_FORMAT, "block_bytes": block_bytes, **identity}
        json.dumps(self.identity)  # a JSON object, or a TypeError here rather than on the thread
        self.directory = self.root / pool_dir_name(pool_name, self.identity)
        self.block_bytes = block_bytes
        self.slot_bytes = slot_bytes_for(block_bytes)
        self.capacity_blocks = capacity_blocks
        self.settings = settings
        self.admission = admission
        self._faults = faults
        self._lock = threading.Lock()  # guards the counters and the rest timers
        self._counters = dict.fromkeys((c for c in COUNTERS if c not in disk_writer.COUNTERS), 0)
        self._own_unavailable = 0  # write-backs dropped before the writer existed
        self._read_s = 0.0
        self._reads_rest_until = 0.0
        self._writes_rest_until = 0.0
        self.last_error = ""
        self._catalog = DiskCatalog(capacity_blocks)
        self._file: BlockFile | None = None
        self._index: SlotIndex | None = None
        self._writer: DiskWriter | None = None
        self._ready = threading.Event()  # set once opening ended, well or not
        self._open = False  # the files are open and the writer runs
        self._closing = False
        self._readers = concurrent.futures.ThreadPoolExecutor(settings.reader_threads,
                                                              thread_name_prefix="kvtier-disk-read")
        self._thread = threading.Thread(target=self._run, name="kvtier-disk-write", daemon=True)
        self._thread.start()

    # ---- availability ------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Open, not closing, and neither reads nor writes resting after an error."""
        now = time.monotonic()
        return self._open and not self._closing and now >= self._reads_rest_until and now >= self._writes_rest_until

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the directory is open (True) or could not be (False); False on timeout."""
        return self._ready.wait(timeout_s) and self._open

    def _readable(self) -> bool:
        return self._open and not self._closing and time.monotonic() >= self._reads_rest_until

    def _writes_resting(self) -> bool:
        return time.monotonic() < self._writes_rest_until

    def _rest(self, direction: str, exc: OSError) -> None:
        until = time.monotonic() + self.settings.error_backoff_s
        with self._lock:
            if direction == "read":
                self._reads_rest_until = until
            else:
                self._writes_rest_until = until
            self.last_error = f"{direction}: {exc}"

    # ---- opening (the tier's thread) ------------------------------------------------------

    def _run(self) -> None:
        try:
            writer = self._open_files()
        except Exception as exc:  # noqa: BLE001 - a tier that cannot open is a tier of misses
            self.last_error = f"open: {exc}"
            log.error("disk tier %s: cannot be used (%s); the pool runs without it", self.directory, exc)
            self._ready.set()
            return
        if writer is None:
            self._ready.set()
            return
        self._open = True
        self._ready.set()
        try:
            writer.run(lambda: self._closing)
        finally:
            self._open = False
            if self._index is not None:
                self._index.close()
            if self._file is not None:
                self._file.close()

    def _open_files(self) -> DiskWriter | None:
        try:
            opened = open_directory(self.root, self.pool_name, self.directory, self.identity,
                                    capacity_blocks=self.capacity_blocks, block_bytes=self.block_bytes,
                                    direct=self.settings.direct_io)
        except DirectoryBusy as exc:
            self.last_error = str(exc)
            log.error("disk tier %s is %s (another live kvtierd); this pool runs without a disk tier (give each "
                      "daemon its own disk_dir)", self.directory, exc)
            return None
        index, file, records = opened.index, opened.file, opened.records
        file.faults = self._faults
        for slot in self._catalog.load((r.key, r.slot, r.checksum) for r in records):
            index.invalidate(slot)  # a key found twice keeps its newest slot
            self._catalog.release(slot)
        self._index, self._file = index, file
        with self._lock:
            self._counters["adopted_blocks"] = len(self._catalog)
            self._counters["torn_records"] = opened.torn
        writer = DiskWriter(file=file, index=index, catalog=self._catalog, settings=self.settings,
                            next_seq=max((r.seq for r in records), default=0) + 1,
                            on_error=lambda exc: self._rest("write", exc), resting=self._writes_resting,
                            name=str(self.directory))
        self._writer = writer
        log.info("disk tier %s: %d blocks adopted%s; %d slots of %d bytes, %s I/O%s", self.directory,
                 len(self._catalog), f" ({opened.torn} torn records dropped)" if opened.torn else "",
                 self.capacity_blocks, self.slot_bytes, "direct" if file.direct else "buffered",
                 "" if file.preallocated else ", not preallocated (a full disk fails writes: counted)")
        return writer

    # ---- counters -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        writer = self._writer
        written: dict[str, Any] = writer.counters() if writer is not None else {
            **dict.fromkeys(disk_writer.COUNTERS, 0), "write_seconds": 0.0}
        with self._lock:
            counts = dict(self._counters)
            read_s = self._read_s
            written["writes_dropped_unavailable"] += self._own_unavailable
        counts.update(written)
        counts["evictions"] = self._catalog.evictions
        s: dict[str, Any] = {name: counts[name] for name in COUNTERS}
        file = self._file
        s.update(
            read_seconds=round(read_s, 6),
            write_seconds=written["write_seconds"],
            available=self.available,
            last_error=self.last_error,
            path=str(self.directory),
            capacity_blocks=self.capacity_blocks,
            used_blocks=len(self._catalog),
            block_bytes=self.block_bytes,
            slot_bytes=self.slot_bytes,
            direct_io=bool(file is not None and file.direct),
            preallocated=bool(file is not None and file.preallocated),
            write_queue_depth_blocks=writer.depth_blocks if writer is not None else 0,
            write_queue_blocks=writer.capacity_blocks if writer is not None else 0,
        )
        return s

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._counters[name] += n

    # ---- reads ----------------------------------------------------------------------------

    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        if not hashes:
            return 0
        if not self._readable():
            self._count(skipped_unavailable=1)
            return 0
        n = self._catalog.prefix(hashes)
        with self._lock:
            c = self._counters
            c["exists_calls"] += 1
            c["exists_blocks"] += len(hashes)
            c["exists_hit_blocks"] += n
        return n

    def read_into(self, hashes: Sequence[bytes], dests: Sequence[Any]) -> int:
        if len(dests) < len(hashes):
            raise ValueError(f"{len(hashes)} hashes but {len(dests)} buffers")
        if not hashes:
            return 0
        if not self._readable():
            self._count(skipped_unavailable=1)
            return 0
        file, writer = self._file, self._writer
        assert file is not None and writer is not None
        views = [byte_view(d) for d in dests[: len(hashes)]]
        for v in views:
            if v.nbytes != self.block_bytes or v.readonly:
                raise ValueError(f"read_into needs writable buffers of {self.block_bytes} bytes")
        t0 = time.perf_counter()
        entries = self._catalog.begin_read(hashes)
        verdicts: list[str] = []
        try:
            verdicts = self._read_all(file, entries, views)
        finally:
            ok = [v == "ok" for v in verdicts] + [False] * (len(entries) - len(verdicts))
            writer.retire(self._catalog.end_read(entries, ok))
        good = 0
        while good < len(ok) and ok[good]:
            good += 1
        hits = ok.count(True)
        corrupt = verdicts.count("corrupt")
        errors = verdicts.count("error")
        with self._lock:
            c = self._counters
            c["disk_hits"] += hits
            c["disk_corrupt"] += corrupt
            c["read_errors"] += errors
            c["bytes_read"] += hits * self.block_bytes
            self._read_s += time.perf_counter() - t0
        if corrupt:
            log.warning("disk tier %s: %d blocks failed their checksum in a read of %d (dropped, not served)",
                        self.directory, corrupt, len(entries))
        return good

    def _read_all(self, file: BlockFile, entries: list[DiskEntry], views: list[memoryview]) -> list[str]:
        n = len(entries)
        if n == 0:
            return []
        # Enough tasks to keep every reader busy, each at most ~read_task_bytes (at least one block).
        per_task = max(1, self.settings.read_task_bytes // self.slot_bytes)
        tasks = max(min(self.settings.reader_threads, n), -(-n // per_task))
        step = -(-n // tasks)
        if step >= n:
            return self._read_some(file, entries, views)
        futures = [self._readers.submit(self._read_some, file, entries[i:i + step], views[i:i + step])
                   for i in range(0, n, step)]
        out: list[str] = []
        for f in futures:
            out += f.result()
        return out

    def _read_some(self, file: BlockFile, entries: list[DiskEntry], views: list[memoryview]) -> list[str]:
        out: list[str] = []
        for entry, view in zip(entries, views):
            try:
                file.read(entry.slot, view)
            except OSError as exc:
                out.append("error")
                self._rest("read", exc)
                log.warning("disk tier %s: read of slot %d failed (%s); reads rest %.1f s", self.directory,
                            entry.slot, exc, self.settings.error_backoff_s)
                continue
            out.append("ok" if block_checksum(view) == entry.checksum else "corrupt")
        return out

    # ---- writes -----------------------------------------------------------------------------

    def write_back(self, key: bytes, data: Any, *, copy: bool = True) -> bool:
        """Queue one block for writing; False (counted) if it was dropped. Never blocks."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"disk tier keys are 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        writer = self._writer
        if writer is None or not self._open or self._closing or self._writes_resting():
            if writer is not None:
                writer.drop_unavailable()
            else:
                with self._lock:
                    self._own_unavailable += 1
            return False
        if writer.queued(key) or self._catalog.contains(key):
            self._catalog.touch(key)
            self._count(writes_present=1)
            return True
        if self.admission is not None and not self.admission.admit(key):
            self._count(writes_not_admitted=1)
            return False
        view = byte_view(data)
        if view.nbytes != self.block_bytes:
            raise ValueError(f"write_back of {view.nbytes} bytes; blocks are {self.block_bytes} bytes")
        return writer.offer(key, view)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write was written, failed or dropped (tests, benchmarks)."""
        writer = self._writer
        return writer is None or writer.flush(timeout_s)

    def clear(self, match: Callable[[bytes], bool] | None = None) -> int:
        """Drop the blocks held (and queued) whose key ``match`` accepts (all without it); returns how many."""
        accept = match if match is not None else (lambda _key: True)
        writer = self._writer
        if writer is not None:
            writer.cancel(accept)
        n, retired = self._catalog.drop_matching(accept)
        if writer is not None:
            writer.retire(retired)
        return n

    def keys(self) -> list[bytes]:
        """The keys held, least recent first (tests, tools)."""
        return self._catalog.keys()

    # ---- shutdown ---------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop taking writes, write what is queued for up to timeout_s, sync the index, close the files.

        Returns True if nothing queued was dropped for lack of time.
        """
        if self._closing:
            self._thread.join(timeout_s)
            return True
        deadline = time.monotonic() + timeout_s
        self._ready.wait(max(0.0, deadline - time.monotonic()))
        writer = self._writer
        drained = True
        if writer is not None:
            drained = writer.flush(max(0.0, deadline - time.monotonic()))
            writer.drain_deadline = deadline
        self._closing = True
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._thread.join(max(0.1, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("disk tier %s: its writer did not stop in time", self.directory)
            return False
        return drained

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
