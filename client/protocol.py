"""kvtier wire protocol, version 1: the one place that defines it.

Contract
========

Transport: ZMQ. The daemon binds a ROUTER socket; a client connects DEALER
sockets. A request is a multipart message::

    [header, *payload]

``header`` is one MessagePack map (str keys); ``payload`` frames are raw block
bytes (data plane "inline"). The ROUTER prepends the peer identity; the reply
goes back to that identity as ``[header, *payload]``.

Request header: ``{"v": PROTOCOL_VERSION, "op": str, "id": uint, "sid": str,
...op fields}``. ``sid`` (session id) is absent for ``hello`` and optional for
``health`` and ``stats``. ``id`` is chosen by the client, 1 .. 2**63-1, and
comes back unchanged in the reply; id 0 is reserved for replies to messages
whose id could not be read (undecodable header, missing or bad ``id``).

Reply header: ``{"v": 1, "id": id, "ok": True, ...result}`` or
``{"v": 1, "id": id, "ok": False, "error": {"code": int, "name": str,
"message": str}}``. Exactly one reply per request.

Every field a request may carry is declared once, in its op's msgspec
``Struct`` (``OPS[op].type``), with its type and bounds; unknown fields,
missing required fields, wrong types and out-of-range values are
INVALID_FIELD errors. ``decode_request`` decodes and validates a header in one
step; ``decode_reply`` does the same for an ok reply (``OPS[op].reply``). Block hashes are 16-byte MessagePack ``bin`` values in a
list, in prefix order. Tiers in replies are the strings ``"gpu"`` / ``"cpu"`` /
``"remote"``, and ``"disk"`` to a session whose hello named feature
``"disk_tier"`` (others get ``"remote"`` for a disk-tier block: below the CPU
tier, fetched into it on restore).

Packed hashes (feature ``"packed_hashes"``, advertised in hello's
``features``): every hash-list field also takes ONE ``bin`` of ``16 * n``
bytes, the n hashes back to back. A request whose hashes came packed gets its
reply's per-block tier lists packed too: one ``bin`` of n bytes, one code per
block (``TIER_CODES``). Arrays in, arrays out; packed in, packed out.

Deadlines (feature ``"deadlines"``): ``store`` and ``restore`` take
``deadline_ns``, the CLOCK_MONOTONIC instant after which the client has
given up the call and may reuse the memory its slots name. The daemon reads
or writes a client's memory only before it (a restore's write must be able
to finish before it), else it answers DEADLINE_EXCEEDED with nothing stored
or written. Only meaningful where both read one clock: hello's reply gives
the daemon's ``clock`` (``kvtier.client.shared_clock`` checks it).

Error codes (``ErrorCode``) are stable numbers; new codes may be added, the
meaning of a number never changes. Hundreds group them: 1xx the request was
malformed (a client bug, never retry), 2xx the request does not fit the
daemon's state, 3xx capacity, 4xx the daemon failed or is going away.

This module imports msgpack and msgspec only (no zmq, no torch) so that any process, and
the docs generator, can use it. ``docs/protocol.md`` is the prose version.
"""

from __future__ import annotations

import functools
import itertools
import re
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Any, Literal, Union

import msgpack
import msgspec

PROTOCOL_VERSION = 1
HASH_BYTES = 16

# Soft limits the daemon checks on every request (an error reply, the sender
# stays connected). The daemon may configure lower payload limits and reports
# its limits in the hello reply; the ZMQ hard limit (MAXMSGSIZE, per frame) is
# set above them, and a frame over it makes libzmq drop the connection.
MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_HASHES = 65536
# Arrays, maps and their elements in one header, all levels: a request with
# MAX_HASHES hashes and as many slots holds ~131k.
MAX_HEADER_VALUES = 4 * MAX_HASHES
MAX_PAYLOAD_FRAMES = 1
MAX_STR_LEN = 256
MAX_REGISTERED_TENSORS = 1024
DEFAULT_MAX_PAYLOAD_BYTES = 512 * 1024 * 1024
RESERVED_ID = 0
MAX_ID = 2**63 - 1

# Per-block tier codes of packed tier lists: the one table of them. A code is
# its tier's first letter, a letter found nowhere else in any tier name, which
# is what lets pack_tiers work without a step per block (checked below).
TIER_CODES: dict[str, bytes] = {"gpu": b"g", "cpu": b"c", "remote": b"r", "disk": b"d"}
TIERS = tuple(TIER_CODES)
MODES = ("store", "engine")
HASH_ALGOS = ("xxh3_128", "sha256")
PLANES = ("inline", "shm", "kv")

# What this side of the protocol can do beyond plain v1; the daemon lists its
# features in the hello reply and a client uses one only when it is listed.
FEATURE_PACKED_HASHES = "packed_hashes"
FEATURE_HINTS = "hints"  # lookup / allocate / store take "hints" (HINT_FIELDS)
FEATURE_HINT_OUTPUT_TOKENS = "hint_output_tokens"  # "hints" take "output_tokens" (added within v1)
FEATURE_DEADLINES = "deadlines"  # store / restore take "deadline_ns"; hello's reply gives "clock" (added within v1)
FEATURE_EVENTS = "events"  # the "events" verb: keys the pool started and stopped holding (added within v1)
FEATURE_PIN_TAGS = "pin_tags"  # lookup / pin / unpin take "pin_tag"; unpin of a tag alone drops all its pins (within v1)
# hello takes "features" (what the client reads in replies); a session naming "disk_tier" there gets
# tier "disk" (code "d") for disk-tier blocks, others "remote" for them (added within v1).
FEATURE_DISK_TIER = "disk_tier"
# restore takes "lend": the reply may lend CPU-tier slots ("lent") instead of copying; the "release_lends"
# verb ends lends (added within v1). Listed only to sessions that may get lends (the daemon's user).
FEATURE_LEND = "lend"
FEATURES = (FEATURE_PACKED_HASHES, FEATURE_HINTS, FEATURE_HINT_OUTPUT_TOKENS, FEATURE_DEADLINES, FEATURE_EVENTS,
            FEATURE_PIN_TAGS, FEATURE_DISK_TIER)
