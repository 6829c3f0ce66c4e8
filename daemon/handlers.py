"""Request handlers: the dispatch table, one function per protocol verb, and what they check.

Verb families live by concern: the client-memory verbs (``attach_arena``,
``register_kv``, ``unregister_kv``) in ``daemon.handling.session_memory``, ``stats``
in ``daemon.handling.stats_verbs``; ``store`` and ``restore`` check what every plane
shares and hand the rest to their data plane (``daemon.planes``, one
implementation per plane, chosen from ``PLANES`` by the request's
``plane``). The types handlers share (``Reply``, ``Pending``,
``HandlerContext``) are in ``daemon.handling.handler_context``.

Contract:

- ``SESSION_HANDLERS[op](ctx, req, session) -> Reply | Pending`` for the verbs
  that need a session (``OPS[op].session == "required"``): ``session`` is the
  request's session, already looked up and, for verbs that renew the lease,
  renewed by the server, which answers the error itself when there is none.
  ``OPEN_HANDLERS[op](ctx, req)`` for the verbs that need none (``hello``,
  ``stats``, ``health``). Every op of ``OPS`` is in exactly one table, the one
  its ``session`` says (checked on import).
- A handler validates everything it can before it changes anything (plan,
  then apply): when it raises, nothing changed. It raises ``ProtocolError``
  for its own refusals and lets the pool's ``NoSpace`` / ``NotFound`` /
  ``PoolError`` through; the server maps them to error replies.
- A handler never waits for a copy. When the pool returns an ``Op`` that is
  still in flight the handler returns ``Pending``: the server parks it and
  sends ``finish(op)``'s reply when the op is done (or an error reply when
  the op failed, after calling ``on_error``). ``keep`` holds buffers the
  copy reads or writes (ZMQ frames, staging tensors) alive until then.
- Tenants: ``hello`` resolves the session's tenant first (UNAUTHORIZED
  creates nothing; a peer's wrong tokens are rate-limited, past the limit
  TOO_MANY_AUTH_FAILURES without a look at the token: ``daemon.access.auth_limits``),
  then checks ``max_sessions`` (TOO_MANY_SESSIONS); every block hash a client sends reaches a pool only
  through ``pool_keys`` (the tenant's namespace, ``daemon.tenancy.tenants``), and no
  reply carries a pool key. ``clear`` and the ``tenants`` part of ``stats``
  are per tenant. ``events`` (which does reply with pool keys: the hashes
  themselves without tenants) is refused to tenants' sessions.
- Pool names are per tenant (``daemon.pooling.pools``): a session works in its own
  tenant's pool of the name its hello sent, and every reply and error names
  a pool by that bare name. Only the operator's view (``_viewer`` None:
  ``stats``, ``health``) names pools by their keys, ``"<tenant>/<name>"``
  with tenants, so two tenants' same-named pools stay apart there; each
  pool's ``stats`` entry also says its ``tenant`` and bare ``name`` then.
- Deadlines (``daemon.shared_memory.deadlines``): a store or restore that names its
  client's deadline reads or writes that client's memory only before it;
  past it the reply is DEADLINE_EXCEEDED and nothing was stored or written.
- Pin tags released (``daemon.clients.pin_releases``): a pinning ``lookup`` or
  ``pin`` under a tag, sent before the ``unpin`` that released the tag (a
  lower request id) and read after it, pins nothing (``pinned`` 0, no
  ``tiers`` for ``pin``): a connection the client gave up must not leave
  pins it never heard of (``pins_after_release_total``).
- Packed in, packed out: a request whose hashes came packed
  (``Request.packed``) gets its reply's ``tiers`` as packed codes
  (``protocol.pack_tiers``); lookup and pin pack the pool's tiers directly,
  allocate and restore through ``_packs_tiers``.
- Tier names: a disk-tier block is ``"disk"`` only to a session whose hello
  named feature ``"disk_tier"``; to others it is ``"remote"`` (a tier below
  the CPU tier, as they know it), and allocate's ``num_disk_hits`` counts
  in ``num_remote_hits`` (``_names_disk``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence

from kvtier.client.protocol import (
    EVENT_REMOVED,
    EVENT_STORED,
    FEATURE_DISK_TIER,
    FEATURE_LEND,
    FEATURES,
    MAX_HASHES,
    MAX_HEADER_BYTES,
    OPS,
    PROTOCOL_VERSION,
    TIER_CODES,
    ErrorCode,
    LookupReply,
    ProtocolError,
    Request,
    pack_tiers,
)
from kvtier.client.shared_clock import daemon_clock
from kvtier.tiers.version import kvtier_version
from kvtier.daemon.shared_memory import deadlines
from kvtier.daemon.handling.handler_context import (
    LOOP_COPY_MAX_BYTES,
    HandlerContext,
    KvImporter,
    OpenHandler,
    Pending,
    Reply,
    Result,
    SessionHandler,
    done_or_pending,
    pool_entry,
    pool_keys,
    reply_tiers,
    require_mode,
)
from kvtier.daemon.clients.hints import request_hints
from kvtier.daemon.clients.sessions import Session
from kvtier.daemon.handling.session_memory import attach_arena, register_kv, unregister_kv
from kvtier.daemon.handling.stats_verbs import sees, stats, stats_fields, viewer_of
from kvtier.daemon.planes import PlaneCall, plane_for
from kvtier.daemon.pooling.pools import PoolEntry
from kvtier.daemon.tenancy.tenants import ANONYMOUS
from kvtier.tiers.pool import Op, Tier
from kvtier.tiers.pool.journal import REMOVED, STORED

# Re-exported: the server, the parking lot and tests take them from here.
__all__ = ["DAEMON_VERSION", "LOOP_COPY_MAX_BYTES", "OPEN_HANDLERS", "SESSION_HANDLERS", "HandlerContext", "KvImporter",
           "OpenHandler", "Pending", "Reply", "Result", "SessionHandler", "stats_fields"]

log = logging.getLogger(__name__)

DAEMON_VERSION = kvtier_version()  # the package metadata (kvtier.tiers.version)

# ---- session verbs -----------------------------------------------------------


def _resolve_tenant(ctx: HandlerContext, token: str | None) -> str:
    """``tenants.resolve``, with the peer's wrong tokens limited (``daemon.access.auth_limits``)."""
    limiter = ctx.auth_failures
    if token is None or limiter is None or not ctx.tenants.enabled:
        return ctx.tenants.resolve(ctx.peer, token)
    wait_s = limiter.wait_s(ctx.auth_peer)
    if wait_s > 0:
        # Refused untried: a guess made now can never be right.
        raise ProtocolError(ErrorCode.TOO_MANY_AUTH_FAILURES,
                            f"too many wrong tenant tokens from this peer (max_auth_failures_per_minute "
                            f"{limiter.per_minute}); try again in {wait_s:.1f} s")
    try:
        return ctx.tenants.resolve(ctx.peer, token)
    except ProtocolError as exc:
        if exc.code == ErrorCode.UNAUTHORIZED:
            limiter.failed(ctx.auth_peer)
        raise


