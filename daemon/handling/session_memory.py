"""A session's client memory: the arena and registrations it maps, the files behind them, and copies to and from them.

Contract (the event loop's thread only; the handlers in ``SESSION_HANDLERS`` and
the data planes, ``daemon.planes``, call it):

- ``attach_arena``, ``register_kv``, ``unregister_kv``: the verbs (see
  docs/protocol.md). Each maps files only after ``check_file_budget``
  allowed them (TOO_MANY_FILES) and ``claim_files`` made them the session's
  (all or none: NOT_OWNER for another user's file, IN_USE for one another
  live session attached); a verb that fails closes what it opened.
- ``release_registration`` / ``release_arena``: forget one, returning its
  files to the budget; in engine mode a registration takes the GPU tier with
  it. ``release_arena(unlink=True)`` removes the file if this session owns it.
- ``client_copy(ctx, session, copy, files)``: run a copy to or from the
  client's memory; a file found truncated, or a fault the fault-safe copies
  (``daemon.shared_memory.client_memory``) caught, fails the request with TRANSFER_FAILED
  and drops the session's arena and registrations (``drop_client_memory``):
  the daemon never faults on a client's file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.client.protocol import ErrorCode, ProtocolError, Request
from kvtier.client.shm_arena import ShmAccessError, ShmArena, ShmArenaError, ShmSparseError
from kvtier.daemon.shared_memory import client_memory
from kvtier.daemon.handling.handler_context import HandlerContext, Reply, Result, pool_entry
from kvtier.daemon.shared_memory.kv_import import KvShareAccessError, KvShareSparseError
from kvtier.daemon.clients.sessions import Closeable, Registration, Session
from kvtier.blocks.layout import BlockLayout

__all__ = ["INTACT_CHECK_MAX_FILES", "attach_arena", "check_file_budget", "check_intact", "claim_files",
           "client_copy", "drop_client_memory", "register_kv", "release_arena", "release_files",
           "release_registration", "unregister_kv"]

log = logging.getLogger(__name__)


def attach_arena(ctx: HandlerContext, req: Request, session: Session) -> Result:
    f = req.msg
    entry = pool_entry(ctx, session)
    if session.arena is not None:
        raise ProtocolError(ErrorCode.INVALID_STATE, "this session already has an arena")
    if f.slot_bytes != entry.block_bytes:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"slot_bytes {f.slot_bytes} != pool block_bytes {entry.block_bytes}")
    check_file_budget(ctx, session, 1)
    try:
        arena = ShmArena.attach(f.name, f.num_slots, f.slot_bytes)
    except ShmAccessError as exc:
        raise ProtocolError(ErrorCode.ACCESS_DENIED, str(exc)) from None
    except ShmSparseError as exc:
        raise ProtocolError(ErrorCode.SPARSE_FILE, str(exc)) from None
    except ShmArenaError as exc:
        raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None
    try:
        claim_files(ctx, session, [(arena.inode, arena.file_uid)], f"arena {f.name}")
    except BaseException:
        arena.close()
        raise
    layout = BlockLayout.from_buffer(arena.buffer, arena.num_slots, arena.slot_bytes)
    session.arena = (arena, layout)
    return Reply({"num_slots": arena.num_slots})


def register_kv(ctx: HandlerContext, req: Request, session: Session) -> Result:
    f = req.msg
    entry = pool_entry(ctx, session)
    name = f.name
    if name in session.registrations:
        raise ProtocolError(ErrorCode.INVALID_STATE, f"registration {name!r} exists in this session")
    if entry.mode == "engine" and entry.gpu_owner is not None:
        raise ProtocolError(ErrorCode.INVALID_STATE, f"pool {entry.bare_name!r} already has a GPU tier registered")
    if len(session.registrations) >= ctx.max_registrations_per_session:
        raise ProtocolError(ErrorCode.TOO_MANY_REGISTRATIONS,
                            f"this session holds {len(session.registrations)} registrations, the most one may "
                            f"(max_registrations_per_session); unregister_kv one first")
    # Each shm tensor maps its file once (one descriptor): counted before any is opened.
    check_file_budget(ctx, session, sum(1 for item in f.tensors if item.desc.get("transport") == "shm"))
    tensors: list[Any] = []
    handles: list[Closeable] = []
    files: list[tuple[tuple[int, int], int]] = []
    claimed = False
    try:
        for i, item in enumerate(f.tensors):
            try:
                tensor, handle = ctx.kv_import(item.desc)
            except KvShareAccessError as exc:
                raise ProtocolError(ErrorCode.ACCESS_DENIED, f"tensors[{i}].desc: {exc}") from None
            except KvShareSparseError as exc:
                raise ProtocolError(ErrorCode.SPARSE_FILE, f"tensors[{i}].desc: {exc}") from None
            except (ValueError, TypeError, KeyError, OSError, RuntimeError) as exc:
                raise ProtocolError(ErrorCode.INVALID_FIELD, f"tensors[{i}].desc: {exc}") from None
            tensors.append(tensor)
            handles.append(handle)
        try:
            layout = BlockLayout(tensors, [item.block_dim for item in f.tensors])
        except (ValueError, IndexError) as exc:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"tensors: {exc}") from None
        if layout.block_bytes != entry.block_bytes:
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"registered tensors hold {layout.block_bytes} bytes per block, pool blocks are {entry.block_bytes}",
            )
        for handle in handles:
            files.extend(getattr(handle, "files", ()))
        claim_files(ctx, session, files, f"registration {name!r}")
        claimed = True
        reg = Registration(name, layout, handles, files=files)
        if entry.mode == "engine":
            ctx.pools.attach_engine_gpu(entry, (session.sid, name), layout)
            reg.attached_gpu = True
    except BaseException:
        if claimed:
            release_files(ctx, session, files)
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
    release_files(ctx, session, reg.files)
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
        release_files(ctx, session, [(arena.inode, arena.file_uid)])
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


def check_file_budget(ctx: HandlerContext, session: Session, n: int) -> None:
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


def claim_files(ctx: HandlerContext, session: Session, files: Sequence[tuple[tuple[int, int], int]], what: str) -> None:
    """Make ``files`` this session's (all or none): refused if another live session owns one, or another user's file."""
    check_file_budget(ctx, session, len(files))
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


def release_files(ctx: HandlerContext, session: Session, files: Sequence[tuple[tuple[int, int], int]]) -> None:
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


def unregister_kv(ctx: HandlerContext, req: Request, session: Session) -> Result:
    name = req.msg.name
    reg = session.registrations.get(name)
    if reg is None:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no registration {name!r} in this session")
    if session.in_flight:
        raise ProtocolError(ErrorCode.INVALID_STATE, "copies of this session are in flight; retry when they are done")
    del session.registrations[name]
    release_registration(ctx, session, reg)
    return Reply()



# Files checked for truncation before every copy; more (a registration with a
# file per layer) only where the copies are not fault-safe. One check is one
# fstat, 1.4 µs (2-core VM, loaded): 64 files were 115 µs per restore, a
# cost the fault-safe copies make needless (they fail on a short file).
INTACT_CHECK_MAX_FILES = 8


def check_intact(files: Sequence[ShmArena]) -> None:
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


def client_copy(ctx: HandlerContext, session: Session, copy: Callable[[], None], files: Sequence[ShmArena]) -> None:
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
            check_intact(files)
        try:
            copy()
        except client_memory.ClientMemoryFault as fault:
            if before:
                raise
            try:
                check_intact(files)
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
