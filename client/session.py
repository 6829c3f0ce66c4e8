"""A client's session with kvtierd: hello, what the session holds, recovery when the daemon forgets it, heartbeats.

Contract
========

``Session`` is the state ``kvtier.client.client.Client`` keeps per session,
and the steps that open one; ``Heartbeat`` keeps it alive. Both send through
the client: ``send`` is the client's late-bound ``_roundtrip`` (a test or a
subclass may wrap it, and recovery's requests must go through that too).

- ``hello(deadline_s)`` opens a session: sends ``hello`` (pool, layout,
  client name, requested lease, tenant token, and the reply features this
  client reads, ``CLIENT_FEATURES``: again without them, once and for good,
  when a daemon from before them refuses the field), resent on a new socket after
  each timeout until ``deadline_s``, then records what the reply granted:
  ``sid``, ``lease_s``, ``heartbeat_s``, ``pool_info``, ``limits``,
  ``features`` and the ``packed_hashes`` / ``hints`` / ``pin_tags`` flags they imply, and
  ``deadlines``: the daemon takes deadlines and reads this process's clock
  (``shared_clock``; the hello's send and receive times bracket its reading).
  Raises ``KvtierTimeout("no kvtierd answering at ...")`` when none
  answered, ``DaemonError`` for a refusal (UNAUTHORIZED, a layout that does
  not match the pool, ...).
- What the session holds, kept by the client's verbs: ``pins`` (a
  ``Counter`` of hashes, all of them), ``tag_pins`` (pin tag -> the
  ``Counter`` of the pins taken under it), ``requests`` (engine-mode request ids), ``tokens``
  (their ``TokenChain``s), ``registrations`` (``register_kv`` wire form, with
  the tensors kept alive), ``arena``.
- ``call(op, fields, frames, deadline_s) -> (reply header, frames)``: one
  request of ``Client._call``, sent through ``Transport.retry`` (an
  idempotent verb is resent after a timeout). When the daemon answers
  UNKNOWN_SESSION (restart or lease expiry) it rejected the request
  unexecuted: the session is marked ``gone``, a new one is opened (hello,
  re-attach the arena, re-register the KV tensors) and the request is sent
  again, whatever the verb. A ``store`` or ``restore`` on the shm or kv
  plane carries the call's deadline when ``deadlines`` holds. If the old
  session held pins or requests, or its arena cannot come back (a lease
  expiry unlinks the arena's file: it is dropped, and ``open_arena`` makes
  a new one), the call raises
  ``SessionLost`` listing them instead, once; the new session is ready for
  the next call. A failure half-way leaves ``gone`` set, so the next call
  starts over with a new hello rather than use half a session (the pins and
  requests the old session held are still reported, by the call that
  completes the new one). When the daemon answers SHUTTING_DOWN (it is
  stopping, or handing its socket to a successor: ``systemctl reload``) it
  did not run the request either: the socket is dropped, the session
  counts as gone (a successor does not know it), and the request is sent
  again on a new connection, at once the first time, then after a pause
  that doubles from ``SHUTDOWN_PAUSE_S`` (at most ``MAX_SHUTDOWN_PAUSE_S``,
  and at most half the time the call has left), until the call's deadline;
  past it the SHUTTING_DOWN error is raised.
  Otherwise raises what ``Transport`` raises.
- ``call_many(op, fields_list, deadline_s) -> reply headers``: the same for
  ``Client._call_many`` (pipelined): every request's reply header, error
  replies included, in order (one refused request fails only itself). No
  resend after a timeout (the socket is dropped and the timeout raised); a
  reply of UNKNOWN_SESSION means the daemon forgot the session, and one of
  SHUTTING_DOWN that it is leaving (the socket is dropped): the session is
  reopened and the batch sent again once (what ran in the old session went
  with it).
- ``recover_in_background(sid, timeout_s)``: the heartbeat thread's way to
  the same recovery, under the client's lock, so that an engine's
  registered KV tensors come back while it is idle; a ``SessionLost`` is
  kept in ``pending_loss`` and the next ``call`` raises it without sending.
- ``Heartbeat(session, transport, recover)``: a daemon thread that renews
  the lease every ``heartbeat_s`` on a DEALER socket of its own (ZMQ
  sockets are not thread-safe) with the session's id, and calls
  ``recover(sid)`` when the daemon has forgotten that session. A heartbeat
  with no answer only opens a new socket for the next; the thread ends when
  ``stop()`` is called or the transport's context is terminated.

Every method that touches the session expects the client's lock held,
except ``recover_in_background``, which takes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import zmq

from kvtier.client.data_planes import arena_fields
from kvtier.client.protocol import (
    CLIENT_FEATURES,
    FEATURE_DEADLINES,
    FEATURE_HINT_OUTPUT_TOKENS,
    FEATURE_HINTS,
    FEATURE_PACKED_HASHES,
    FEATURE_PIN_TAGS,
    OPS,
    ErrorCode,
    KvtierError,
    decode,
    encode,
    request_header,
)
from kvtier.client.shared_clock import shares_clock
from kvtier.client.shm_arena import ShmArena
from kvtier.client.tokens import TokenChain
from kvtier.client.transport import DaemonError, KvtierTimeout, Transport, error_of

__all__ = ["Heartbeat", "PoolLayout", "Registration", "Session", "SessionLost"]

log = logging.getLogger(__name__)


DEADLINE_ROUNDING_NS = 1_000
# After a SHUTTING_DOWN the request goes again at once on a new connection (a successor that took the socket over
# accepts it); if the daemon still says so (a stop with nobody after it yet), after this pause, doubling up to the
# most. In a hand-over both daemons accept on the socket and the old one answers SHUTTING_DOWN for up to a second
# (daemon.process.upgrade.REDIRECT_MAX_S): each new connection lands on either, so the client tries ~10 times a
# second rather than 2, and never pauses past half the time its call has left (the last try needs time to answer).
SHUTDOWN_PAUSE_S = 0.02
MAX_SHUTDOWN_PAUSE_S = 0.1


class SessionLost(DaemonError):
    """The daemon forgot this client's session; what it held is gone.

    The client has already opened a new session (re-attached its arena and
    re-registered its KV tensors); the engine must redo ``lost_pins`` and
    ``lost_requests`` itself if it still needs them. ``lost_arena``: the
    arena could not be re-attached (the lease ran out and the daemon unlinked
    its file); the client dropped it, and ``open_arena`` makes a new one.
    """

    def __init__(self, message: str, lost_pins: list[bytes], lost_requests: list[str], *,
                 lost_arena: bool = False) -> None:
        super().__init__(int(ErrorCode.UNKNOWN_SESSION), message)
        self.lost_pins = lost_pins
        self.lost_requests = lost_requests
        self.lost_arena = lost_arena


@dataclass(frozen=True)
class PoolLayout:
    """A pool's layout, as sent in hello (every field is part of the pool identity)."""

    model: str
    block_size: int
    block_bytes: int
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    hash_algo: str = "xxh3_128"
    mode: str = "store"

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Registration:
    tensors: list[dict[str, Any]]  # wire form (kv_share descriptors + block dims)
    keep: list[Any]  # the exported tensors/handles, alive while registered


