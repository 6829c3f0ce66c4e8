"""Request handlers: one function per protocol verb.

Contract:

- ``HANDLERS[op](ctx, req, session) -> Reply | Pending``. ``session`` is the
  request's session (already looked up and, for verbs that renew the lease,
  renewed by the server) or None for verbs that have none.
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
  TOO_MANY_AUTH_FAILURES without a look at the token: ``daemon.auth_limits``),
  then checks ``max_sessions`` (TOO_MANY_SESSIONS); every block hash a client sends reaches a pool only
  through ``_keys`` (the tenant's namespace, ``daemon.tenants``), and no
  reply carries a pool key. ``clear`` and the ``tenants`` part of ``stats``
  are per tenant. ``events`` (which does reply with pool keys: the hashes
  themselves without tenants) is refused to tenants' sessions.
- Pool names are per tenant (``daemon.pools``): a session works in its own
  tenant's pool of the name its hello sent, and every reply and error names
  a pool by that bare name. Only the operator's view (``_viewer`` None:
  ``stats``, ``health``) names pools by their keys, ``"<tenant>/<name>"``
  with tenants, so two tenants' same-named pools stay apart there; each
  pool's ``stats`` entry also says its ``tenant`` and bare ``name`` then.
- Deadlines (``daemon.deadlines``): a store or restore that names its
  client's deadline reads or writes that client's memory only before it;
  past it the reply is DEADLINE_EXCEEDED and nothing was stored or written.
- Pin tags released (``daemon.pin_releases``): a pinning ``lookup`` or
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.protocol import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    EVENT_REMOVED,
    EVENT_STORED,
    FEATURE_DISK_TIER,
    FEATURE_LEND,
    FEATURES,
    MAX_HASHES,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    TIER_CODES,
    ErrorCode,
    ProtocolError,
    Request,
    frame_nbytes,
    pack_tiers,
)
from kvtier.client.shared_clock import daemon_clock
from kvtier.client.shm_arena import ShmAccessError, ShmArena, ShmArenaError, ShmSparseError
from kvtier.daemon import client_memory, deadlines
from kvtier.daemon.auth_limits import AuthFailureLimiter
from kvtier.daemon.connections import Peer
from kvtier.daemon.hints import request_hints
from kvtier.daemon.kv_import import KvShareAccessError, KvShareSparseError
from kvtier.daemon.lends import LendTable
from kvtier.daemon.metrics import Counters
from kvtier.daemon.pin_releases import PinReleases
from kvtier.daemon.pools import PoolEntry, PoolRegistry
from kvtier.daemon.sessions import Closeable, Registration, Session, SessionTable
from kvtier.daemon.tenants import ANONYMOUS, TenantRegistry
from kvtier.tiers.layout import BlockLayout
from kvtier.tiers.pool import Op, Tier
from kvtier.tiers.pool.journal import REMOVED, STORED

log = logging.getLogger(__name__)

DAEMON_VERSION = "0.1.0"


@dataclass
class Reply:
    fields: dict[str, Any] = field(default_factory=dict)
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
    lends: LendTable = field(default_factory=LendTable)  # CPU-tier slots lent to same-user clients (daemon.lends)


def _entry(ctx: HandlerContext, session: Session) -> PoolEntry:
    return ctx.pools.get(session.pool_name)  # the pool's key, never ambiguous between tenants


def _require_mode(entry: PoolEntry, mode: str, op: str) -> None:
    if entry.mode != mode:
        raise ProtocolError(ErrorCode.WRONG_MODE,
                            f"{op} needs a {mode}-mode pool; pool {entry.bare_name!r} is {entry.mode}-mode")


def _keys(ctx: HandlerContext, session: Session, hashes: Sequence[bytes]) -> list[bytes]:
    """The pool keys of a session's block hashes: its tenant's namespace (the only way hashes reach a pool)."""
    return ctx.tenants.namespace(session.tenant, hashes)


def _tiers(tiers: Sequence[Any]) -> list[str]:
    # Tier is a str enum: _value_ is the plain string, without enum.__get__ per element.
    return [t._value_ if isinstance(t, Tier) else str(t) for t in tiers]


def _reply_tiers(req: Request, tiers: Sequence[Any]) -> bytes | list[str]:
    # Packed straight from the Tier members: no string per block on that path.
    return pack_tiers(tiers) if req.packed else _tiers(tiers)


def _done_or_pending(op: Op, finish: Callable[[Op], Reply], **kw: Any) -> Result:
    # An op with nothing to copy is already done; reply at once.
    if op.done and op.error is None:
        return finish(op)
    return Pending(op, finish, **kw)


# ---- session verbs -----------------------------------------------------------


def _resolve_tenant(ctx: HandlerContext, token: str | None) -> str:
    """``tenants.resolve``, with the peer's wrong tokens limited (``daemon.auth_limits``)."""
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


