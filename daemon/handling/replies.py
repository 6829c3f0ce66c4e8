"""Replies on their way out: the payload libzmq has not sent yet, per connection, and the tier memory it lends.

Contract (the event loop's thread only):

- ``ReplyQueue(metrics, error_log)``; ``attach(sock)`` once the ROUTER
  socket exists.
- ``send(identity, header, frames, on_sent=None, lender=None)``: one reply
  (header encoded here: a map, or a typed reply through
  ``protocol.encode_reply``'s one reusable encoder). Frames go out with ``copy=False``: block bytes
  are not copied again, and pyzmq keeps their buffers alive until libzmq
  has sent them. A reply with payload or ``on_sent`` is tracked until then;
  ``on_sent`` (a restore that lends tier memory) runs once libzmq let go
  of the frames. ``lender``: ``(sid, connection)`` of a lending reply, so
  that the session's end can shut that connection down. A reply libzmq
  refuses is dropped, never raised, and never waited for (the socket is
  ``ROUTER_MANDATORY``: without it libzmq drops a reply to a full or
  unknown peer without a word, and 19,000 lost replies left the counter at
  0): ``replies_dropped_total{reason}``, ``"full"`` (the connection's
  queue holds ``SNDHWM`` replies it has not read) or ``"gone"`` (no such
  connection any more), a rate-limited log line, and ``on_sent`` at once.
- ``unsent_bytes(identity)``: payload bytes handed to libzmq for that
  connection and not sent yet (the loop caps it: ``max_unread_reply_bytes``);
  ``copied_bytes``: the unsent payload of every connection that is not lent
  tier memory but buffers the daemon allocated (the loop caps it with the
  parked replies' ``max_unread_reply_bytes_total``).
- ``release_sent()``: runs ``on_sent`` of the replies libzmq is done with
  and updates the ``reply_bytes_unsent`` / ``reply_bytes_lent`` gauges.
- ``settle(identity, timeout_s) -> float``: before the loop refuses a
  request for unread replies: releases that connection's replies libzmq is
  done with (since the turn began its client may have read some and asked
  again; O(1) per reply), then, when the rest are at most
  ``SETTLE_MAX_PENDING`` replies handed to libzmq within ``SETTLE_WINDOW_S``,
  waits up to ``timeout_s`` (may be 0) for them to be reported sent;
  returns the seconds it took (no wait for a connection with more, or older,
  replies unsent: one that does not read). libzmq frees a sent reply on its
  I/O thread, and pyzmq marks the reply's tracker done on a thread of its
  own (its garbage collector), which must win the GIL from the busy loop
  first: a reply the client has read can look unsent for milliseconds, and
  a client that reads every reply would be refused as one that reads none.
- ``session_ended(sid, reason, lease_s)``: when that session still has
  lent replies unsent, their connections are shut down
  (``daemon.access.connections.shut_down``: libzmq drops what it queued, the
  trackers complete, the blocks come back) by ``shut_unread(now_s)``: at
  once after a lease expiry, a lease later after ``bye`` (a client that
  pipelined requests before its bye may still be reading).
  ``unread_connections_shut_total`` per connection, a log line per session.
- ``abandon()`` at shutdown: gives every lent buffer back (libzmq drops the
  replies when the socket closes).
- ``shut_lent()`` (a hand-over: the successor will own the tier memory):
  shuts down every connection that still queues a lent reply; returns how
  many.
- ``busy``: anything still unsent; ``lending``: a lent reply still unsent;
  ``sessions_to_shut``: ended sessions waiting.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import zmq

from kvtier.client.protocol import ReplyMessage, encode_reply, frame_nbytes
from kvtier.daemon.access.connections import Connection, shut_down
from kvtier.daemon.access.log_limit import RateLimitedLog
from kvtier.daemon.telemetry.metrics import Counters

log = logging.getLogger(__name__)


# A reply unsent for longer than this is unread, whatever pyzmq's garbage-collector thread lags (it
# reports within a millisecond mostly, 10 ms at the 99th percentile with the loop busy and a load
# average of 10 on 2 cores): settle() waits only for connections whose unsent replies are all younger.
SETTLE_WINDOW_S = 0.5
# ...and that have at most this many: a client that reads has one request with payload in flight
# (two, when the lag spans its next round trip); one with more pipelines requests it does not read.
SETTLE_MAX_PENDING = 2


class _Unsent(NamedTuple):
    """A reply handed to libzmq with payload it may not have sent yet."""

    tracker: zmq.MessageTracker
    on_sent: Callable[[], None] | None  # gives lent tier memory back
    identity: bytes
    nbytes: int
    sid: str | None  # lent replies: the session whose request it answers
    conn: Connection | None  # lent replies: the connection that request came on
    sent_s: float  # time.monotonic() when it was handed to libzmq


class ReplyQueue:
    """See the module docstring."""

    def __init__(self, metrics: Counters, error_log: RateLimitedLog) -> None:
        self.metrics = metrics
        self._error_log = error_log
        self._sock: zmq.Socket | None = None
        # Per connection, in the order handed to libzmq (which sends them in that order).
        self._sending: dict[bytes, deque[_Unsent]] = {}
        self._unsent_bytes: dict[bytes, int] = {}
        self.copied_bytes = 0
        # Ended sessions whose lent replies were still unsent: sid -> (when their
        # connections are shut down if those replies are still there, why it ended).
        self._unread_after_end: dict[str, tuple[float, str]] = {}
        self.metrics.set("reply_bytes_lent", 0)  # in stats from the start, like the counters beside it
        self.metrics.inc("unread_connections_shut_total", 0)
        for reason in ("full", "gone"):
            self.metrics.inc("replies_dropped_total", 0, reason=reason)

    def attach(self, sock: zmq.Socket) -> None:
        self._sock = sock

    @property
    def busy(self) -> bool:
        return bool(self._sending)

    @property
    def lending(self) -> bool:
        return any(u.on_sent is not None for u in self._items())

    @property
    def sessions_to_shut(self) -> bool:
        return bool(self._unread_after_end)

    def unsent_bytes(self, identity: bytes) -> int:
        return self._unsent_bytes.get(identity, 0)

    def send(self, identity: bytes, header: dict[str, Any] | ReplyMessage, frames: list[Any],
             on_sent: Callable[[], None] | None = None,
             lender: tuple[str, Connection | None] | None = None) -> None:
        """See the module docstring."""
        assert self._sock is not None
        nbytes = sum(frame_nbytes(f) for f in frames) if frames else 0
        track = on_sent is not None or nbytes > 0
        try:
            # NOBLOCK: with ROUTER_MANDATORY a full peer would block the loop.
            tracker = self._sock.send_multipart([identity, encode_reply(header), *frames], flags=zmq.NOBLOCK,
                                                copy=False, track=track)
        except zmq.ZMQError as exc:  # peer gone or its queue full: the reply is lost, not the daemon
            reason = "full" if exc.errno == zmq.EAGAIN else "gone"
            self.metrics.inc("replies_dropped_total", reason=reason)
            rid = header.id if isinstance(header, ReplyMessage) else header.get("id")
            self._error_log.log(f"dropped-{reason}", "reply %s to a client dropped (%s): %s", rid,
                                "it does not read its replies" if reason == "full" else "its connection is gone", exc)
            if on_sent is not None:
                on_sent()
            return
        if track:
            sid, conn = lender if lender is not None else (None, None)
            self._sending.setdefault(identity, deque()).append(
                _Unsent(tracker, on_sent, identity, nbytes, sid, conn, time.monotonic()))
            self._unsent_bytes[identity] = self._unsent_bytes.get(identity, 0) + nbytes
            if on_sent is None:
                self.copied_bytes += nbytes

    def _items(self) -> Iterator[_Unsent]:
        for queue in self._sending.values():
            yield from queue

    def _release(self, item: _Unsent) -> None:
        """Account for one reply libzmq is done with (its tier memory back, its bytes off the counts)."""
        if item.on_sent is not None:
            item.on_sent()
        else:
            self.copied_bytes -= item.nbytes
        left = self._unsent_bytes.get(item.identity, 0) - item.nbytes
        if left > 0:
            self._unsent_bytes[item.identity] = left
        else:
            self._unsent_bytes.pop(item.identity, None)

    def release_sent(self) -> None:
        """See the module docstring."""
        if not self._sending:
            return
        lent_bytes = 0
        for identity in list(self._sending):
            still: deque[_Unsent] = deque()
            for item in self._sending[identity]:
                if not item.tracker.done:
                    still.append(item)
                    if item.on_sent is not None:
                        lent_bytes += item.nbytes
                else:
                    self._release(item)
            if still:
                self._sending[identity] = still
            else:
                del self._sending[identity]
        self.metrics.set("reply_bytes_unsent", sum(self._unsent_bytes.values()))
        self.metrics.set("reply_bytes_lent", lent_bytes)

    def settle(self, identity: bytes, timeout_s: float) -> float:
        """See the module docstring."""
        t0_s = time.monotonic()
        queue = self._sending.get(identity)
        while queue:
            # The oldest first: sent in order, so a done reply's elders are done too (O(1) per reply).
            if queue[0].tracker.done:
                self._release(queue.popleft())
                continue
            left_s = t0_s + timeout_s - time.monotonic()
            if left_s <= 0 or len(queue) > SETTLE_MAX_PENDING or queue[0].sent_s < t0_s - SETTLE_WINDOW_S:
                break  # piled up, or unsent for longer than any lag: unread
            try:
                queue[0].tracker.wait(left_s)  # gives the GIL away: pyzmq's thread can report the send
            except zmq.NotDone:
                break
        if queue is not None and not queue:
            del self._sending[identity]
        return time.monotonic() - t0_s

    def shut_lent(self) -> int:
        """See the module docstring."""
        conns = {u.conn for u in self._items() if u.on_sent is not None and not u.tracker.done and u.conn is not None}
        shut = sum(shut_down(conn) for conn in conns)
        if shut:
            self.metrics.inc("unread_connections_shut_total", shut)
        return shut

    def session_ended(self, sid: str, reason: str, lease_s: float) -> None:
        """See the module docstring."""
        if any(u.sid == sid and u.on_sent is not None for u in self._items()):
            # Its lent replies are still queued: their blocks come back when the
            # client reads them, or else when its connection is shut down.
            grace_s = 0.0 if reason == "expired" else lease_s
            self._unread_after_end[sid] = (time.monotonic() + grace_s, reason)

    def shut_unread(self, now_s: float) -> None:
        """Shut down the connections that still queue lent replies of sessions ended a while ago.

        Those replies keep tier blocks lent (not evictable, not reusable) for as
        long as libzmq holds them, and a client that does not read holds them
        until its socket closes. Shut down, the connection fails: libzmq drops
        what it queued for it, its trackers complete, and release_sent gives
        the blocks back. After a bye the client gets a lease to read first (it
        may be reading the replies it pipelined before its bye); an expired
        session's client was silent for a whole lease already.
        """
        due = [sid for sid, (deadline_s, _reason) in self._unread_after_end.items() if deadline_s <= now_s]
        for sid in due:
            _deadline_s, reason = self._unread_after_end.pop(sid)
            unread = [u for u in self._items() if u.sid == sid and u.on_sent is not None and not u.tracker.done]
            conns = {u.conn for u in unread if u.conn is not None}
            shut = sum(shut_down(conn) for conn in conns)
            if not shut:
                continue
            self.metrics.inc("unread_connections_shut_total", shut)
            log.info("session %s ended (%s) with %d lent replies unread (%d bytes of tier memory): shut down %d "
                     "connection(s) to get the blocks back (the client reconnects)",
                     sid[:8], reason, len(unread), sum(u.nbytes for u in unread), shut)

    def abandon(self) -> None:
        """See the module docstring."""
        for item in self._items():
            if item.on_sent is not None:
                item.on_sent()
        self._sending = {}
        self.copied_bytes = 0
