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

Every field a request may carry is listed in ``OPS`` with its type; unknown
fields, missing required fields, wrong types and out-of-range values are
INVALID_FIELD errors. Block hashes are 16-byte MessagePack ``bin`` values in a
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

This module imports msgpack only (no zmq, no torch) so that any process, and
the docs generator, can use it. ``docs/protocol.md`` is the prose version.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

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


# ---- field types -----------------------------------------------------------


class FieldType:
    """Checks one decoded value; returns it (possibly normalised) or raises ProtocolError."""

    wire: str = ""

    def check(self, name: str, value: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def _bad(name: str, why: str) -> ProtocolError:
        return ProtocolError(ErrorCode.INVALID_FIELD, f"field {name!r}: {why}")


@dataclass(frozen=True)
class UInt(FieldType):
    lo: int = 0
    hi: int = 2**64 - 1

    @property
    def wire(self) -> str:  # type: ignore[override]
        return f"uint {self.lo}..{self.hi}" if self.hi < 2**64 - 1 else f"uint >= {self.lo}"

    def check(self, name: str, value: Any) -> int:
        # bool is an int subclass in Python; on the wire it is its own type.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, f"expected an unsigned integer, got {type(value).__name__}")
        if not self.lo <= value <= self.hi:
            raise self._bad(name, f"{value} is outside {self.lo}..{self.hi}")
        return value


@dataclass(frozen=True)
class Seconds(FieldType):
    lo_s: float = 0.0
    hi_s: float = 86400.0

    @property
    def wire(self) -> str:  # type: ignore[override]
        return f"float or int, seconds, {self.lo_s} < x <= {self.hi_s}"

    def check(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(name, f"expected a number of seconds, got {type(value).__name__}")
        if not (math.isfinite(value) and self.lo_s < value <= self.hi_s):
            raise self._bad(name, f"{value} is outside ({self.lo_s}, {self.hi_s}]")
        return float(value)


@dataclass(frozen=True)
class Str(FieldType):
    min_len: int = 1
    max_len: int = MAX_STR_LEN

    @property
    def wire(self) -> str:  # type: ignore[override]
        return f"str, {self.min_len}..{self.max_len} chars"

    def check(self, name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise self._bad(name, f"expected a string, got {type(value).__name__}")
        if not self.min_len <= len(value) <= self.max_len:
            raise self._bad(name, f"length {len(value)} is outside {self.min_len}..{self.max_len}")
        return value


@dataclass(frozen=True)
class Enum(FieldType):
    values: tuple[str, ...] = ()

    @property
    def wire(self) -> str:  # type: ignore[override]
        return "str, one of " + ", ".join(f'"{v}"' for v in self.values)

    def check(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in self.values:
            raise self._bad(name, f"expected one of {list(self.values)}, got {value!r}")
        return value


@dataclass(frozen=True)
class StrList(FieldType):
    max_items: int = 64
    max_len: int = 64

    @property
    def wire(self) -> str:  # type: ignore[override]
        return f"array of str, at most {self.max_items}, each 1..{self.max_len} chars"

    def check(self, name: str, value: Any) -> list[str]:
        if not isinstance(value, list):
            raise self._bad(name, f"expected an array of strings, got {type(value).__name__}")
        if len(value) > self.max_items:
            raise self._bad(name, f"{len(value)} items, at most {self.max_items}")
        for item in value:
            if not isinstance(item, str) or not 0 < len(item) <= self.max_len:
                raise self._bad(name, f"items must be strings of 1..{self.max_len} chars, got {item!r}")
        return value


@dataclass(frozen=True)
class Bool(FieldType):
    wire: str = "bool"

    def check(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self._bad(name, f"expected a bool, got {type(value).__name__}")
        return value


@dataclass(frozen=True)
class Hashes(FieldType):
    max_count: int = MAX_HASHES

    @property
    def wire(self) -> str:  # type: ignore[override]
        return (f"array of bin16 (block hashes), at most {self.max_count}; "
                f"or packed: one bin of 16*n bytes, n at most {self.max_count}")

    def check(self, name: str, value: Any) -> list[bytes]:
        if type(value) is bytes:  # msgpack decodes every bin to exactly bytes
            return self._unpack(name, value)
        if not isinstance(value, list):
            raise self._bad(name, f"expected an array of 16-byte bin or one bin of 16*n bytes, got {type(value).__name__}")
        if len(value) > self.max_count:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r}: {len(value)} hashes, limit {self.max_count}")
        for i, h in enumerate(value):
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                got = f"{len(h)} bytes" if isinstance(h, bytes) else type(h).__name__
                raise self._bad(name, f"element {i}: expected bin of {HASH_BYTES} bytes, got {got}")
        return value

    def _unpack(self, name: str, packed: bytes) -> list[bytes]:
        n, rest = divmod(len(packed), HASH_BYTES)
        if rest:
            raise self._bad(name, f"packed hashes are {len(packed)} bytes, not a multiple of {HASH_BYTES}")
        if n > self.max_count:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r}: {n} packed hashes, limit {self.max_count}")
        return unpack_hashes(packed)


@dataclass(frozen=True)
class UIntList(FieldType):
    max_count: int = MAX_HASHES
    hi: int = 2**32 - 1

    @property
    def wire(self) -> str:  # type: ignore[override]
        return f"array of uint (0..{self.hi}), at most {self.max_count}"

    def check(self, name: str, value: Any) -> list[int]:
        if not isinstance(value, list):
            raise self._bad(name, f"expected an array of uint, got {type(value).__name__}")
        if len(value) > self.max_count:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r}: {len(value)} entries, limit {self.max_count}")
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self.hi:
                raise self._bad(name, f"element {i}: expected uint 0..{self.hi}, got {v!r}")
        return value


@dataclass(frozen=True)
class Spec:
    """One field of a request (or of a nested map)."""

    type: FieldType
    required: bool = True
    default: Any = None
    doc: str = ""


@dataclass(frozen=True)
class Map(FieldType):
    fields: Mapping[str, Spec] = field(default_factory=dict)
    # Opaque maps (kv_share descriptors) are passed through after a shallow check.
    opaque: bool = False
    max_keys: int = 64

    @property
    def wire(self) -> str:  # type: ignore[override]
        return "map (opaque)" if self.opaque else "map, see its fields"

    def check(self, name: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self._bad(name, f"expected a map, got {type(value).__name__}")
        if len(value) > self.max_keys:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r}: {len(value)} keys, limit {self.max_keys}")
        if self.opaque:
            for key in value:
                if not isinstance(key, str):
                    raise self._bad(name, "map keys must be strings")
            return value
        return check_fields(value, self.fields, prefix=f"{name}.")


@dataclass(frozen=True)
class MapList(FieldType):
    item: Map = field(default_factory=Map)
    max_count: int = MAX_REGISTERED_TENSORS

    @property
    def wire(self) -> str:  # type: ignore[override]
        return f"array of map, 1..{self.max_count}"

    def check(self, name: str, value: Any) -> list[dict[str, Any]]:
        if not isinstance(value, list) or not value:
            raise self._bad(name, "expected a non-empty array of maps")
        if len(value) > self.max_count:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r}: {len(value)} entries, limit {self.max_count}")
        return [self.item.check(f"{name}[{i}]", v) for i, v in enumerate(value)]


def check_fields(values: Mapping[str, Any], specs: Mapping[str, Spec], *, prefix: str = "") -> dict[str, Any]:
    """Validate ``values`` against ``specs``: every key known, every required key present."""
    out: dict[str, Any] = {}
    for key in values:
        if not isinstance(key, str):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"field names must be strings, got {key!r}")
        if key not in specs:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"unknown field {prefix}{key!r}")
    for key, spec in specs.items():
        if key in values and not (values[key] is None and not spec.required):
            out[key] = spec.type.check(prefix + key, values[key])
        elif spec.required:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"missing field {prefix}{key!r}")
        else:
            out[key] = spec.default
    return out


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

