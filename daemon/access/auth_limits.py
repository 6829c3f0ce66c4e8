"""How many wrong tenant tokens one peer may try: a token bucket per peer.

Without it a client could guess tokens as fast as the loop answers hello
(4,900 guesses/s measured on the 2-core VM, issue 32 item 9).

Contract (the event loop's thread only):

- ``AuthFailureLimiter(per_minute, clock=time.monotonic)``: each peer (the
  connection's uid on ``ipc://``, IP address on ``tcp://``:
  ``daemon.access.connections.peer_of_frame``) has a bucket of ``per_minute``
  failures that refills at ``per_minute`` a minute.
- ``wait_s(peer) -> float``: 0.0 while the peer may try a token; else the
  seconds until its bucket holds one failure again. The caller refuses the
  hello (TOO_MANY_AUTH_FAILURES) *without checking its token*, so a guess
  made while refused can never succeed.
- ``failed(peer)``: a token check failed: one failure out of the bucket, and
  ``auth_failures_total`` / ``auth_refused_total`` counters for ``publish``.
  A right token costs nothing, so a client that knows its token is never
  slowed by this.
- At most ``MAX_PEERS`` buckets are kept (peers spread over many addresses
  would otherwise grow the table): refilled ones are dropped first, then the
  oldest.
- ``publish(metrics)``: ``auth_failures_total`` (wrong tokens) and
  ``auth_refused_total`` (hellos refused untried).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.daemon.access.connections import Peer
from kvtier.daemon.telemetry.metrics import Counters

MAX_PEERS = 65536


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at_s: float


class AuthFailureLimiter:
    """See the module docstring."""

    def __init__(self, per_minute: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if per_minute < 1:
            raise ValueError(f"per_minute must be at least 1, got {per_minute}")
        self.per_minute = per_minute
        self._rate_per_s = per_minute / 60.0
        self._clock = clock
        self._buckets: dict[Peer, _Bucket] = {}
        self.failures_total = 0
        self.refused_total = 0

    def _level(self, bucket: _Bucket, now_s: float) -> float:
        return min(float(self.per_minute), bucket.tokens + (now_s - bucket.at_s) * self._rate_per_s)

    def wait_s(self, peer: Peer) -> float:
        """See the module docstring."""
        bucket = self._buckets.get(peer)
        if bucket is None:
            return 0.0
        level = self._level(bucket, self._clock())
        if level >= 1.0:
            return 0.0
        self.refused_total += 1
        return (1.0 - level) / self._rate_per_s

    def failed(self, peer: Peer) -> None:
        """See the module docstring."""
        now_s = self._clock()
        self.failures_total += 1
        bucket = self._buckets.get(peer)
        if bucket is None:
            if len(self._buckets) >= MAX_PEERS:
                self._make_room(now_s)
            bucket = self._buckets[peer] = _Bucket(float(self.per_minute), now_s)
        bucket.tokens = self._level(bucket, now_s) - 1.0
        bucket.at_s = now_s

    def _make_room(self, now_s: float) -> None:
        full = [p for p, b in self._buckets.items() if self._level(b, now_s) >= self.per_minute]
        for peer in full:
            del self._buckets[peer]
        while len(self._buckets) >= MAX_PEERS:
            del self._buckets[next(iter(self._buckets))]  # the oldest: dicts keep insertion order

    def publish(self, metrics: Counters) -> None:
        metrics.set("auth_failures_total", self.failures_total)
        metrics.set("auth_refused_total", self.refused_total)
