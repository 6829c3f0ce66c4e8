"""A remote tier below the CPU tier: KV blocks in Redis or Valkey (standalone or Cluster).

A ``RemoteTier`` is self-contained: it knows block hashes, bytes and one
server (or cluster), nothing of the pool, slots or copies. The pool asks it
whether the blocks after its CPU-held prefix exist, fetches them into the CPU
tier, and hands it the blocks the CPU tier evicts.

This module holds the blocks' side: keys, lookups and fetches, and the
tier's counters. The value format and its checks are
``kvtier.tiers.remote.values``'s; the write-back queue and its threads are
``kvtier.tiers.remote.writer``'s; which client to use and whether the server
may be tried at all (URL, reconnect backoff, health pings) is
``kvtier.tiers.remote.connection``'s; the settings are
``kvtier.tiers.remote.settings``'s.

Contract:

- ``RemoteTier(url, pool_key, block_bytes, settings=RemoteTierSettings(),
  *, secret, admission=None)``: the tier's identity, then how it runs (one
  frozen value, ``kvtier.tiers.remote.settings``: queue, threads, timeouts,
  backoff; validated when built; re-exported here with
  ``RemoteTierError``), then the deployment's secret (32 bytes,
  ``kvtier.tiers.remote.secret``: every daemon sharing the server must hold
  the same one). ``url`` (``url.parse_url``) chooses the mode:
  ``redis://host:port/db`` (also ``rediss://``, ``unix://``, ``valkey://``,
  ``valkeys://``) is one server; ``redis+cluster://host:port[,host:port...]``
  (also ``rediss+cluster://``, ``valkey+cluster://``) is a Redis Cluster, the
  listed nodes being startup nodes. Construction never raises for an
  unreachable server: the tier starts unavailable and connects on its own.
- Keys: ``b"kvtier:v2:" + pool_key + b":" + block_hash.hex()``. ``pool_key``
  identifies pool (layout) *and* tenant, so neither ever sees another's
  blocks; it is restricted to ``[A-Za-z0-9._-]`` (no glob or hash-tag
  characters, so ``SCAN MATCH kvtier:v2:<pool_key>:*`` is exact and Cluster
  spreads a pool's keys over all slots). ``make_pool_key(...)`` derives one.
- Values: a 32-byte header ``struct "<4sBxxxQ16s"`` = magic ``b"KVT1"``,
  format version (2), payload length, a 16-byte MAC (keyed BLAKE3 over the
  version, length, server key and payload); then the payload (exactly
  ``block_bytes`` bytes). ``values`` builds and checks them.
- ``exists_prefix(hashes) -> int``: one round trip (standalone: a cached Lua
  script that stops at the first key whose value is not exactly a block's
  size, falling back to pipelined ``STRLEN`` where scripting is refused;
  Cluster: pipelined ``STRLEN``, split per node); the number of leading
  hashes present with a value of the right size. Never raises: when the
  tier is unavailable or the round trip fails it returns 0 (counted). A
  block it reports may still be gone (evicted) or bad by the time it is
  fetched.
- ``fetch(hashes) -> list[memoryview | None]``: pipelined ``GETRANGE key 0
  value_bytes`` (split per node by redis-py in Cluster mode; in round trips
  of at most ``settings.fetch_round_trip_bytes``): the server never sends
  more than one byte past a block's value, however large the value under
  the key, so a foreign value costs no memory or time. Each value is
  checked (``values.decode``). A missing value is ``None``
  (``remote_misses``); a longer one ``None`` (``remote_oversized``), a
  shorter or malformed one ``None`` (``remote_corrupt``), both queued for
  deletion; a well-formed one whose MAC is wrong (copied from another key,
  forged, written with another secret) ``None`` (``remote_unauthentic``,
  left alone: a daemon with a wrong secret must not delete the fleet's
  blocks); a failed round trip gives ``None`` for its blocks
  (``remote_errors``). Never a wrong block, never raises. A payload is a
  read-only memoryview of exactly ``block_bytes`` bytes (no copy).
  ``fetch_async`` runs it on a reader thread and returns a
  ``concurrent.futures.Future``.
- ``write_back(key, data, copy=True) -> bool``: write-back of one block,
  never blocking on the server (``writer.RemoteWriter.write_back``).
  Admission (if given) is asked first; the block is copied (unless
  ``copy=False``: the caller hands over a buffer it will never change) and
  queued. Full queue, unavailable tier or closed tier: dropped and counted,
  returns False. Worker threads send queued blocks as pipelined ``SET``s
  (``EX settings.ttl_s`` when given). Thread: the caller's (one thread, as
  the admission object is not required to be thread-safe).
- Availability: any connection-level failure (refused, reset, timeout,
  CLUSTERDOWN, uncovered slot) marks the tier unavailable; while unavailable
  reads answer "miss" without touching the network and writes are dropped.
  The connection's health thread reconnects with exponential backoff
  (``retry_initial_s`` doubling up to ``retry_max_s``,
  +-``retry_jitter_fraction``) and, while available, pings every
  ``health_interval_s`` (all in ``settings``) so a dead server is noticed
  without traffic. Recovery needs no caller action. Cluster MOVED/ASK
  (resharding) and topology refreshes are redis-py's; a failover shows as
  a short unavailability.
- ``stats() -> dict``: counters (see ``COUNTERS``) plus ``available``,
  ``write_queue_depth_blocks`` and the mode; ``close(timeout_s)`` drains the
  write queue for up to ``timeout_s`` (over the current connection: no
  reconnect once closing) and stops every thread.
- Thread safety: every public method may be called from any thread.

Capacity and eviction are the server's: run it with ``maxmemory`` and
``maxmemory-policy allkeys-lru`` (see docs/remote-tier.md).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.tiers.remote import connection as remote_connection
from kvtier.tiers.remote import writer as remote_writer
from kvtier.tiers.remote.connection import RemoteConnection, is_connection_failure, parse_url
from kvtier.tiers.remote.settings import RemoteTierError, RemoteTierSettings
from kvtier.tiers.remote import values as remote_values
from kvtier.tiers.remote.values import FORMAT_VERSION, HEADER, HEADER_BYTES, MAGIC, ValueMac, decode, encode_header
from kvtier.tiers.remote.writer import Admission, RemoteWriter

try:
    import redis
    import redis.exceptions
except ImportError:  # pragma: no cover - exercised only where redis-py is absent
    redis = None  # type: ignore[assignment]

__all__ = [
    "COUNTERS", "DEFAULT_SETTINGS", "FORMAT_VERSION", "HEADER", "HEADER_BYTES", "KEY_PREFIX", "MAGIC",
    "Admission", "RemoteTier", "RemoteTierError", "RemoteTierSettings", "make_pool_key",
]

log = logging.getLogger(__name__)

# v2: values carry a MAC (format 2). Daemons of format 1 use other keys, so a
# fleet being upgraded never reads, or deletes, the other format's values.
KEY_PREFIX = b"kvtier:v2:"

_POOL_KEY_RE = re.compile(rb"[A-Za-z0-9._-]{1,128}")

# Standalone lookups run this instead of a pipeline of STRLEN: one command in,
# one integer out, stopping at the first key without a value of a block's size
# (ARGV[1]): absent, or not a value this pool could use. redis-py spends ~4 us
# of Python per pipelined command, so for 256 hashes this is ~5x faster
# (bench/remote.py). Cluster cannot run it: a script's keys must share a slot.
# pcall: a key of another type (WRONGTYPE) ends the prefix, not the script.
_PREFIX_SCRIPT = """
local want = tonumber(ARGV[1])
for i = 1, #KEYS do
  if redis.pcall('STRLEN', KEYS[i]) ~= want then return i - 1 end
