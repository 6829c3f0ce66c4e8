"""Giving back what a session holds, once it ends and its copies are done.

Contract: ``release_session(ctx, replies, session, reason)`` is the
``SessionTable``'s releaser. ``reason`` is "bye", "expired" or "shutdown".

- "shutdown": the pools are closed and about to go, so only OS resources
  matter: registrations are closed and the arena unmapped, its file kept
  (the client lives on and may bring it to the next daemon).
- Otherwise: the session's pins (its pin tags' too) and engine requests go
  from its pool, its registrations and arena are released (the arena file
  removed if this session still owns it), lent replies it left unread are
  handed to ``ReplyQueue.session_ended``, and a pool left without sessions
  starts its idle time. A pool already gone is not an error.
"""

from __future__ import annotations

import logging
import time

from kvtier.client.protocol import ProtocolError
from kvtier.daemon.handling.handler_context import HandlerContext
from kvtier.daemon.handling.session_memory import release_arena, release_registration
from kvtier.daemon.handling.replies import ReplyQueue
from kvtier.daemon.clients.sessions import Session
from kvtier.tiers.pool import NotFound, PoolError

__all__ = ["release_session"]

log = logging.getLogger(__name__)


def release_session(ctx: HandlerContext, replies: ReplyQueue, session: Session, reason: str) -> None:
    """See the module docstring."""
    if reason == "shutdown":
        for reg in session.registrations.values():
            reg.close()
        session.registrations.clear()
        release_arena(ctx, session, unlink=False)
        return
    replies.session_ended(session.sid, reason, session.lease_s)
    ctx.lends.session_ended(session.sid)  # a dead client's lends: the blocks may go
    try:
        entry = ctx.pools.get(session.pool_name)
    except ProtocolError:
        return
    pool = entry.pool
    pins = pool.unpin_all(session.sid)
    for tag in session.pin_tags:
        pins += pool.unpin_all(session.pin_owner(tag))
    session.pin_tags.clear()
    requests = len(session.requests)
    for name in sorted(session.requests):
        try:
            pool.free(session.pool_request_id(name))
        except (NotFound, PoolError):
            pass  # already gone with a detached GPU tier
    session.requests.clear()
    registrations = len(session.registrations)
    for reg in list(session.registrations.values()):
        release_registration(ctx, session, reg)
    session.registrations.clear()
    # The client is dead (expired) or done with it (bye): the file goes,
    # if this session still owns it.
    release_arena(ctx, session, unlink=True)
    entry.sessions.discard(session.sid)
    if not entry.sessions:
        entry.idle_since_s = time.monotonic()
    log.info("session %s ended (%s): released %d pins, %d requests, %d registrations",
             session.sid[:8], reason, pins, requests, registrations)
