"""The wire schema: validation of request headers, without a daemon."""

from __future__ import annotations

import msgpack
import pytest

from kvtier.client.protocol import (
    MAX_HEADER_BYTES,
    OPS,
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    decode_header,
    encode,
    error_reply,
    recoverable_id,
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


def code_of(header: dict[str, object], payload: tuple[object, ...] = (), **kw: object) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        validate_request(header, payload, **kw)  # type: ignore[arg-type]
    return info.value.code


def test_valid_requests_fill_defaults() -> None:
    req = validate_request(hdr("lookup", hashes=[H, H]))
    assert req.op == "lookup" and req.id == 7 and req.fields == {"hashes": [H, H], "pin": False}
    req = validate_request(hdr("hello", pool="p", layout=LAYOUT))
    assert req.sid is None and req.fields["layout"] == LAYOUT
    req = validate_request(hdr("store", hashes=[H]), (b"x" * 64,))
    assert req.fields["plane"] == "inline" and len(req.payload) == 1
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
        "UNAUTHORIZED": 205,
        "NO_SPACE": 300, "TRANSFER_FAILED": 400, "SHUTTING_DOWN": 401, "INTERNAL": 402,
    }


def test_lookup_does_not_renew_and_mutations_do_not_retry() -> None:
    assert not OPS["lookup"].renews_lease and OPS["lookup"].idempotent
    for op in ("pin", "unpin", "allocate", "append", "free", "register_kv"):
        assert not OPS[op].idempotent, op
