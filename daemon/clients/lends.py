"""Lends: CPU-tier slots a same-user client reads in place, from its own read-only mapping of the arena file.

Why: a restore into a client's memory is a copy by another process (kvtierd
writes into vLLM's tensors), which on a loaded host runs at ~0.4-0.6x of a
memcpy inside one process. A lend hands the client the slots instead, and the
client gathers the blocks itself (``kvtier.client.arena_map``): one copy, in
the process that owns the destination.

Contract
========

- ``LendTable(lease_s, max_per_session)``; ``enabled`` is ``lease_s > 0``
  (config ``lend_lease_s``; 0 turns lending off).
- ``offer(session, entry, hashes, allowed=) -> dict | None``: on the loop
  (the pool's thread), for a restore that asked for a lend (field ``lend``,
  feature ``"lend"``). Borrows the held prefix from the pool when every block
  of it lies in the CPU tier of a persistent arena (``persist_cpu_tier``)
  and the session's client runs as this daemon's user (ipc, SO_PEERCRED:
  that user can read the arena's file anyway, mode 0600, so a lend shows it
  nothing it could not read; another user, tcp, or a client whose uid the
  kernel would not say gets no lend). Returns the reply's ``lent`` map
  (``id``, ``path``, ``inode``, ``block_bytes``, ``slots``, ``expires_ns``)
  and holds the blocks (read-held: not evicted, not overwritten) until
  ``release``, the lease's end (``expires_ns``, CLOCK_MONOTONIC) or the
  session's. None, with nothing changed, where it cannot lend (the caller
  restores as it would have): lending off, another user, a GPU-tier block,
  a tier in private memory, a write in flight, a remote or disk tier to
  consult, an empty prefix, test fault injection, a hand-over under way
  (``paused``), or the session already holding ``max_per_session`` lends.
- ``release(sid, ids) -> int``: ends those of the session's lends (others'
  ids and unknown ones are ignored: a release is idempotent); returns how
  many ended.
- ``expire(now_ns=None) -> int``: ends every lend past its lease (the
  server's sweep). A client that finished its copy before ``expires_ns``
  read intact bytes: a lend never ends before then but by its client's
  release, its session's end (a bye, or a lease expired: the client is taken
  for dead) or the daemon's stop (a successor of a hand-over waits for lends
  to end: ``Server.quiet``).
- ``session_ended(sid) -> int`` (a dead client's, a bye's: ``release_session``)
  and ``close()`` (shutdown) end lends without waiting. ``len()``: lends held.
- ``stats() -> dict``: the daemon counters ``stats`` and Prometheus show
  (``daemon.handling.stats_verbs``): lends granted, ended by their client's release,
  by their lease, or with their session (and shutdown), since start; lends
  held now (``lends_held``) and the bytes they hold (``lends_held_bytes``). granted =
  released + expired + dropped + held.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.daemon.clients.sessions import Session

__all__ = ["LendTable", "DEFAULT_LEASE_S", "DEFAULT_MAX_PER_SESSION"]

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 2.0
DEFAULT_MAX_PER_SESSION = 64


@dataclass(slots=True)
class Lend:
    sid: str
    release: Callable[[], None]
    expires_ns: int
    nbytes: int


class LendTable:
    """See the module docstring."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S, max_per_session: int = DEFAULT_MAX_PER_SESSION, *,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.lease_s = lease_s
        self.max_per_session = max_per_session
        self._clock_ns = clock_ns
        self._lends: dict[int, Lend] = {}
        self._per_session: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._uid = os.geteuid()
        self.granted_total = 0
        self.released_total = 0  # by the client (release_lends, or a restore's release)
        self.expired_total = 0  # by the lease's end
        self.dropped_total = 0  # with the session (a bye, a dead client) or the daemon's stop
        self.held_bytes = 0
        # Set while a hand-over is under way (the server, each loop turn): the successor adopts the CPU tier's
        # file and may write any slot once this daemon lets go, so that must wait for every lend's end. Lending
        # nothing new from the successor's start, the lends have ended (lease_s) before it is ready (its start
        # takes seconds), and requests held for the swap wait for copies only, not for leases.
        self.paused = False

    @property
    def enabled(self) -> bool:
        return self.lease_s > 0

    def __len__(self) -> int:
        return len(self._lends)

    def may_lend(self, session: Session) -> bool:
        """Lending on, and the session's client this daemon's user (root may read the file anyway)."""
        return self.enabled and session.uid is not None and session.uid in (self._uid, 0)

    def offer(self, session: Session, entry: Any, hashes: Sequence[bytes], *,
              allowed: bool = True) -> dict[str, Any] | None:
        if not allowed or self.paused or not self.may_lend(session):
            return None
        if self._per_session.get(session.sid, 0) >= self.max_per_session:
            return None
        pool = entry.pool
        cpu = getattr(pool, "cpu", None)
        arena = getattr(cpu, "slot_recorder", None)
        path = getattr(arena, "data_path", None)
        if path is None:
            return None  # a CPU tier in private memory: no file a client could map
        borrowed = pool.borrow(hashes, cpu_only=True, with_views=False)
        if borrowed is None:
            return None
        if not borrowed.tiers:
            borrowed.release()
            return None
        lend_id = next(self._ids)
        expires_ns = self._clock_ns() + int(self.lease_s * 1e9)
        nbytes = len(borrowed.slots) * int(entry.block_bytes)
        self._lends[lend_id] = Lend(session.sid, borrowed.release, expires_ns, nbytes)
        self._per_session[session.sid] = self._per_session.get(session.sid, 0) + 1
        self.granted_total += 1
        self.held_bytes += nbytes
        return {"id": lend_id, "path": str(path), "inode": int(arena.data_inode), "block_bytes": entry.block_bytes,
                "slots": list(borrowed.slots), "expires_ns": expires_ns}

    def stats(self) -> dict[str, int]:
        return {"lends_granted_total": self.granted_total, "lends_released_total": self.released_total,
                "lends_expired_total": self.expired_total, "lends_dropped_total": self.dropped_total,
                "lends_held": len(self._lends), "lends_held_bytes": self.held_bytes}

    def _end(self, lend_id: int) -> None:
        lend = self._lends.pop(lend_id)
        self.held_bytes -= lend.nbytes
        left = self._per_session.get(lend.sid, 1) - 1
        if left > 0:
            self._per_session[lend.sid] = left
        else:
            self._per_session.pop(lend.sid, None)
        try:
            lend.release()
        except Exception:  # a pool dropped under it: its memory went with it
            log.exception("releasing lend %d", lend_id)

    def release(self, sid: str, ids: Iterable[int]) -> int:
        ended = 0
        for lend_id in ids:
            lend = self._lends.get(lend_id)
            if lend is not None and lend.sid == sid:
                self._end(lend_id)
                ended += 1
        self.released_total += ended
        return ended

    def expire(self, now_ns: int | None = None) -> int:
        if not self._lends:
            return 0
        now = self._clock_ns() if now_ns is None else now_ns
        late = [i for i, lend in self._lends.items() if lend.expires_ns <= now]
        for lend_id in late:
            self._end(lend_id)
        self.expired_total += len(late)
        return len(late)

    def session_ended(self, sid: str) -> int:
        if sid not in self._per_session:
            return 0
        ids = [i for i, lend in self._lends.items() if lend.sid == sid]
        for lend_id in ids:
            self._end(lend_id)
        self.dropped_total += len(ids)
        return len(ids)

    def close(self) -> None:
        ids = list(self._lends)
        for lend_id in ids:
            self._end(lend_id)
        self.dropped_total += len(ids)