# What this client reads in replies: sent in hello's "features" to daemons that list FEATURE_DISK_TIER.
CLIENT_FEATURES = (FEATURE_DISK_TIER,)

# The "events" verb's event kinds, one byte each in its reply's "kinds".
EVENT_STORED = b"s"  # the pool holds the key now (it did not before)
EVENT_REMOVED = b"r"  # the pool no longer holds the key
MAX_EVENTS = MAX_HASHES  # per "events" reply


class ErrorCode(IntEnum):
    """Stable error numbers (see the module docstring for the grouping)."""

    MALFORMED = 100  # not a MessagePack map, or frames missing
    UNSUPPORTED_VERSION = 101
    UNKNOWN_OP = 102
    INVALID_FIELD = 103  # missing, unknown, wrong type, out of range
    TOO_LARGE = 104  # header, hash list or payload over the limits

    UNKNOWN_SESSION = 200  # no such session (expired, closed, daemon restarted)
    LAYOUT_MISMATCH = 201  # hello for an existing pool with another layout
    WRONG_MODE = 202  # verb not available in this pool's mode
    NOT_FOUND = 203  # hash, request, registration or slot does not exist
    INVALID_STATE = 204  # well-formed but contradicts current state
    UNAUTHORIZED = 205  # hello names no tenant this daemon serves (bad or missing token/key)
    FOREIGN_SESSION = 206  # the sid belongs to a session another user (ipc peer uid) opened
    IN_USE = 207  # the arena or KV file is attached by another live session
    NOT_OWNER = 208  # the arena or KV file belongs to another user than the session's
    ACCESS_DENIED = 209  # the daemon may not open the client's shared-memory file (its mode or group)
    SPARSE_FILE = 210  # the client's shared-memory file has pages not allocated (ftruncate without posix_fallocate)

    NO_SPACE = 300  # the tier cannot make room (nothing changed)
    TOO_MANY_REGISTRATIONS = 301  # the session holds max_registrations_per_session registrations
    TOO_MANY_FILES = 302  # the session (or the daemon) maps as many shared-memory files as it may
    TOO_MANY_POOLS = 303  # the daemon holds max_pools pools; a hello may join one, not create another
    TOO_MANY_PINS = 304  # the session (or its tenant) holds max_pinned_share of the pool pinned
    UNREAD_REPLIES = 305  # this connection's (or, with some, all connections') unread replies hold their cap
    TOO_MANY_CONNECTIONS = 306  # the daemon (or this peer) holds as many connections as it may; this one is closed
    TOO_MANY_SESSIONS = 307  # the daemon holds max_sessions live sessions; hello again after some end
    TOO_MANY_AUTH_FAILURES = 308  # this peer's wrong tenant tokens used up max_auth_failures_per_minute; wait

    TRANSFER_FAILED = 400  # a copy failed; nothing was committed
    SHUTTING_DOWN = 401  # the daemon is draining and takes no new work
    INTERNAL = 402  # a daemon bug; the daemon runs on
    DEADLINE_EXCEEDED = 403  # the client's deadline passed before the daemon could touch its memory; nothing done


class KvtierError(Exception):
    """Base of every error the kvtier client library raises."""


