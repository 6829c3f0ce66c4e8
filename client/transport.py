"""A client's connection to kvtierd: sockets, deadlines, and one request's send and receive.

Contract
========

``Transport(endpoint, curve)`` holds a ZMQ context and the client's main
DEALER socket (opened on first use, a CURVE client when ``curve`` is given).
It knows nothing of sessions: the caller passes the session id and the hash
form with every request. Not thread-safe: ``kvtier.client.client.Client``
serialises its calls under its lock; the heartbeat thread
(``kvtier.client.session.Heartbeat``) sends on a socket of its own from
``new_socket()``, with ids from ``next_id()`` (one counter, so ids never
repeat across the two).

- ``roundtrip(op, fields, frames, deadline_s, sid=, packed_hashes=)`` sends
  one request and returns ``(reply header, reply frames)`` of the reply that
  carries its id (late replies to abandoned requests are skipped). Raises
  ``KvtierTimeout`` when the request cannot be queued or no reply comes by
  ``deadline_s`` (``time.monotonic()`` seconds), ``DaemonError`` for an
  error reply, ``ProtocolError`` for a reply that is not a v1 reply.
- ``roundtrip_many(op, fields_list, deadline_s, sid=, packed_hashes=)``
  sends every request, then reads every reply (one round trip for all);
  returns the reply headers in request order, error replies among them
  (``error_of`` makes one an exception): one refused request costs its
  batch-mates nothing, and their replies (the pins they took) are never
  dropped. An error the daemon could not tie to a request raises at once.
- ``retry(op, deadline_s, attempt, *args, idempotent=)`` runs ``attempt(*args,
  attempt deadline)`` and returns what it returns. An idempotent request's attempt
  gets at most ``ATTEMPT_SHARE`` of the time left (at least
  ``MIN_ATTEMPT_S``), so a request lost with a dying daemon leaves time for
  one on its successor. On ``KvtierTimeout`` it drops the socket (stale
  replies go with it) and tries again while the request is idempotent and
  the deadline is not past; otherwise the timeout propagates. Other errors
  propagate at once.
- ``reset()`` drops the main socket (the next request opens a fresh one);
  ``close()`` drops it and terminates the context, which ends the heartbeat
  socket's wait too.
- A daemon that stops (or hands its socket to a successor) closes its
  connections; a request that reached it in its last instant goes
  unanswered. The main socket is watched (a libzmq monitor of its
  disconnections, read only when a reply is ``WATCH_SLICE_MS`` late): a
  connection that closes while a request waits for its reply, with no
  reply there, raises ``ConnectionLost`` (a ``KvtierTimeout``) at once
  instead of at the attempt's deadline, so ``retry`` resends an idempotent
  request on a new socket (a successor's, or the backlog of a socket
  systemd holds) and a non-idempotent one fails now rather than later.
  Disconnections from before a request was sent do not count (the monitor
  is drained before each send). The wait is a blocking receive whose
  ZMQ_RCVTIMEO is the watch slice, so a prompt reply costs one receive and
  no poll.
- ``probe_health(endpoint, timeout_s=, curve=)``: one session-less
  ``health`` request on a socket of its own (readiness probes, scripts);
  returns the reply's fields, raises ``KvtierTimeout`` or ``ProtocolError``.

The errors the wire produces are defined here: ``KvtierTimeout`` (also a
``TimeoutError``) and ``DaemonError(code, message)``; both derive from
``protocol.KvtierError``. ``error_of(reply, op)`` turns an error reply into
its exception; ``reply_fields(reply)`` drops the envelope keys.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import zmq
from zmq.backend import zmq_poll
from zmq.utils.monitor import recv_monitor_message

from kvtier.client.curve import CurveKeys
from kvtier.client.protocol import (
    OPS,
    PROTOCOL_VERSION,
    ErrorCode,
    KvtierError,
    ProtocolError,
    decode,
    decode_reply,
    encode,
    error_name,
    reply_error,
    request_header,
)

__all__ = ["ConnectionLost", "DaemonError", "KvtierTimeout", "Transport", "error_of", "probe_health", "reply_fields"]

log = logging.getLogger(__name__)

# A retried call gives each attempt at most this share of the time left, so a
# request lost with a dying daemon leaves time for one on the new daemon.
ATTEMPT_SHARE = 0.5
MIN_ATTEMPT_S = 0.2
# A reply later than this makes the wait look at the socket's disconnections (then again as often): a request
# lost with a closing connection is resent within this, and a prompt reply costs no more than before.
WATCH_SLICE_MS = 50
# Plain ints, not the IntEnum/IntFlag members (whose lookups and __and__ cost Python time on every request).
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_RCVTIMEO = int(zmq.RCVTIMEO)
_EVENT_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
# The backend's send, without pyzmq's Python-level wrapper (routing_id/group for draft sockets, then super()):
# a request's send costs ~1 us less of CPU (measured interleaved with round trips, where caches are cold).
_send = zmq.backend.Socket.send

T = TypeVar("T")


class KvtierTimeout(KvtierError, TimeoutError):
    """No reply before the call's deadline."""


