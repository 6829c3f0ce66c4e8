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
- ``retry(op, deadline_s, attempt, idempotent=)`` runs ``attempt(attempt
  deadline)`` and returns what it returns. An idempotent request's attempt
  gets at most ``ATTEMPT_SHARE`` of the time left (at least
  ``MIN_ATTEMPT_S``), so a request lost with a dying daemon leaves time for
  one on its successor. On ``KvtierTimeout`` it drops the socket (stale
  replies go with it) and tries again while the request is idempotent and
  the deadline is not past; otherwise the timeout propagates. Other errors
  propagate at once.
- ``reset()`` drops the main socket (the next request opens a fresh one);
  ``close()`` drops it and terminates the context, which ends the heartbeat
  socket's wait too.
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

from kvtier.client.curve import CurveKeys
from kvtier.client.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    KvtierError,
    ProtocolError,
    decode,
    encode,
    error_name,
    request_header,
)

__all__ = ["DaemonError", "KvtierTimeout", "Transport", "error_of", "probe_health", "reply_fields"]

log = logging.getLogger(__name__)

# A retried call gives each attempt at most this share of the time left, so a
# request lost with a dying daemon leaves time for one on the new daemon.
ATTEMPT_SHARE = 0.5
MIN_ATTEMPT_S = 0.2

T = TypeVar("T")


class KvtierTimeout(KvtierError, TimeoutError):
    """No reply before the call's deadline."""


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
        return self._sock

    def reset(self) -> None:
        # A fresh DEALER: replies to abandoned requests cannot reach it, and it
        # reconnects to a restarted daemon from scratch.
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self.reset()
        self._zctx.term()

    def roundtrip(self, op: str, fields: Mapping[str, Any], frames: Sequence[Any], deadline_s: float, *,
                  sid: str | None, packed_hashes: bool) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Send one request and wait for its reply; raises on error replies."""
        rid = self.next_id()
        header = request_header(op, rid, sid, packed_hashes=packed_hashes, **fields)
        sock = self._socket()
        try:
            sock.send_multipart([encode(header), *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise KvtierTimeout(f"{op}: cannot queue the request (daemon unreachable at {self.endpoint})") from None
        while True:
            rh, rest = self._next_reply(sock, op, deadline_s)
            if rh.get("id") not in (rid, 0):
                continue  # a late reply to an earlier request on this socket
            if rh["ok"] is True:
                return rh, rest
            raise error_of(rh, op)

    def roundtrip_many(self, op: str, fields_list: Sequence[Mapping[str, Any]], deadline_s: float, *,
                       sid: str | None, packed_hashes: bool) -> list[dict[str, Any]]:
        """Send every request, then collect every reply (error replies too): one round trip for all of them."""
        sock = self._socket()
        rids: list[int] = []
        for fields in fields_list:
            rid = self.next_id()
            header = request_header(op, rid, sid, packed_hashes=packed_hashes, **fields)
            try:
                sock.send_multipart([encode(header)], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise KvtierTimeout(f"{op}: cannot queue the request (daemon unreachable at {self.endpoint})") from None
            rids.append(rid)
        replies: dict[int, dict[str, Any]] = {}
        while len(replies) < len(rids):
            rh, _ = self._next_reply(sock, op, deadline_s)
            answered = rh.get("id")
            if answered == 0 and rh["ok"] is not True:
                raise error_of(rh, op)  # an error the daemon could not tie to a request
            if answered not in rids or answered in replies:
                continue  # a late reply to an earlier request on this socket
            replies[answered] = rh
        return [replies[rid] for rid in rids]

    def _next_reply(self, sock: zmq.Socket, op: str, deadline_s: float) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """The next well-formed reply on ``sock``, whatever request it answers."""
        remaining_ms = int((deadline_s - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
            raise KvtierTimeout(f"{op}: no reply from {self.endpoint} in time")
        reply = sock.recv_multipart(copy=False)
        try:
            rh = decode(reply[0].buffer)
        except Exception as exc:
            raise ProtocolError(ErrorCode.MALFORMED, f"undecodable reply to {op}: {exc}") from None
        if not isinstance(rh, dict) or rh.get("v") != PROTOCOL_VERSION or "ok" not in rh:
            raise ProtocolError(ErrorCode.MALFORMED, f"reply to {op} is not a v{PROTOCOL_VERSION} reply: {rh!r:.200}")
        return rh, reply[1:]

    def retry(self, op: str, deadline_s: float, attempt: Callable[[float], T], *, idempotent: bool) -> T:
        """``attempt(attempt_deadline_s)``, resent on a new socket after a timeout while ``idempotent`` and in time."""
        while True:
            try:
                return attempt(attempt_deadline(deadline_s) if idempotent else deadline_s)
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