class ProtocolError(KvtierError):
    """A message that breaks the protocol (raised on either side)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


# ---- packed hashes -----------------------------------------------------------

# Splitting packed hashes: one cached struct.Struct("16s" * n).unpack is the
# fastest way found (256 hashes, CPython 3.11: 3.1 us with the list() around
# it, vs 13 us for a list comprehension of slices, 16 us for re.findall and
# 23 us for map over slice objects; numpy's V16 tolist is 2.9 us but would make
# this module import numpy). A Struct costs ~35 bytes per field, so only
# sizes up to _UNPACK_CHUNK are compiled, each once; longer lists go through
# the largest one with iter_unpack, which keeps the cache under ~10 MB.
_UNPACK_CHUNK = 1024


@functools.lru_cache(maxsize=256)
def _hash_struct(n: int) -> struct.Struct:
    return struct.Struct(f"{HASH_BYTES}s" * n)


def unpack_hashes(packed: bytes) -> list[bytes]:
    """The 16-byte hashes of a packed-hashes bin (its length a multiple of 16, unchecked here)."""
    n = len(packed) // HASH_BYTES
    if n <= _UNPACK_CHUNK:
        return list(_hash_struct(n).unpack(packed))
    whole = n - n % _UNPACK_CHUNK
    out = list(itertools.chain.from_iterable(
        _hash_struct(_UNPACK_CHUNK).iter_unpack(memoryview(packed)[: whole * HASH_BYTES])))
    if whole < n:
        out += _hash_struct(n - whole).unpack_from(packed, whole * HASH_BYTES)
    return out


def pack_hashes(hashes: Sequence[bytes]) -> bytes:
    """The packed-hashes bin of checked 16-byte hashes (the client checks them first)."""
    return b"".join(hashes)


# ---- packed tier lists -------------------------------------------------------

_TIER_OF_CODE: dict[int, str] = {code[0]: name for name, code in TIER_CODES.items()}
_CODE_OF_TIER: dict[str, int] = {name: code[0] for name, code in TIER_CODES.items()}
_ALL_CODES = b"".join(TIER_CODES.values())


def _letters_to_delete() -> bytes | None:
    """The letters pack_tiers deletes, or None when the table does not allow its shortcut."""
    names = "".join(TIER_CODES)
    for name, code in TIER_CODES.items():
        if not (name.isascii() and len(code) == 1 and code.decode() == name[0]) or names.count(name[0]) != 1:
            return None
    return bytes(sorted(set(names.encode()) - set(_ALL_CODES)))


_NON_CODE_LETTERS = _letters_to_delete()


def pack_tiers(tiers: Sequence[str]) -> bytes:
    """The packed form of a tier list: one code per block (``TIER_CODES``).

    Takes tier names or ``str`` enum members whose values are tier names (the
    daemon's ``Tier``), so the daemon need not build the strings first. Only
    for the daemon's own tiers: a wrong number of codes raises ValueError, a
    string that is no tier name is not always noticed.
    """
    if tiers and tiers.count(tiers[0]) == len(tiers):
        # One tier for the whole prefix, the usual answer: one identity pass, no string per block.
        code = TIER_CODES.get(getattr(tiers[0], "_value_", tiers[0]))
        if code is not None:
            return code * len(tiers)
    if _NON_CODE_LETTERS is not None:
        # Joining the names and deleting every letter that is not a code leaves
        # exactly one code per name (each code is its name's first letter and
        # appears nowhere else): ~1 us for 256 blocks, against ~4.5 us for a
        # dict lookup per block.
        packed = "".join(tiers).encode("ascii").translate(None, _NON_CODE_LETTERS)
        if len(packed) == len(tiers):
            return packed
    try:
        return bytes(map(_CODE_OF_TIER.__getitem__, tiers))
    except KeyError as exc:
        raise ValueError(f"not a tier: {exc.args[0]!r}") from None


class TierList(Sequence[str]):
    """A packed tier list read as a sequence of tier names ("gpu", "cpu", "remote", "disk").

    Read-only and compares equal to lists and tuples of the same names, so
    callers written for lists keep working; ``codes`` is the packed bytes.
    """

    __slots__ = ("_codes",)

    def __init__(self, codes: bytes) -> None:
        if not isinstance(codes, bytes):
            raise ProtocolError(ErrorCode.MALFORMED, f"packed tiers must be bin, got {type(codes).__name__}")
        if codes.translate(None, _ALL_CODES):
            unknown = sorted(set(codes.translate(None, _ALL_CODES)))
            raise ProtocolError(ErrorCode.MALFORMED, f"packed tiers carry unknown tier codes {bytes(unknown)!r}")
        self._codes = codes

    @classmethod
    def of(cls, tiers: Iterable[str]) -> TierList:
        """A TierList of tier names."""
        return cls(pack_tiers(list(tiers)))

    @property
    def codes(self) -> bytes:
        return self._codes

    def __len__(self) -> int:
        return len(self._codes)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return TierList(self._codes[index])
        return _TIER_OF_CODE[self._codes[index]]

    def __iter__(self) -> Iterator[str]:
        return map(_TIER_OF_CODE.__getitem__, self._codes)

    def __reversed__(self) -> Iterator[str]:
        return map(_TIER_OF_CODE.__getitem__, reversed(self._codes))

    def __contains__(self, tier: object) -> bool:
        return isinstance(tier, str) and tier in _CODE_OF_TIER and _CODE_OF_TIER[tier] in self._codes

    def count(self, tier: object) -> int:
        if not isinstance(tier, str) or tier not in _CODE_OF_TIER:
            return 0
        return self._codes.count(_CODE_OF_TIER[tier])

    def index(self, tier: object, start: int = 0, stop: int | None = None) -> int:
        if isinstance(tier, str) and tier in _CODE_OF_TIER:
            try:
                return self._codes.index(_CODE_OF_TIER[tier], start, len(self._codes) if stop is None else stop)
            except ValueError:
                pass
        raise ValueError(f"{tier!r} is not in the tier list")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TierList):
            return self._codes == other._codes
        if isinstance(other, list):
            return len(other) == len(self._codes) and list(self) == other
        if isinstance(other, tuple):
            return len(other) == len(self._codes) and tuple(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"TierList({list(self)!r})"


# ---- the schema ------------------------------------------------------------
#
# Each request is one msgspec Struct, declared once: its fields, their types and
# bounds. The daemon decodes a header straight into its op's Struct (msgspec's
# msgpack is this protocol's wire format) and msgspec validates it in C in the
# same step. A field absent or nil gets its default; unknown fields are refused.


def _uint(lo: int, hi: int) -> Any:
    return Annotated[int, msgspec.Meta(ge=lo, le=hi)]


def _text(lo: int, hi: int) -> Any:
    return Annotated[str, msgspec.Meta(min_length=lo, max_length=hi)]


def _seconds(hi_s: float) -> Any:
    return Annotated[float, msgspec.Meta(gt=0.0, le=hi_s)]


MAX_LEASE_S = 3600.0
MAX_POOL_NAME = 128  # chars of a hello's pool name
MAX_TOKEN_LEN = 256  # chars of a hello's tenant token
MAX_FEATURES = 64  # names in a hello's "features", each 1..MAX_FEATURE_LEN chars
MAX_FEATURE_LEN = 64
MAX_DESC_KEYS = 64  # keys of a register_kv tensor descriptor

Hash16 = Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]
# Block hashes in prefix order: an array of bin16, or packed (feature "packed_hashes"): one bin of 16 * n bytes.
HashList = bytes | Annotated[list[Hash16], msgspec.Meta(max_length=MAX_HASHES)]
SlotList = Annotated[list[_uint(0, 2**32 - 1)], msgspec.Meta(max_length=MAX_HASHES)]


class Layout(msgspec.Struct, forbid_unknown_fields=True):
    """A pool's layout, as hello sends it; every field required."""

    model: _text(1, MAX_STR_LEN)  # model identity (name or path + revision)
    block_size: _uint(1, 2**32 - 1)  # tokens per block
    block_bytes: _uint(1, 2**40)  # bytes of one block, all layers, K and V
    dtype: _text(1, 32)  # KV element type, e.g. "bfloat16"
    num_layers: _uint(1, 2**20)
    kv_heads: _uint(1, 2**20)  # KV heads on this rank
    head_dim: _uint(1, 2**20)
    tp_rank: _uint(0, 2**20)
    tp_size: _uint(1, 2**20)
    hash_algo: Literal["xxh3_128", "sha256"]
    mode: Literal["store", "engine"]  # "store": the daemon owns the GPU tier; "engine": the engine's KV is

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


LAYOUT_FIELDS: tuple[str, ...] = Layout.__struct_fields__


class KvTensor(msgspec.Struct, forbid_unknown_fields=True):
    """One registered tensor: its kv_share descriptor (opaque to the protocol) and its block dimension."""

    # Skipped by the one-step decode (no containers built from an opaque map): _finish
    # replaces it with the dict it holds, read with decode()'s limits on the whole header.
    desc: msgspec.Raw
    block_dim: _uint(0, 16)


# Per-request hints (feature "hints"): what the application knows about the
# request. Soft: a daemon may bound or ignore them, never fails a request for
# them once they are valid. Documented in docs/protocol.md ("Hints").
MAX_RETAIN_S = 86400.0
MAX_PRIORITY = 255
MAX_OUTPUT_TOKENS = 2**31 - 1


class HintFields(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A request's "hints" map."""

    session: _text(1, MAX_STR_LEN) | None = None  # opaque key of the conversation (a prompt-cache key), per tenant
    retain_s: _seconds(MAX_RETAIN_S) | None = None  # soft TTL while capacity allows (bounded per client)
    priority: _uint(0, MAX_PRIORITY) | None = 0  # higher is evicted later
    # Feature "hint_output_tokens": clients send it only to daemons that list the feature.
    output_tokens: _uint(0, MAX_OUTPUT_TOKENS) | None = 0  # tokens the request generated so far (its stores)


HINT_FIELDS: tuple[str, ...] = HintFields.__struct_fields__


@dataclass(frozen=True, slots=True)
class Hints:
    """The client's side of ``HintFields``: checked here as the daemon will check them."""

    session: str | None = None
    retain_s: float | None = None
    priority: int = 0
    output_tokens: int = 0  # an engine's count of the tokens the request generated; 0: none

    def __post_init__(self) -> None:
        wire = self.to_wire()
        try:
            msgspec.convert(wire, HintFields, strict=True)
        except msgspec.ValidationError as exc:
            raise _invalid(exc, prefix="hints.") from None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {}
        if self.session is not None:
            wire["session"] = self.session
        if self.retain_s is not None:
            wire["retain_s"] = self.retain_s
        if self.priority:
            wire["priority"] = self.priority
        if self.output_tokens:
            wire["output_tokens"] = self.output_tokens
        return wire


class Message(msgspec.Struct, kw_only=True, tag_field="op", forbid_unknown_fields=True):
    """The header fields every request carries; one subclass per op (its tag is the op)."""

    v: int
    id: int
    sid: str | None = None


class HelloRequest(Message, tag="hello"):
    pool: _text(1, MAX_POOL_NAME)  # pool name; the first hello creates the pool
    layout: Layout
    client: _text(0, 128) | None = ""  # free text for logs
    lease_s: _seconds(MAX_LEASE_S) | None = None  # requested lease; the daemon may shorten it
    # Added within v1: tenant token (daemons with [tenants]); CURVE keys need none.
    token: _text(1, MAX_TOKEN_LEN) | None = None
    # Added within v1, like token: reply features this client reads, e.g. ["disk_tier"]; unknown names ignored.
    features: list[_text(1, MAX_FEATURE_LEN)] | None = None

    def __post_init__(self) -> None:
        if self.client is None:
            self.client = ""
        if self.features is not None and len(self.features) > MAX_FEATURES:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"field 'features': {len(self.features)} items, at most {MAX_FEATURES}")


class HeartbeatRequest(Message, tag="heartbeat"):
    pass


class ByeRequest(Message, tag="bye"):
    pass


class AttachArenaRequest(Message, tag="attach_arena"):
    name: _text(1, 255)  # file name in /dev/shm made by kvtier.client.shm_arena (kvtier-...)
    num_slots: _uint(1, 2**32 - 1)
    slot_bytes: _uint(1, 2**40)  # must equal the pool's block_bytes


class RegisterKvRequest(Message, tag="register_kv"):
    name: _text(1, 128)  # registration name, unique within the session
    # One per layer, or one for all layers; block byte order is tensor by tensor.
    tensors: Annotated[list[KvTensor], msgspec.Meta(min_length=1, max_length=MAX_REGISTERED_TENSORS)]


class UnregisterKvRequest(Message, tag="unregister_kv"):
    name: _text(1, 128)


# Feature "pin_tags", added within v1: the pins' tag (the request they serve).
PinTag = _text(1, MAX_STR_LEN) | None


class LookupRequest(Message, tag="lookup"):
    hashes: HashList
    pin: bool | None = False
    hints: HintFields | None = None
    pin_tag: PinTag = None


class PinRequest(Message, tag="pin"):
    hashes: HashList
    pin_tag: PinTag = None


class UnpinRequest(Message, tag="unpin"):
    hashes: HashList | None = None  # absent: every pin of pin_tag
    pin_tag: PinTag = None


class AllocateRequest(Message, tag="allocate"):
    req: _text(1, MAX_STR_LEN)  # engine request id (unique within the session)
    hashes: HashList
    num_tokens: _uint(0, 2**40)
    hints: HintFields | None = None


class AppendRequest(Message, tag="append"):
    req: _text(1, MAX_STR_LEN)
    num_tokens: _uint(0, 2**40)  # NEW tokens
    hashes: HashList  # of the blocks these tokens filled


class FreeRequest(Message, tag="free"):
    req: _text(1, MAX_STR_LEN)
    # Tokens whose K/V the engine wrote; blocks past them lose their hash (a failed request).
    valid_tokens: _uint(0, 2**40) | None = None


class _PlaneRequest(Message):
    hashes: HashList
    plane: Literal["inline", "shm", "kv"] | None = "inline"  # where the block bytes are
    slots: SlotList | None = None  # plane "shm": arena slots; plane "kv": slots of the registered tensors
    reg: _text(1, 128) | None = None  # plane "kv": name of the registration
    # Feature "deadlines", added within v1: CLOCK_MONOTONIC ns after which the client no longer waits.
    deadline_ns: _uint(1, MAX_ID) | None = None

    def __post_init__(self) -> None:
        if self.plane is None:
            self.plane = "inline"


LendIds = Annotated[list[_uint(0, 2**32 - 1)], msgspec.Meta(max_length=MAX_HASHES)]


class StoreRequest(_PlaneRequest, tag="store"):
    hints: HintFields | None = None


class RestoreRequest(_PlaneRequest, tag="restore"):
    # Feature "lend", added within v1: planes "shm"/"kv": the daemon may lend the prefix's CPU-tier slots
    # ("lent" in the reply) instead of copying; the client copies them and sends release_lends.
    lend: bool | None = False
    release: LendIds | None = None  # feature "lend": lends of this session to end first (release_lends's ids)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lend is None:
            self.lend = False


class ReleaseLendsRequest(Message, tag="release_lends"):
    ids: LendIds  # the lends (restore replies' lent.id) this session is done reading


class StatsRequest(Message, tag="stats"):
    pass


class HealthRequest(Message, tag="health"):
    pass


class ClearRequest(Message, tag="clear"):
    pass


class EventsRequest(Message, tag="events"):
    since: _uint(0, MAX_ID)  # the last event already read (a reply's "next"); 0: from the oldest kept
    max_events: _uint(1, MAX_EVENTS) | None = MAX_EVENTS

    def __post_init__(self) -> None:
        if self.max_events is None:
            self.max_events = MAX_EVENTS


# ---- replies -----------------------------------------------------------------
#
# An ok reply of each op, one Struct: the envelope and the op's result fields.
# Unknown fields are ignored (a daemon may add reply fields within v1); stats
# and health reply free-form maps (docs/protocol.md) and have no Struct. Every
# class is kw_only: msgspec then keeps the fields in declaration order, envelope
# first, so a typed reply the daemon encodes (encode_reply) is byte for byte
# the map it used to pack (msgspec moves kw_only fields after the others).


class ReplyMessage(msgspec.Struct, kw_only=True):
    """The envelope of an ok reply; a subclass adds an op's result fields."""

    v: int
    id: int
    ok: bool


class NoFieldsReply(ReplyMessage, kw_only=True):
    pass


TierField = bytes | list[str]  # tier names, or packed codes (TIER_CODES) to a request whose hashes were packed


class HelloReply(ReplyMessage, kw_only=True):
    sid: str
    lease_s: float
    heartbeat_s: float
    protocol_version: int = PROTOCOL_VERSION
    daemon_version: str = ""
    features: list[Any] | None = None  # absent from daemons before features; names this client does not know are ignored
    pool: dict[str, Any] = msgspec.field(default_factory=dict)
    limits: dict[str, Any] = msgspec.field(default_factory=dict)
    clock: Any = None  # feature "deadlines": checked by kvtier.client.shared_clock


class HeartbeatReply(ReplyMessage, kw_only=True):
    lease_s: float


class AttachArenaReply(ReplyMessage, kw_only=True):
    num_slots: int


class RegisterKvReply(ReplyMessage, kw_only=True):
    num_blocks: int
    gpu_tier: bool = False


class LookupReply(ReplyMessage, kw_only=True):
    tiers: TierField
    pinned: int = 0


class TiersReply(ReplyMessage, kw_only=True):
    """pin and restore: the tiers of the prefix."""

    tiers: TierField


class RestoreReply(TiersReply, kw_only=True):
    # Feature "lend": the lent CPU-tier slots (id, path, inode, block_bytes, slots, expires_ns) when the
    # daemon lent instead of copying (kvtier.client.arena_map.Lent.from_wire reads it).
    lent: dict[str, Any] | None = None


class ReleaseLendsReply(ReplyMessage, kw_only=True):
    released: int


class UnpinReply(ReplyMessage, kw_only=True):
    unpinned: int


class AllocateReply(ReplyMessage, kw_only=True):
    block_ids: list[int]
    tiers: TierField
    num_gpu_hits: int
    num_cpu_hits: int
    num_remote_hits: int = 0
    num_disk_hits: int = 0  # to sessions whose hello named feature "disk_tier"


class AppendReply(ReplyMessage, kw_only=True):
    block_ids: list[int]
    new_block_ids: list[int]


class StoreReply(ReplyMessage, kw_only=True):
    stored: int
    present: int


class ClearReply(ReplyMessage, kw_only=True):
    cleared: int


class EventsReply(ReplyMessage, kw_only=True):
    kinds: bytes
    hashes: bytes
    next: int
    lost: bool



@dataclass(frozen=True)
class OpSpec:
    type: type[Message]
    reply: type[ReplyMessage] | None  # None: a free-form map (stats, health)
    session: str = "required"  # "required" | "none" | "optional"
    payload: bool = False  # may carry a payload frame
    renews_lease: bool = True
    idempotent: bool = False  # safe for a client to resend after a timeout
    doc: str = ""

    @property
    def fields(self) -> tuple[str, ...]:
        """The op's own fields (not the header's)."""
        return tuple(f for f in self.type.__struct_fields__ if f not in HEADER_FIELDS)


HEADER_FIELDS = ("v", "op", "id", "sid")

OPS: dict[str, OpSpec] = {
    "hello": OpSpec(HelloRequest, HelloReply, session="none", idempotent=True,
                    doc="open a session on a pool (creating the pool), negotiate version and layout"),
    "heartbeat": OpSpec(HeartbeatRequest, HeartbeatReply, idempotent=True, doc="renew the session lease"),
    "bye": OpSpec(ByeRequest, NoFieldsReply, idempotent=True, doc="end the session, releasing everything it holds"),
    "attach_arena": OpSpec(
        AttachArenaRequest, AttachArenaReply,
        doc="map the client's shared-memory staging arena (data plane shm); the daemon unlinks it when the session ends",
    ),
    "register_kv": OpSpec(RegisterKvRequest, RegisterKvReply, doc="register engine KV tensors (engine mode: they become the pool's GPU tier)"),
    "unregister_kv": OpSpec(UnregisterKvRequest, NoFieldsReply, doc="drop a registration"),
    "lookup": OpSpec(
        LookupRequest, LookupReply,
        renews_lease=False,
        # Without "pin": resent after a timeout. A pinned lookup resent pins twice: the Python client does not resend it.
        idempotent=True,
        doc="longest cached prefix and the tier of each block; optionally pin it atomically",
    ),
    "pin": OpSpec(PinRequest, TiersReply, doc="pin the longest available prefix (never evicted while pinned)"),
    "unpin": OpSpec(UnpinRequest, UnpinReply, doc="drop this session's pins on these hashes (of the tag), or every pin of a tag"),
    "allocate": OpSpec(AllocateRequest, AllocateReply,
                       doc="engine mode: block table for a new request; CPU hits are restored into slots before the reply"),
    "append": OpSpec(AppendRequest, AppendReply, doc="engine mode: grow a request; hashes of the blocks these tokens filled"),
    "free": OpSpec(FreeRequest, NoFieldsReply, doc="engine mode: release a request's blocks"),
    "store": OpSpec(StoreRequest, StoreReply, payload=True, idempotent=True,
                    doc="copy blocks into the pool (content-addressed; present hashes are skipped)"),
    "restore": OpSpec(RestoreRequest, RestoreReply, idempotent=True, doc="copy the longest available prefix out of the pool"),
    "release_lends": OpSpec(ReleaseLendsRequest, ReleaseLendsReply, idempotent=True,
                            doc='feature "lend": end these lends of the session (unknown or ended ids are ignored)'),
    "stats": OpSpec(StatsRequest, None, session="optional", renews_lease=False, idempotent=True, doc="counters"),
    "health": OpSpec(HealthRequest, None, session="optional", renews_lease=False, idempotent=True, doc="liveness/readiness"),
    "clear": OpSpec(ClearRequest, ClearReply, idempotent=True, doc="drop every unpinned, unused cached block of the session's pool"),
    "events": OpSpec(
        EventsRequest, EventsReply,
        renews_lease=False,
        idempotent=True,
        doc='feature "events": the keys the pool started ("s") and stopped ("r") holding after event "since", in order',
    ),
}

# The fields of each op that hold block hashes: the ones that may come packed.
HASH_FIELDS: dict[str, tuple[str, ...]] = {op: tuple(f for f in spec.fields if f == "hashes") for op, spec in OPS.items()}

# Decode and validate an ok reply of one op in one step.
_REPLY_DECODERS: dict[str, msgspec.msgpack.Decoder] = {
    op: msgspec.msgpack.Decoder(spec.reply) for op, spec in OPS.items() if spec.reply is not None}


def decode_reply(op: str, data: bytes | memoryview) -> ReplyMessage | None:
    """An ok reply to ``op`` as its op's Struct, or None if ``data`` is none (an error reply, another op's, or
    not valid: ``reply_error`` says why). Ops without a reply Struct (stats, health): always None."""
    decoder = _REPLY_DECODERS.get(op)
    if decoder is None:
        return None
    try:
        reply = decoder.decode(data)
    except Exception:  # msgspec's errors, UnicodeDecodeError
        return None
    return reply if reply.ok is True and reply.v == PROTOCOL_VERSION else None


def reply_error(op: str, data: bytes | memoryview) -> ProtocolError:
    """Why an ok reply to ``op`` does not decode as its Struct (MALFORMED)."""
    try:
        _REPLY_DECODERS[op].decode(data)
    except Exception as exc:
        return ProtocolError(ErrorCode.MALFORMED, f"bad reply to {op}: {str(exc).replace('`', '')}")
    return ProtocolError(ErrorCode.MALFORMED, f"bad reply to {op}")


# Decodes and validates a header of any op in one step (ops told apart by "op").
_REQUEST_DECODER = msgspec.msgpack.Decoder(Union[tuple(spec.type for spec in OPS.values())])  # noqa: UP007


def check_text(name: str, value: Any, max_len: int, min_len: int = 1) -> str:
    """A string field's check, for callers that check one value ahead (config, connectors): raises ProtocolError."""
    if not isinstance(value, str):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"field {name!r}: expected a string, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"field {name!r}: length {len(value)} is outside {min_len}..{max_len}")
    return value


_ERROR_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_NAMED = re.compile(r"^Object (?P<kind>contains unknown|missing required) field `(?P<name>[^`]*)`$")
_OVER = re.compile(r"`(array|object)` of length <=")
_ELEMENT = re.compile(r"^(?P<list>.*)\[(?P<index>\d+)\]$")


def _invalid(exc: msgspec.ValidationError, prefix: str = "") -> ProtocolError:
    """msgspec's validation message as this protocol's error: INVALID_FIELD, or TOO_LARGE for a list over its limit."""
    m = _ERROR_AT.match(str(exc))
    what, path = (m["what"], (m["path"] or "").lstrip(".")) if m else (str(exc), "")
    named = _NAMED.match(what)
    if named:
        full = prefix + (f"{path}." if path else "") + named["name"]
        kind = "unknown" if named["kind"] == "contains unknown" else "missing"
        return ProtocolError(ErrorCode.INVALID_FIELD, f"{kind} field {full!r}")
    code = ErrorCode.TOO_LARGE if _OVER.search(what) else ErrorCode.INVALID_FIELD
    text = what.replace("`", "")
    text = text[:1].lower() + text[1:]
    element = _ELEMENT.match(path)
    if element:  # an element of a list: named as the list's field, then the element's index
        path, text = element["list"], f"element {element['index']}: {text}"
    return ProtocolError(code, f"field {prefix + path!r}: {text}")


@dataclass(slots=True)
class Request:
    """A validated request: ``msg`` is the op's Struct (every field set, defaults filled in)."""

    op: str
    id: int
    sid: str | None
    msg: Any  # the op's Message subclass
    payload: list[Any]  # raw frames (zmq.Frame or bytes)
    # Its hashes came packed: its reply's tier lists go out packed too.
    packed: bool = False

    @property
    def spec(self) -> OpSpec:
        return OPS[self.op]


# One reusable encoder for headers: a map packs to the bytes msgpack.packb(use_bin_type=True) gives it, in a
# tenth of the time (packb builds a Packer per call: ~3 us of a 256-hash lookup's header, against 0.4).
_HEADER_ENCODER = msgspec.msgpack.Encoder()


def encode(header: Mapping[str, Any]) -> bytes:
    if type(header) is dict:
        try:
            return _HEADER_ENCODER.encode(header)
        except TypeError:
            pass  # msgspec refuses subclasses of int/float/str (numpy.float64 ...); msgpack packs them as their base
        except RecursionError:
            # msgspec nests on the C stack, to the interpreter's recursion limit: a hostile request's header,
            # nested ~1,000 deep, re-encoded by validate_request, must not end the daemon's loop. msgpack packs
            # it (or says ValueError past its own limit), as before msgspec did the common case.
            pass
    return msgpack.packb(header, use_bin_type=True)


def decode(data: bytes | memoryview) -> Any:
    # Limits keep a hostile header from building huge containers; the header
    # size itself is capped before decoding. Per-container limits do not
    # bound nesting: 4 MiB of arrays of empty arrays is ~4M objects (1.9 s of
    # the daemon's loop), so the hooks count every array and map as it is
    # built and stop at MAX_HEADER_VALUES (the attack: 0.07 s; a legitimate
    # header holds a fraction of it, and the hooks cost it nothing measurable).
    left = MAX_HEADER_VALUES

    def counted(container: Any) -> Any:
        nonlocal left
        left -= len(container) + 1
        if left < 0:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"header holds more than {MAX_HEADER_VALUES} values")
        return container

    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        max_bin_len=MAX_HEADER_BYTES,
        max_str_len=MAX_HEADER_BYTES,
        max_array_len=MAX_HASHES * 2,
        max_map_len=1024,
        max_ext_len=0,
        list_hook=counted,
        object_hook=counted,
    )