class ConnectionLost(KvtierTimeout):
    """The connection a request went out on closed before its reply (see the module docstring)."""


class DaemonError(KvtierError):
    """The daemon answered with an error."""

    def __init__(self, code: int, message: str) -> None:
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else code
        self.name = error_name(code)
        self.message = message
        super().__init__(f"{self.name} ({int(code)}): {message}")


def error_of(rh: Mapping[str, Any], op: str) -> KvtierError:
    """The exception for error reply ``rh`` to ``op``: a ``DaemonError``, or a ``ProtocolError`` if it has no error map."""
    err = rh.get("error")
    if not isinstance(err, dict):
        return ProtocolError(ErrorCode.MALFORMED, f"error reply to {op} without an error map")
    return DaemonError(int(err.get("code", int(ErrorCode.INTERNAL))), str(err.get("message", "")))


def reply_fields(rh: Mapping[str, Any]) -> dict[str, Any]:
    """A reply's own fields, without the envelope (``v``, ``id``, ``ok``)."""
    return {k: v for k, v in rh.items() if k not in ("v", "id", "ok")}


def attempt_deadline(deadline_s: float) -> float:
    """The deadline of one attempt of a request that may be resent: a share of what is left."""
    now = time.monotonic()
    return min(deadline_s, now + max(MIN_ATTEMPT_S, (deadline_s - now) * ATTEMPT_SHARE))


