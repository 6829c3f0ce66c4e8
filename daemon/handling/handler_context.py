"""What every handler shares: the context it runs in, what it returns, and the small steps all verbs take.

Contract (the event loop's thread only):

- ``SessionHandler``: ``(ctx, req, session) -> Reply | Pending``, a verb that
  needs a session: the server has looked it up (and answered the error
  itself when there is none) before the handler runs. ``OpenHandler``:
  ``(ctx, req) -> Reply | Pending``, a verb that needs none (``hello``,
  ``stats``, ``health``). ``daemon.handlers`` holds both tables and the
  rules each handler keeps.
- ``Reply``: a reply's fields (a map the server wraps in the envelope, or the
  op's typed ``ReplyMessage``, envelope included, sent as it is) and payload
  frames; ``on_sent`` runs once ZMQ no longer reads the frames (memory they
  lend goes back there).
- ``Pending``: a copy still in flight; the server parks it and sends
  ``finish(op)``'s reply when the op is done (see ``daemon.handling.parking``).
- ``HandlerContext``: the daemon-wide state handlers read and change (pools,
  sessions, counters, limits), built once by the server.
- ``pool_entry``, ``pool_keys``, ``require_mode``, ``tier_names``,
  ``reply_tiers``, ``done_or_pending``: steps every verb family takes; none
  changes anything but what it says.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.protocol import DEFAULT_MAX_PAYLOAD_BYTES, ErrorCode, ProtocolError, ReplyMessage, Request, pack_tiers
from kvtier.daemon.access.auth_limits import AuthFailureLimiter
from kvtier.daemon.access.connections import Peer
from kvtier.daemon.clients.lends import LendTable
from kvtier.daemon.clients.pin_releases import PinReleases
from kvtier.daemon.clients.sessions import Closeable, Session, SessionTable
from kvtier.daemon.pooling.pools import PoolEntry, PoolRegistry
from kvtier.daemon.telemetry.metrics import Counters
from kvtier.daemon.tenancy.tenants import TenantRegistry
from kvtier.tiers.pool import Op, Tier

__all__ = ["LOOP_COPY_MAX_BYTES", "HandlerContext", "KvImporter", "OpenHandler", "Pending", "Reply", "Result",
           "SessionHandler",
           "done_or_pending", "pool_entry", "pool_keys", "reply_tiers", "require_mode", "tier_names"]


@dataclass
class Reply:
    # The result fields (the server adds the envelope), or the whole typed reply, envelope included
    # (encoded as it is: no map built per request).
    fields: dict[str, Any] | ReplyMessage = field(default_factory=dict)
    frames: list[Any] = field(default_factory=list)
    # Called on the loop thread once ZMQ no longer reads ``frames`` (sent,
    # dropped, or the daemon stopped): frames that lend memory return it here.
    on_sent: Callable[[], None] | None = None


@dataclass
class Pending:
    op: Op
    finish: Callable[[Op], Reply]
    on_error: Callable[[Op], None] | None = None
    keep: Any = None
    # Payload bytes the reply will carry. They count against the connection's
    # unread budget while the copy runs: a client that sends restores faster
    # than their copies finish (a GPU tier's blocks are copied, never lent)
    # must not park unbounded replies the budget never saw.
    reply_bytes: int = 0


Result = Reply | Pending

# Restores into client memory up to this size are lent in place and copied by the loop itself
# (daemon.planes.lent); larger ones go through a copy worker.
LOOP_COPY_MAX_BYTES = 64 << 20

# desc -> (tensor, handle to close when the registration goes)
KvImporter = Callable[[dict[str, Any]], tuple[Any, Closeable]]


@dataclass
class HandlerContext:
    pools: PoolRegistry
    sessions: SessionTable
    metrics: Counters
    kv_import: KvImporter
    default_lease_s: float
    max_lease_s: float
    heartbeat_s: float | None = None
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    detach_timeout_s: float = 10.0
    started_s: float = field(default_factory=time.monotonic)
    draining: bool = False
    tenants: TenantRegistry = field(default_factory=TenantRegistry)
    # CURVE User-Id of the connection the request being handled came on
    # (None without CURVE); set by the server before each dispatch.
    peer: str | None = None
    # uid of the local (ipc) process the request came from (SO_PEERCRED); None over tcp.
    peer_uid: int | None = None
    # hello only: the connection's peer (uid on ipc, IP address on tcp), whose wrong tokens are counted.
    auth_peer: Peer = None
    auth_failures: AuthFailureLimiter | None = None  # None: tokens may be tried without limit
    # Shared-memory files (arenas, KV tensors) mapped by sessions: (st_dev, st_ino)
    # -> the session that owns the file; only it may map it, only its end unlinks it.
    file_owner: dict[tuple[int, int], str] = field(default_factory=dict)
    files_mapped: int = 0  # mappings held by all sessions: one descriptor each
    max_shm_files_per_session: int = 1024
    max_registrations_per_session: int = 64
    max_pinned_share: float = 0.5  # of a pool's blocks: pins of one session, and of one tenant's sessions
    max_shm_files_total: int = 4096  # the server sets it below RLIMIT_NOFILE
    pin_releases: PinReleases = field(default_factory=PinReleases)  # tags released, by which request
    # Restores into client memory up to this size are lent in place (daemon.planes.lent); 0: none (the test seam's).
    lend_restore_max_bytes: int = LOOP_COPY_MAX_BYTES
    lends: LendTable = field(default_factory=LendTable)  # CPU-tier slots lent to same-user clients (daemon.clients.lends)


def pool_entry(ctx: HandlerContext, session: Session) -> PoolEntry:
    return ctx.pools.get(session.pool_name)  # the pool's key, never ambiguous between tenants


def require_mode(entry: PoolEntry, mode: str, op: str) -> None:
    if entry.mode != mode:
        raise ProtocolError(ErrorCode.WRONG_MODE,
                            f"{op} needs a {mode}-mode pool; pool {entry.bare_name!r} is {entry.mode}-mode")


def pool_keys(ctx: HandlerContext, session: Session, hashes: Sequence[bytes]) -> list[bytes]:
    """The pool keys of a session's block hashes: its tenant's namespace (the only way hashes reach a pool)."""
    return ctx.tenants.namespace(session.tenant, hashes)


def tier_names(tiers: Sequence[Any]) -> list[str]:
    # Tier is a str enum: _value_ is the plain string, without enum.__get__ per element.
    return [t._value_ if isinstance(t, Tier) else str(t) for t in tiers]


def reply_tiers(req: Request, tiers: Sequence[Any]) -> bytes | list[str]:
    # Packed straight from the Tier members: no string per block on that path.
    return pack_tiers(tiers) if req.packed else tier_names(tiers)


def done_or_pending(op: Op, finish: Callable[[Op], Reply], **kw: Any) -> Result:
    # An op with nothing to copy is already done; reply at once.
    if op.done and op.error is None:
        return finish(op)
    return Pending(op, finish, **kw)


SessionHandler = Callable[[HandlerContext, Request, Session], Result]
OpenHandler = Callable[[HandlerContext, Request], Result]
