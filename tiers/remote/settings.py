"""How a ``RemoteTier`` runs: its settings, in one frozen value, and its configuration error.

Contract:

- ``RemoteTierSettings(...)``: every knob of ``RemoteTier`` that is not the
  tier's identity (URL, pool key, block size) or an object it calls
  (``admission``). Frozen and slotted: one value may be shared by many
  tiers and never changes under them. Defaults are the recommended ones of
  docs/remote-tier.md. Units are in the names (``_s`` seconds, ``_bytes``,
  ``_blocks``, ``_fraction`` of 1); counts are plain ints.
- ``__post_init__`` refuses, with ``RemoteTierError`` naming the field and
  the value, a wrong type (``True`` is no count; a float is no count), a
  count or size below 1, a time that is not a positive finite number,
  ``retry_max_s < retry_initial_s``, a jitter outside [0, 1) (1 could make
  a retry delay 0: a busy loop against a dead server) and a ``ttl_s`` that
  is neither None nor a whole number of seconds >= 1 (``SET ... EX`` takes
  whole seconds).
- ``RemoteTierError``: bad configuration (settings, URL, pool key, sizes)
  or redis-py missing; ``kvtier.tiers.remote.tier`` raises it too.

Stdlib only: the daemon, tests and benchmarks build settings without redis-py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RemoteTierError", "RemoteTierSettings"]


class RemoteTierError(RuntimeError):
    """Bad configuration (settings, URL, pool key, sizes) or redis-py missing."""


# Which fields are counts/sizes (whole numbers >= 1) and which are durations (seconds > 0).
_AT_LEAST_ONE = ("write_queue_blocks", "writer_threads", "write_batch_blocks", "reader_threads",
                 "fetch_round_trip_bytes", "max_connections")
_POSITIVE_SECONDS = ("timeout_s", "connect_timeout_s", "retry_initial_s", "retry_max_s", "health_interval_s")


@dataclass(frozen=True, slots=True)
class RemoteTierSettings:
    """The settings of one ``RemoteTier`` (see the module docstring and docs/remote-tier.md)."""

    # Write-back. Memory: up to write_queue_blocks values of block_bytes + 32 bytes are held.
    write_queue_blocks: int = 1024  # a full queue drops the block (counted), never blocks the caller
    writer_threads: int = 2
    write_batch_blocks: int = 32  # SETs per pipelined round trip
    ttl_s: int | None = None  # SET ... EX ttl_s; None: capacity is the server's maxmemory alone
    # Reads.
    reader_threads: int = 1  # behind fetch_async
    fetch_round_trip_bytes: int = 64 << 20  # most value bytes one GET round trip asks for (client memory)
    # The connection: a hung server costs a read at most timeout_s before it is a miss.
    timeout_s: float = 0.5  # socket timeout of every command
    connect_timeout_s: float = 0.5
    max_connections: int = 64  # redis-py's connection pool (per node in Cluster mode)
    # Reconnect backoff while unavailable: retry_initial_s doubling up to retry_max_s, each +-jitter.
    retry_initial_s: float = 0.05
    retry_max_s: float = 5.0
    retry_jitter_fraction: float = 0.2
    health_interval_s: float = 2.0  # ping period while available and idle

    def __post_init__(self) -> None:
        for name in _AT_LEAST_ONE:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise RemoteTierError(f"RemoteTierSettings.{name} must be an int >= 1, got {value!r}")
        for name in _POSITIVE_SECONDS:
            value = getattr(self, name)
            if not _is_real(value) or not 0.0 < value < math.inf:  # also refuses NaN
                raise RemoteTierError(f"RemoteTierSettings.{name} must be a number of seconds > 0, got {value!r}")
        if self.retry_max_s < self.retry_initial_s:
            raise RemoteTierError(f"RemoteTierSettings.retry_max_s ({self.retry_max_s!r}) must be >= "
                                  f"retry_initial_s ({self.retry_initial_s!r})")
        jitter = self.retry_jitter_fraction
        if not _is_real(jitter) or not 0.0 <= jitter < 1.0:
            raise RemoteTierError(f"RemoteTierSettings.retry_jitter_fraction must be in [0, 1), got {jitter!r}")
        if self.ttl_s is not None and (not _is_int(self.ttl_s) or self.ttl_s < 1):
            raise RemoteTierError(f"RemoteTierSettings.ttl_s must be None or an int >= 1 (seconds), got {self.ttl_s!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