class Transport:
    """See the module docstring."""

    def __init__(self, endpoint: str, curve: CurveKeys | None) -> None:
        self.endpoint = endpoint
        self._curve = curve
        self._zctx = zmq.Context()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None  # the main socket's disconnections
        self._monitor_poll: list[tuple[zmq.Socket, int]] = []  # zmq_poll's argument for it, built once
        self._rcvtimeo_ms = -1  # the main socket's ZMQ_RCVTIMEO as last set (set only when it changes)

    def next_id(self) -> int:
        return next(self._ids)

    def new_socket(self) -> zmq.Socket:
        """A new connected DEALER socket (the caller closes it)."""
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.apply(sock)
        sock.connect(self.endpoint)
        return sock

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self.new_socket()
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitor_poll = [(self._monitor, _POLLIN)]
            self._rcvtimeo_ms = -1
        return self._sock

    def _disconnected(self) -> bool:
        """Whether the main socket's connection closed since the last look (the events are consumed)."""
        monitor = self._monitor
        if monitor is None:
            return False
        found = False
        # Asked before every request: zmq_poll itself (1.1 us), not Socket.poll (a Poller per call, 2.1 us) nor
        # get(ZMQ_EVENTS) (1.5 us, most of it pyzmq building a SocketOption enum member per call).
        while zmq_poll(self._monitor_poll, 0):
            found |= recv_monitor_message(monitor)["event"] == _EVENT_DISCONNECTED
        return found

    def reset(self) -> None:
        # A fresh DEALER: replies to abandoned requests cannot reach it, and it
        # reconnects to a restarted daemon from scratch.
        if self._monitor is not None:
            if self._sock is not None:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
            self._monitor_poll = []
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self.reset()
        self._zctx.term()

    def roundtrip(self, op: str, fields: Mapping[str, Any], frames: Sequence[Any], deadline_s: float, *,
                  sid: str | None, packed_hashes: bool) -> tuple[Any, list[zmq.Frame]]:
        """Send one request and wait for its reply: its op's ``ReplyMessage`` (a map for stats and health);
        raises on error replies, and on an ok reply that is not its op's (MALFORMED)."""
        rid = next(self._ids)
        data = encode(request_header(op, rid, sid, packed_hashes=packed_hashes, **fields))
        sock = self._sock if self._sock is not None else self._socket()
        if zmq_poll(self._monitor_poll, 0):
            self._disconnected()  # a connection that closed before this request is none of its business
        try:
            if frames:
                sock.send_multipart([data, *frames], flags=_NOBLOCK, copy=False)
            else:
                # One frame, copied: a header (KiB) is cheaper to copy than to wrap in a zero-copy Frame.
                _send(sock, data, _NOBLOCK)
        except zmq.Again:
            raise KvtierTimeout(f"{op}: cannot queue the request (daemon unreachable at {self.endpoint})") from None
        while True:
            frames = self._recv(sock, op, deadline_s)
            # An ok reply, decoded and checked in one step; from a copy (a header is small: copying it costs
            # less than the memoryview that .buffer builds).
            typed = decode_reply(op, frames[0].bytes)
            if typed is not None:
                if typed.id == rid:
                    return typed, frames[1:]
                continue  # a late reply to an earlier request on this socket
            rh, _ = self._envelope(frames, op)
            if rh.get("id") not in (rid, 0):
                continue  # a late reply to an earlier request on this socket
            if rh["ok"] is True:
                if OPS[op].reply is None:
                    return rh, frames[1:]
                raise reply_error(op, frames[0].buffer)
            raise error_of(rh, op)

    def roundtrip_many(self, op: str, fields_list: Sequence[Mapping[str, Any]], deadline_s: float, *,
                       sid: str | None, packed_hashes: bool) -> list[Any]:
        """Send every request, then collect every reply (error replies too, as maps; ok ones as ``roundtrip``
        returns them): one round trip for all of them."""
        sock = self._socket()
        self._disconnected()
        rids: list[int] = []
        for fields in fields_list:
            rid = self.next_id()
            header = request_header(op, rid, sid, packed_hashes=packed_hashes, **fields)
            try:
                sock.send_multipart([encode(header)], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise KvtierTimeout(f"{op}: cannot queue the request (daemon unreachable at {self.endpoint})") from None
            rids.append(rid)
        wanted = set(rids)
        replies: dict[int, Any] = {}
        while len(replies) < len(rids):
            frames = self._recv(sock, op, deadline_s)
            # An ok reply decodes straight into its op's Struct, checked in the same step (no map, no re-encoding).
            typed = decode_reply(op, frames[0].buffer)
            if typed is not None:
                if typed.id in wanted and typed.id not in replies:
                    replies[typed.id] = typed
                continue  # else a late reply to an earlier request on this socket
            rh, _ = self._envelope(frames, op)
            answered = rh.get("id")
            if answered == 0 and rh["ok"] is not True:
                raise error_of(rh, op)  # an error the daemon could not tie to a request
            if answered not in wanted or answered in replies:
                continue  # a late reply to an earlier request on this socket
            if rh["ok"] is True and OPS[op].reply is not None:
                raise reply_error(op, frames[0].buffer)  # ours, ok, but not its op's reply
            replies[answered] = rh
        return [replies[rid] for rid in rids]

    def _recv(self, sock: zmq.Socket, op: str, deadline_s: float) -> list[zmq.Frame]:
        """The next reply's frames on the main socket ``sock``, by the deadline; ``ConnectionLost`` if its
        connection closes first with no reply there (see the module docstring).

        A blocking receive with ZMQ_RCVTIMEO as the watch slice, not a poll and then a receive: a prompt
        reply costs one call (a Poller's poll is ~3 us of CPU more per request). Each slice that passes
        without a reply reads the monitor.
        """
        while True:
            left_ms = int((deadline_s - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise KvtierTimeout(f"{op}: no reply from {self.endpoint} in time")
            slice_ms = WATCH_SLICE_MS if left_ms > WATCH_SLICE_MS else left_ms
            if slice_ms != self._rcvtimeo_ms:
                sock.set(_RCVTIMEO, slice_ms)
                self._rcvtimeo_ms = slice_ms
            try:
                frame = sock.recv(copy=False)
            except zmq.Again:
                if self._disconnected() and not sock.poll(0, zmq.POLLIN):  # no reply came in before it closed
                    raise ConnectionLost(f"the connection to {self.endpoint} closed before the reply came (the "
                                         "daemon there stopped or handed over)") from None
                continue
            # Frame.more, not RCVMORE: recv_multipart asks the socket once more per message.
            return [frame, *sock.recv_multipart(copy=False)] if frame.more else [frame]

    def _envelope(self, reply: list[zmq.Frame], op: str) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """A reply's header as a map (any op's, error replies too), checked to be a v1 reply."""
        try:
            rh = decode(reply[0].buffer)
        except Exception as exc:
            raise ProtocolError(ErrorCode.MALFORMED, f"undecodable reply to {op}: {exc}") from None
        if not isinstance(rh, dict) or rh.get("v") != PROTOCOL_VERSION or "ok" not in rh:
            raise ProtocolError(ErrorCode.MALFORMED, f"reply to {op} is not a v{PROTOCOL_VERSION} reply: {rh!r:.200}")
        return rh, reply[1:]

    def retry(self, op: str, deadline_s: float, attempt: Callable[..., T], *args: Any, idempotent: bool) -> T:
        """``attempt(*args, attempt_deadline_s)``, resent on a new socket after a timeout while ``idempotent`` and
        in time (``args``, not a closure: a request's attempt is the client's send itself)."""
        while True:
            try:
                if not idempotent:
                    return attempt(*args, deadline_s)
                now = time.monotonic()  # attempt_deadline(deadline_s), inline: it runs once per request
                return attempt(*args, min(deadline_s, now + max(MIN_ATTEMPT_S, (deadline_s - now) * ATTEMPT_SHARE)))
            except KvtierTimeout:
                self.reset()
                if not idempotent or time.monotonic() >= deadline_s:
                    raise
                log.info("kvtier %s timed out; retrying on a new socket", op)


def probe_health(endpoint: str, *, timeout_s: float = 1.0, curve: CurveKeys | None = None) -> dict[str, Any]:
    """One session-less ``health`` request (readiness probes, scripts); ``curve`` for a CURVE daemon."""
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    try:
        sock.connect(endpoint)
        sock.send(encode(request_header("health", 1, None)))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise KvtierTimeout(f"no kvtierd answering at {endpoint}")
        rh = decode(sock.recv_multipart()[0])
        if not isinstance(rh, dict) or rh.get("ok") is not True:
            raise ProtocolError(ErrorCode.MALFORMED, f"bad health reply: {rh!r:.200}")
        return reply_fields(rh)
    finally:
        sock.close(linger=0)
        zctx.term()
