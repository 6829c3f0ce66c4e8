"""The remote tier's write-back queue: blocks sent to Redis/Valkey by background threads.

``RemoteTier`` owns one; the pool never sees it. Contract:

- ``RemoteWriter(conn, settings, key_of, block_bytes, url, mac, admission=None)``
  starts ``settings.writer_threads`` threads that send queued items as
  pipelined ``SET``s (``EX settings.ttl_s`` when given) and ``DEL``s, at
  most ``settings.write_batch_blocks`` per round trip, over ``conn``'s
  current client. ``key_of(block_hash)`` names a block's key; ``mac``
  (``values.ValueMac``) tags each value for that key, on the writer
  thread.
- ``write_back(key, data, copy=True) -> bool``: never blocks on the server.
  Admission (if given) is asked first; the block is copied straight into
  its value's layout (unless ``copy=False``: the caller hands over a buffer
  it will never change) and queued. Full queue, unavailable connection or
  closed writer: dropped and counted, returns False. The caller's thread
  (one thread: the admission object need not be thread-safe).
- ``delete(block_hash)``: queue a key's deletion (a malformed value the
  reader found). A full queue drops it; the next fetch finds it again.
- A batch whose round trip fails counts its blocks ``writes_failed`` and
  reports the failure to ``conn`` (which marks the tier unavailable); a
  writer thread never dies.
- ``flush(timeout_s) -> bool``: waits until every queued item was sent,
  failed or dropped. ``close(deadline)``: no more writes are taken; what is
  queued is sent until ``deadline`` (monotonic) and dropped after it; the
  threads stop. Returns True if they stopped by the deadline.
- ``counters() -> dict``: ``COUNTERS`` and ``write_seconds``; ``depth_blocks``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvtier.tiers.remote.connection import RemoteConnection
from kvtier.tiers.remote.settings import RemoteTierSettings
from kvtier.tiers.remote.values import HEADER_BYTES, ValueMac, byte_view, encode_header, seal

__all__ = ["COUNTERS", "Admission", "RemoteWriter"]

log = logging.getLogger("kvtier.tiers.remote.tier")  # one logger for the whole remote tier

COUNTERS = (
    "writes_queued",
    "writes_done",
    "writes_failed",  # sent but refused or lost (server error, connection lost mid-batch)
    "writes_dropped_full",
    "writes_dropped_unavailable",
    "writes_not_admitted",
    "bytes_written",
    "deletes_queued",  # malformed values' keys queued for deletion
)

# (block_hash, value or payload, needs_header); a value of None deletes the key.
_Item = tuple[bytes, "bytearray | memoryview | bytes | None", bool]


class Admission(Protocol):
    """What the remote tier needs of an admission filter (``policies.admit2.SecondSightingAdmission`` fits)."""

    def admit(self, key: bytes) -> bool: ...


class RemoteWriter:
    def __init__(self, conn: RemoteConnection, settings: RemoteTierSettings, key_of: Callable[[bytes], bytes],
                 block_bytes: int, url: str, mac: ValueMac, admission: Admission | None = None) -> None:
        self._conn = conn
        self._settings = settings
        self._key_of = key_of
        self._block_bytes = block_bytes
        self._url = url
        self._mac = mac
        self.admission = admission
        self._lock = threading.Lock()  # guards the counters
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._write_s = 0.0
        self._closed = False
        self._deadline: float | None = None  # set by close: past it, writers drop what is left
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=settings.write_queue_blocks)
        self._threads = [threading.Thread(target=self._loop, name=f"kvtier-remote-write-{i}", daemon=True)
                         for i in range(settings.writer_threads)]
        for t in self._threads:
            t.start()

    # ---- counters ------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._counters[name] += n

    def counters(self) -> dict[str, Any]:
        with self._lock:
            return {**self._counters, "write_seconds": round(self._write_s, 6)}

    @property
    def depth_blocks(self) -> int:
        return self._queue.qsize()

    # ---- taking writes -------------------------------------------------------------------

    def write_back(self, key: bytes, data: Any, *, copy: bool = True) -> bool:
        if self._closed or not self._conn.available:
            self._count(writes_dropped_unavailable=1)
            return False
        if self.admission is not None and not self.admission.admit(key):
            self._count(writes_not_admitted=1)
            return False
        view = byte_view(data)
        if view.nbytes != self._block_bytes:
            raise ValueError(f"write_back of {view.nbytes} bytes; blocks are {self._block_bytes} bytes")
        if self._queue.full():
            # Checked before copying so a saturated queue costs no memcpy.
            self._count(writes_dropped_full=1)
            return False
        item: _Item
        if copy:
            # One copy, straight into the value's final layout; the writer seals the header in place.
            value = bytearray(HEADER_BYTES + self._block_bytes)
            value[HEADER_BYTES:] = view
            item = (key, value, True)
        else:
            item = (key, view, False)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._count(writes_dropped_full=1)
            return False
        self._count(writes_queued=1)
        return True

    def delete(self, block_hash: bytes) -> None:
        try:
            self._queue.put_nowait((block_hash, None, False))
            self._count(deletes_queued=1)
        except queue.Full:
            pass  # the next fetch finds it corrupt again and retries

    # ---- the writer threads --------------------------------------------------------------

    def _value(self, server_key: bytes, item: _Item) -> bytes | memoryview | None:
        _, data, in_place = item
        if data is None:
            return None
        if in_place:
            assert isinstance(data, bytearray)
            seal(data, server_key, self._mac)
            return memoryview(data)  # redis-py before 8 encodes memoryview but not bytearray
        return encode_header(server_key, data, self._mac) + data  # copy=False: the writer pays the concatenation

    def _take_batch(self) -> list[_Item] | None:
        """Up to write_batch_blocks queued items; None when closing and nothing is left."""
        try:
            first = self._queue.get(timeout=0.1)
        except queue.Empty:
            return None if self._closed else []
        batch = [first]
        while len(batch) < self._settings.write_batch_blocks:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if not batch:
                continue
            try:
                self._send(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _send(self, batch: list[_Item]) -> None:
        sets = sum(1 for _, data, _ in batch if data is not None)
        deadline = self._deadline
        current = self._conn.current()
        if current is None or (deadline is not None and time.monotonic() > deadline):
            self._count(writes_dropped_unavailable=sets)
            return
        client, gen = current
        t0 = time.perf_counter()
        try:
            pipe = self._conn.pipeline(client)
            for item in batch:
                server_key = self._key_of(item[0])
                value = self._value(server_key, item)
                if value is None:
                    pipe.delete(server_key)
                else:
                    pipe.set(server_key, value, ex=self._settings.ttl_s)
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - a writer must never die
            self._conn.failed(exc, gen, f"SET of {sets} blocks")
            self._count(writes_failed=sets)
            return
        done = failed = 0
        first_error: Exception | None = None
        for item, reply in zip(batch, replies):
            if item[1] is None:
                continue
            if isinstance(reply, Exception):
                failed += 1
                first_error = first_error or reply
            else:
                done += 1
        if first_error is not None:
            self._conn.failed(first_error, gen, f"SET ({failed} of {sets} blocks)")
        else:
            self._conn.succeeded()
        with self._lock:
            self._counters["writes_done"] += done
            self._counters["writes_failed"] += failed
            self._counters["bytes_written"] += done * self._block_bytes
            self._write_s += time.perf_counter() - t0
        log.debug("remote tier %s: wrote %d blocks (%d failed)", self._url, done, failed)

    # ---- draining ------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, deadline: float) -> bool:
        self._closed = True
        self._deadline = deadline
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)