def hello(ctx: HandlerContext, req: Request) -> Result:
    if ctx.draining:
        raise ProtocolError(ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
    f = req.msg
    # Who it is comes first: an unauthorised hello must not create a pool,
    # and the pool it opens is that tenant's of that name (no one else's).
    tenant = _resolve_tenant(ctx, f.token)
    ctx.sessions.check_room()  # before a pool is created for a session that cannot open
    entry = ctx.pools.get_or_create(f.pool, f.layout.to_dict(), tenant=tenant)
    lease_s = min(f.lease_s or ctx.default_lease_s, ctx.max_lease_s)
    # The session remembers the pool's key: every later verb reaches this very pool.
    new = ctx.sessions.open(entry.name, f.client, lease_s, tenant=tenant, peer=ctx.peer, uid=ctx.peer_uid)
    new.reads_disk_tier = FEATURE_DISK_TIER in (f.features or ())
    entry.sessions.add(new.sid)
    entry.idle_since_s = None
    log.info("session %s opened on pool %r by %r (lease %.1fs%s)", new.sid[:8], entry.name, f.client, lease_s,
             f", tenant {tenant!r}" if tenant != ANONYMOUS else "")
    pool = entry.pool
    return Reply(
        {
            "sid": new.sid,
            "lease_s": lease_s,
            "heartbeat_s": min(ctx.heartbeat_s or lease_s / 3, lease_s / 3),
            "protocol_version": PROTOCOL_VERSION,
            "daemon_version": DAEMON_VERSION,
            "features": list(FEATURES) + ([FEATURE_LEND] if ctx.lends.may_lend(new) else []),
            "clock": daemon_clock(),
            "pool": {
                "name": entry.bare_name,
                "mode": entry.mode,
                "block_bytes": entry.block_bytes,
                "gpu_blocks": pool.gpu_blocks,
                "cpu_blocks": pool.cpu_blocks,
            },
            "limits": {
                "max_header_bytes": MAX_HEADER_BYTES,
                "max_payload_bytes": ctx.max_payload_bytes,
                "max_hashes": MAX_HASHES,
            },
        }
    )


def heartbeat(ctx: HandlerContext, req: Request, session: Session) -> Result:
    return Reply({"lease_s": session.lease_s})


def bye(ctx: HandlerContext, req: Request, session: Session) -> Result:
    ctx.sessions.end(session, "bye")
    return Reply()



# ---- lookups and pins --------------------------------------------------------


def lookup(ctx: HandlerContext, req: Request, session: Session) -> Result:
    entry = pool_entry(ctx, session)
    pool = entry.pool
    hashes = pool_keys(ctx, session, req.msg.hashes)
    tiers = pool.lookup(hashes, hints=request_hints(req.msg.hints, session, entry, len(hashes), ctx.metrics))
    ctx.tenants.note_lookup(session.tenant, len(hashes), tiers)
    pinned = 0
    if req.msg.pin and not _released(ctx, req, session):
        if tiers:
            _check_pins(ctx, session, entry, len(tiers))
            # Same thread, no copy in between: the pinned prefix is the one looked up.
            tiers = _pin(session, entry, hashes[: len(tiers)], req.msg.pin_tag)
        pinned = len(tiers)
    # Typed: the server encodes it as it is, with one reusable encoder (protocol.encode_reply).
    return Reply(LookupReply(v=PROTOCOL_VERSION, id=req.id, ok=True, tiers=reply_tiers(req, tiers), pinned=pinned))


def pin(ctx: HandlerContext, req: Request, session: Session) -> Result:
    entry = pool_entry(ctx, session)
    hashes = pool_keys(ctx, session, req.msg.hashes)
    if _released(ctx, req, session):
        return Reply({"tiers": reply_tiers(req, [])})
    _check_pins(ctx, session, entry, len(entry.pool.lookup(hashes, count=False)))
    tiers = _pin(session, entry, hashes, req.msg.pin_tag)
    return Reply({"tiers": reply_tiers(req, tiers)})


def _released(ctx: HandlerContext, req: Request, session: Session) -> bool:
    """Whether this pinning request was sent before its tag's release (see the module docstring)."""
    tag = req.msg.pin_tag
    if tag is None or not ctx.pin_releases.stale(session.sid, tag, req.id):
        return False
    ctx.metrics.inc("pins_after_release_total")
    return True


def _pin(session: Session, entry: PoolEntry, keys: Sequence[bytes], tag: str | None) -> list[Tier]:
    """Pin the held prefix of ``keys`` for the session (under ``tag``): the session's counts follow."""
    tiers = entry.pool.pin(session.pin_owner(tag), keys)
    session.num_pins += len(tiers)
    if tag is not None and tiers:
        session.pin_tags[tag] = session.pin_tags.get(tag, 0) + len(tiers)
    return tiers


def _check_pins(ctx: HandlerContext, session: Session, entry: PoolEntry, more: int) -> None:
    """Refuse (before pinning anything) pins past the session's, or its tenant's, share of the pool."""
    cap = int(entry.capacity_blocks * ctx.max_pinned_share)
    if session.num_pins + more > cap:
        raise ProtocolError(ErrorCode.TOO_MANY_PINS,
                            f"this session would hold {session.num_pins + more} pinned blocks; a session may pin "
                            f"{cap} (max_pinned_share {ctx.max_pinned_share:g} of the pool's "
                            f"{entry.capacity_blocks} blocks): unpin first")
    if session.tenant == ANONYMOUS:
        return  # no tenants: one owner, whose sessions share the pool as they see fit
    # pool_name is the pool's key: the same pool, and (the key says whose) the same tenant's sessions.
    mine = sum(s.num_pins for s in ctx.sessions if s.tenant == session.tenant and s.pool_name == session.pool_name)
    if mine + more > cap:
        raise ProtocolError(ErrorCode.TOO_MANY_PINS,
                            f"tenant {session.tenant!r} would hold {mine + more} pinned blocks in this pool; a tenant "
                            f"may pin {cap} (max_pinned_share {ctx.max_pinned_share:g} of the pool's "
                            f"{entry.capacity_blocks} blocks): unpin first")


def unpin(ctx: HandlerContext, req: Request, session: Session) -> Result:
    """Drop pins on ``hashes`` (the tag's, with ``pin_tag``), or, with ``pin_tag`` alone, every pin of the tag:
    those whose replies the client never read too (a lost reply, a resent lookup)."""
    f = req.msg
    tag, hashes = f.pin_tag, f.hashes
    if hashes is None and tag is None:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "unpin needs 'hashes', or 'pin_tag' alone to drop every pin of a tag")
    pool = pool_entry(ctx, session).pool
    owner = session.pin_owner(tag)
    n = pool.unpin_all(owner) if hashes is None else pool.unpin(owner, pool_keys(ctx, session, hashes))
    if hashes is None:
        ctx.pin_releases.release(session.sid, tag, req.id)
    session.num_pins -= n
    if tag is not None:
        left = session.pin_tags.get(tag, 0) - n
        if hashes is None or left <= 0:
            session.pin_tags.pop(tag, None)
        else:
            session.pin_tags[tag] = left
    return Reply({"unpinned": n})


