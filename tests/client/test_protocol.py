"""The wire schema: validation of request headers, without a daemon."""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.client.protocol import (
    FEATURE_PACKED_HASHES,
    FEATURES,
    HASH_FIELDS,
    MAX_HEADER_BYTES,
    OPS,
    PROTOCOL_VERSION,
    TIER_CODES,
    TIERS,
    ErrorCode,
    ProtocolError,
    Request,
    TierList,
    decode_header,
    decode_request,
    encode,
    error_reply,
    pack_tiers,
    recoverable_id,
    request_header,
    validate_request,
)

LAYOUT = {
    "model": "m", "block_size": 4, "block_bytes": 64, "dtype": "bfloat16", "num_layers": 2,
    "kv_heads": 1, "head_dim": 8, "tp_rank": 0, "tp_size": 1, "hash_algo": "xxh3_128", "mode": "store",
}
H = b"\x01" * 16


def hdr(op: str, **fields: object) -> dict[str, object]:
    base: dict[str, object] = {"v": PROTOCOL_VERSION, "op": op, "id": 7}
    if op != "hello":
        base["sid"] = "s" * 32
    base.update(fields)
    return base


def body(req: Request) -> dict[str, object]:
    """A request's own fields (not the header's), as a dict."""
    return {name: getattr(req.msg, name) for name in OPS[req.op].fields}


def code_of(header: dict[str, object], payload: tuple[object, ...] = (), **kw: object) -> ErrorCode:
    """The error code of a bad request, the same whether it comes decoded or as the frame the daemon reads."""
    with pytest.raises(ProtocolError) as info:
        validate_request(header, payload, **kw)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError) as wire:
        decode_request(encode(header), payload, **kw)  # type: ignore[arg-type]
    assert (wire.value.code, wire.value.message) == (info.value.code, info.value.message)
    return info.value.code


def test_valid_requests_fill_defaults() -> None:
    req = validate_request(hdr("lookup", hashes=[H, H]))
    assert req.op == "lookup" and req.id == 7 and body(req) == {"hashes": [H, H], "pin": False, "hints": None, "pin_tag": None}
    req = validate_request(hdr("hello", pool="p", layout=LAYOUT))
    assert req.sid is None and req.msg.layout.to_dict() == LAYOUT
    req = validate_request(hdr("store", hashes=[H]), (b"x" * 64,))
    assert req.msg.plane == "inline" and len(req.payload) == 1
    assert validate_request({"v": 1, "op": "health", "id": 1}).sid is None


@pytest.mark.parametrize(
    ("header", "code"),
    [
        ({"op": "health", "id": 1}, ErrorCode.MALFORMED),
        ({"v": 2, "op": "health", "id": 1}, ErrorCode.UNSUPPORTED_VERSION),
        ({"v": 1, "op": "health"}, ErrorCode.MALFORMED),
        ({"v": 1, "op": "health", "id": 0}, ErrorCode.MALFORMED),
        ({"v": 1, "op": "health", "id": True}, ErrorCode.MALFORMED),
        ({"v": 1, "op": "fly", "id": 1}, ErrorCode.UNKNOWN_OP),
        ({"v": 1, "op": 5, "id": 1}, ErrorCode.MALFORMED),
        (hdr("lookup"), ErrorCode.INVALID_FIELD),  # missing hashes
        (hdr("lookup", hashes="abc"), ErrorCode.INVALID_FIELD),
        (hdr("lookup", hashes=[b"\x01" * 15]), ErrorCode.INVALID_FIELD),
        (hdr("lookup", hashes=["x" * 16]), ErrorCode.INVALID_FIELD),
        (hdr("lookup", hashes=[H], pin=1), ErrorCode.INVALID_FIELD),
        (hdr("lookup", hashes=[H], color="red"), ErrorCode.INVALID_FIELD),
        (hdr("lookup", hashes=[H] * 70000), ErrorCode.TOO_LARGE),
        ({"v": 1, "op": "lookup", "id": 1, "hashes": [H]}, ErrorCode.INVALID_FIELD),  # no sid
        ({"v": 1, "op": "lookup", "id": 1, "sid": 5, "hashes": [H]}, ErrorCode.INVALID_FIELD),
        (hdr("hello", pool="p", layout=LAYOUT, sid="x"), ErrorCode.INVALID_FIELD),
        (hdr("hello", pool="p", layout={**LAYOUT, "block_size": 0}), ErrorCode.INVALID_FIELD),
        (hdr("hello", pool="p", layout={**LAYOUT, "mode": "turbo"}), ErrorCode.INVALID_FIELD),
        (hdr("hello", pool="p", layout={**LAYOUT, "extra": 1}), ErrorCode.INVALID_FIELD),
        (hdr("hello", pool="p", layout={k: v for k, v in LAYOUT.items() if k != "dtype"}), ErrorCode.INVALID_FIELD),
        (hdr("hello", pool="", layout=LAYOUT), ErrorCode.INVALID_FIELD),
        (hdr("hello", pool="p", layout=LAYOUT, lease_s=-1), ErrorCode.INVALID_FIELD),
        (hdr("allocate", req="r", hashes=[], num_tokens=-1), ErrorCode.INVALID_FIELD),
        (hdr("restore", hashes=[H], slots=[1, -2]), ErrorCode.INVALID_FIELD),
        (hdr("restore", hashes=[H], plane="carrier-pigeon"), ErrorCode.INVALID_FIELD),
    ],
)
def test_bad_headers(header: dict[str, object], code: ErrorCode) -> None:
    assert code_of(header) == code