# One reusable encoder for typed replies (its buffer is reused from call to call).
_REPLY_ENCODER = msgspec.msgpack.Encoder()


def encode_reply(header: Mapping[str, Any] | ReplyMessage) -> bytes:
    """A reply header's bytes: a typed reply (its op's ``ReplyMessage``) through one reusable msgspec
    encoder, a map as ``encode`` packs it. The same fields in the same order give the same bytes either
    way (a Struct's fields go out in declaration order: the envelope, then the op's)."""
    if isinstance(header, ReplyMessage):
        return _REPLY_ENCODER.encode(header)
    return encode(header)


def recoverable_id(header: Any) -> int:
    """The id to answer with: the request's own if readable, else RESERVED_ID.

    Takes the decoded header or its frame (decoded here again: this runs for rejected requests only)."""
    if isinstance(header, (bytes, memoryview)):
        try:
            header = decode_header(header)
        except ProtocolError:
            return RESERVED_ID
    if isinstance(header, dict):
        rid = header.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 < rid <= MAX_ID:
            return rid
    return RESERVED_ID


def decode_header(data: bytes | memoryview) -> dict[str, Any]:
    """Decode a header frame, raising ProtocolError(MALFORMED / TOO_LARGE)."""
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header is {len(data)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        header = decode(data)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(ErrorCode.MALFORMED, f"header is not valid MessagePack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"header must be a map, got {type(header).__name__}")
    return header


def _check_envelope(spec: OpSpec | None, op: str, sid: Any, payload: Sequence[Any], max_payload_bytes: int) -> OpSpec:
    """The checks of the header's session id and of the payload frames, in the order the errors are reported."""
    if spec is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op[:64]!r}")
    if spec.session == "none":
        if sid is not None:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"op {op!r} takes no 'sid'")
    elif sid is None:
        if spec.session == "required":
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"op {op!r} needs a session: field 'sid' missing")
    elif not isinstance(sid, str) or not 0 < len(sid) <= 64:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "field 'sid' must be a string of 1..64 chars")
    if len(payload) > (MAX_PAYLOAD_FRAMES if spec.payload else 0):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"op {op!r} takes {MAX_PAYLOAD_FRAMES if spec.payload else 0} payload frame(s), got {len(payload)}")
    if payload:
        payload_bytes = sum(frame_nbytes(f) for f in payload)
        if payload_bytes > max_payload_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"payload is {payload_bytes} bytes, limit {max_payload_bytes}")
    return spec


