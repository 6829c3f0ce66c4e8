"""The kvtier client: what an inference engine uses to talk to kvtierd.

Contract
========

- ``Client(endpoint, pool, layout)`` connects a DEALER socket, sends
  ``hello`` and holds the session it gets. Every call takes ``timeout_s``
  (default: the client's) and turns it into a monotonic deadline that covers
  the whole call, retries included. A call that misses it raises
  ``KvtierTimeout``.
- Errors: ``DaemonError(code, message)`` for an error reply (``code`` is a
  ``protocol.ErrorCode``); ``ProtocolError`` for a reply that breaks the
  protocol or a request this library refuses to send; ``KvtierTimeout``;
  ``SessionLost`` (a ``DaemonError``) when the daemon forgot the session
  (restart or lease expiry) while it held pins or engine requests. All derive
  from ``KvtierError``.
- Reconnects: after a timeout the client drops its socket (stale replies go
  with it) and opens a new one. When the daemon answers UNKNOWN_SESSION, the
  client sends a new ``hello``, re-attaches its arena and re-registers its KV
  tensors, and then retries the call (the daemon had rejected it unexecuted).
  If the old session held pins or requests, or its arena cannot be
  re-attached (a lease expiry unlinks the arena's file), the call raises
  ``SessionLost`` instead, listing them, once; the new session is ready for
  the next call (without the lost arena: ``open_arena`` makes a new one).
- Only idempotent verbs (``protocol.OPS[op].idempotent``) are resent after a
  timeout; others raise ``KvtierTimeout`` at once, since the daemon may or
  may not have executed them.
- Heartbeats: a background thread renews the lease every ``heartbeat_s`` on
  its own DEALER socket (ZMQ sockets are not thread-safe) with the same
  session id. When a heartbeat finds the session gone, that thread opens the
  new session itself (under the lock, on the main socket), so registrations
  come back while the engine is idle; a ``SessionLost`` it finds is raised by
  the next call, which is then not sent. The main socket is guarded by a
  lock, so a Client may be shared by threads (their calls are serialised).
- Security: ``curve_server_key`` (the daemon's public key, Z85 or its key
  file) with ``curve_secret_key_file`` (this client's ``NAME.key_secret``)
  makes every socket of the client a CURVE client (``kvtier.client.curve``):
  required by a daemon with CURVE keys configured, which never answers a
  client it does not know. ``token`` is sent in ``hello`` to a daemon that
  serves tenants by token; the session then works in that tenant's block
  namespace. A refused identity raises ``DaemonError`` with code
  UNAUTHORIZED.
- Packed hashes: when the daemon's hello reply lists the feature
  ``"packed_hashes"``, hash lists go out as one packed bin and the daemon
  answers with packed tier codes; otherwise as arrays (an older daemon).
  Either way ``lookup``/``pin``/``allocate``/``restore`` return tiers as a
  ``Sequence[str]``: a ``TierList`` over the codes, or a list of strings.
- Importing this module imports no torch. ``register_kv`` accepts torch
  tensors and imports ``kvtier.client.kv_share`` only when called.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq

from kvtier.client.curve import CurveKeys
from kvtier.client.hashing import BlockHasher
from kvtier.client.protocol import (
    FEATURE_HINTS,
    FEATURE_PACKED_HASHES,
    HASH_BYTES,
    OPS,
    PROTOCOL_VERSION,
    ErrorCode,
    Hints,
    KvtierError,
    ProtocolError,
    TierList,
    decode,
    encode,
    error_name,
    frame_nbytes,
    request_header,
)
from kvtier.client.shm_arena import SHM_DIR, ShmArena

__all__ = [
    "Allocation",
    "Client",
    "DaemonError",
    "KvtierError",
    "KvtierTimeout",
    "PoolLayout",
    "ProtocolError",
    "RestoreResult",
    "SessionLost",
    "TierList",
    "probe_health",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
# A retried call gives each attempt at most this share of the time left, so a
# request lost with a dying daemon leaves time for one on the new daemon.
ATTEMPT_SHARE = 0.5
MIN_ATTEMPT_S = 0.2


class KvtierTimeout(KvtierError, TimeoutError):
    """No reply before the call's deadline."""