# ---- engine-managed mode -----------------------------------------------------


def allocate(ctx: HandlerContext, req: Request, session: Session) -> Result:
    entry = pool_entry(ctx, session)
    require_mode(entry, "engine", "allocate")
    f = req.msg
    hashes = pool_keys(ctx, session, f.hashes)
    op = entry.pool.allocate(session.pool_request_id(f.req), hashes, f.num_tokens,
                             hints=request_hints(f.hints, session, entry, len(hashes), ctx.metrics))
    ctx.tenants.note_lookup(session.tenant, len(hashes), op.result["tiers"])
    session.requests.add(f.req)

    def failed(_op: Op) -> None:
        session.requests.discard(f.req)  # the pool freed it when the restore failed

    return done_or_pending(op, lambda o: Reply(dict(o.result)), on_error=failed)


def append(ctx: HandlerContext, req: Request, session: Session) -> Result:
    entry = pool_entry(ctx, session)
    require_mode(entry, "engine", "append")
    f = req.msg
    if f.req not in session.requests:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no request {f.req!r} in this session")
    op = entry.pool.append(session.pool_request_id(f.req), f.num_tokens, pool_keys(ctx, session, f.hashes))
    return done_or_pending(op, lambda o: Reply(dict(o.result)))


def free(ctx: HandlerContext, req: Request, session: Session) -> Result:
    entry = pool_entry(ctx, session)
    require_mode(entry, "engine", "free")
    name = req.msg.req
    if name not in session.requests:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no request {name!r} in this session")
    entry.pool.free(session.pool_request_id(name), valid_tokens=req.msg.valid_tokens)
    session.requests.discard(name)
    return Reply()