def _finish(msg: Message, op: str, payload: Sequence[Any], header: Mapping[str, Any] | bytes | memoryview) -> Request:
    """The Request of a validated message: packed hashes split, opaque descriptors read from ``header``
    (the decoded header, or its frame: then decoded again, for register_kv only)."""
    packed = False
    if HASH_FIELDS[op]:
        hashes = msg.hashes  # type: ignore[attr-defined]
        if type(hashes) is bytes:
            n, rest = divmod(len(hashes), HASH_BYTES)
            if rest:
                raise ProtocolError(ErrorCode.INVALID_FIELD,
                                    f"field 'hashes': packed hashes are {len(hashes)} bytes, not a multiple of {HASH_BYTES}")
            if n > MAX_HASHES:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"field 'hashes': {n} packed hashes, limit {MAX_HASHES}")
            msg.hashes = unpack_hashes(hashes)  # type: ignore[attr-defined]
            packed = True
    elif op == "register_kv":
        # The descriptors are maps of anything: read with decode()'s limits on the whole header, as before.
        decoded = header if isinstance(header, Mapping) else decode_header(header)
        for i, tensor in enumerate(msg.tensors):  # type: ignore[attr-defined]
            tensor.desc = _opaque_map(f"tensors[{i}].desc", decoded["tensors"][i]["desc"])
    return Request(op=op, id=msg.id, sid=msg.sid, msg=msg, payload=list(payload), packed=packed)