def test_payload_rules() -> None:
    assert code_of(hdr("lookup", hashes=[H]), (b"x",)) == ErrorCode.INVALID_FIELD
    assert code_of(hdr("store", hashes=[H]), (b"x", b"y")) == ErrorCode.INVALID_FIELD
    assert code_of(hdr("store", hashes=[H]), (b"x" * 100,), max_payload_bytes=99) == ErrorCode.TOO_LARGE


def test_decode_header() -> None:
    assert decode_header(encode({"a": 1})) == {"a": 1}
    for bad in (b"\xc1", b"\x92\x01", b"", msgpack.packb([1, 2]), b"\x81\x01\x02"):
        with pytest.raises(ProtocolError) as info:
            decode_header(bad)
        assert info.value.code == ErrorCode.MALFORMED
    with pytest.raises(ProtocolError) as info:
        decode_header(b"\x00" * (MAX_HEADER_BYTES + 1))
    assert info.value.code == ErrorCode.TOO_LARGE


def test_reply_ids() -> None:
    assert recoverable_id({"id": 9}) == 9
    assert recoverable_id({"id": "9"}) == 0
    assert recoverable_id(None) == 0
    reply = error_reply(3, ErrorCode.NO_SPACE, "full")
    assert reply == {"v": 1, "id": 3, "ok": False, "error": {"code": 300, "name": "NO_SPACE", "message": "full"}}


def test_error_codes_are_stable() -> None:
    # Clients in other languages hard-code these numbers: never renumber.
    assert {c.name: int(c) for c in ErrorCode} == {
        "MALFORMED": 100, "UNSUPPORTED_VERSION": 101, "UNKNOWN_OP": 102, "INVALID_FIELD": 103, "TOO_LARGE": 104,
        "UNKNOWN_SESSION": 200, "LAYOUT_MISMATCH": 201, "WRONG_MODE": 202, "NOT_FOUND": 203, "INVALID_STATE": 204,
        "UNAUTHORIZED": 205, "FOREIGN_SESSION": 206, "IN_USE": 207, "NOT_OWNER": 208, "ACCESS_DENIED": 209,
        "SPARSE_FILE": 210,
        "NO_SPACE": 300, "TOO_MANY_REGISTRATIONS": 301, "TOO_MANY_FILES": 302, "TOO_MANY_POOLS": 303, "TOO_MANY_PINS": 304, "UNREAD_REPLIES": 305,
        "TOO_MANY_CONNECTIONS": 306, "TOO_MANY_SESSIONS": 307, "TOO_MANY_AUTH_FAILURES": 308,
        "TRANSFER_FAILED": 400, "SHUTTING_DOWN": 401, "INTERNAL": 402,
        "DEADLINE_EXCEEDED": 403,
    }


