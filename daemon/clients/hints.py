"""Wire hints (feature "hints") to the tiers' ``RequestHints``, bounded per client.

The protocol module validated the fields; this module decides what the pool
hears:

- ``session`` is scoped to the tenant and keyed by a digest: the pool sees
  ``session_key(tenant, key)``, 16 bytes of BLAKE2b over the tenant's name
  and the key. Two tenants naming the same session key never share its
  statistics, and every key the protocol takes (1..256 characters, up to
  1 KiB of UTF-8) fits the tiers' bound (``MAX_SESSION_KEY_BYTES``) with
  room to spare: a tenant prefix on the raw key once made a 256-character
  key 257 bytes and the request an INTERNAL error. Per-session state in the
  policies costs 16 bytes of key, whatever the client sent.
- ``retain_s`` is cut to ``MAX_RETAIN_S`` (an hour: the longest prompt-cache
  TTL an API offers today), and a session may hold retention on at most its
  share of the pool: half the pool's blocks (GPU + CPU tier) divided by the
  sessions on the pool. A request past the share keeps its other hints and
  loses ``retain_s`` (counted in ``hints_retain_refused_total``): a hint is
  soft, so exceeding the share is no error. The ledger is
  ``kvtier.daemon.clients.retention.Retention``: O(log n) per request.
- ``at_s`` is the daemon's monotonic clock when the request arrived.
- ``output_tokens`` passes as it came (validated: 0..2**31-1).

Called by the handlers of lookup, allocate and store; returns None when the
request carried no hints, so the pool sees exactly a hint-less request.
"""

from __future__ import annotations

import hashlib
import time

from kvtier.client.protocol import HintFields
from kvtier.daemon.clients.sessions import Session
from kvtier.daemon.pooling.pools import PoolEntry
from kvtier.daemon.telemetry.metrics import Counters
from kvtier.tiers.hints import RequestHints

MAX_RETAIN_S = 3600.0
RETAIN_SHARE_OF_POOL = 0.5
SESSION_KEY_BYTES = 16  # 128 bits: two live sessions' keys never meet by chance
_SESSION_PERSON = b"kvtier-session"


def session_key(tenant: str, key: str) -> bytes:
    """The pool's key of session ``key`` of ``tenant``: fixed length, whatever the length of ``key``."""
    h = hashlib.blake2b(digest_size=SESSION_KEY_BYTES, person=_SESSION_PERSON)
    name = tenant.encode()
    # The tenant's length first: ("ab", "c") and ("a", "bc") stay apart.
    h.update(len(name).to_bytes(4, "little") + name + key.encode())
    return h.digest()


def retain_share_blocks(entry: PoolEntry) -> int:
    return int(entry.capacity_blocks * RETAIN_SHARE_OF_POOL) // max(1, len(entry.sessions))


def request_hints(wire: HintFields | None, session: Session, entry: PoolEntry, num_blocks: int,
                  metrics: Counters, *, now_s: float | None = None) -> RequestHints | None:
    """The pool's hints for one request of ``num_blocks`` blocks, or None for a request without any."""
    if wire is None:
        return None
    now_s = time.monotonic() if now_s is None else now_s
    key = wire.session
    scoped = session_key(session.tenant, key) if key is not None else None
    retain_s = min(float(wire.retain_s or 0.0), MAX_RETAIN_S)
    if retain_s > 0.0 and not session.retained.reserve(now_s, now_s + retain_s, num_blocks,
                                                        retain_share_blocks(entry)):
        metrics.inc("hints_retain_refused_total")
        retain_s = 0.0
    hints = RequestHints(session=scoped, retain_s=retain_s, priority=int(wire.priority or 0), at_s=now_s,
                         output_tokens=int(wire.output_tokens or 0))
    return None if hints.empty else hints