LAYOUT_FIELDS: dict[str, Spec] = {
    "model": Spec(Str(), doc="model identity (name or path + revision)"),
    "block_size": Spec(UInt(1, 2**32 - 1), doc="tokens per block"),
    "block_bytes": Spec(UInt(1, 2**40), doc="bytes of one block, all layers, K and V"),
    "dtype": Spec(Str(1, 32), doc='KV element type, e.g. "bfloat16"'),
    "num_layers": Spec(UInt(1, 2**20)),
    "kv_heads": Spec(UInt(1, 2**20), doc="KV heads on this rank"),
    "head_dim": Spec(UInt(1, 2**20)),
    "tp_rank": Spec(UInt(0, 2**20)),
    "tp_size": Spec(UInt(1, 2**20)),
    "hash_algo": Spec(Enum(HASH_ALGOS)),
    "mode": Spec(Enum(MODES), doc='"store": the daemon owns the GPU tier; "engine": the engine\'s registered KV tensors are the GPU tier'),
}
LAYOUT = Map(LAYOUT_FIELDS)

# One registered tensor: the kv_share descriptor (opaque to the protocol; the
# daemon's importer validates it) plus which dimension indexes blocks.
KV_TENSOR = Map(
    {
        "desc": Spec(Map(opaque=True), doc="tensor descriptor produced by kvtier.client.kv_share"),
        "block_dim": Spec(UInt(0, 16), doc="dimension of the tensor that indexes blocks"),
    }
)