# ---- store mode: the data planes ---------------------------------------------


def _plane_call(ctx: HandlerContext, req: Request, session: Session, op: str) -> PlaneCall:
    """What every store and restore checks before its plane does (see ``daemon.planes``)."""
    entry = pool_entry(ctx, session)
    require_mode(entry, "store", op)
    deadlines.check_arrival(req.msg.deadline_ns, op)
    return PlaneCall(ctx, req, session, entry, pool_keys(ctx, session, req.msg.hashes))


def store(ctx: HandlerContext, req: Request, session: Session) -> Result:
    call = _plane_call(ctx, req, session, "store")
    if len(set(call.hashes)) != len(call.hashes):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "'hashes' names a hash twice")
    return plane_for(req.msg.plane).store(call)


def restore(ctx: HandlerContext, req: Request, session: Session) -> Result:
    msg = req.msg
    if msg.release:
        ctx.lends.release(session.sid, msg.release)  # release_lends sent along (the client copied them)
    return plane_for(msg.plane).restore(_plane_call(ctx, req, session, "restore"))


def release_lends(ctx: HandlerContext, req: Request, session: Session) -> Result:
    return Reply({"released": ctx.lends.release(session.sid, req.msg.ids)})


# ---- daemon-wide -------------------------------------------------------------