def test_lookup_does_not_renew_and_mutations_do_not_retry() -> None:
    assert not OPS["lookup"].renews_lease and OPS["lookup"].idempotent
    for op in ("pin", "unpin", "allocate", "append", "free", "register_kv"):
        assert not OPS[op].idempotent, op


# ---- packed hashes and packed tiers -------------------------------------------


def hashes_of(n: int, seed: int = 0) -> list[bytes]:
    return [(seed * 1_000_003 + i).to_bytes(16, "little") for i in range(n)]


@pytest.mark.parametrize("n", [0, 1, 255, 1024, 1025, 3000, 65536])
def test_packed_hashes_validate_to_the_same_list(n: int) -> None:
    hs = hashes_of(n, seed=n)
    for op in ("lookup", "pin", "unpin", "restore", "store"):
        array = validate_request(hdr(op, hashes=hs), (b"x",) if op == "store" else ())
        packed = validate_request(hdr(op, hashes=b"".join(hs)), (b"x",) if op == "store" else ())
        assert body(packed) == body(array) and type(packed.msg.hashes) is list
        assert packed.packed and not array.packed
    # Packing is part of the wire schema: request_header does it for every hash field.
    header = request_header("allocate", 3, "s" * 32, packed_hashes=True, req="r", hashes=hs, num_tokens=4)
    assert header["hashes"] == b"".join(hs)
    assert validate_request(header).msg.hashes == hs
    assert request_header("lookup", 3, "s" * 32, hashes=hs)["hashes"] is hs
    # Hashes the client packed go out as an array again to a daemon without the feature.
    assert request_header("lookup", 3, "s" * 32, hashes=b"".join(hs))["hashes"] == hs
    assert request_header("lookup", 3, "s" * 32, packed_hashes=True, hashes=b"".join(hs))["hashes"] == b"".join(hs)


def test_packed_hashes_survive_msgpack() -> None:
    hs = hashes_of(300)
    wire = encode(request_header("lookup", 9, "s" * 32, packed_hashes=True, hashes=hs, pin=True))
    assert len(wire) < 16 * 300 + 100 < 18 * 300  # one bin: no per-hash bin header (2 bytes each)
    req = validate_request(decode_header(wire))
    assert body(req) == {"hashes": hs, "pin": True, "hints": None, "pin_tag": None} and req.packed


@pytest.mark.parametrize(
    ("value", "code", "words"),
    [
        (b"\x01" * 17, ErrorCode.INVALID_FIELD, "not a multiple of 16"),
        (b"\x01" * 15, ErrorCode.INVALID_FIELD, "not a multiple of 16"),
        (b"\x01" * 16 * 65537, ErrorCode.TOO_LARGE, "65537 packed hashes, limit 65536"),
        ("x" * 32, ErrorCode.INVALID_FIELD, "got str"),
        (1234, ErrorCode.INVALID_FIELD, "got int"),
        (bytearray(32), ErrorCode.INVALID_FIELD, "got bytearray"),
    ],
)
def test_bad_packed_hashes(value: object, code: ErrorCode, words: str) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_request(hdr("lookup", hashes=value))
    assert info.value.code == code
    assert "'hashes'" in info.value.message and words in info.value.message, info.value.message


def test_every_op_with_hashes_takes_them_packed() -> None:
    assert {op for op, names in HASH_FIELDS.items() if names} == {
        "lookup", "pin", "unpin", "allocate", "append", "store", "restore"}
    assert all(names == ("hashes",) for names in HASH_FIELDS.values() if names)
    assert FEATURE_PACKED_HASHES in FEATURES


def test_tier_codes_table() -> None:
    # Other-language clients hard-code these: never change a code.
    assert TIER_CODES == {"gpu": b"g", "cpu": b"c", "remote": b"r", "disk": b"d"}
    assert TIERS == ("gpu", "cpu", "remote", "disk")
    names = ["gpu", "cpu", "remote", "cpu", "gpu", "gpu", "remote", "disk", "disk", "remote"]
    assert pack_tiers(names) == b"gcrcggrddr"
    assert TierList(b"gcrcggrddr") == names
    assert pack_tiers([]) == b""
    with pytest.raises(ValueError):
        pack_tiers(["gpu", "flash"])  # (a name whose letters give the shortcut away)


