"""Client sessions: what each client holds, and its lease.

Contract:

- A session is opened by ``hello`` on one pool and is named by a random
  ``sid`` (32 hex chars). It owns, and on release gives back, everything the
  client acquired through it: pins (the pool's pin owner is the sid, or
  ``"<sid>#<tag>"`` for pins taken under a pin tag: ``pin_tags``), engine
  requests (pool request ids ``"<sid>:<req>"``), KV registrations, and its
  shared-memory staging arena.
- The lease: every session verb except ``lookup``, ``stats`` and ``health``
  renews it (``touch``). A session whose lease ran out is *expired*: it is
  gone from the table at once (later requests with its sid get
  UNKNOWN_SESSION) and its holdings are released as soon as none of its
  copies is in flight, so a copy never writes into memory that was released.
- ``close`` (the ``bye`` verb) and daemon shutdown release the same way.
- At most ``max_sessions`` live at once (each costs ~3.7 KB and a slot in
  every sweep: 24,915 held +90 MB): ``check_room()`` (``hello`` asks it
  before it creates a pool) and ``open`` raise TOO_MANY_SESSIONS past it.
  Sessions that ended and wait for their copies do not count.
- Identity: a session records who opened it (the CURVE User-Id ``peer``,
  the ipc peer's ``uid``); the server honours its sid only from the same
  identity (see ``daemon.server``).
- Single-threaded: only the event loop calls this module.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.client.protocol import ErrorCode, ProtocolError
from kvtier.daemon.clients.retention import Retention

log = logging.getLogger(__name__)


class Closeable(Protocol):
    def close(self) -> None: ...


@dataclass(eq=False)
class Registration:
    """Engine KV tensors imported from one client; ``layout`` is a BlockLayout."""

    name: str
    layout: Any
    handles: list[Closeable]  # importer handles that keep the memory mapped
    attached_gpu: bool = False  # engine mode: this registration is the pool's GPU tier
    files: list[tuple[tuple[int, int], int]] = field(default_factory=list)  # ((dev, ino), uid) it maps

    def close(self) -> None:
        for handle in self.handles:
            try:
                handle.close()
            except Exception as exc:  # releasing must not stop at the first failure
                log.warning("closing KV registration %r: %s", self.name, exc)
        self.handles.clear()


@dataclass(eq=False)
class Session:
    sid: str
    pool_name: str  # the pool's key (daemon.pooling.pools.pool_key: "<tenant>/<name>" with tenants), for PoolRegistry.get
    client: str
    lease_s: float
    expires_at_s: float
    requests: set[str] = field(default_factory=set)
    registrations: dict[str, Registration] = field(default_factory=dict)
    arena: Any = None  # kvtier.client.shm_arena arena owned by the daemon side, or None
    # (st_dev, st_ino) -> mappings of that shared-memory file this session holds
    # (arena and registrations; one descriptor each). The daemon's ownership map
    # is HandlerContext.file_owner.
    files: dict[tuple[int, int], int] = field(default_factory=dict)
    num_pins: int = 0  # pin calls minus unpins, for stats only (the pool holds the truth)
    # pin tag -> pins taken under it minus those dropped (never below the pool's count); released with the session
    pin_tags: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0  # parked requests whose copies are still running
    ended: str = ""  # why the session ended ("expired", "bye", "shutdown"); "" while live
    tenant: str = ""  # whose block namespace it works in ("" = the anonymous tenant: no tenants configured)
    peer: str | None = None  # CURVE User-Id that opened it; only that identity may use the sid
    uid: int | None = None  # ipc: the uid of the process that opened it; only that user may use the sid
    # the retain_s hints it holds (kvtier.daemon.clients.hints)
    retained: Retention = field(default_factory=Retention)
    reads_disk_tier: bool = False  # its hello named feature "disk_tier": replies may say tier "disk"

    def pool_request_id(self, req: str) -> str:
        # The sid prefix keeps two clients' request ids apart in one pool.
        return f"{self.sid}:{req}"

    def pin_owner(self, tag: str | None) -> str:
        # "#" appears in no sid: a tag's pins never mix with the untagged ones.
        return self.sid if tag is None else f"{self.sid}#{tag}"


# (session, reason) -> None; gives back the session's holdings to its pool.
Releaser = Callable[[Session, str], None]


class SessionTable:
    """See the module docstring."""

    def __init__(self, releaser: Releaser, *, clock: Callable[[], float] = time.monotonic,
                 max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        self._ending: list[Session] = []  # ended, waiting for copies in flight
        self._release = releaser
        self._clock = clock
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def check_room(self) -> None:
        """Raise TOO_MANY_SESSIONS when ``max_sessions`` are live."""
        if len(self._sessions) >= self.max_sessions:
            raise ProtocolError(
                ErrorCode.TOO_MANY_SESSIONS,
                f"the daemon holds {len(self._sessions)} live sessions, its max_sessions; retry when some end "
                "(clients that stop must send bye; others expire after their lease) or ask the operator to raise it")

    def open(self, pool_name: str, client: str, lease_s: float, *, tenant: str = "", peer: str | None = None,
             uid: int | None = None) -> Session:
        self.check_room()
        sid = secrets.token_hex(16)
        session = Session(sid, pool_name, client, lease_s, self._clock() + lease_s, tenant=tenant, peer=peer, uid=uid)
        self._sessions[sid] = session
        return session

    def get(self, sid: str) -> Session:
        session = self._sessions.get(sid)
        if session is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION,
                f"no session {sid[:64]!r} (expired, closed, or the daemon restarted): send hello again",
            )
        return session

    def is_live(self, sid: str) -> bool:
        return sid in self._sessions

    def touch(self, session: Session) -> None:
        session.expires_at_s = self._clock() + session.lease_s

    def end(self, session: Session, reason: str) -> None:
        """Remove a session now; release its holdings once its copies are done."""
        if self._sessions.pop(session.sid, None) is None:
            return
        session.ended = reason
        self._ending.append(session)
        self.sweep_ending()

    def sweep(self) -> list[Session]:
        """End every session whose lease ran out; returns them."""
        now_s = self._clock()
        expired = [s for s in self._sessions.values() if s.expires_at_s <= now_s]
        for session in expired:
            self.expired_total += 1
            self.end(session, "expired")
        self.sweep_ending()
        return expired

    def sweep_ending(self) -> None:
        still: list[Session] = []
        for session in self._ending:
            if session.in_flight > 0:
                still.append(session)
                continue
            try:
                self._release(session, session.ended)
            except Exception:
                log.exception("releasing session %s failed", session.sid)
        self._ending = still

    @property
    def num_ending(self) -> int:
        return len(self._ending)

    def end_all(self, reason: str) -> None:
        for session in list(self._sessions.values()):
            self.end(session, reason)