end
return #KEYS
"""

COUNTERS = (
    "exists_calls",
    "exists_blocks",  # hashes asked about
    "exists_hit_blocks",  # hashes reported present (the returned prefixes)
    "remote_hits",  # blocks fetch returned, verified
    "remote_misses",  # blocks fetch found absent
    "remote_corrupt",  # blocks fetch found present but malformed (too short, magic, version, length field)
    "remote_oversized",  # blocks fetch found longer than a block's value (read no further than one byte past it)
    "remote_unauthentic",  # blocks fetch found well-formed but with a wrong MAC (another key's, forged, other secret)
    "remote_errors",  # blocks not read because a round trip failed
    "skipped_unavailable",  # exists/fetch calls answered "miss" because the tier was unavailable
    "bytes_fetched",  # payload bytes of remote_hits
    *remote_writer.COUNTERS,  # writes_*, bytes_written, deletes_queued: the write-back queue's
    *remote_connection.COUNTERS,  # unavailable_events, reconnects: the connection's own
)


DEFAULT_SETTINGS = RemoteTierSettings()  # frozen: one shared default is safe


def make_pool_key(*parts: object) -> bytes:
    """A pool key from the things that must never mix (layout identity, tenant).

    Canonical (JSON, sorted keys) and hashed, so any values work and the key
    stays short and within the allowed characters.
    """
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=repr).encode()
    return hashlib.sha256(canonical).hexdigest()[:32].encode()


class RemoteTier:
    """Blocks of one pool in Redis/Valkey. See the module docstring."""

    def __init__(self, url: str, pool_key: bytes, block_bytes: int,
                 settings: RemoteTierSettings = DEFAULT_SETTINGS, *, secret: bytes,
                 admission: Admission | None = None) -> None:
        if redis is None:
            raise RemoteTierError("the remote tier needs redis-py: pip install 'redis>=5'")
        if not isinstance(pool_key, bytes) or not _POOL_KEY_RE.fullmatch(pool_key):
            raise RemoteTierError(
                f"pool_key must be 1-128 bytes of [A-Za-z0-9._-], got {pool_key!r} (see make_pool_key)"
            )
        if block_bytes < 1:
            raise RemoteTierError(f"block_bytes must be >= 1, got {block_bytes}")
        if not isinstance(settings, RemoteTierSettings):
            raise RemoteTierError(f"settings must be a RemoteTierSettings, got {type(settings).__name__}")
        mac = ValueMac(secret)  # refuses a missing blake3 or a secret of the wrong size
        endpoint = parse_url(url)
        self.url = endpoint.display
        self.cluster = endpoint.cluster
        self.pool_key = pool_key
        self.block_bytes = block_bytes
        self.value_bytes = HEADER_BYTES + block_bytes
        self.settings = settings
        self._mac = mac
        # A reply of GETRANGE is at most one byte longer than a value.
        self._fetch_chunk_blocks = max(1, settings.fetch_round_trip_bytes // (self.value_bytes + 1))
        self._prefix = KEY_PREFIX + pool_key + b":"
        self._use_script = not self.cluster  # cleared for good if the server refuses scripts

        self._lock = threading.Lock()  # guards the read counters and the lookup script below
        self._counters: dict[str, int] = {
            c: 0 for c in COUNTERS if c not in remote_connection.COUNTERS and c not in remote_writer.COUNTERS}
        self._seconds = {"exists": 0.0, "fetch": 0.0}
        # The lookup script, registered on each connection generation's client (as the client
        # changes on reconnect); a redis-py Script reloads itself on NOSCRIPT.
        self._script: Any = None
        self._script_generation = -1
        self._closed = False

        # One synchronous connect attempt, so a healthy server is usable as soon
        # as we return; a dead one costs at most connect_timeout_s here.
        self._conn = RemoteConnection(endpoint, settings)
        self._readers = concurrent.futures.ThreadPoolExecutor(settings.reader_threads,
                                                              thread_name_prefix="kvtier-remote-read")
        self._writer = RemoteWriter(self._conn, settings, self.key, block_bytes, self.url, mac, admission)

    # ---- keys and values --------------------------------------------------------------

    def key(self, block_hash: bytes) -> bytes:
        """The server key of a block of this pool."""
        return self._prefix + block_hash.hex().encode()

    def encode_header(self, block_hash: bytes, payload: bytes | bytearray | memoryview) -> bytes:
        """The 32-byte header of this pool's value of a block (exposed for tests and tools)."""
        return encode_header(self.key(block_hash), payload, self._mac)

    @property
    def admission(self) -> Admission | None:
        return self._writer.admission

    # ---- availability ------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._conn.available

    def wait_available(self, timeout_s: float) -> bool:
        """Block until the tier is available (tests, start-up); False on timeout or once closed."""
        return self._conn.wait_available(timeout_s)

    # ---- counters -------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._counters[name] += n

    def stats(self) -> dict[str, Any]:
        counts = self._conn.counters()  # its own lock; never taken inside ours
        written = self._writer.counters()
        counts.update(written)
        with self._lock:
            counts.update(self._counters)
            seconds = {f"{k}_seconds": round(v, 6) for k, v in self._seconds.items()}
        s: dict[str, Any] = {name: counts[name] for name in COUNTERS}
        s.update(seconds, write_seconds=written["write_seconds"])
        s.update(
            available=self._conn.available,
            last_error=self._conn.last_error,
            mode="cluster" if self.cluster else "standalone",
            url=self.url,
            write_queue_depth_blocks=self._writer.depth_blocks,
            write_queue_blocks=self.settings.write_queue_blocks,
        )
        return s

    # ---- reads ----------------------------------------------------------------------------

    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        if not hashes:
            return 0
        current = self._conn.current()
        if current is None:
            self._count(skipped_unavailable=1)
            return 0
        client, gen = current
        t0 = time.perf_counter()
        keys = [self.key(h) for h in hashes]
        n: int | None = None
        if self._use_script:
            n = self._exists_prefix_script(client, gen, keys)
        if n is None:
            n = self._exists_prefix_pipeline(client, gen, keys)
        with self._lock:
            self._counters["exists_calls"] += 1
            self._counters["exists_blocks"] += len(hashes)
            self._counters["exists_hit_blocks"] += n
            self._seconds["exists"] += time.perf_counter() - t0
        return n

    def _lookup_script(self, client: Any, generation: int) -> Any:
        """The Lua lookup script registered on this generation's client."""
        with self._lock:
            if self._script_generation != generation:
                self._script = client.register_script(_PREFIX_SCRIPT)
                self._script_generation = generation
            return self._script

    def _exists_prefix_script(self, client: Any, gen: int, keys: list[bytes]) -> int | None:
        """The prefix length by Lua; None to use the pipeline instead.

        A server that refuses scripts for good (ACL, disabled EVAL, a proxy
        without scripting) switches this tier to the pipeline for good; any
        other script error (BUSY, ...) only for this call.
        """
        try:
            n = int(self._lookup_script(client, gen)(keys=keys, args=[self.value_bytes], client=client))
        except redis.exceptions.ResponseError as exc:
            if is_connection_failure(exc):
                self._conn.failed(exc, gen, f"EXISTS script over {len(keys)} blocks")
                return 0
            text = str(exc).lower()
            if isinstance(exc, redis.exceptions.NoPermissionError) or "unknown command" in text or "disabled" in text:
                self._use_script = False
                log.warning("remote tier %s: Lua lookup refused (%s); using pipelined EXISTS", self.url, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - never raise to the caller
            self._conn.failed(exc, gen, f"EXISTS script over {len(keys)} blocks")
            return 0
        self._conn.succeeded()
        return n

    def _exists_prefix_pipeline(self, client: Any, gen: int, keys: list[bytes]) -> int:
        try:
            pipe = self._conn.pipeline(client)
            for k in keys:
                pipe.strlen(k)
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - never raise to the caller
            self._conn.failed(exc, gen, f"STRLEN of {len(keys)} blocks")
            return 0
        n = 0
        for reply in replies:
            if isinstance(reply, Exception):
                self._conn.failed(reply, gen, "STRLEN")
                return n
            if reply != self.value_bytes:
                break
            n += 1
        self._conn.succeeded()
        return n

    def fetch(self, hashes: Sequence[bytes]) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(hashes)
        if not hashes:
            return out
        current = self._conn.current()
        if current is None:
            self._count(skipped_unavailable=1, remote_errors=len(hashes))
            return out
        client, gen = current
        t0 = time.perf_counter()
        hits = misses = errors = 0
        rejected = dict.fromkeys((remote_values.CORRUPT, remote_values.OVERSIZED, remote_values.UNAUTHENTIC), 0)
        bad_keys: list[bytes] = []
        last = self.value_bytes  # GETRANGE's end is inclusive: one byte past a value tells "longer"
        # Even round trips (256 blocks at 255 per trip go as 128 + 128, not 255 + 1).
        trips = -(-len(hashes) // self._fetch_chunk_blocks)
        step = -(-len(hashes) // trips)
        for start in range(0, len(hashes), step):
            keys = [self.key(h) for h in hashes[start : start + step]]
            try:
                pipe = self._conn.pipeline(client)
                for k in keys:
                    pipe.getrange(k, 0, last)
                replies = pipe.execute(raise_on_error=False)
            except Exception as exc:  # noqa: BLE001 - a failed round trip is a miss, never an error
                self._conn.failed(exc, gen, f"GETRANGE of {len(keys)} blocks")
                errors += len(hashes) - start
                break
            first_error: Exception | None = None
            for i, value in enumerate(replies, start):
                if not value:  # GETRANGE of an absent key is "" (None from a proxy that says nil)
                    misses += 1
                elif isinstance(value, Exception):
                    errors += 1
                    first_error = first_error or value
                else:
                    payload, verdict = decode(value, keys[i - start], self.block_bytes, self._mac)
                    if payload is not None:
                        out[i] = payload
                        hits += 1
                        continue
                    rejected[verdict] += 1
                    if verdict != remote_values.UNAUTHENTIC:
                        bad_keys.append(hashes[i])
            if first_error is not None:  # one report per round trip, not per block
                self._conn.failed(first_error, gen, f"GETRANGE ({errors} blocks)")
        if not errors:
            self._conn.succeeded()
        with self._lock:
            c = self._counters
            c["remote_hits"] += hits
            c["remote_misses"] += misses
            c["remote_corrupt"] += rejected[remote_values.CORRUPT]
            c["remote_oversized"] += rejected[remote_values.OVERSIZED]
            c["remote_unauthentic"] += rejected[remote_values.UNAUTHENTIC]
            c["remote_errors"] += errors
            c["bytes_fetched"] += hits * self.block_bytes
            self._seconds["fetch"] += time.perf_counter() - t0
        if bad_keys:
            log.warning("remote tier %s: %d malformed values in a fetch of %d blocks (queued for deletion)",
                        self.url, len(bad_keys), len(hashes))
            for h in bad_keys:
                self._writer.delete(h)
        if rejected[remote_values.UNAUTHENTIC]:
            log.warning("remote tier %s: %d values in a fetch of %d blocks failed authentication (misses): written "
                        "by a daemon with another remote secret, or by someone else", self.url,
                        rejected[remote_values.UNAUTHENTIC], len(hashes))
        return out

    def fetch_async(
        self, hashes: Sequence[bytes], callback: Callable[[concurrent.futures.Future], None] | None = None
    ) -> concurrent.futures.Future:
        """``fetch`` on a reader thread; ``callback(future)`` runs on that thread when done."""
        future = self._readers.submit(self.fetch, list(hashes))
        if callback is not None:
            future.add_done_callback(callback)
        return future

    # ---- writes (writer.py) ----------------------------------------------------------------

    def write_back(self, key: bytes, data: Any, *, copy: bool = True) -> bool:
        """Queue one block for writing; False (counted) if it was dropped. Never blocks."""
        return self._writer.write_back(key, data, copy=copy)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write was sent, failed or dropped (tests, benchmarks)."""
        return self._writer.flush(timeout_s)

    # ---- shutdown ---------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop taking writes, send what is queued for up to timeout_s, stop all threads.

        Returns True if every queued write was sent (or failed) in time.
        """
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        # No reconnect while closing: the queue drains over the current client or is dropped.
        self._conn.stop_connecting()
        # The writers drop what they cannot send in time.
        drained = self._writer.close(time.monotonic() + timeout_s)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._conn.close()
        if not drained:
            log.warning("remote tier %s: closed with writes still in flight", self.url)
        return drained

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