HASHES = Spec(Hashes(), doc="block hashes, bin16 each, prefix order")
# Feature "pin_tags", added within v1: a daemon without it refuses the key.
PIN_TAG = Spec(Str(1, MAX_STR_LEN), required=False,
               doc="the pins' tag (the request they serve): unpin of the tag alone drops every pin taken under it")
REQ = Spec(Str(1, MAX_STR_LEN), doc="engine request id (unique within the session)")
PLANE_FIELDS: dict[str, Spec] = {
    "plane": Spec(Enum(PLANES), required=False, default="inline", doc="where the block bytes are"),
    "slots": Spec(UIntList(), required=False, doc='plane "shm": arena slots; plane "kv": slots of the registered tensors; one per hash'),
    "reg": Spec(Str(1, 128), required=False, doc='plane "kv": name of the registration'),
    # Feature "deadlines", added within v1: a daemon without it refuses the key.
    "deadline_ns": Spec(UInt(1, MAX_ID), required=False,
                        doc="CLOCK_MONOTONIC ns after which the client no longer waits: the daemon then leaves its memory alone"),
}


# Per-request hints (feature "hints"): what the application knows about the
# request. Soft: a daemon may bound or ignore them, never fails a request for
# them once they are valid. Documented in docs/protocol.md ("Hints").
MAX_RETAIN_S = 86400.0
MAX_PRIORITY = 255
MAX_OUTPUT_TOKENS = 2**31 - 1
HINT_FIELDS: dict[str, Spec] = {
    "session": Spec(Str(1, MAX_STR_LEN), required=False,
                    doc="opaque key of the conversation or agent session (a prompt-cache key); scoped to the tenant"),
    "retain_s": Spec(Seconds(0.0, MAX_RETAIN_S), required=False,
                     doc="soft TTL: keep these blocks at least this long while capacity allows (bounded per client)"),
    "priority": Spec(UInt(0, MAX_PRIORITY), required=False, default=0, doc="higher is evicted later; default 0"),
    # Feature "hint_output_tokens": a daemon without it refuses the key (INVALID_FIELD), so clients
    # send it only to daemons that list the feature.
    "output_tokens": Spec(UInt(0, MAX_OUTPUT_TOKENS), required=False, default=0,
                          doc="tokens the request generated so far, as the engine counts them (its stores)"),
}
HINTS = Spec(Map(HINT_FIELDS, max_keys=len(HINT_FIELDS)), required=False,
             doc='feature "hints": session / retain_s / priority / output_tokens of the request')


@dataclass(frozen=True, slots=True)
class Hints:
    """The client's side of ``HINT_FIELDS``: checked here as the daemon will check them."""

    session: str | None = None
    retain_s: float | None = None
    priority: int = 0
    output_tokens: int = 0  # an engine's count of the tokens the request generated; 0: none

    def __post_init__(self) -> None:
        check_fields(self.to_wire(), HINT_FIELDS, prefix="hints.")

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