@given(st.lists(st.sampled_from(["gpu", "cpu", "remote", "disk"]), max_size=300), st.booleans())
def test_pack_tiers_is_one_code_per_name_uniform_runs_included(names: list[str], as_tuple: bool) -> None:
    """The one-tier shortcut (a whole prefix in one tier) packs exactly as the general path."""
    codes = {"gpu": b"g", "cpu": b"c", "remote": b"r", "disk": b"d"}
    tiers = tuple(names) if as_tuple else names
    assert pack_tiers(tiers) == b"".join(codes[n] for n in names)
    if names:
        assert pack_tiers([names[0]] * len(names)) == codes[names[0]] * len(names)


def test_pack_tiers_refuses_a_uniform_list_of_no_tier() -> None:
    with pytest.raises(ValueError):
        pack_tiers(["flash"] * 4)


def test_pack_tiers_takes_str_enum_members() -> None:
    import enum

    class T(str, enum.Enum):  # the shape of kvtier.tiers.pool.Tier
        GPU = "gpu"
        CPU = "cpu"
        REMOTE = "remote"

    assert pack_tiers([T.GPU, T.REMOTE, T.CPU]) == b"grc"


def test_tier_list_reads_like_a_list_of_names() -> None:
    names = ["gpu", "gpu", "cpu", "remote"]
    t = TierList(b"ggcr")
    assert isinstance(t, Sequence)
    assert len(t) == 4 and t.codes == b"ggcr"
    assert t == names and names == t and t == tuple(names) and t == TierList.of(names)
    assert t != names[:3] and t != ["gpu", "gpu", "cpu", "cpu"] and t != [1, 2, 3, 4] and t != "ggcr"
    assert not (t != names)
    assert list(t) == names and [*t] == names and list(reversed(t)) == names[::-1]
    assert t[0] == "gpu" and t[2] == "cpu" and t[-1] == "remote"
    assert t[1:3] == ["gpu", "cpu"] and isinstance(t[1:3], TierList) and t[::-1] == names[::-1]
    with pytest.raises(IndexError):
        t[4]
    assert t.count("gpu") == 2 and t.count("remote") == 1 and t.count("disk") == 0 and t.count(3) == 0
    assert t.count("tape") == 0
    assert "cpu" in t and "disk" not in t and "tape" not in t and 103 not in t
    assert t.index("cpu") == 2 and t.index("gpu", 1) == 1
    with pytest.raises(ValueError):
        t.index("disk")
    with pytest.raises(ValueError):
        t.index("gpu", 2)
    assert repr(t) == "TierList(['gpu', 'gpu', 'cpu', 'remote'])"
    assert TierList(b"") == [] and not TierList(b"") and len(TierList(b"")) == 0
    assert sorted(t) == sorted(names) and set(t) == {"gpu", "cpu", "remote"}
    with pytest.raises(TypeError):
        hash(t)  # equal to lists, so unhashable like them
    with pytest.raises(TypeError):
        t[0] = "cpu"  # type: ignore[index]


def test_tier_list_refuses_unknown_codes() -> None:
    with pytest.raises(ProtocolError) as info:
        TierList(b"gcx")
    assert info.value.code == ErrorCode.MALFORMED and "b'x'" in info.value.message
    with pytest.raises(ProtocolError):
        TierList(["gpu"])  # type: ignore[arg-type]