def health(ctx: HandlerContext, req: Request) -> Result:
    viewer = viewer_of(ctx, req)
    return Reply(
        {
            "status": "draining" if ctx.draining else "ok",
            "uptime_s": round(time.monotonic() - ctx.started_s, 3),
            # Counted in the asker's view too: another tenant's pools and sessions, even
            # as a number, would tell a tenant when they come and go.
            "pools": sum(1 for e in ctx.pools if sees(viewer, e.tenant)),
            "sessions": sum(1 for s in ctx.sessions if sees(viewer, s.tenant)),
            "protocol_version": PROTOCOL_VERSION,
            "daemon_version": DAEMON_VERSION,
            "pid": os.getpid(),
            # Per pool with a remote tier: is it reachable now (the daemon
            # serves the GPU and CPU tiers either way and reconnects alone).
            # The operator's view names pools by key; a tenant's, its own by their bare names.
            "remote": {(e.name if viewer is None else e.bare_name): bool(e.pool.remote.available) for e in ctx.pools
                       if e.pool.remote is not None and sees(viewer, e.tenant)},
            # Likewise per pool with a disk tier: open and not resting after an I/O error.
            "disk": {(e.name if viewer is None else e.bare_name): bool(e.pool.disk.available) for e in ctx.pools
                     if e.pool.disk is not None and sees(viewer, e.tenant)},
        }
    )


def clear(ctx: HandlerContext, req: Request, session: Session) -> Result:
    pool = pool_entry(ctx, session).pool
    # A tenant clears its own blocks only; without tenants, the whole pool.
    n = pool.clear() if session.tenant == ANONYMOUS else ctx.tenants.clear(pool, session.tenant)
    log.info("session %s cleared pool %r: %d blocks dropped", session.sid[:8], session.pool_name, n)
    return Reply({"cleared": n})


EVENT_KIND_CODES = {STORED: EVENT_STORED[0], REMOVED: EVENT_REMOVED[0]}


def events(ctx: HandlerContext, req: Request, session: Session) -> Result:
    if session.tenant != ANONYMOUS:
        # A tenant's pool keys are one-way digests of its hashes (daemon.tenancy.tenants):
        # they could not be handed back as the hashes it knows.
        raise ProtocolError(ErrorCode.INVALID_STATE, "events are not served to tenants' sessions")
    journal = pool_entry(ctx, session).pool.journal
    if journal is None:
        raise ProtocolError(ErrorCode.INVALID_STATE, f"pool {session.pool_name!r} keeps no key journal")
    f = req.msg
    found, nxt, lost = journal.since(f.since, f.max_events)
    return Reply({"kinds": bytes(EVENT_KIND_CODES[kind] for kind, _ in found),
                  "hashes": b"".join(key for _, key in found), "next": nxt, "lost": lost})