def _error_code(rh: Any) -> int | None:
    """The error code of reply ``rh`` (a map, or an ok reply's Struct); None for a success."""
    if not isinstance(rh, Mapping):
        return None
    err = rh.get("error") if rh.get("ok") is not True else None
    return err.get("code") if isinstance(err, dict) else None


class Send(Protocol):
    """The client's ``_roundtrip``: one request, its reply header and frames."""

    def __call__(self, op: str, fields: Mapping[str, Any], frames: Sequence[Any], deadline_s: float, *,
                 with_sid: bool = True) -> tuple[Any, list[Any]]: ...


class Session:
    """See the module docstring."""

    def __init__(self, transport: Transport, send: Send, lock: threading.RLock, *, pool: str,
                 layout: dict[str, Any], client_name: str, lease_s: float | None, token: str | None) -> None:
        self._transport = transport
        self._send = send
        self._lock = lock
        self._hello_fields: dict[str, Any] = {"pool": pool, "layout": layout, "client": client_name}
        if lease_s is not None:
            self._hello_fields["lease_s"] = lease_s
        if token is not None:
            self._hello_fields["token"] = token
        # What the daemon's hello reply granted.
        self.sid: str | None = None
        self.lease_s = 0.0
        self.heartbeat_s = 0.0
        self.pool_info: dict[str, Any] = {}
        self.limits: dict[str, Any] = {}
        self.features: tuple[str, ...] = ()
        self.packed_hashes = False  # the daemon listed FEATURE_PACKED_HASHES in its hello reply
        self.hints = False  # ... and FEATURE_HINTS
        self.hint_output_tokens = False  # ... and FEATURE_HINT_OUTPUT_TOKENS
        self.pin_tags = False  # ... and FEATURE_PIN_TAGS
        self.deadlines = False  # ... and FEATURE_DEADLINES, and reads our clock (shared_clock)
        self.gone = False  # the daemon answered UNKNOWN_SESSION
        # Send hello's "features" (CLIENT_FEATURES) until a daemon refuses the field (one from before it).
        self._send_features = True
        self.pending_loss: SessionLost | None = None  # found by the heartbeat thread, raised by the next call
        self.closed = False  # the client closed: nothing may open a session again
        # What the session holds.
        self.pins: Counter[bytes] = Counter()
        self.tag_pins: dict[str, Counter[bytes]] = {}
        self.requests: set[str] = set()
        self.tokens: dict[str, TokenChain] = {}
        self.registrations: dict[str, Registration] = {}
        self.arena: ShmArena | None = None

    def hello(self, deadline_s: float) -> None:
        window_ns = [0, 0]  # the last attempt's send and receive: the daemon's clock reading lies between

        def attempt(attempt_deadline_s: float) -> tuple[Any, list[Any]]:
            fields = self._hello_fields
            if self._send_features:
                fields = {**fields, "features": list(CLIENT_FEATURES)}
            window_ns[0] = time.monotonic_ns()
            reply = self._send("hello", fields, (), attempt_deadline_s, with_sid=False)
            window_ns[1] = time.monotonic_ns()
            return reply

        resends = 0
        while True:
            try:
                # hello changes nothing the daemon holds for us: safe to resend.
                rh, _ = self._transport.retry("hello", deadline_s, attempt, idempotent=True)
                break
            except KvtierTimeout:
                raise KvtierTimeout(f"no kvtierd answering at {self._transport.endpoint}") from None
            except DaemonError as exc:
                if exc.code == ErrorCode.SHUTTING_DOWN:
                    self._after_shutting_down("hello", exc, deadline_s, resends)
                    resends += 1
                    continue
                # A daemon from before hello's "features" refuses the field: it has no disk tier to
                # name either, so the same hello without it loses nothing.
                if not (self._send_features and exc.code == ErrorCode.INVALID_FIELD and "'features'" in str(exc)):
                    raise
                self._send_features = False
        self.sid = rh.sid
        self.lease_s = rh.lease_s
        self.heartbeat_s = rh.heartbeat_s
        self.pool_info = dict(rh.pool)
        self.limits = dict(rh.limits)
        features = rh.features
        self.features = tuple(f for f in features if isinstance(f, str)) if isinstance(features, list) else ()
        self.packed_hashes = isinstance(features, list) and FEATURE_PACKED_HASHES in features
        self.hints = isinstance(features, list) and FEATURE_HINTS in features
        self.hint_output_tokens = self.hints and FEATURE_HINT_OUTPUT_TOKENS in features
        self.pin_tags = isinstance(features, list) and FEATURE_PIN_TAGS in features
        self.deadlines = (isinstance(features, list) and FEATURE_DEADLINES in features
                          and shares_clock(rh.clock, window_ns[0], window_ns[1]))
        self.gone = False

    def call(self, op: str, fields: Mapping[str, Any], frames: Sequence[Any], deadline_s: float, *,
             idempotent: bool | None = None) -> tuple[Any, list[Any]]:
        """One request in a live session: reopened first if the daemon forgot ours, resent if it forgets it now.
        ``idempotent`` overrides the verb's (a pinned lookup is not: resent, it would pin twice)."""
        if self.pending_loss is not None:
            self._raise_pending_loss()
        if idempotent is None:
            idempotent = OPS[op].idempotent
        resends = 0
        while True:
            try:
                if self.gone:
                    self._reestablish(deadline_s)
                # Stamped per send (after a re-opened session too): only data-plane requests carry a "plane".
                sent = self._stamped(op, fields, deadline_s) if "plane" in fields else fields
                return self._transport.retry(op, deadline_s, self._send, op, sent, frames, idempotent=idempotent)
            except SessionLost:
                raise
            except DaemonError as exc:
                if exc.code == ErrorCode.SHUTTING_DOWN:
                    # Not run either; the daemon that serves next does not know this session.
                    self._after_shutting_down(op, exc, deadline_s, resends)
                    resends += 1
                elif exc.code != ErrorCode.UNKNOWN_SESSION or time.monotonic() >= deadline_s:
                    raise
                # Rejected before it ran: safe to resend, whatever the verb.
                self.gone = True

    def _after_shutting_down(self, op: str, exc: DaemonError, deadline_s: float, resends: int) -> None:
        """The daemon said SHUTTING_DOWN (the module docstring): drop the socket, pause, or raise at the deadline."""
        self._transport.reset()
        left_s = deadline_s - time.monotonic()
        if left_s <= 0:
            raise exc
        if resends:
            time.sleep(min(SHUTDOWN_PAUSE_S * 2 ** (resends - 1), MAX_SHUTDOWN_PAUSE_S, left_s / 2))
        else:
            log.info("kvtier %s: the daemon at %s is shutting down or handing over; resending on a new connection",
                     op, self._transport.endpoint)

    def _stamped(self, op: str, fields: Mapping[str, Any], deadline_s: float) -> Mapping[str, Any]:
        """The request as sent now: with the call's deadline where the daemon works on this process's memory.

        Settled per send, like packed hashes: a session re-opened on a daemon
        without the feature (or on another clock) sends none. The transport
        gives up a resendable call only once ``deadline_s`` has passed, so the
        daemon, which acts only before ``deadline_ns``, never acts after it;
        the microsecond taken off covers float rounding.
        """
        if not self.deadlines or fields.get("plane", "inline") == "inline" or "deadline_ns" not in OPS[op].fields:
            return fields
        return {**fields, "deadline_ns": int(deadline_s * 1e9) - DEADLINE_ROUNDING_NS}

    def call_many(self, op: str, fields_list: Sequence[Mapping[str, Any]], deadline_s: float) -> list[Any]:
        """Many requests of one verb, pipelined: every reply header, errors included; no resend after a timeout."""
        self._raise_pending_loss()
        for attempt in range(2):
            self._ensure(deadline_s)
            try:
                replies = self._transport.roundtrip_many(op, fields_list, deadline_s, sid=self.sid,
                                                         packed_hashes=self.packed_hashes)
            except KvtierTimeout:
                self._transport.reset()
                raise
            lost = next((rh for rh in replies
                         if _error_code(rh) in (ErrorCode.UNKNOWN_SESSION, ErrorCode.SHUTTING_DOWN)), None)
            if lost is None:
                return replies
            if attempt:
                raise error_of(lost, op)
            # The daemon forgot the session (or is leaving: its successor will not know it): what it ran
            # before (pins) went with it, and it ran nothing after. Open a new one, send all again.
            if _error_code(lost) == ErrorCode.SHUTTING_DOWN:
                self._transport.reset()
            self.gone = True
        raise AssertionError("unreachable")

    def _raise_pending_loss(self) -> None:
        """Raise (once) the ``SessionLost`` the heartbeat thread found."""
        if self.pending_loss is not None:
            loss, self.pending_loss = self.pending_loss, None
            raise loss

    def _ensure(self, deadline_s: float) -> None:
        """A live session before a request is sent: a new one if the daemon forgot ours."""
        if self.gone:
            self._reestablish(deadline_s)

    def arena_fields(self) -> dict[str, Any]:
        assert self.arena is not None
        return arena_fields(self.arena)

    def _reestablish(self, deadline_s: float) -> None:
        """New session after the daemon forgot ours; raise SessionLost if state was lost."""
        lost_pins = sorted(self.pins.elements())
        lost_requests = sorted(self.requests)
        held = (Counter(self.pins), dict(self.tag_pins), set(self.requests), dict(self.tokens))
        self.pins.clear()
        self.tag_pins.clear()
        self.requests.clear()
        self.tokens.clear()
        old_sid = self.sid
        self.sid = None
        try:
            self.hello(deadline_s)
            lost_arena = self._restore_state(deadline_s)
        except BaseException:
            # Half a session (no arena or registrations) must not pass for a
            # whole one: the next call starts over with a new hello, and
            # reports what the old session held then.
            self.pins, self.tag_pins, self.requests, self.tokens = held
            self.gone = True
            raise
        log.warning("kvtier session %s lost; new session %s", (old_sid or "")[:8], (self.sid or "")[:8])
        if lost_pins or lost_requests or lost_arena:
            raise SessionLost(
                f"the daemon lost session {old_sid} (restart or lease expiry): "
                f"{len(lost_pins)} pins and {len(lost_requests)} requests are gone"
                + ("; the arena's file was unlinked: call open_arena again" if lost_arena else ""),
                lost_pins,
                lost_requests,
                lost_arena=lost_arena,
            )

    def _restore_state(self, deadline_s: float) -> bool:
        """Re-attach the arena and re-register KV tensors in a new session; True if the arena is lost."""
        lost_arena = False
        if self.arena is not None:
            try:
                self._send("attach_arena", self.arena_fields(), (), deadline_s)
            except DaemonError as exc:
                if exc.code != ErrorCode.NOT_FOUND:
                    raise
                # Our lease ran out and the daemon unlinked the arena's file: its
                # name cannot come back. Dropped, not silently replaced: the
                # caller's views of the old memory would no longer be the
                # daemon's. open_arena makes a new one.
                arena, self.arena = self.arena, None
                arena.close()
                lost_arena = True
        for name, reg in self.registrations.items():
            self._send("register_kv", {"name": name, "tensors": reg.tensors}, (), deadline_s)
        return lost_arena

    def recover_in_background(self, sid: str, timeout_s: float) -> None:
        """The daemon forgot ``sid``: open a new session now, so that an engine's
        registered KV tensors (its GPU tier) come back without waiting for its
        next call. A loss of pins or requests is raised by that next call."""
        with self._lock:
            if self.closed or self.sid != sid:
                return  # already re-established (or closing)
            self.gone = True
            try:
                self._reestablish(time.monotonic() + timeout_s)
            except SessionLost as loss:
                self.pending_loss = loss
            except KvtierError as exc:
                log.warning("kvtier session recovery failed (the next call retries): %s", exc)