def hello(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    if ctx.draining:
        raise ProtocolError(ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
    f = req.fields
    # Who it is comes first: an unauthorised hello must not create a pool,
    # and the pool it opens is that tenant's of that name (no one else's).
    tenant = _resolve_tenant(ctx, f["token"])
    ctx.sessions.check_room()  # before a pool is created for a session that cannot open
    entry = ctx.pools.get_or_create(f["pool"], f["layout"], tenant=tenant)
    lease_s = min(f["lease_s"] or ctx.default_lease_s, ctx.max_lease_s)
    # The session remembers the pool's key: every later verb reaches this very pool.
    new = ctx.sessions.open(entry.name, f["client"], lease_s, tenant=tenant, peer=ctx.peer, uid=ctx.peer_uid)
    new.reads_disk_tier = FEATURE_DISK_TIER in (f["features"] or ())
    entry.sessions.add(new.sid)
    entry.idle_since_s = None
    log.info("session %s opened on pool %r by %r (lease %.1fs%s)", new.sid[:8], entry.name, f["client"], lease_s,
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


def heartbeat(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    return Reply({"lease_s": session.lease_s})


def bye(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    ctx.sessions.end(session, "bye")
    return Reply()


def attach_arena(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    f = req.fields
    entry = _entry(ctx, session)
    if session.arena is not None:
        raise ProtocolError(ErrorCode.INVALID_STATE, "this session already has an arena")
    if f["slot_bytes"] != entry.block_bytes:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"slot_bytes {f['slot_bytes']} != pool block_bytes {entry.block_bytes}")
    _check_file_budget(ctx, session, 1)
    try:
        arena = ShmArena.attach(f["name"], f["num_slots"], f["slot_bytes"])
    except ShmAccessError as exc:
        raise ProtocolError(ErrorCode.ACCESS_DENIED, str(exc)) from None
    except ShmSparseError as exc:
        raise ProtocolError(ErrorCode.SPARSE_FILE, str(exc)) from None
    except ShmArenaError as exc:
        raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None
    try:
        _claim_files(ctx, session, [(arena.inode, arena.file_uid)], f"arena {f['name']}")
    except BaseException:
        arena.close()
        raise
    layout = BlockLayout.from_buffer(arena.buffer, arena.num_slots, arena.slot_bytes)
    session.arena = (arena, layout)
    return Reply({"num_slots": arena.num_slots})


def register_kv(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    f = req.fields
    entry = _entry(ctx, session)
    name = f["name"]
    if name in session.registrations:
        raise ProtocolError(ErrorCode.INVALID_STATE, f"registration {name!r} exists in this session")
    if entry.mode == "engine" and entry.gpu_owner is not None:
        raise ProtocolError(ErrorCode.INVALID_STATE, f"pool {entry.bare_name!r} already has a GPU tier registered")
    if len(session.registrations) >= ctx.max_registrations_per_session:
        raise ProtocolError(ErrorCode.TOO_MANY_REGISTRATIONS,
                            f"this session holds {len(session.registrations)} registrations, the most one may "
                            f"(max_registrations_per_session); unregister_kv one first")
    # Each shm tensor maps its file once (one descriptor): counted before any is opened.
    _check_file_budget(ctx, session, sum(1 for item in f["tensors"]
                                         if isinstance(item.get("desc"), dict) and item["desc"].get("transport") == "shm"))
    tensors: list[Any] = []
    handles: list[Closeable] = []
    files: list[tuple[tuple[int, int], int]] = []
    claimed = False
    try:
        for i, item in enumerate(f["tensors"]):
            try:
                tensor, handle = ctx.kv_import(item["desc"])
            except KvShareAccessError as exc:
                raise ProtocolError(ErrorCode.ACCESS_DENIED, f"tensors[{i}].desc: {exc}") from None
            except KvShareSparseError as exc:
                raise ProtocolError(ErrorCode.SPARSE_FILE, f"tensors[{i}].desc: {exc}") from None
            except (ValueError, TypeError, KeyError, OSError, RuntimeError) as exc:
                raise ProtocolError(ErrorCode.INVALID_FIELD, f"tensors[{i}].desc: {exc}") from None
            tensors.append(tensor)
            handles.append(handle)
        try:
            layout = BlockLayout(tensors, [item["block_dim"] for item in f["tensors"]])
        except (ValueError, IndexError) as exc:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"tensors: {exc}") from None
        if layout.block_bytes != entry.block_bytes:
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"registered tensors hold {layout.block_bytes} bytes per block, pool blocks are {entry.block_bytes}",
            )
        for handle in handles:
            files.extend(getattr(handle, "files", ()))
        _claim_files(ctx, session, files, f"registration {name!r}")
        claimed = True
        reg = Registration(name, layout, handles, files=files)
        if entry.mode == "engine":
            ctx.pools.attach_engine_gpu(entry, (session.sid, name), layout)
            reg.attached_gpu = True
    except BaseException:
        if claimed:
            _release_files(ctx, session, files)
        for handle in handles:
            handle.close()
        raise
    session.registrations[name] = reg
    log.info("session %s registered %r: %d tensors, %d blocks", session.sid[:8], name, len(tensors), layout.num_blocks)
    return Reply({"num_blocks": layout.num_blocks, "gpu_tier": reg.attached_gpu})


def release_registration(ctx: HandlerContext, session: Session, reg: Registration) -> None:
    """Forget a registration; in engine mode its tensors stop being the GPU tier."""
    entry = ctx.pools.get(session.pool_name)
    if reg.attached_gpu:
        # The GPU tier goes with every request in it, this session's included.
        ctx.pools.detach_engine_gpu(entry, (session.sid, reg.name), ctx.detach_timeout_s)
        session.requests.clear()
    _release_files(ctx, session, reg.files)
    reg.files = []
    reg.close()


def release_arena(ctx: HandlerContext, session: Session, *, unlink: bool) -> None:
    """Unmap a session's arena; with ``unlink``, remove its file too, if this session (still) owns it."""
    if session.arena is None:
        return
    arena, _layout = session.arena
    session.arena = None
    owned = arena.inode is not None and ctx.file_owner.get(arena.inode) == session.sid
    if arena.inode is not None:
        _release_files(ctx, session, [(arena.inode, arena.file_uid)])
    arena.close()
    if unlink and owned:
        try:
            arena.unlink()
        except PermissionError:
            # /dev/shm is sticky: a daemon running as its own user (the documented
            # multi-user set-up) may not remove an engine's file. The client removes
            # it when it closes the arena; a crashed client's file stays until its
            # user (or root) removes it (docs/operating.md, "Clients' shared memory").
            log.info("session %s: arena file %s is another user's in sticky %s; left to its owner",
                     session.sid[:8], arena.name, arena.path.parent)


def _check_file_budget(ctx: HandlerContext, session: Session, n: int) -> None:
    """Refuse (TOO_MANY_FILES) before mapping ``n`` more files: per session, and daemon-wide below the fd limit."""
    held = sum(session.files.values())
    if held + n > ctx.max_shm_files_per_session:
        raise ProtocolError(ErrorCode.TOO_MANY_FILES,
                            f"this session maps {held} shared-memory files and asks for {n} more; at most "
                            f"{ctx.max_shm_files_per_session} (max_shm_files_per_session)")
    if ctx.files_mapped + n > ctx.max_shm_files_total:
        raise ProtocolError(ErrorCode.TOO_MANY_FILES,
                            f"the daemon maps {ctx.files_mapped} shared-memory files of all sessions; {n} more would "
                            f"pass its limit of {ctx.max_shm_files_total} (kept below its file descriptor limit)")


def _claim_files(ctx: HandlerContext, session: Session, files: Sequence[tuple[tuple[int, int], int]], what: str) -> None:
    """Make ``files`` this session's (all or none): refused if another live session owns one, or another user's file."""
    _check_file_budget(ctx, session, len(files))
    for inode, uid in files:
        # The daemon may open files the client cannot: it maps only the
        # caller's own (on ipc, where the caller's uid is known; root may).
        if session.uid not in (None, 0) and uid != session.uid:
            raise ProtocolError(ErrorCode.NOT_OWNER, f"{what}: the file belongs to another user")
        owner = ctx.file_owner.get(inode)
        if owner is not None and owner != session.sid and ctx.sessions.is_live(owner):
            raise ProtocolError(ErrorCode.IN_USE, f"{what}: the file is attached by another session")
    for inode, _uid in files:
        ctx.file_owner[inode] = session.sid
        session.files[inode] = session.files.get(inode, 0) + 1
    ctx.files_mapped += len(files)


def _release_files(ctx: HandlerContext, session: Session, files: Sequence[tuple[tuple[int, int], int]]) -> None:
    for inode, _uid in files:
        left = session.files.get(inode, 0) - 1
        if left < 0:
            continue
        ctx.files_mapped -= 1
        if left:
            session.files[inode] = left
            continue
        del session.files[inode]
        if ctx.file_owner.get(inode) == session.sid:
            del ctx.file_owner[inode]


def unregister_kv(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    name = req.fields["name"]
    reg = session.registrations.get(name)
    if reg is None:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no registration {name!r} in this session")
    if session.in_flight:
        raise ProtocolError(ErrorCode.INVALID_STATE, "copies of this session are in flight; retry when they are done")
    del session.registrations[name]
    release_registration(ctx, session, reg)
    return Reply()


# ---- lookups and pins --------------------------------------------------------


def lookup(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    entry = _entry(ctx, session)
    pool = entry.pool
    hashes = _keys(ctx, session, req.fields["hashes"])
    tiers = pool.lookup(hashes, hints=request_hints(req.fields["hints"], session, entry, len(hashes), ctx.metrics))
    ctx.tenants.note_lookup(session.tenant, len(hashes), tiers)
    if req.fields["pin"] and _released(ctx, req, session):
        return Reply({"tiers": _reply_tiers(req, tiers), "pinned": 0})
    if req.fields["pin"] and tiers:
        _check_pins(ctx, session, entry, len(tiers))
        # Same thread, no copy in between: the pinned prefix is the one looked up.
        tiers = _pin(session, entry, hashes[: len(tiers)], req.fields["pin_tag"])
    return Reply({"tiers": _reply_tiers(req, tiers), "pinned": len(tiers) if req.fields["pin"] else 0})


def pin(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    entry = _entry(ctx, session)
    hashes = _keys(ctx, session, req.fields["hashes"])
    if _released(ctx, req, session):
        return Reply({"tiers": _reply_tiers(req, [])})
    _check_pins(ctx, session, entry, len(entry.pool.lookup(hashes, count=False)))
    tiers = _pin(session, entry, hashes, req.fields["pin_tag"])
    return Reply({"tiers": _reply_tiers(req, tiers)})


def _released(ctx: HandlerContext, req: Request, session: Session) -> bool:
    """Whether this pinning request was sent before its tag's release (see the module docstring)."""
    tag = req.fields["pin_tag"]
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


def unpin(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    """Drop pins on ``hashes`` (the tag's, with ``pin_tag``), or, with ``pin_tag`` alone, every pin of the tag:
    those whose replies the client never read too (a lost reply, a resent lookup)."""
    assert session is not None
    f = req.fields
    tag, hashes = f["pin_tag"], f["hashes"]
    if hashes is None and tag is None:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "unpin needs 'hashes', or 'pin_tag' alone to drop every pin of a tag")
    pool = _entry(ctx, session).pool
    owner = session.pin_owner(tag)
    n = pool.unpin_all(owner) if hashes is None else pool.unpin(owner, _keys(ctx, session, hashes))
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


def allocate(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    entry = _entry(ctx, session)
    _require_mode(entry, "engine", "allocate")
    f = req.fields
    hashes = _keys(ctx, session, f["hashes"])
    op = entry.pool.allocate(session.pool_request_id(f["req"]), hashes, f["num_tokens"],
                             hints=request_hints(f["hints"], session, entry, len(hashes), ctx.metrics))
    ctx.tenants.note_lookup(session.tenant, len(hashes), op.result["tiers"])
    session.requests.add(f["req"])

    def failed(_op: Op) -> None:
        session.requests.discard(f["req"])  # the pool freed it when the restore failed

    return _done_or_pending(op, lambda o: Reply(dict(o.result)), on_error=failed)


def append(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    entry = _entry(ctx, session)
    _require_mode(entry, "engine", "append")
    f = req.fields
    if f["req"] not in session.requests:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no request {f['req']!r} in this session")
    op = entry.pool.append(session.pool_request_id(f["req"]), f["num_tokens"], _keys(ctx, session, f["hashes"]))
    return _done_or_pending(op, lambda o: Reply(dict(o.result)))


def free(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    entry = _entry(ctx, session)
    _require_mode(entry, "engine", "free")
    name = req.fields["req"]
    if name not in session.requests:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no request {name!r} in this session")
    entry.pool.free(session.pool_request_id(name), valid_tokens=req.fields.get("valid_tokens"))
    session.requests.discard(name)
    return Reply()


# ---- store mode --------------------------------------------------------------


def _plane_layout(ctx: HandlerContext, req: Request, session: Session, n: int) -> tuple[BlockLayout, list[int]]:
    """Layout and slots for planes shm and kv, checked before any copy is planned."""
    f = req.fields
    plane = f["plane"]
    slots = f["slots"]
    if slots is None or len(slots) != n:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"plane {plane!r} needs 'slots', one per hash ({n})")
    if plane == "shm":
        if f["reg"] is not None:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "plane 'shm' takes no 'reg'")
        if session.arena is None:
            raise ProtocolError(ErrorCode.INVALID_STATE, "plane 'shm' needs an arena: send attach_arena first")
        layout = session.arena[1]
    else:
        if f["reg"] is None:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "plane 'kv' needs 'reg'")
        reg = session.registrations.get(f["reg"])
        if reg is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no registration {f['reg']!r} in this session")
        layout = reg.layout
    bad = [s for s in slots if s >= layout.num_blocks]
    if bad:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"slot {bad[0]} out of range (the {plane} layout has {layout.num_blocks} slots)")
    if len(set(slots)) != len(slots):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "'slots' names a slot twice")
    return layout, list(slots)


def store(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    entry = _entry(ctx, session)
    _require_mode(entry, "store", "store")
    f = req.fields
    deadlines.check_arrival(f["deadline_ns"], "store")
    hashes = _keys(ctx, session, f["hashes"])
    n = len(hashes)
    if len(set(hashes)) != n:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "'hashes' names a hash twice")
    keep: Any = None
    read_by_ns = None  # the pool reads the client's own memory (CUDA IPC): its copy must end by the deadline
    if f["plane"] == "inline":
        if f["slots"] is not None or f["reg"] is not None:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "plane 'inline' takes no 'slots' or 'reg'")
        nbytes = sum(frame_nbytes(fr) for fr in req.payload)
        if nbytes != n * entry.block_bytes or (n and len(req.payload) != 1):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"inline store of {n} blocks needs one payload frame of {n * entry.block_bytes} bytes, got {nbytes} in {len(req.payload)} frames",
            )
        if n == 0:
            return Reply({"stored": 0, "present": 0})
        frame = req.payload[0]
        # Zero-copy: the pool reads the block bytes straight out of the ZMQ frame.
        src = BlockLayout.from_buffer(getattr(frame, "buffer", frame), n, entry.block_bytes)
        slots = list(range(n))
        keep = frame
    else:
        if req.payload:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"plane {f['plane']!r} takes no payload frame")
        src, slots = _plane_layout(ctx, req, session, n)
        files = _plane_files(session, req)
    ctx.tenants.check_store(session.tenant, entry.pool, hashes, entry.block_bytes)
    if f["plane"] != "inline" and client_memory.is_client_host_memory(src):
        # The client's file may shrink under us: its bytes are copied out
        # here with calls that fail instead of faulting, and the pool reads
        # only the daemon's own staging buffer.
        staging = BlockLayout.contiguous(n, entry.block_bytes, "cpu")
        client_src, client_slots = src, slots
        _client_copy(ctx, session, lambda: client_memory.read_blocks(client_src, client_slots, staging), files)
        deadlines.check_read(f["deadline_ns"], "store")
        src, slots, keep = staging, list(range(n)), staging
    elif f["plane"] != "inline":
        read_by_ns = f["deadline_ns"]
    op = entry.pool.store(hashes, src, slots, hints=request_hints(f["hints"], session, entry, n, ctx.metrics),
                          read_by_ns=read_by_ns)
    return _done_or_pending(op, lambda o: Reply(dict(o.result)), keep=keep)


def restore(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    entry = _entry(ctx, session)
    _require_mode(entry, "store", "restore")
    f = req.fields
    if f["release"]:
        ctx.lends.release(session.sid, f["release"])  # release_lends sent along (the client copied them)
    deadlines.check_arrival(f["deadline_ns"], "restore")
    hashes = _keys(ctx, session, f["hashes"])
    n = len(hashes)
    pool = entry.pool
    if f["plane"] == "inline":
        if f["slots"] is not None or f["reg"] is not None:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "plane 'inline' takes no 'slots' or 'reg'")
        # Size the staging buffer to what will come back, so a long miss
        # costs no memory. Nothing runs on the loop between this probe and the
        # restore, but a remote tier may hold more by then (a write-back
        # landed): the restore stops at k blocks.
        k = len(pool.lookup(hashes, count=False))
        if k * entry.block_bytes > ctx.max_payload_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"restoring {k} blocks makes a {k * entry.block_bytes}-byte reply, limit {ctx.max_payload_bytes}; ask for fewer",
            )
        if k == 0:
            pool.lookup(hashes)  # counted like any restore of a miss
            return Reply({"tiers": []})
        borrowed = pool.borrow(hashes, max_views=1)
        if borrowed is not None:
            # Zero-copy: the prefix lies in one run of one tier's slots, and
            # ZMQ reads it from there; the tier holds the blocks until the
            # reply has left (see Reply.on_sent). A scattered prefix is
            # gathered into a staging buffer instead: the reply is one frame.
            return Reply({"tiers": _tiers(borrowed.tiers)}, borrowed.views, on_sent=borrowed.release)
        staging = BlockLayout.contiguous(k, entry.block_bytes, "cpu")
        # Slots past the held prefix are never written; they only satisfy the
        # pool's "one slot per hash" check so its lookup counters see every hash.
        op = pool.restore(hashes, staging, list(range(k)) + [0] * (n - k), max_blocks=k)

        def finish(o: Op) -> Reply:
            got = len(o.result["tiers"])
            frames = [staging.slab()[:got].numpy()] if got else []
            return Reply({"tiers": list(o.result["tiers"])}, frames)

        return _done_or_pending(op, finish, keep=staging, reply_bytes=k * entry.block_bytes)
    dst, slots = _plane_layout(ctx, req, session, n)
    files = _plane_files(session, req)
    deadline_ns = f["deadline_ns"]
    if f["lend"]:
        # The client copies the blocks itself from its mapping of the CPU tier's file (daemon.lends);
        # where it cannot be lent, the restore goes on below as if it had not asked.
        lent = ctx.lends.offer(session, entry, hashes, getattr(entry.transfer, "fault_hook", None))
        if lent is not None:
            return Reply({"tiers": ["cpu"] * len(lent["slots"]), "lent": lent})
    if not client_memory.is_client_host_memory(dst):
        op = pool.restore(hashes, dst, slots, start_by_ns=deadlines.write_by_ns(deadline_ns, n * entry.block_bytes))
        return _done_or_pending(op, lambda o: Reply({"tiers": list(o.result["tiers"])}))
    # Client host memory: the loop copies the blocks out with calls that fail
    # instead of faulting (see store). Straight from the tiers where the pool
    # can lend them in place: one copy, and no hand-off to a copy worker,
    # which costs more than the copy up to LOOP_COPY_MAX_BYTES (32 MiB: 13-88
    # ms through a worker and a staging buffer, 5-9 ms here). Larger restores,
    # and pools with test fault injection (it acts on the copy engines), go
    # through a copy worker ...
    lend = n * entry.block_bytes <= LOOP_COPY_MAX_BYTES and getattr(entry.transfer, "fault_hook", None) is None
    borrowed = pool.borrow(hashes) if lend else None
    if borrowed is not None:
        try:
            got = len(borrowed.tiers)
            deadlines.check_write(deadline_ns, got * entry.block_bytes, "restore")
            _client_copy(ctx, session, lambda: client_memory.write_views(borrowed.views, dst, slots[:got]), files)
        finally:
            borrowed.release()
        return Reply({"tiers": _tiers(borrowed.tiers)})
    # ... else the pool writes a staging buffer first (a remote tier to
    # consult, a write still in flight into a block, a large restore).
    k = len(pool.lookup(hashes, count=False))
    if k == 0:
        pool.lookup(hashes)
        return Reply({"tiers": []})
    staging = BlockLayout.contiguous(k, entry.block_bytes, "cpu")
    op = pool.restore(hashes, staging, list(range(k)) + [0] * (n - k))

    def finish_client(o: Op) -> Reply:
        got = len(o.result["tiers"])
        deadlines.check_write(deadline_ns, got * entry.block_bytes, "restore")
        _client_copy(ctx, session, lambda: client_memory.write_blocks(staging, got, dst, slots), files)
        return Reply({"tiers": list(o.result["tiers"])})

    return _done_or_pending(op, finish_client, keep=staging)


# Restores into client memory up to this size are copied by the loop itself (see restore).
LOOP_COPY_MAX_BYTES = 64 << 20


def _plane_files(session: Session, req: Request) -> list[ShmArena]:
    """The ``/dev/shm`` files behind the request's plane, for ``_client_copy``'s truncation check.

    Taken after ``_plane_layout`` (the arena or registration exists). The
    objects themselves are held: a restore copies out later, when the
    session may have dropped them (see ``_check_intact``).
    """
    if req.fields["plane"] == "shm":
        assert session.arena is not None
        return [session.arena[0]]
    reg = session.registrations[req.fields["reg"]]
    return [arena for handle in reg.handles for arena in getattr(handle, "shm_files", ())]


# Files checked for truncation before every copy; more (a registration with a
# file per layer) only where the copies are not fault-safe. One check is one
# fstat, 1.4 µs (2-core VM, loaded): 64 files were 115 µs per restore, a
# cost the fault-safe copies make needless (they fail on a short file).
INTACT_CHECK_MAX_FILES = 8


def _check_intact(files: Sequence[ShmArena]) -> None:
    """Raise ``ClientMemoryFault`` naming the first of ``files`` that is shorter than its mapping."""
    for arena in files:
        if arena.closed:
            # Dropped (unregister_kv, a fault) while a restore was in flight:
            # the layout's views still map it and the copy goes on as it did
            # before this check existed, fault-safe; no size to ask here.
            continue
        try:
            arena.check_intact()
        except ShmArenaError as exc:
            raise client_memory.ClientMemoryFault(str(exc)) from None


def _client_copy(ctx: HandlerContext, session: Session, copy: Callable[[], None], files: Sequence[ShmArena]) -> None:
    """Run a copy to or from the session's shared memory; a fault fails the request and the session's client memory.

    ``files`` are checked first (``INTACT_CHECK_MAX_FILES``): a file
    truncated since it was mapped fails with an error naming it and both
    sizes, and is not touched even where the copies are plain memory copies
    (``client_memory.available()`` False). A truncation after the check is
    the fault-safe copy's to catch; files not checked first are checked after
    such a fault, for the message.
    """
    before = len(files) <= INTACT_CHECK_MAX_FILES or not client_memory.available()
    try:
        if before:
            _check_intact(files)
        try:
            copy()
        except client_memory.ClientMemoryFault as fault:
            if before:
                raise
            try:
                _check_intact(files)
            except client_memory.ClientMemoryFault as found:
                raise client_memory.ClientMemoryFault(f"{found} ({fault})") from None
            raise
    except client_memory.ClientMemoryFault as exc:
        drop_client_memory(ctx, session, str(exc))
        raise ProtocolError(ErrorCode.TRANSFER_FAILED, f"{exc}; this session's arena and registrations were dropped: "
                            "attach and register them again") from None


def drop_client_memory(ctx: HandlerContext, session: Session, why: str) -> None:
    """Forget a session's arena and registrations (not unlinking anything): its memory is unusable."""
    ctx.metrics.inc("client_memory_faults_total")
    log.warning("session %s: %s; dropping its arena and %d registrations", session.sid[:8], why,
                len(session.registrations))
    for reg in list(session.registrations.values()):
        try:
            release_registration(ctx, session, reg)
        except Exception:
            log.exception("releasing registration %r", reg.name)
    session.registrations.clear()
    release_arena(ctx, session, unlink=False)


# ---- daemon-wide -------------------------------------------------------------


def stats_fields(ctx: HandlerContext) -> dict[str, Any]:
    """The ``stats`` reply's fields, the operator's view; also the snapshot the Prometheus endpoint serves
    (loop thread only). Pools are keyed by ``PoolEntry.name``: with tenants ``"<tenant>/<name>"``, and
    each says its ``tenant`` and bare ``name`` (what ``stats`` and Prometheus label them with)."""
    pools: dict[str, Any] = {}
    for entry in ctx.pools:
        s = entry.pool.stats()
        s["mode"] = entry.mode
        s["sessions"] = len(entry.sessions)
        s["gpu_registered"] = entry.gpu_owner is not None
        if ctx.tenants.enabled:  # without tenants the reply stays as it always was
            s["tenant"] = entry.tenant
            s["name"] = entry.bare_name
        pools[entry.name] = s
    out = {"pools": pools, "daemon": ctx.metrics.snapshot(), "sessions": len(ctx.sessions)}
    if ctx.tenants.enabled:
        out["tenants"] = ctx.tenants.stats()
    return out


def stats(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    fields = stats_fields(ctx)
    viewer = _viewer(ctx, req)
    if viewer is not None:
        # A tenant sees its own pools, by the names its hellos sent, and its own
        # counters; someone who is neither a tenant nor the operator sees no pool or tenant.
        fields["pools"] = {s["name"]: s for s in fields["pools"].values() if _sees(viewer, s["tenant"])}
        fields["tenants"] = ctx.tenants.stats(only=viewer) if viewer else {}
        fields["sessions"] = sum(1 for s in ctx.sessions if s.tenant == viewer) if viewer else 0
    return Reply(fields)


def _viewer(ctx: HandlerContext, req: Request) -> str | None:
    """Whose view a session-optional request gets: None the operator's (everything), a tenant's name,
    or "" (nobody's: no pool, no tenant). Without tenants, everyone is the operator."""
    if not ctx.tenants.enabled:
        return None
    if req.sid is not None:
        # stats does not need a session, but one it names says whose it is.
        try:
            named = ctx.sessions.get(req.sid)
        except ProtocolError:
            named = None
        mine = named is not None and named.peer == ctx.peer and named.uid in (None, ctx.peer_uid)
        return named.tenant if mine and named is not None else ""
    tenant = ctx.tenants.tenant_of_peer(ctx.peer)
    if tenant is not None:
        return tenant
    if ctx.peer is not None:
        return None  # an authorised CURVE key that is no tenant's: the operator's
    # ipc: the daemon's own user (and root) is the operator; a token tenant names its session.
    return None if ctx.peer_uid in (os.getuid(), 0) else ""


def _sees(viewer: str | None, tenant: str) -> bool:
    """Whether ``viewer`` (see ``_viewer``) may see what belongs to ``tenant``: the operator all, a tenant its own."""
    return viewer is None or (viewer != "" and tenant == viewer)


def health(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    viewer = _viewer(ctx, req)
    return Reply(
        {
            "status": "draining" if ctx.draining else "ok",
            "uptime_s": round(time.monotonic() - ctx.started_s, 3),
            # Counted in the asker's view too: another tenant's pools and sessions, even
            # as a number, would tell a tenant when they come and go.
            "pools": sum(1 for e in ctx.pools if _sees(viewer, e.tenant)),
            "sessions": sum(1 for s in ctx.sessions if _sees(viewer, s.tenant)),
            "protocol_version": PROTOCOL_VERSION,
            "daemon_version": DAEMON_VERSION,
            "pid": os.getpid(),
            # Per pool with a remote tier: is it reachable now (the daemon
            # serves the GPU and CPU tiers either way and reconnects alone).
            # The operator's view names pools by key; a tenant's, its own by their bare names.
            "remote": {(e.name if viewer is None else e.bare_name): bool(e.pool.remote.available) for e in ctx.pools
                       if e.pool.remote is not None and _sees(viewer, e.tenant)},
            # Likewise per pool with a disk tier: open and not resting after an I/O error.
            "disk": {(e.name if viewer is None else e.bare_name): bool(e.pool.disk.available) for e in ctx.pools
                     if e.pool.disk is not None and _sees(viewer, e.tenant)},
        }
    )


def clear(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    pool = _entry(ctx, session).pool
    # A tenant clears its own blocks only; without tenants, the whole pool.
    n = pool.clear() if session.tenant == ANONYMOUS else ctx.tenants.clear(pool, session.tenant)
    log.info("session %s cleared pool %r: %d blocks dropped", session.sid[:8], session.pool_name, n)
    return Reply({"cleared": n})


EVENT_KIND_CODES = {STORED: EVENT_STORED[0], REMOVED: EVENT_REMOVED[0]}


def events(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    if session.tenant != ANONYMOUS:
        # A tenant's pool keys are one-way digests of its hashes (daemon.tenants):
        # they could not be handed back as the hashes it knows.
        raise ProtocolError(ErrorCode.INVALID_STATE, "events are not served to tenants' sessions")
    journal = _entry(ctx, session).pool.journal
    if journal is None:
        raise ProtocolError(ErrorCode.INVALID_STATE, f"pool {session.pool_name!r} keeps no key journal")
    f = req.fields
    found, nxt, lost = journal.since(f["since"], f["max_events"])
    return Reply({"kinds": bytes(EVENT_KIND_CODES[kind] for kind, _ in found),
                  "hashes": b"".join(key for _, key in found), "next": nxt, "lost": lost})


Handler = Callable[[HandlerContext, Request, Session | None], Result]


def _packs_tiers(handler: Handler) -> Handler:
    """Packed in, packed out for a verb whose reply's ``tiers`` the pool builds as
    strings: packs them after the handler (or its ``Pending.finish``), so the
    handler itself stays as it is."""

    @functools.wraps(handler)
    def packing(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
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
    if "tiers" in reply.fields:
        reply.fields["tiers"] = pack_tiers(reply.fields["tiers"])
    return reply


def _names_disk(handler: Handler) -> Handler:
    """A verb whose reply lists tiers, for sessions that did not name feature "disk_tier" in hello:
    disk-tier blocks are "remote" to them (see the contract). Costs nothing in a pool without a disk tier."""

    @functools.wraps(handler)
    def naming(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
        result = handler(ctx, req, session)
        if session is None or session.reads_disk_tier:
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
    tiers = fields.get("tiers")
    if isinstance(tiers, bytes):
        fields["tiers"] = tiers.replace(_DISK_CODE, _REMOTE_CODE)
    elif tiers:
        fields["tiers"] = ["remote" if t == "disk" else t for t in tiers]
    if "num_disk_hits" in fields:
        fields["num_remote_hits"] = fields.get("num_remote_hits", 0) + fields.pop("num_disk_hits")
    return reply


_DISK_CODE, _REMOTE_CODE = TIER_CODES["disk"], TIER_CODES["remote"]


def release_lends(ctx: HandlerContext, req: Request, session: Session | None) -> Result:
    assert session is not None
    return Reply({"released": ctx.lends.release(session.sid, req.fields["ids"])})


HANDLERS: dict[str, Handler] = {
    "hello": hello,
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
    "stats": stats,
    "health": health,
    "clear": clear,
    "events": events,
    "release_lends": release_lends,
}