def test_a_header_of_nested_empty_containers_is_refused_before_it_costs_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-container limits do not bound nesting: ~4M empty arrays in 4 MiB. Refused after MAX_HEADER_VALUES.

    The cost is counted in containers built, not timed (a timed bound failed on a loaded runner): the
    whole header would build 3.3M of them (1.9 s of the loop, 2-core VM)."""
    import msgpack

    from kvtier.client import protocol
    from kvtier.client.protocol import MAX_HEADER_VALUES, decode_header

    built = 0
    unpackb = msgpack.unpackb

    def counting_unpackb(data: bytes, **kw: object) -> object:
        def counted(hook: object) -> object:
            def call(container: object) -> object:
                nonlocal built
                built += 1
                return hook(container)  # type: ignore[operator]
            return call
        return unpackb(data, **{k: counted(v) if k.endswith("_hook") else v for k, v in kw.items()})

    monkeypatch.setattr(protocol.msgpack, "unpackb", counting_unpackb)
    inner = b"\xdc" + (32).to_bytes(2, "big") + b"\x90" * 32  # an array of 32 empty arrays
    for empty in (b"\x90", b"\x80"):  # arrays, and maps
        body = inner.replace(b"\x90", empty)
        n = 100_000
        header = b"\x81\xa1x" + b"\xdd" + n.to_bytes(4, "big") + body * n
        built = 0
        with pytest.raises(ProtocolError) as err:
            decode_header(header)
        assert err.value.code == ErrorCode.TOO_LARGE and str(MAX_HEADER_VALUES) in str(err.value)
        assert 0 < built <= MAX_HEADER_VALUES + 1 < n * 33 // 10


def test_the_largest_legitimate_header_still_decodes() -> None:
    from kvtier.client.protocol import MAX_HASHES, decode_header

    hs = [bytes([i % 256]) * 16 for i in range(MAX_HASHES)]
    req = validate_request(decode_header(encode({"v": 1, "op": "store", "id": 1, "sid": "s" * 32, "hashes": hs,
                                                 "plane": "shm", "slots": list(range(MAX_HASHES))})))
    assert len(req.msg.hashes) == MAX_HASHES and len(req.msg.slots) == MAX_HASHES


def test_ok_replies_decode_as_their_ops_struct_and_bad_ones_are_malformed() -> None:
    from kvtier.client.protocol import LookupReply, decode_reply, ok_reply, reply_error

    tiers = pack_tiers(["gpu", "cpu"])
    reply = decode_reply("lookup", encode(ok_reply(9, tiers=tiers, pinned=2, added_later=1)))  # unknown fields: ignored
    assert isinstance(reply, LookupReply) and (reply.id, reply.tiers, reply.pinned) == (9, tiers, 2)
    assert decode_reply("lookup", encode(ok_reply(9, tiers=["gpu"]))).pinned == 0  # type: ignore[union-attr]
    assert decode_reply("lookup", encode(error_reply(9, ErrorCode.NO_SPACE, "full"))) is None
    assert decode_reply("stats", encode(ok_reply(9, pools={}))) is None  # free-form: the client keeps the map
    bad = encode(ok_reply(9, tiers=7))
    assert decode_reply("lookup", bad) is None
    err = reply_error("lookup", bad)
    assert err.code == ErrorCode.MALFORMED and "tiers" in err.message and "lookup" in err.message
    for op, spec in OPS.items():  # every op but the free-form two has a reply Struct
        assert (spec.reply is None) == (op in ("stats", "health")), op


@given(rid=st.integers(1, 2**63 - 1), pinned=st.integers(0, 2**32),
       tiers=st.one_of(st.binary(max_size=300), st.lists(st.sampled_from(TIERS), max_size=40)))
def test_a_typed_lookup_reply_encodes_to_the_bytes_of_its_map(rid: int, pinned: int, tiers: object) -> None:
    from kvtier.client.protocol import LookupReply, encode_reply, ok_reply

    typed = LookupReply(v=PROTOCOL_VERSION, id=rid, ok=True, tiers=tiers, pinned=pinned)  # type: ignore[arg-type]
    assert encode_reply(typed) == encode(ok_reply(rid, tiers=tiers, pinned=pinned))
    assert encode_reply(ok_reply(rid, tiers=tiers)) == encode(ok_reply(rid, tiers=tiers))  # a map: as before


def test_every_reply_struct_keeps_the_envelope_first_and_its_fields_in_order() -> None:
    # msgspec moves kw_only fields after the others: every reply class is kw_only, so none moves.
    for op, spec in OPS.items():
        if spec.reply is None:
            continue
        fields = spec.reply.__struct_fields__
        assert fields[:3] == ("v", "id", "ok"), (op, fields)
        own = tuple(f for cls in reversed(spec.reply.__mro__) for f in cls.__dict__.get("__annotations__", {}))
        assert fields == tuple(dict.fromkeys(own)), (op, fields)