class Heartbeat:
    """See the module docstring."""

    def __init__(self, session: Session, transport: Transport, recover: Callable[[str], None]) -> None:
        self._session = session
        self._transport = transport
        self._recover = recover
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(join_timeout_s)

    def _loop(self) -> None:
        session = self._session
        sock: zmq.Socket | None = None
        try:
            while not self._stop.wait(session.heartbeat_s):
                sid = session.sid
                if sid is None or session.gone:
                    continue
                if sock is None:
                    sock = self._transport.new_socket()
                rid = self._transport.next_id()
                try:
                    sock.send(encode(request_header("heartbeat", rid, sid)), flags=zmq.NOBLOCK)
                except zmq.Again:
                    continue
                deadline_s = time.monotonic() + session.heartbeat_s
                answered = False
                while (remaining_ms := int((deadline_s - time.monotonic()) * 1000)) > 0:
                    if not sock.poll(remaining_ms, zmq.POLLIN):
                        break
                    try:
                        rh = decode(sock.recv_multipart()[0])
                    except Exception:
                        continue
                    if not isinstance(rh, dict) or rh.get("id") != rid:
                        continue
                    answered = True
                    err = rh.get("error") if rh.get("ok") is False else None
                    if isinstance(err, dict) and err.get("code") == int(ErrorCode.UNKNOWN_SESSION):
                        self._recover(sid)
                    elif isinstance(err, dict) and err.get("code") == int(ErrorCode.SHUTTING_DOWN):
                        answered = False  # the next heartbeat goes on a new connection (a successor's)
                    break
                if not answered:
                    sock.close(linger=0)  # start clean against a restarted daemon
                    sock = None
        except zmq.ContextTerminated:
            pass
        finally:
            if sock is not None:
                sock.close(linger=0)
