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
- Reconnects (``kvtier.client.transport``): after a timeout the client
  drops its socket (stale replies go with it) and opens a new one; only
  idempotent verbs (``protocol.OPS[op].idempotent``) are resent, since the
  daemon may or may not have executed the others.
- Sessions (``kvtier.client.session``): when the daemon answers
  UNKNOWN_SESSION, the client sends a new ``hello``, re-attaches its arena,
  re-registers its KV tensors and resends the call (the daemon had rejected
  it unexecuted). If the old session held pins or requests, or its arena
  cannot be re-attached, the call raises ``SessionLost`` instead, once; the
  new session is ready for the next call. A heartbeat thread renews the
  lease on a socket of its own and reopens a forgotten session itself, so
  registrations come back while the engine is idle; the ``SessionLost`` it
  finds is raised by the next call, which is then not sent. One lock guards
  the main socket and the session, so a Client may be shared by threads
  (their calls are serialised).
- Security: ``curve_server_key`` (the daemon's public key, Z85 or its key
  file) with ``curve_secret_key_file`` (this client's ``NAME.key_secret``)
  makes every socket of the client a CURVE client (``kvtier.client.curve``):
  required by a daemon with CURVE keys configured, which never answers a
  client it does not know. ``token`` is sent in ``hello`` to a daemon that
  serves tenants by token; the session then works in that tenant's block
  namespace. A refused identity raises ``DaemonError`` with code
  UNAUTHORIZED.
- Packed hashes (``kvtier.client.hash_wire``): hash lists go out packed to
  a daemon that lists ``"packed_hashes"``, as arrays to an older one; either
  way ``lookup``/``pin``/``allocate``/``restore`` return a ``Sequence[str]``.
- Pins: ``lookup(pin=True)``, ``lookup_many(pin=True)`` and ``pin`` record
  what they pinned (``SessionLost.lost_pins`` lists it). ``pin_tag`` (a
  request's name) files pins under a tag, and ``unpin_tag(tag)`` drops
  every pin of the tag in the daemon (feature ``"pin_tags"``), those whose
  replies were lost to a timeout included: a pin this client never heard of
  does not outlive the request that tagged it. ``lookup_many`` answers per
  request: one refused request is an error in its own place, never its
  batch-mates' failure.
- ``events(since)`` reads the pool's key journal (feature ``"events"``):
  ``Events(stored_or_removed, next, lost)``; the vLLM connector turns it
  into vLLM's KV cache events for routers.
- Importing this module imports no torch. ``register_kv`` accepts torch
  tensors and imports ``kvtier.client.kv_share`` only when called.

Layout: ``Client`` keeps the verbs and composes ``transport.Transport``
and ``session.Session`` / ``session.Heartbeat``; hash and tier lists in wire
form are ``hash_wire``'s, data-plane fields ``data_planes``'s, the hash
chains of ``allocate_tokens`` / ``append_tokens`` ``tokens``'s. Every
request goes through ``Client._roundtrip`` (session recovery's too), so a
test or a subclass can wrap that one method.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvtier.client import data_planes
from kvtier.client.arena_map import Lent
from kvtier.client.curve import CurveKeys
from kvtier.client.hash_wire import check_hashes, pack_hashes, tier_list, wire_hashes
from kvtier.client.hashing import BlockHasher
from kvtier.client.protocol import (
    EVENT_STORED,
    FEATURE_EVENTS,
    FEATURE_LEND,
    HASH_BYTES,
    MAX_EVENTS,
    MAX_STR_LEN,
    OPS,
    ErrorCode,
    Hints,
    KvtierError,
    ProtocolError,
    ReplyMessage,
    TierList,
    check_text,
)
from kvtier.client.session import Heartbeat, PoolLayout, Registration, Session, SessionLost
from kvtier.client.shm_arena import ShmArena
from kvtier.client.shm_orphans import remove_orphaned_arenas
from kvtier.client.tokens import TokenChain
from kvtier.client.transport import DaemonError, KvtierTimeout, Transport, error_of, probe_health, reply_fields

__all__ = [
    "Allocation",
    "Client",
    "DaemonError",
    "Events",
    "KvtierError",
    "KvtierTimeout",
    "PoolLayout",
    "ProtocolError",
    "RestoreResult",
    "SessionLost",
    "TierList",
    "probe_health",
]

# bench/protocol_paths.py times the client's hash checks under these names.
_check_hashes = check_hashes
_pack_hashes = pack_hashes

DEFAULT_TIMEOUT_S = 5.0


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
    # lend=True: the daemon lent its CPU-tier slots instead of copying (kvtier.client.arena_map); nothing
    # was written into the slots asked for: the caller copies, then calls release_lends([lent.id])
    lent: Lent | None = None

    def __len__(self) -> int:
        return len(self.tiers)


@dataclass(frozen=True)
class Events:
    """What the pool started and stopped holding since a cursor (``Client.events``)."""

    changes: list[tuple[bool, bytes]]  # (stored: True, removed: False; the key), oldest first
    next: int  # the cursor to ask with next time
    lost: bool  # events after the cursor asked with were dropped: resynchronise


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
        curve = CurveKeys.load(curve_server_key, curve_secret_key_file) if curve_server_key is not None else None
        self.endpoint = endpoint
        self.pool = pool
        self.layout = layout.to_wire() if isinstance(layout, PoolLayout) else dict(layout)
        self.timeout_s = timeout_s
        self.hasher = BlockHasher(int(self.layout["block_size"]), str(self.layout.get("hash_algo", "xxh3_128")))
        # One lock serialises the main socket and the session state: a Client
        # may be shared by threads, and the heartbeat thread recovers under it.
        self._lock = threading.RLock()
        self._transport = Transport(endpoint, curve)
        # Late-bound, so that recovery's requests also go through a wrapped _roundtrip.
        self._session = Session(self._transport, lambda *a, **kw: self._roundtrip(*a, **kw), self._lock,
                                pool=pool, layout=self.layout, client_name=client_name, lease_s=lease_s, token=token)
        self._heartbeat: Heartbeat | None = None
        try:
            with self._lock:
                self._session.hello(time.monotonic() + timeout_s)
        except BaseException:
            self._teardown()
            raise
        if heartbeat:
            self._heartbeat = Heartbeat(self._session, self._transport,
                                        lambda sid: self._session.recover_in_background(sid, self.timeout_s))
            self._heartbeat.start()

    # ---- lifecycle -------------------------------------------------------------

    def close(self, timeout_s: float = 1.0) -> None:
        """End the session (best effort), stop the heartbeat, drop the sockets."""
        if self._session.closed:
            return
        if self._heartbeat is not None:
            self._heartbeat.stop(timeout_s + 1.0)
        with self._lock:
            if self._session.sid is not None:
                try:
                    self._roundtrip("bye", {}, (), time.monotonic() + timeout_s)
                except KvtierError:
                    pass  # the lease will release it
            self._session.closed = True
            self._teardown()

    def _teardown(self) -> None:
        self._transport.reset()
        arena, self._session.arena = self._session.arena, None
        if arena is not None:
            arena.close()
            arena.unlink()
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- what the session's hello reply granted -----------------------------------

    @property
    def sid(self) -> str | None:
        return self._session.sid

    @property
    def lease_s(self) -> float:
        return self._session.lease_s

    @property
    def heartbeat_s(self) -> float:
        return self._session.heartbeat_s

    @property
    def pool_info(self) -> dict[str, Any]:
        return self._session.pool_info

    @property
    def limits(self) -> dict[str, Any]:
        return self._session.limits

    @property
    def features(self) -> tuple[str, ...]:
        """What the daemon listed in its hello reply."""
        return self._session.features

    @property
    def deadlines(self) -> bool:
        """Stores and restores on the shm and kv planes carry their deadline: the daemon touches this
        process's memory only before it (protocol feature ``"deadlines"``, ``shared_clock``)."""
        return self._session.deadlines

    @property
    def _packed_hashes(self) -> bool:
        return self._session.packed_hashes

    @_packed_hashes.setter
    def _packed_hashes(self, value: bool) -> None:
        # Tests play a client that predates packed hashes by clearing it.
        self._session.packed_hashes = value

    # ---- the request path ------------------------------------------------------

    def _roundtrip(self, op: str, fields: Mapping[str, Any], frames: Sequence[Any], deadline_s: float, *,
                   with_sid: bool = True) -> tuple[Any, list[zmq.Frame]]:
        """Send one request and wait for its reply; raises on error replies (``Transport.roundtrip``)."""
        # The form is settled per send: a call that re-opened its session on
        # an older daemon sends the hashes it packed as an array again.
        return self._transport.roundtrip(op, fields, frames, deadline_s, sid=self._session.sid if with_sid else None,
                                         packed_hashes=self._session.packed_hashes)

    def _begin(self, timeout_s: float | None) -> float:
        """The call's deadline; refuses a closed client."""
        if self._session.closed:
            raise KvtierError("client is closed")
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _call(self, op: str, fields: Mapping[str, Any] | None = None, frames: Sequence[Any] = (), *,
              timeout_s: float | None = None, idempotent: bool | None = None) -> tuple[Any, list[zmq.Frame]]:
        """One request of a verb, in a live session, by the call's deadline (``Session.call``): the reply (its
        op's ``ReplyMessage`` Struct, or a map for stats and health) and its payload frames."""
        # _begin, inline (every call passes here)
        if self._session.closed:
            raise KvtierError("client is closed")
        deadline_s = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        # The session keeps no reference to the fields: a dict passes as it is (the verbs build theirs per call).
        fields = fields if type(fields) is dict else dict(fields or {})
        with self._lock:
            return self._session.call(op, fields, frames, deadline_s, idempotent=idempotent)

    def _call_many(self, op: str, fields_list: Sequence[Mapping[str, Any]], *,
                   timeout_s: float | None = None) -> list[Any]:
        """``_call`` for many requests of one idempotent verb, pipelined (``Session.call_many``): each
        request's reply fields, or the error it got (one refusal fails only its own request)."""
        if not OPS[op].idempotent:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{op} is not idempotent: it cannot be pipelined")
        deadline_s = self._begin(timeout_s)
        with self._lock:
            replies = self._session.call_many(op, fields_list, deadline_s)
        return [rh if isinstance(rh, ReplyMessage) or rh["ok"] is True else error_of(rh, op) for rh in replies]

    def _wire_hashes(self, hashes: Sequence[bytes], *, keys: bool = False) -> tuple[list[bytes], Any]:
        """Checked hashes and their wire form: packed when the daemon takes it.
        ``keys``: the caller counts them as pins, so they must be exactly bytes."""
        return wire_hashes(hashes, packed=self._session.packed_hashes and not keys)

    def _with_hints(self, fields: dict[str, Any], hints: Hints | None) -> dict[str, Any]:
        if hints is not None and self._session.hints:
            wire = hints.to_wire()
            if not self._session.hint_output_tokens:
                wire.pop("output_tokens", None)  # a daemon without the feature would refuse the request
            if wire:
                fields["hints"] = wire
        return fields

    # ---- verbs: session and daemon -------------------------------------------

    def release_lends(self, ids: Sequence[int], *, timeout_s: float | None = None) -> int:
        """End lends (``RestoreResult.lent.id``) this client is done reading; returns how many the daemon ended."""
        rh, _ = self._call("release_lends", {"ids": [int(i) for i in ids]}, timeout_s=timeout_s)
        return int(rh.released)

    def heartbeat(self, *, timeout_s: float | None = None) -> None:
        self._call("heartbeat", timeout_s=timeout_s)

    def health(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        rh, _ = self._call("health", timeout_s=timeout_s)
        return reply_fields(rh)

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        rh, _ = self._call("stats", timeout_s=timeout_s)
        return reply_fields(rh)

    def clear(self, *, timeout_s: float | None = None) -> int:
        rh, _ = self._call("clear", timeout_s=timeout_s)
        return rh.cleared

    def events(self, since: int, *, max_events: int = MAX_EVENTS, timeout_s: float | None = None) -> Events:
        """The keys the session's pool started and stopped holding after event ``since``, in order.

        Start with ``since=0`` and pass each reply's ``next`` to the next call.
        Raises ``KvtierError`` where the daemon lacks the feature.
        """
        if FEATURE_EVENTS not in self._session.features:
            raise KvtierError("this kvtierd does not serve events (feature 'events'): upgrade it")
        rh, _ = self._call("events", {"since": since, "max_events": max_events}, timeout_s=timeout_s)
        kinds, keys = rh.kinds, rh.hashes
        if len(keys) != HASH_BYTES * len(kinds):
            raise ProtocolError(ErrorCode.MALFORMED, f"events reply: {len(kinds)} kinds but {len(keys)} hash bytes")
        stored = EVENT_STORED[0]
        changes = [(kind == stored, keys[i * HASH_BYTES:(i + 1) * HASH_BYTES]) for i, kind in enumerate(kinds)]
        return Events(changes, rh.next, rh.lost)

    # ---- lookups and pins ------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], *, pin: bool = False, hints: Hints | None = None,
               pin_tag: str | None = None, timeout_s: float | None = None) -> Sequence[str]:
        """Tiers of the longest cached prefix of ``hashes`` ("gpu"/"cpu"/"remote" per block).

        ``hints`` (session, retain_s, priority) tell the daemon's eviction what
        the application knows; a daemon without the "hints" feature is sent
        none (they are soft, so nothing fails for it). ``pin``: also pin the
        prefix found, under ``pin_tag`` when given (see ``unpin_tag``). A
        pinned lookup is not resent after a timeout: the daemon may have
        pinned already, and would pin twice.
        """
        if pin_tag is not None:
            self._check_tag(pin_tag, pin)
        hashes, wire = wire_hashes(hashes, packed=self._session.packed_hashes and not pin)
        fields = {"hashes": wire, "pin": pin}
        if hints is not None or pin_tag is not None:
            fields = self._lookup_fields(wire, pin, hints, pin_tag)
        rh, _ = self._call("lookup", fields, timeout_s=timeout_s, idempotent=not pin)
        tiers = tier_list(rh.tiers)
        if pin:
            self._note_pins(hashes[: rh.pinned], pin_tag)
        return tiers

    def lookup_many(self, requests: Sequence[Sequence[bytes]], *, pin: bool = False,
                    hints: Sequence[Hints | None] | None = None, pin_tags: Sequence[str | None] | None = None,
                    timeout_s: float | None = None) -> list[Sequence[str] | KvtierError]:
        """``lookup`` of each hash list, pipelined: all requests go out before any reply is read.

        One round trip for the batch instead of one each (a scheduler that
        admits many requests at once). Each answer is what ``lookup`` would
        have returned, in order, or the error it would have raised
        (``DaemonError`` for a refusal, ``ProtocolError`` for a request this
        library refused to send): one bad request never fails its batch-mates,
        and their pins are recorded as ``lookup`` records them. Raises only
        for the batch as a whole (``KvtierTimeout``: no reply was read, so
        pins the daemon took are unknown here; tag them, ``pin_tags``, and
        ``unpin_tag`` releases them. ``SessionLost``). Not resent after a timeout.
        """
        n = len(requests)
        if hints is not None and len(hints) != n:
            raise ValueError(f"{n} requests but {len(hints)} hints")
        if pin_tags is not None and len(pin_tags) != n:
            raise ValueError(f"{n} requests but {len(pin_tags)} pin tags")
        per_hints = hints if hints is not None else [None] * n
        tags = pin_tags if pin_tags is not None else [None] * n
        out: list[Sequence[str] | KvtierError] = []
        sent: list[tuple[int, list[bytes]]] = []  # (index in out, checked hashes)
        fields_list: list[dict[str, Any]] = []
        for i, (h, hint, tag) in enumerate(zip(requests, per_hints, tags)):
            try:
                self._check_tag(tag, pin)
                hashes, wire = self._wire_hashes(h, keys=pin)
            except ProtocolError as exc:
                out.append(exc)  # refused here, never sent
                continue
            out.append([])  # its answer, once read
            sent.append((i, hashes))
            fields_list.append(self._lookup_fields(wire, pin, hint, tag))
        if not fields_list:
            return out
        replies = self._call_many("lookup", fields_list, timeout_s=timeout_s)
        for (i, hashes), reply in zip(sent, replies):
            if isinstance(reply, KvtierError):
                out[i] = reply
                continue
            if pin:
                self._note_pins(hashes[: reply.pinned], tags[i])
            out[i] = tier_list(reply.tiers)
        return out

    def pin(self, hashes: Sequence[bytes], *, pin_tag: str | None = None,
            timeout_s: float | None = None) -> Sequence[str]:
        self._check_tag(pin_tag, True)
        hashes = check_hashes(hashes)
        fields: dict[str, Any] = {"hashes": hashes}
        if pin_tag is not None and self._session.pin_tags:
            fields["pin_tag"] = pin_tag
        rh, _ = self._call("pin", fields, timeout_s=timeout_s)
        tiers = tier_list(rh.tiers)
        self._note_pins(hashes[: len(tiers)], pin_tag)
        return tiers

    def unpin(self, hashes: Sequence[bytes], *, pin_tag: str | None = None,
              timeout_s: float | None = None) -> int:
        """Drop one pin per hash (of those taken under ``pin_tag``, when given); returns how many went."""
        self._check_tag(pin_tag, True)
        hashes = check_hashes(hashes)
        fields: dict[str, Any] = {"hashes": hashes}
        if pin_tag is not None and self._session.pin_tags:
            fields["pin_tag"] = pin_tag
        rh, _ = self._call("unpin", fields, timeout_s=timeout_s)
        self._forget_pins(hashes, pin_tag)
        return rh.unpinned

    def unpin_tag(self, pin_tag: str, *, timeout_s: float | None = None) -> int:
        """Drop every pin taken under ``pin_tag``, those whose replies never came back included
        (a batch that timed out, a lookup lost with its socket); returns how many went.

        A daemon without the feature ``"pin_tags"`` was never sent the tag:
        the pins this client recorded under it are dropped by their hashes.
        """
        self._check_tag(pin_tag, True)
        known = self._session.tag_pins.get(pin_tag)
        if self._session.pin_tags:
            rh, _ = self._call("unpin", {"pin_tag": pin_tag}, timeout_s=timeout_s)
        elif known:
            rh, _ = self._call("unpin", {"hashes": sorted(known.elements())}, timeout_s=timeout_s)
        else:
            return 0
        known = self._session.tag_pins.pop(pin_tag, None)
        if known:
            self._session.pins.subtract(known)
            self._session.pins = +self._session.pins
        return rh.unpinned

    def _lookup_fields(self, wire: Any, pin: bool, hints: Hints | None, pin_tag: str | None) -> dict[str, Any]:
        fields = self._with_hints({"hashes": wire, "pin": pin}, hints)
        if pin_tag is not None and self._session.pin_tags:
            fields["pin_tag"] = pin_tag  # a daemon without the feature would refuse it: the pins are the session's
        return fields

    @staticmethod
    def _check_tag(pin_tag: str | None, pin: bool) -> None:
        if pin_tag is None:
            return
        if not pin:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "pin_tag names pins: it needs pin=True")
        check_text("pin_tag", pin_tag, MAX_STR_LEN)

    def _note_pins(self, hashes: Sequence[bytes], pin_tag: str | None) -> None:
        if not hashes:
            return
        self._session.pins.update(hashes)
        if pin_tag is not None:
            self._session.tag_pins.setdefault(pin_tag, Counter()).update(hashes)

    def _forget_pins(self, hashes: Sequence[bytes], pin_tag: str | None) -> None:
        """What ``unpin(hashes, pin_tag)`` dropped: one recorded pin per hash, where one is recorded."""
        pins = self._session.pins
        tagged = self._session.tag_pins.get(pin_tag) if pin_tag is not None else None
        for h in hashes:
            if tagged is not None:
                if tagged[h] <= 0:
                    continue
                tagged[h] -= 1
            if pins[h] > 0:
                pins[h] -= 1
        self._session.pins = +pins
        if tagged is not None:
            tagged = +tagged
            if tagged:
                self._session.tag_pins[pin_tag] = tagged  # type: ignore[index]
            else:
                self._session.tag_pins.pop(pin_tag, None)  # type: ignore[arg-type]

    # ---- engine-managed mode ---------------------------------------------------

    def allocate(self, req: str, hashes: Sequence[bytes], num_tokens: int, *, hints: Hints | None = None,
                 timeout_s: float | None = None) -> Allocation:
        """Block table for a new request; CPU-tier hits are already restored into their slots."""
        _, wire = self._wire_hashes(hashes)
        rh, _ = self._call("allocate", self._with_hints({"req": req, "hashes": wire, "num_tokens": num_tokens}, hints),
                           timeout_s=timeout_s)
        self._session.requests.add(req)
        return Allocation(rh.block_ids, tier_list(rh.tiers), rh.num_gpu_hits, rh.num_cpu_hits)

    def append(self, req: str, num_new_tokens: int, new_hashes: Sequence[bytes], *,
               timeout_s: float | None = None) -> tuple[list[int], list[int]]:
        """Grow a request; returns (whole block table, newly allocated block ids)."""
        _, wire = self._wire_hashes(new_hashes)
        rh, _ = self._call("append", {"req": req, "num_tokens": num_new_tokens, "hashes": wire}, timeout_s=timeout_s)
        return rh.block_ids, rh.new_block_ids

    def free(self, req: str, *, valid_tokens: int | None = None, timeout_s: float | None = None) -> None:
        """Release a request. ``valid_tokens``: after a failure, how many leading
        tokens' K/V were really written; blocks past them are not kept cached."""
        fields: dict[str, Any] = {"req": req}
        if valid_tokens is not None:
            fields["valid_tokens"] = valid_tokens
        self._call("free", fields, timeout_s=timeout_s)
        self._session.requests.discard(req)
        self._session.tokens.pop(req, None)

    def hashes_for(self, token_ids: Sequence[int], **hash_kwargs: Any) -> list[bytes]:
        """Block hashes of the full blocks of ``token_ids`` (see ``BlockHasher.hash_blocks``)."""
        return self.hasher.hash_blocks(token_ids, **hash_kwargs)

    def allocate_tokens(self, req: str, token_ids: Sequence[int], *, timeout_s: float | None = None,
                        **hash_kwargs: Any) -> Allocation:
        """``allocate`` from token ids: hashes computed here; ``append_tokens`` continues the chain."""
        tokens = list(token_ids)
        hashes, chain = TokenChain.start(self.hasher, tokens, hash_kwargs)
        alloc = self.allocate(req, hashes, len(tokens), timeout_s=timeout_s)
        self._session.tokens[req] = chain
        return alloc

    def append_tokens(self, req: str, new_token_ids: Sequence[int], *,
                      timeout_s: float | None = None) -> tuple[list[int], list[int]]:
        """``append`` from the new token ids of a request started with ``allocate_tokens``."""
        chain = self._session.tokens.get(req)
        if chain is None:
            raise KvtierError(f"request {req!r} was not started with allocate_tokens")
        new_token_ids = list(new_token_ids)
        new_hashes, tokens = chain.extend(self.hasher, new_token_ids)
        table = self.append(req, len(new_token_ids), new_hashes, timeout_s=timeout_s)
        chain.advance(self.hasher.block_size, len(new_token_ids), new_hashes, tokens)  # only once the daemon took it
        return table

    # ---- store mode --------------------------------------------------------------

    def store(self, hashes: Sequence[bytes], data: Any = None, *, slots: Sequence[int] | None = None,
              reg: str | None = None, hints: Hints | None = None, timeout_s: float | None = None) -> tuple[int, int]:
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
        return rh.stored, rh.present

    def restore(self, hashes: Sequence[bytes], *, slots: Sequence[int] | None = None, reg: str | None = None,
                timeout_s: float | None = None, lend: bool = False,
                release: Sequence[int] = ()) -> RestoreResult:
        """Copy out the longest held prefix: inline (``data``), to arena ``slots``, or to ``reg``'s slots.

        ``lend`` (with ``slots``; sent only to a daemon that lists feature ``"lend"``): the daemon may
        lend the blocks instead (``RestoreResult.lent``; ``kvtier.client.arena_map``); ``release``: lends to
        end first, as ``release_lends`` would (sent only with ``lend``)."""
        hashes, wire = self._wire_hashes(hashes)
        fields, _ = self._plane(None, slots, reg, len(hashes))
        fields["hashes"] = wire
        if lend and fields["plane"] != "inline" and FEATURE_LEND in self._session.features:
            fields["lend"] = True
            if release:
                fields["release"] = [int(i) for i in release]
        rh, frames = self._call("restore", fields, timeout_s=timeout_s)
        tiers = tier_list(rh.tiers)
        if fields["plane"] != "inline":
            lent = rh.lent
            return RestoreResult(tiers, lent=Lent.from_wire(lent) if lent is not None else None)
        data = frames[0].buffer if frames else memoryview(b"")
        expected = len(tiers) * int(self.pool_info.get("block_bytes", self.layout["block_bytes"]))
        if data.nbytes != expected:
            raise ProtocolError(ErrorCode.MALFORMED, f"restore reply carries {data.nbytes} bytes for {len(tiers)} blocks")
        return RestoreResult(tiers, data)

    def _plane(self, data: Any, slots: Sequence[int] | None, reg: str | None, n: int) -> tuple[dict[str, Any], list[Any]]:
        return data_planes.plane_fields(data, slots, reg, n, have_arena=self._session.arena is not None,
                                        max_payload_bytes=self.limits.get("max_payload_bytes"))

    # ---- data planes 2 and 3 -----------------------------------------------------

    def open_arena(self, num_slots: int, *, timeout_s: float | None = None) -> ShmArena:
        """Create this client's shared-memory staging arena (one block per slot) and announce it."""
        if self._session.arena is not None:
            raise KvtierError("this client already has an arena")
        block_bytes = int(self.layout["block_bytes"])
        remove_orphaned_arenas()  # a crashed predecessor's, which a daemon of another user could not remove
        arena = ShmArena.create(num_slots, block_bytes, name_prefix=f"kvtier-{(self.sid or 'x')[:8]}")
        self._session.arena = arena
        try:
            data_planes.share_with_daemon(self.endpoint, [arena.name])
            self._call("attach_arena", self._arena_fields(), timeout_s=timeout_s)
        except BaseException:
            self._session.arena = None
            arena.close()
            arena.unlink()
            raise
        return arena

    @property
    def arena(self) -> ShmArena | None:
        return self._session.arena

    def _arena_fields(self) -> dict[str, Any]:
        return self._session.arena_fields()

    def register_kv(self, name: str, tensors: Sequence[Any], block_dims: int | Sequence[int], *,
                    timeout_s: float | None = None) -> int:
        """Share KV tensors with the daemon (engine mode: they become the GPU tier); returns num_blocks.

        ``tensors``: one per layer or one for all; ``block_dims``: the
        dimension that indexes blocks, one for all tensors or one each.
        CPU tensors must live in shared memory (``kv_share``), CUDA tensors
        travel as IPC handles.
        """
        wire = data_planes.kv_tensor_fields(tensors, block_dims)
        data_planes.share_with_daemon(self.endpoint, data_planes.shm_names(wire))
        rh, _ = self._call("register_kv", {"name": name, "tensors": wire}, timeout_s=timeout_s)
        self._session.registrations[name] = Registration(wire, list(tensors))
        return rh.num_blocks

    def unregister_kv(self, name: str, *, timeout_s: float | None = None) -> None:
        self._call("unregister_kv", {"name": name}, timeout_s=timeout_s)
        self._session.registrations.pop(name, None)
