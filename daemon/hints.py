"""Wire hints (feature "hints") to the tiers' ``RequestHints``, bounded per client.

The protocol module validated the fields; this module decides what the pool
hears:

- ``session`` is scoped to the tenant (``b"<tenant>\\0<session>"``): two
  tenants naming the same session key never share its statistics.
- ``retain_s`` is cut to ``MAX_RETAIN_S`` (an hour: the longest prompt-cache
  TTL an API offers today), and a session may hold retention on at most its
  share of the pool: half the pool's blocks (GPU + CPU tier) divided by the
  sessions on the pool. A request past the share keeps its other hints and
  loses ``retain_s`` (counted in ``hints_retain_refused_total``): a hint is
  soft, so exceeding the share is no error. The ledger is
  ``kvtier.daemon.retention.Retention``: O(log n) per request.
- ``at_s`` is the daemon's monotonic clock when the request arrived.
- ``output_tokens`` passes as it came (validated: 0..2**31-1).

Called by the handlers of lookup, allocate and store; returns None when the
request carried no hints, so the pool sees exactly a hint-less request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kvtier.daemon.metrics import Counters
from kvtier.daemon.pools import PoolEntry
from kvtier.daemon.sessions import Session
from kvtier.tiers.hints import RequestHints

MAX_RETAIN_S = 3600.0
RETAIN_SHARE_OF_POOL = 0.5


def retain_share_blocks(entry: PoolEntry) -> int:
    return int(entry.capacity_blocks * RETAIN_SHARE_OF_POOL) // max(1, len(entry.sessions))


def request_hints(wire: Mapping[str, Any] | None, session: Session, entry: PoolEntry, num_blocks: int,
                  metrics: Counters, *, now_s: float | None = None) -> RequestHints | None:
    """The pool's hints for one request of ``num_blocks`` blocks, or None for a request without any."""
    if not wire:
        return None
    now_s = time.monotonic() if now_s is None else now_s
    key = wire.get("session")
    scoped = f"{session.tenant}\0{key}".encode() if key is not None else None
    retain_s = min(float(wire.get("retain_s") or 0.0), MAX_RETAIN_S)
    if retain_s > 0.0 and not session.retained.reserve(now_s, now_s + retain_s, num_blocks,
                                                        retain_share_blocks(entry)):
        metrics.inc("hints_retain_refused_total")
        retain_s = 0.0
    hints = RequestHints(session=scoped, retain_s=retain_s, priority=int(wire.get("priority") or 0), at_s=now_s,
                         output_tokens=int(wire.get("output_tokens") or 0))
    return None if hints.empty else hints