def _packs_tiers(handler: SessionHandler) -> SessionHandler:
    """Packed in, packed out for a verb whose reply's ``tiers`` the pool builds as
    strings: packs them after the handler (or its ``Pending.finish``), so the
    handler itself stays as it is."""

    @functools.wraps(handler)
    def packing(ctx: HandlerContext, req: Request, session: Session) -> Result:
        result = handler(ctx, req, session)
        if not req.packed:
            return result
        if isinstance(result, Reply):
            return _pack_reply_tiers(result)
        finish = result.finish
        result.finish = lambda op: _pack_reply_tiers(finish(op))
        return result

    return packing


def _pack_reply_tiers(reply: Reply) -> Reply:
    fields = reply.fields
    if isinstance(fields, dict) and "tiers" in fields:
        fields["tiers"] = pack_tiers(fields["tiers"])
    return reply


def _names_disk(handler: SessionHandler) -> SessionHandler:
    """A verb whose reply lists tiers, for sessions that did not name feature "disk_tier" in hello:
    disk-tier blocks are "remote" to them (see the contract). Costs nothing in a pool without a disk tier."""

    @functools.wraps(handler)
    def naming(ctx: HandlerContext, req: Request, session: Session) -> Result:
        result = handler(ctx, req, session)
        if session.reads_disk_tier:
            return result
        entry = ctx.pools.find(session.pool_name)
        if entry is None or entry.pool.disk is None:
            return result
        if isinstance(result, Reply):
            return _disk_as_remote(result)
        finish = result.finish
        result.finish = lambda op: _disk_as_remote(finish(op))
        return result

    return naming


def _disk_as_remote(reply: Reply) -> Reply:
    fields = reply.fields
    if isinstance(fields, LookupReply):
        fields.tiers = _tiers_as_remote(fields.tiers)
        return reply
    assert isinstance(fields, dict)
    tiers = fields.get("tiers")
    if tiers:
        fields["tiers"] = _tiers_as_remote(tiers)
    if "num_disk_hits" in fields:
        fields["num_remote_hits"] = fields.get("num_remote_hits", 0) + fields.pop("num_disk_hits")
    return reply


def _tiers_as_remote(tiers: bytes | list[str]) -> bytes | list[str]:
    if isinstance(tiers, bytes):
        return tiers.replace(_DISK_CODE, _REMOTE_CODE)
    return ["remote" if t == "disk" else t for t in tiers]


_DISK_CODE, _REMOTE_CODE = TIER_CODES["disk"], TIER_CODES["remote"]


# The verbs that need a session: the server resolves it before it calls one.
SESSION_HANDLERS: dict[str, SessionHandler] = {
    "heartbeat": heartbeat,
    "bye": bye,
    "attach_arena": attach_arena,
    "register_kv": register_kv,
    "unregister_kv": unregister_kv,
    "lookup": _names_disk(lookup),
    "pin": _names_disk(pin),
    "unpin": unpin,
    "allocate": _names_disk(_packs_tiers(allocate)),
    "append": append,
    "free": free,
    "store": store,
    "restore": _names_disk(_packs_tiers(restore)),
    "clear": clear,
    "events": events,
    "release_lends": release_lends,
}

# The verbs that need none (stats and health may name one: whose view they get, viewer_of).
OPEN_HANDLERS: dict[str, OpenHandler] = {
    "hello": hello,
    "stats": stats,
    "health": health,
}


def _check_tables() -> None:
    """Each op in the table its spec's ``session`` says: the server picks the table, the decoder checks ``sid``."""
    needs = {op for op, spec in OPS.items() if spec.session == "required"}
    if set(SESSION_HANDLERS) != needs or set(OPEN_HANDLERS) != set(OPS) - needs:
        raise RuntimeError(f"handler tables disagree with OPS: session verbs {sorted(SESSION_HANDLERS)}, "
                           f"open verbs {sorted(OPEN_HANDLERS)}, OPS needs a session for {sorted(needs)}")


_check_tables()