def _opaque_map(name: str, value: Any) -> dict[str, Any]:
    """A descriptor map the protocol passes through (the daemon's importer checks it): str keys, at most MAX_DESC_KEYS."""
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"field {name!r}: expected a map, got {type(value).__name__}")
    if len(value) > MAX_DESC_KEYS:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r}: {len(value)} keys, limit {MAX_DESC_KEYS}")
    for key in value:
        if not isinstance(key, str):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"field {name!r}: map keys must be strings")
    return value


def decode_request(data: bytes | memoryview, payload: Sequence[Any] = (), *,
                   max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Request:
    """Decode and validate a request header frame (and check its payload frames) in one step.

    A header msgspec accepts as its op's Struct is checked no further but for its
    envelope; any other goes through ``decode_header`` and ``validate_request``,
    which say exactly what is wrong (and with which code)."""
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header is {len(data)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        msg = _REQUEST_DECODER.decode(data)
    except ProtocolError:
        raise
    except Exception:  # msgspec's errors, and UnicodeDecodeError for a str that is not UTF-8
        return validate_request(decode_header(data), payload, max_payload_bytes=max_payload_bytes)
    if msg.v != PROTOCOL_VERSION or not 0 < msg.id <= MAX_ID:
        return validate_request(decode_header(data), payload, max_payload_bytes=max_payload_bytes)
    op = type(msg).__struct_config__.tag
    _check_envelope(OPS[op], op, msg.sid, payload, max_payload_bytes)
    return _finish(msg, op, payload, data)


def validate_request(header: Mapping[str, Any], payload: Sequence[Any] = (), *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Request:
    """Check a decoded request header (and its payload frames) against the schema."""
    version = header.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolError(ErrorCode.MALFORMED, "header field 'v' (protocol version) missing or not an integer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version} not supported; this daemon speaks {PROTOCOL_VERSION}")
    rid = header.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 < rid <= MAX_ID:
        raise ProtocolError(ErrorCode.MALFORMED, f"header field 'id' must be an integer 1..{MAX_ID}")
    op = header.get("op")
    if not isinstance(op, str):
        raise ProtocolError(ErrorCode.MALFORMED, "header field 'op' missing or not a string")
    spec = _check_envelope(OPS.get(op), op, header.get("sid"), payload, max_payload_bytes)
    for key in header:
        if not isinstance(key, str):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"field names must be strings, got {key!r}")
    for name in HASH_FIELDS[op]:
        value = header.get(name)
        if value is not None and type(value) is not bytes and not isinstance(value, list):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"field {name!r}: expected an array of 16-byte bin or one bin "
                                f"of 16*n bytes, got {type(value).__name__}")
    try:
        # Through MessagePack, not msgspec.convert: convert would take a str for bytes (base64).
        msg = msgspec.msgpack.decode(encode(header), type=spec.type)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None
    return _finish(msg, op, payload, header)


def frame_nbytes(frame: Any) -> int:
    """Bytes in a payload frame (zmq.Frame, bytes or any buffer)."""
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).nbytes


def request_header(op: str, rid: int, sid: str | None, *, packed_hashes: bool = False, **fields: Any) -> dict[str, Any]:
    """A request header. Its hash fields (checked by the caller, as lists or
    already packed) go packed with ``packed_hashes``, as arrays without."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": op, "id": rid}
    if sid is not None:
        header["sid"] = sid
    for k, v in fields.items():
        if v is not None:
            header[k] = v
    for name in HASH_FIELDS[op]:  # () for most ops, ("hashes",) for the rest
        value = header.get(name)
        if value is None or (type(value) is bytes) == packed_hashes:
            continue  # absent, or already in the form wanted
        header[name] = pack_hashes(value) if packed_hashes else unpack_hashes(value)
    return header


def ok_reply(rid: int, **result: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, **result}


def error_reply(rid: int, code: ErrorCode, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": False, "error": {"code": int(code), "name": code.name, "message": message}}


def error_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"UNKNOWN_{code}"