class DaemonError(KvtierError):
    """The daemon answered with an error."""

    def __init__(self, code: int, message: str) -> None:
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else code
        self.name = error_name(code)
        self.message = message
        super().__init__(f"{self.name} ({int(code)}): {message}")


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


@dataclass(frozen=True)
class Allocation:
    block_ids: list[int]  # the request's whole block table
    tiers: Sequence[str]  # tier of each hit block, prefix order
    num_gpu_hits: int
    num_cpu_hits: int

    @property
    def num_hit_blocks(self) -> int:
        return len(self.tiers)


@dataclass(frozen=True)
class RestoreResult:
    tiers: Sequence[str]  # one per restored block: the longest held prefix
    data: memoryview | None = None  # inline plane: len(tiers) * block_bytes bytes, zero-copy

    def __len__(self) -> int:
        return len(self.tiers)


@dataclass
class _Registration:
    tensors: list[dict[str, Any]]  # wire form (kv_share descriptors + block dims)
    keep: list[Any]  # the exported tensors/handles, alive while registered


@dataclass
class _TokenState:
    """What append_tokens needs to continue a request's hash chain."""

    num_tokens: int
    parent: bytes | None
    pending: list[int]  # tokens of the trailing partial block
    hash_kwargs: dict[str, Any] = field(default_factory=dict)


def _as_buffer(data: Any) -> Any:
    """A zero-copy buffer for an inline payload (bytes-like, numpy array, CPU torch tensor)."""
    if hasattr(data, "numpy") and hasattr(data, "is_cuda"):
        # A torch tensor: its numpy view shares memory. Checked by attribute so
        # this module never imports torch.
        if data.is_cuda:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "inline data must be in host memory")
        return data.contiguous().numpy()
    return data


def _check_hashes(hashes: Sequence[bytes]) -> list[bytes]:
    out = list(hashes)
    for h in out:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            i = next(i for i, x in enumerate(out) if x is h)  # counted only here: enumerate costs ~1 us per 256
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"block hash {i}: must be {HASH_BYTES}-byte bytes, got {h!r:.40}")
    return out


def _pack_hashes(hashes: Sequence[bytes]) -> bytes:
    """The packed-hashes bin of ``hashes``, checked on the way.

    The join is the type check (it refuses anything that is not a buffer,
    naming it) and one len() pass in C the length check: 4.4 us for 256
    hashes, against 6.9 us for the exact per-element check alone (a Python
    loop, or one pass for the types and one for the lengths: the same) plus
    the join. The total length catches a buffer whose len() is not its size.
    A 16-byte bytearray or memoryview goes through: it packs to the same bin.
    """
    try:
        packed = b"".join(hashes)
    except TypeError:
        packed = b""
    n = len(hashes)
    if len(packed) != HASH_BYTES * n or list(map(len, hashes)).count(HASH_BYTES) != n:
        _check_hashes(hashes)  # names the culprit
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"block hashes must be {HASH_BYTES}-byte bytes")
    return packed


def _tier_list(tiers: Any) -> Sequence[str]:
    # Packed in, packed out: codes come back as one bin, names as an array.
    return TierList(tiers) if type(tiers) is bytes else list(tiers)