@dataclass(frozen=True)
class OpSpec:
    fields: Mapping[str, Spec]
    session: str = "required"  # "required" | "none" | "optional"
    payload: bool = False  # may carry a payload frame
    renews_lease: bool = True
    idempotent: bool = False  # safe for a client to resend after a timeout
    doc: str = ""


OPS: dict[str, OpSpec] = {
    "hello": OpSpec(
        {
            "pool": Spec(Str(1, 128), doc="pool name; the first hello creates the pool"),
            "layout": Spec(LAYOUT),
            "client": Spec(Str(0, 128), required=False, default="", doc="free text for logs"),
            "lease_s": Spec(Seconds(0.0, 3600.0), required=False, doc="requested lease; the daemon may shorten it"),
            # Added within v1: a daemon that predates tenants refuses it with
            # INVALID_FIELD, which is right (it cannot honour the namespace).
            "token": Spec(Str(1, 256), required=False, doc="tenant token (daemons with [tenants]); CURVE keys need none"),
            # Added within v1, like token: only to daemons that list feature "disk_tier" (others refuse it).
            "features": Spec(StrList(), required=False, default=None,
                             doc='reply features this client reads, e.g. ["disk_tier"]; unknown names are ignored'),
        },
        session="none",
        idempotent=True,
        doc="open a session on a pool (creating the pool), negotiate version and layout",
    ),
    "heartbeat": OpSpec({}, idempotent=True, doc="renew the session lease"),
    "bye": OpSpec({}, idempotent=True, doc="end the session, releasing everything it holds"),
    "attach_arena": OpSpec(
        {
            "name": Spec(Str(1, 255), doc="file name in /dev/shm made by kvtier.client.shm_arena (kvtier-...)"),
            "num_slots": Spec(UInt(1, 2**32 - 1)),
            "slot_bytes": Spec(UInt(1, 2**40), doc="must equal the pool's block_bytes"),
        },
        doc="map the client's shared-memory staging arena (data plane shm); the daemon unlinks it when the session ends",
    ),
    "register_kv": OpSpec(
        {
            "name": Spec(Str(1, 128), doc="registration name, unique within the session"),
            "tensors": Spec(MapList(KV_TENSOR), doc="one per layer, or one for all layers; block byte order is tensor by tensor"),
        },
        doc="register engine KV tensors (engine mode: they become the pool's GPU tier)",
    ),
    "unregister_kv": OpSpec({"name": Spec(Str(1, 128))}, doc="drop a registration"),
    "lookup": OpSpec(
        {"hashes": HASHES, "pin": Spec(Bool(), required=False, default=False), "hints": HINTS, "pin_tag": PIN_TAG},
        renews_lease=False,
        # Without "pin": resent after a timeout. A pinned lookup resent pins twice: the Python client does not resend it.
        idempotent=True,
        doc="longest cached prefix and the tier of each block; optionally pin it atomically",
    ),
    "pin": OpSpec({"hashes": HASHES, "pin_tag": PIN_TAG}, doc="pin the longest available prefix (never evicted while pinned)"),
    "unpin": OpSpec(
        {"hashes": Spec(Hashes(), required=False, doc="the hashes to drop a pin on; absent: every pin of 'pin_tag'"),
         "pin_tag": PIN_TAG},
        doc="drop this session's pins on these hashes (of the tag), or every pin of a tag",
    ),
    "allocate": OpSpec(
        {"req": REQ, "hashes": HASHES, "num_tokens": Spec(UInt(0, 2**40)), "hints": HINTS},
        doc="engine mode: block table for a new request; CPU hits are restored into slots before the reply",
    ),
    "append": OpSpec(
        {"req": REQ, "num_tokens": Spec(UInt(0, 2**40), doc="NEW tokens"), "hashes": HASHES},
        doc="engine mode: grow a request; hashes of the blocks these tokens filled",
    ),
    "free": OpSpec(
        {
            "req": REQ,
            "valid_tokens": Spec(
                UInt(0, 2**40), required=False, default=None,
                doc="tokens whose K/V the engine wrote; blocks past them lose their hash (a failed request)",
            ),
        },
        doc="engine mode: release a request's blocks",
    ),
    "store": OpSpec(
        {"hashes": HASHES, **PLANE_FIELDS, "hints": HINTS},
        payload=True,
        idempotent=True,
        doc="copy blocks into the pool (content-addressed; present hashes are skipped)",
    ),
    "restore": OpSpec(
        {"hashes": HASHES, **PLANE_FIELDS,
         # Feature "lend", added within v1: a daemon without it refuses the key.
         "lend": Spec(Bool(), required=False, default=False,
                      doc='planes "shm"/"kv": the daemon may lend the prefix\'s CPU-tier slots ("lent" in the reply) '
                          "instead of copying; the client copies them and sends release_lends"),
         "release": Spec(UIntList(), required=False, default=None,
                         doc='feature "lend": lends of this session to end first (release_lends\'s ids, sent along)')},
        idempotent=True,
        doc="copy the longest available prefix out of the pool",
    ),
    "release_lends": OpSpec(
        {"ids": Spec(UIntList(), doc="the lends (restore replies' lent.id) this session is done reading")},
        idempotent=True,
        doc='feature "lend": end these lends of the session (unknown or ended ids are ignored)',
    ),
    "stats": OpSpec({}, session="optional", renews_lease=False, idempotent=True, doc="counters"),
    "health": OpSpec({}, session="optional", renews_lease=False, idempotent=True, doc="liveness/readiness"),
    "clear": OpSpec({}, idempotent=True, doc="drop every unpinned, unused cached block of the session's pool"),
    "events": OpSpec(
        {
            "since": Spec(UInt(0, MAX_ID), doc="the last event already read (a reply's 'next'); 0: from the oldest kept"),
            "max_events": Spec(UInt(1, MAX_EVENTS), required=False, default=MAX_EVENTS),
        },
        renews_lease=False,
        idempotent=True,
        doc='feature "events": the keys the pool started ("s") and stopped ("r") holding after event "since", in order',
    ),
}