class Client:
    """See the module docstring."""

    def __init__(
        self,
        endpoint: str,
        pool: str,
        layout: PoolLayout | Mapping[str, Any],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        lease_s: float | None = None,
        client_name: str = "",
        heartbeat: bool = True,
        curve_server_key: str | bytes | os.PathLike[str] | None = None,
        curve_secret_key_file: str | os.PathLike[str] | None = None,
        token: str | None = None,
    ) -> None:
        if (curve_server_key is None) != (curve_secret_key_file is None):
            raise ValueError("CURVE needs both curve_server_key and curve_secret_key_file")
        self._curve = CurveKeys.load(curve_server_key, curve_secret_key_file) if curve_server_key is not None else None
        self._token = token
        self.endpoint = endpoint
        self.pool = pool
        self.layout = layout.to_wire() if isinstance(layout, PoolLayout) else dict(layout)
        self.timeout_s = timeout_s
        self._lease_request_s = lease_s
        self._client_name = client_name
        self._zctx = zmq.Context()
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self.sid: str | None = None
        self.lease_s = 0.0
        self.heartbeat_s = 0.0
        self.pool_info: dict[str, Any] = {}
        self.limits: dict[str, Any] = {}
        self.features: tuple[str, ...] = ()  # what the daemon listed in its hello reply
        self._packed_hashes = False  # the daemon listed FEATURE_PACKED_HASHES in its hello reply
        self._hints = False  # ... and FEATURE_HINTS
        self._session_gone = False  # the daemon answered UNKNOWN_SESSION
        self._pending_loss: SessionLost | None = None  # found by the heartbeat thread, raised by the next call
        self._pins: Counter[bytes] = Counter()
        self._requests: set[str] = set()
        self._tokens: dict[str, _TokenState] = {}
        self._registrations: dict[str, _Registration] = {}
        self._arena: ShmArena | None = None
        self._closed = False
        self.hasher = BlockHasher(int(self.layout["block_size"]), str(self.layout.get("hash_algo", "xxh3_128")))
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        try:
            with self._lock:
                self._hello(time.monotonic() + timeout_s)
        except BaseException:
            self._teardown()
            raise
        if heartbeat:
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="kvtier-heartbeat", daemon=True)
            self._hb_thread.start()

    # ---- lifecycle -------------------------------------------------------------

    def close(self, timeout_s: float = 1.0) -> None:
        """End the session (best effort), stop the heartbeat, drop the sockets."""
        if self._closed:
            return
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout_s + 1.0)
        with self._lock:
            if self.sid is not None:
                try:
                    self._roundtrip("bye", {}, (), time.monotonic() + timeout_s)
                except KvtierError:
                    pass  # the lease will release it
            self._closed = True
            self._teardown()

    def _teardown(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._arena is not None:
            self._arena.close()
            self._arena.unlink()
            self._arena = None
        self._zctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the request path ------------------------------------------------------

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._new_socket()
        return self._sock

    def _new_socket(self) -> zmq.Socket:
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.apply(sock)
        sock.connect(self.endpoint)
        return sock

    def _reset_socket(self) -> None:
        # A fresh DEALER: replies to abandoned requests cannot reach it, and it
        # reconnects to a restarted daemon from scratch.
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _roundtrip(
        self, op: str, fields: Mapping[str, Any], frames: Sequence[Any], deadline_s: float, *, with_sid: bool = True
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Send one request and wait for its reply; raises on error replies."""
        rid = next(self._ids)
        # The form is settled per send: a call that re-opened its session on
        # an older daemon sends the hashes it packed as an array again.
        header = request_header(op, rid, self.sid if with_sid else None, packed_hashes=self._packed_hashes, **fields)
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
            raise _error_of(rh, op)

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

    def _roundtrip_many(self, op: str, fields_list: Sequence[Mapping[str, Any]], deadline_s: float) -> list[dict[str, Any]]:
        """Send every request, then collect every reply: one round trip for all of them."""
        sock = self._socket()
        rids: list[int] = []
        for fields in fields_list:
            rid = next(self._ids)
            header = request_header(op, rid, self.sid, packed_hashes=self._packed_hashes, **fields)
            try:
                sock.send_multipart([encode(header)], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise KvtierTimeout(f"{op}: cannot queue the request (daemon unreachable at {self.endpoint})") from None
            rids.append(rid)
        replies: dict[int, dict[str, Any]] = {}
        error: KvtierError | None = None
        while len(replies) < len(rids):
            rh, _ = self._next_reply(sock, op, deadline_s)
            rid = rh.get("id")
            if rid == 0 and rh["ok"] is not True:
                raise _error_of(rh, op)  # an error the daemon could not tie to a request
            if rid not in rids or rid in replies:
                continue  # a late reply to an earlier request on this socket
            replies[rid] = rh
            if rh["ok"] is not True and error is None:
                error = _error_of(rh, op)
        if error is not None:
            raise error
        return [replies[rid] for rid in rids]

    def _call(
        self,
        op: str,
        fields: Mapping[str, Any] | None = None,
        frames: Sequence[Any] = (),
        *,
        timeout_s: float | None = None,
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        if self._closed:
            raise KvtierError("client is closed")
        deadline_s = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        idempotent = OPS[op].idempotent
        fields = dict(fields or {})
        with self._lock:
            if self._pending_loss is not None:
                loss, self._pending_loss = self._pending_loss, None
                raise loss
            while True:
                if self._session_gone:
                    self._reestablish(deadline_s)
                remaining_s = deadline_s - time.monotonic()
                attempt_deadline_s = deadline_s
                if idempotent:
                    attempt_deadline_s = time.monotonic() + max(MIN_ATTEMPT_S, remaining_s * ATTEMPT_SHARE)
                    attempt_deadline_s = min(attempt_deadline_s, deadline_s)
                try:
                    return self._roundtrip(op, fields, frames, attempt_deadline_s)
                except KvtierTimeout:
                    self._reset_socket()
                    if not idempotent or time.monotonic() >= deadline_s:
                        raise
                    log.info("kvtier %s timed out; retrying on a new socket", op)
                except DaemonError as exc:
                    if exc.code != ErrorCode.UNKNOWN_SESSION:
                        raise
                    # Rejected before it ran: safe to resend, whatever the verb.
                    self._session_gone = True

    def _call_many(self, op: str, fields_list: Sequence[Mapping[str, Any]], *,
                   timeout_s: float | None = None) -> list[dict[str, Any]]:
        """``_call`` for many requests of one idempotent verb, pipelined; all or nothing.

        Any error reply raises (after every reply is read); a timeout resets
        the socket and raises, without a retry: the caller's deadline covers
        the whole batch.
        """
        if not OPS[op].idempotent:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{op} is not idempotent: it cannot be pipelined")
        if self._closed:
            raise KvtierError("client is closed")
        deadline_s = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            if self._pending_loss is not None:
                loss, self._pending_loss = self._pending_loss, None
                raise loss
            for attempt in range(2):
                if self._session_gone:
                    self._reestablish(deadline_s)
                try:
                    return self._roundtrip_many(op, fields_list, deadline_s)
                except KvtierTimeout:
                    self._reset_socket()
                    raise
                except DaemonError as exc:
                    if exc.code != ErrorCode.UNKNOWN_SESSION or attempt:
                        raise
                    # The daemon forgot the session: it ran none of them (every
                    # request carried that session). Open a new one, send again.
                    self._session_gone = True
        raise AssertionError("unreachable")

    def _hello(self, deadline_s: float) -> None:
        fields: dict[str, Any] = {"pool": self.pool, "layout": self.layout, "client": self._client_name}
        if self._lease_request_s is not None:
            fields["lease_s"] = self._lease_request_s
        if self._token is not None:
            fields["token"] = self._token
        while True:
            attempt_deadline_s = min(deadline_s, time.monotonic() + max(MIN_ATTEMPT_S, (deadline_s - time.monotonic()) * ATTEMPT_SHARE))
            try:
                rh, _ = self._roundtrip("hello", fields, (), attempt_deadline_s, with_sid=False)
                break
            except KvtierTimeout:
                self._reset_socket()
                if time.monotonic() >= deadline_s:
                    raise KvtierTimeout(f"no kvtierd answering at {self.endpoint}") from None
        self.sid = str(rh["sid"])
        self.lease_s = float(rh["lease_s"])
        self.heartbeat_s = float(rh["heartbeat_s"])
        self.pool_info = dict(rh.get("pool", {}))
        self.limits = dict(rh.get("limits", {}))
        features = rh.get("features")
        self.features = tuple(f for f in features if isinstance(f, str)) if isinstance(features, list) else ()
        self._packed_hashes = isinstance(features, list) and FEATURE_PACKED_HASHES in features
        self._hints = isinstance(features, list) and FEATURE_HINTS in features
        self._session_gone = False

    def _reestablish(self, deadline_s: float) -> None:
        """New session after the daemon forgot ours; raise SessionLost if state was lost."""
        lost_pins = sorted(self._pins.elements())
        lost_requests = sorted(self._requests)
        self._pins.clear()
        self._requests.clear()
        self._tokens.clear()
        old_sid = self.sid
        self.sid = None
        self._hello(deadline_s)
        try:
            lost_arena = self._restore_session_state(deadline_s)
        except BaseException:
            # Half a session (no arena or registrations) must not pass for a
            # whole one: the next call starts over with a new hello.
            self._session_gone = True
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

    def _restore_session_state(self, deadline_s: float) -> bool:
        """Re-attach the arena and re-register KV tensors in a new session; True if the arena is lost."""
        lost_arena = False
        if self._arena is not None:
            try:
                self._roundtrip("attach_arena", self._arena_fields(), (), deadline_s)
            except DaemonError as exc:
                if exc.code != ErrorCode.NOT_FOUND:
                    raise
                # Our lease ran out and the daemon unlinked the arena's file: its
                # name cannot come back. Dropped, not silently replaced: the
                # caller's views of the old memory would no longer be the
                # daemon's. open_arena makes a new one.
                arena, self._arena = self._arena, None
                arena.close()
                lost_arena = True
        for name, reg in self._registrations.items():
            self._roundtrip("register_kv", {"name": name, "tensors": reg.tensors}, (), deadline_s)
        return lost_arena

    # ---- heartbeats ----------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        sock: zmq.Socket | None = None
        try:
            while not self._hb_stop.wait(self.heartbeat_s):
                sid = self.sid
                if sid is None or self._session_gone:
                    continue
                if sock is None:
                    sock = self._new_socket()
                rid = next(self._ids)
                try:
                    sock.send(encode(request_header("heartbeat", rid, sid)), flags=zmq.NOBLOCK)
                except zmq.Again:
                    continue
                deadline_s = time.monotonic() + self.heartbeat_s
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
                        self._recover_in_background(sid)
                    break
                if not answered:
                    sock.close(linger=0)  # start clean against a restarted daemon
                    sock = None
        except zmq.ContextTerminated:
            pass
        finally:
            if sock is not None:
                sock.close(linger=0)

    def _recover_in_background(self, sid: str) -> None:
        """The daemon forgot ``sid``: open a new session now, so that an engine's
        registered KV tensors (its GPU tier) come back without waiting for its
        next call. A loss of pins or requests is raised by that next call."""
        with self._lock:
            if self._closed or self.sid != sid:
                return  # already re-established (or closing)
            self._session_gone = True
            try:
                self._reestablish(time.monotonic() + self.timeout_s)
            except SessionLost as loss:
                self._pending_loss = loss
            except KvtierError as exc:
                log.warning("kvtier session recovery failed (the next call retries): %s", exc)

    # ---- verbs: session and daemon -------------------------------------------

    def heartbeat(self, *, timeout_s: float | None = None) -> None:
        self._call("heartbeat", timeout_s=timeout_s)

    def health(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        rh, _ = self._call("health", timeout_s=timeout_s)
        return _strip(rh)

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        rh, _ = self._call("stats", timeout_s=timeout_s)
        return _strip(rh)

    def clear(self, *, timeout_s: float | None = None) -> int:
        rh, _ = self._call("clear", timeout_s=timeout_s)
        return int(rh["cleared"])

    # ---- lookups and pins ------------------------------------------------------

    def _wire_hashes(self, hashes: Sequence[bytes], *, keys: bool = False) -> tuple[list[bytes], Any]:
        """Checked hashes and their wire form: packed when the daemon takes it.
        ``keys``: the caller counts them as pins, so they must be exactly bytes."""
        if keys or not self._packed_hashes:
            out = _check_hashes(hashes)
            return out, out
        out = hashes if type(hashes) is list else list(hashes)
        return out, _pack_hashes(out)

    def _with_hints(self, fields: dict[str, Any], hints: Hints | None) -> dict[str, Any]:
        if hints is not None and self._hints:
            wire = hints.to_wire()
            if wire:
                fields["hints"] = wire
        return fields

    def lookup(self, hashes: Sequence[bytes], *, pin: bool = False, hints: Hints | None = None,
               timeout_s: float | None = None) -> Sequence[str]:
        """Tiers of the longest cached prefix of ``hashes`` ("gpu"/"cpu"/"remote" per block).

        ``hints`` (session, retain_s, priority) tell the daemon's eviction what
        the application knows; a daemon without the "hints" feature is sent
        none (they are soft, so nothing fails for it).
        """
        hashes, wire = self._wire_hashes(hashes, keys=pin)
        rh, _ = self._call("lookup", self._with_hints({"hashes": wire, "pin": pin}, hints), timeout_s=timeout_s)
        tiers = _tier_list(rh["tiers"])
        if pin:
            self._pins.update(hashes[: rh.get("pinned", 0)])
        return tiers

    def lookup_many(self, requests: Sequence[Sequence[bytes]], *, pin: bool = False,
                    hints: Sequence[Hints | None] | None = None, timeout_s: float | None = None) -> list[Sequence[str]]:
        """``lookup`` of each hash list, pipelined: all requests go out before any reply is read.

        One round trip for the batch instead of one each (a scheduler that
        admits many requests at once); each answer is exactly what ``lookup``
        would have returned, in order.
        """
        wires = [self._wire_hashes(h, keys=pin) for h in requests]
        if not wires:
            return []
        if hints is not None and len(hints) != len(wires):
            raise ValueError(f"{len(wires)} requests but {len(hints)} hints")
        per = hints if hints is not None else [None] * len(wires)
        replies = self._call_many("lookup", [self._with_hints({"hashes": w, "pin": pin}, h)
                                             for (_, w), h in zip(wires, per)], timeout_s=timeout_s)
        out: list[Sequence[str]] = []
        for (hashes, _), rh in zip(wires, replies):
            if pin:
                self._pins.update(hashes[: rh.get("pinned", 0)])
            out.append(_tier_list(rh["tiers"]))
        return out

    def pin(self, hashes: Sequence[bytes], *, timeout_s: float | None = None) -> Sequence[str]:
        hashes = _check_hashes(hashes)
        rh, _ = self._call("pin", {"hashes": hashes}, timeout_s=timeout_s)
        tiers = _tier_list(rh["tiers"])
        self._pins.update(hashes[: len(tiers)])
        return tiers

    def unpin(self, hashes: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        hashes = _check_hashes(hashes)
        rh, _ = self._call("unpin", {"hashes": hashes}, timeout_s=timeout_s)
        self._pins.subtract(h for h in hashes if self._pins[h] > 0)
        self._pins = +self._pins
        return int(rh["unpinned"])

    # ---- engine-managed mode ---------------------------------------------------

    def allocate(self, req: str, hashes: Sequence[bytes], num_tokens: int, *, hints: Hints | None = None,
                 timeout_s: float | None = None) -> Allocation:
        """Block table for a new request; CPU-tier hits are already restored into their slots."""
        _, wire = self._wire_hashes(hashes)
        rh, _ = self._call("allocate", self._with_hints({"req": req, "hashes": wire, "num_tokens": num_tokens}, hints),
                           timeout_s=timeout_s)
        self._requests.add(req)
        return Allocation(list(rh["block_ids"]), _tier_list(rh["tiers"]), int(rh["num_gpu_hits"]), int(rh["num_cpu_hits"]))

    def append(self, req: str, num_new_tokens: int, new_hashes: Sequence[bytes], *,
               timeout_s: float | None = None) -> tuple[list[int], list[int]]:
        """Grow a request; returns (whole block table, newly allocated block ids)."""
        _, wire = self._wire_hashes(new_hashes)
        rh, _ = self._call("append", {"req": req, "num_tokens": num_new_tokens, "hashes": wire}, timeout_s=timeout_s)
        return list(rh["block_ids"]), list(rh["new_block_ids"])

    def free(self, req: str, *, valid_tokens: int | None = None, timeout_s: float | None = None) -> None:
        """Release a request. ``valid_tokens``: after a failure, how many leading
        tokens' K/V were really written; blocks past them are not kept cached."""
        fields: dict[str, Any] = {"req": req}
        if valid_tokens is not None:
            fields["valid_tokens"] = valid_tokens
        self._call("free", fields, timeout_s=timeout_s)
        self._requests.discard(req)
        self._tokens.pop(req, None)

    def hashes_for(self, token_ids: Sequence[int], **hash_kwargs: Any) -> list[bytes]:
        """Block hashes of the full blocks of ``token_ids`` (see ``BlockHasher.hash_blocks``)."""
        return self.hasher.hash_blocks(token_ids, **hash_kwargs)

    def allocate_tokens(self, req: str, token_ids: Sequence[int], *, timeout_s: float | None = None,
                        **hash_kwargs: Any) -> Allocation:
        """``allocate`` from token ids: hashes computed here; ``append_tokens`` continues the chain."""
        tokens = list(token_ids)
        hashes = self.hasher.hash_blocks(tokens, **hash_kwargs)
        alloc = self.allocate(req, hashes, len(tokens), timeout_s=timeout_s)
        bs = self.hasher.block_size
        self._tokens[req] = _TokenState(len(tokens), hashes[-1] if hashes else None,
                                        tokens[len(hashes) * bs:], hash_kwargs)
        return alloc

    def append_tokens(self, req: str, new_token_ids: Sequence[int], *,
                      timeout_s: float | None = None) -> tuple[list[int], list[int]]:
        """``append`` from the new token ids of a request started with ``allocate_tokens``."""
        state = self._tokens.get(req)
        if state is None:
            raise KvtierError(f"request {req!r} was not started with allocate_tokens")
        bs = self.hasher.block_size
        tokens = state.pending + list(new_token_ids)
        start_block = (state.num_tokens - len(state.pending)) // bs
        new_hashes = self.hasher.hash_blocks(tokens, parent=state.parent, start_block=start_block,
                                             **state.hash_kwargs) if len(tokens) >= bs else []
        table = self.append(req, len(new_token_ids), new_hashes, timeout_s=timeout_s)
        state.num_tokens += len(new_token_ids)
        if new_hashes:
            state.parent = new_hashes[-1]
        state.pending = tokens[len(new_hashes) * bs:]
        return table

    # ---- store mode --------------------------------------------------------------

    def store(
        self,
        hashes: Sequence[bytes],
        data: Any = None,
        *,
        slots: Sequence[int] | None = None,
        reg: str | None = None,
        hints: Hints | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, int]:
        """Store blocks; returns (stored, already present).

        Where the bytes are: ``data`` (inline: one bytes-like object of
        ``len(hashes) * block_bytes`` bytes, or a list of per-block ones),
        ``slots`` of this client's arena (``open_arena``), or ``slots`` of the
        registered tensors ``reg``.
        """
        hashes, wire = self._wire_hashes(hashes)
        fields, frames = self._plane(data, slots, reg, len(hashes))
        fields["hashes"] = wire
        rh, _ = self._call("store", self._with_hints(fields, hints), frames, timeout_s=timeout_s)
        return int(rh["stored"]), int(rh["present"])

    def restore(
        self,
        hashes: Sequence[bytes],
        *,
        slots: Sequence[int] | None = None,
        reg: str | None = None,
        timeout_s: float | None = None,
    ) -> RestoreResult:
        """Copy out the longest held prefix: inline (``data``), to arena ``slots``, or to ``reg``'s slots."""
        hashes, wire = self._wire_hashes(hashes)
        fields, _ = self._plane(None, slots, reg, len(hashes))
        fields["hashes"] = wire
        rh, frames = self._call("restore", fields, timeout_s=timeout_s)
        tiers = _tier_list(rh["tiers"])
        if fields["plane"] != "inline":
            return RestoreResult(tiers)
        data = frames[0].buffer if frames else memoryview(b"")
        expected = len(tiers) * int(self.pool_info.get("block_bytes", self.layout["block_bytes"]))
        if data.nbytes != expected:
            raise ProtocolError(ErrorCode.MALFORMED, f"restore reply carries {data.nbytes} bytes for {len(tiers)} blocks")
        return RestoreResult(tiers, data)

    def _plane(self, data: Any, slots: Sequence[int] | None, reg: str | None, n: int) -> tuple[dict[str, Any], list[Any]]:
        if slots is None:
            if reg is not None:
                raise ProtocolError(ErrorCode.INVALID_FIELD, "reg needs slots")
            frames: list[Any] = []
            if data is not None:
                if isinstance(data, (list, tuple)):
                    data = b"".join(bytes(memoryview(_as_buffer(d)).cast("B")) for d in data)
                buf = _as_buffer(data)
                limit = self.limits.get("max_payload_bytes")
                if limit is not None and frame_nbytes(buf) > limit:
                    raise ProtocolError(ErrorCode.TOO_LARGE, f"payload of {frame_nbytes(buf)} bytes exceeds the daemon's {limit}")
                frames = [buf]
            return {"plane": "inline"}, frames
        if data is not None:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "give data or slots, not both")
        slots = [int(s) for s in slots]
        if len(slots) != n:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{n} hashes but {len(slots)} slots")
        if reg is None:
            if self._arena is None:
                raise KvtierError("no arena: call open_arena first")
            return {"plane": "shm", "slots": slots}, []
        return {"plane": "kv", "slots": slots, "reg": reg}, []

    # ---- data planes 2 and 3 -----------------------------------------------------

    def open_arena(self, num_slots: int, *, timeout_s: float | None = None) -> ShmArena:
        """Create this client's shared-memory staging arena (one block per slot) and announce it."""
        if self._arena is not None:
            raise KvtierError("this client already has an arena")
        block_bytes = int(self.layout["block_bytes"])
        arena = ShmArena.create(num_slots, block_bytes, name_prefix=f"kvtier-{(self.sid or 'x')[:8]}")
        self._arena = arena
        try:
            self._share_with_daemon([arena.name])
            self._call("attach_arena", self._arena_fields(), timeout_s=timeout_s)
        except BaseException:
            self._arena = None
            arena.close()
            arena.unlink()
            raise
        return arena

    @property
    def arena(self) -> ShmArena | None:
        return self._arena

    def _share_with_daemon(self, shm_names: Sequence[str]) -> None:
        """Give shared-memory files to a daemon running as another user: its group, mode 0660.

        The daemon's socket file is owned by the daemon's user and group.
        When that user is not this one, the files this client made (0600)
        get the socket's group, which this process can give only if it is a
        member (the documented set-up: engines in the daemon's group). Where
        it cannot, the daemon answers ACCESS_DENIED with the file's mode.
        """
        if not (self.endpoint.startswith("ipc://") and not self.endpoint.startswith("ipc://@")):
            return  # tcp: the daemon maps no client file; abstract: the daemon serves its own user only
        try:
            st = os.stat(self.endpoint[len("ipc://"):])
        except OSError:
            return
        if st.st_uid == os.getuid():
            return
        for name in shm_names:
            path = SHM_DIR / name
            try:
                os.chown(path, -1, st.st_gid)
                os.chmod(path, 0o660)
            except OSError as exc:
                log.warning("cannot give %s to kvtierd's group %d (%s): the daemon will refuse it; add this user "
                            "to that group", path, st.st_gid, exc.strerror)

    def _arena_fields(self) -> dict[str, Any]:
        assert self._arena is not None
        return {"name": self._arena.name, "num_slots": self._arena.num_slots, "slot_bytes": self._arena.slot_bytes}

    def register_kv(self, name: str, tensors: Sequence[Any], block_dims: int | Sequence[int], *,
                    timeout_s: float | None = None) -> int:
        """Share KV tensors with the daemon (engine mode: they become the GPU tier); returns num_blocks.

        ``tensors``: one per layer or one for all; ``block_dims``: the
        dimension that indexes blocks, one for all tensors or one each.
        CPU tensors must live in shared memory (``kv_share``), CUDA tensors
        travel as IPC handles.
        """
        from kvtier.client import kv_share  # imports torch: only engines that register pay for it

        dims = [block_dims] * len(tensors) if isinstance(block_dims, int) else list(block_dims)
        if len(dims) != len(tensors):
            raise KvtierError(f"{len(tensors)} tensors but {len(dims)} block dims")
        wire = [{"desc": kv_share.export_tensor(t), "block_dim": d} for t, d in zip(tensors, dims)]
        self._share_with_daemon(sorted({w["desc"]["handle"]["name"] for w in wire if w["desc"].get("transport") == "shm"}))
        rh, _ = self._call("register_kv", {"name": name, "tensors": wire}, timeout_s=timeout_s)
        self._registrations[name] = _Registration(wire, list(tensors))
        return int(rh["num_blocks"])

    def unregister_kv(self, name: str, *, timeout_s: float | None = None) -> None:
        self._call("unregister_kv", {"name": name}, timeout_s=timeout_s)
        self._registrations.pop(name, None)


def _error_of(rh: Mapping[str, Any], op: str) -> KvtierError:
    err = rh.get("error")
    if not isinstance(err, dict):
        return ProtocolError(ErrorCode.MALFORMED, f"error reply to {op} without an error map")
    return DaemonError(int(err.get("code", int(ErrorCode.INTERNAL))), str(err.get("message", "")))


def _strip(rh: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rh.items() if k not in ("v", "id", "ok")}


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
        return _strip(rh)
    finally:
        sock.close(linger=0)
        zctx.term()