HEADER_FIELDS = ("v", "op", "id", "sid")

# The fields of type Hashes of each op: the ones that may come packed.
HASH_FIELDS: dict[str, tuple[str, ...]] = {
    op: tuple(name for name, s in spec.fields.items() if isinstance(s.type, Hashes)) for op, spec in OPS.items()
}


@dataclass(slots=True)
class Request:
    """A validated request. ``fields`` holds every field of the op (defaults filled in)."""

    op: str
    id: int
    sid: str | None
    fields: dict[str, Any]
    payload: list[Any]  # raw frames (zmq.Frame or bytes)
    # Its hashes came packed: its reply's tier lists go out packed too.
    packed: bool = False

    @property
    def spec(self) -> OpSpec:
        return OPS[self.op]


def encode(header: Mapping[str, Any]) -> bytes:
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


def recoverable_id(header: Any) -> int:
    """The id to answer with: the request's own if readable, else RESERVED_ID."""
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
    spec = OPS.get(op)
    if spec is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op[:64]!r}")
    sid = header.get("sid")
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
    payload_bytes = sum(frame_nbytes(f) for f in payload)
    if payload_bytes > max_payload_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"payload is {payload_bytes} bytes, limit {max_payload_bytes}")
    body = {k: v for k, v in header.items() if k not in HEADER_FIELDS}
    fields = check_fields(body, spec.fields)
    packed = False
    for name in HASH_FIELDS[op]:  # no generator: this runs on every request
        if type(body.get(name)) is bytes:
            packed = True
    return Request(op=op, id=rid, sid=sid, fields=fields, payload=list(payload), packed=packed)


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
    header.update({k: v for k, v in fields.items() if v is not None})
    for name in HASH_FIELDS[op]:
        value = header.get(name)
        if value is None:
            continue
        if packed_hashes and type(value) is not bytes:
            header[name] = pack_hashes(value)
        elif not packed_hashes and type(value) is bytes:
            header[name] = unpack_hashes(value)
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
