"""Every class of bad input gets its error reply; the daemon keeps serving and loses nothing."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
import zmq

from kvtier.client.client import Client, PoolLayout
from kvtier.client.protocol import MAX_HEADER_BYTES, ErrorCode, decode, encode

BLOCK_BYTES = 1024
LAYOUT = PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                    kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    return kvtierd_module_factory(gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=16 * BLOCK_BYTES,
                                  max_message_bytes=8 * BLOCK_BYTES)


def ask(sock: zmq.Socket, *frames: bytes, timeout_s: float = 5.0) -> tuple[dict[str, Any], list[bytes]]:
    sock.send_multipart(list(frames))
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    reply = sock.recv_multipart()
    return decode(reply[0]), reply[1:]


def error_of(sock: zmq.Socket, *frames: bytes) -> tuple[int, int]:
    header, _ = ask(sock, *frames)
    assert header["ok"] is False and header["v"] == 1, header
    assert set(header["error"]) == {"code", "name", "message"}
    return header["id"], header["error"]["code"]


def test_each_error_class_gets_its_reply_and_nothing_is_lost(daemon, raw: zmq.Socket) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(5)
    hashes = [rng.randbytes(16) for _ in range(4)]
    data = rng.randbytes(4 * BLOCK_BYTES)
    with Client(daemon.endpoint, "victim", LAYOUT) as c:
        assert c.store(hashes, data) == (4, 0)
        sid = c.sid
        before = c.stats()["pools"]["victim"]

        def req(op: str, rid: int = 11, **fields: Any) -> bytes:
            return encode({"v": 1, "op": op, "id": rid, "sid": sid, **fields})

        cases: list[tuple[tuple[bytes, ...], int, ErrorCode]] = [
            ((b"\xc1\xff garbage",), 0, ErrorCode.MALFORMED),
            ((msgpack.packb([1, 2, 3]),), 0, ErrorCode.MALFORMED),
            ((encode({"op": "health", "id": 5}),), 5, ErrorCode.MALFORMED),
            ((encode({"v": 99, "op": "health", "id": 6}),), 6, ErrorCode.UNSUPPORTED_VERSION),
            ((req("teleport", 7),), 7, ErrorCode.UNKNOWN_OP),
            ((req("lookup", 8, hashes="not a list"),), 8, ErrorCode.INVALID_FIELD),
            ((req("lookup", 9, hashes=[b"short"]),), 9, ErrorCode.INVALID_FIELD),
            ((req("lookup", 10, hashes=hashes, bogus=1),), 10, ErrorCode.INVALID_FIELD),
            ((req("store", 12, hashes=hashes), b"x" * 100), 12, ErrorCode.INVALID_FIELD),  # wrong payload size
            ((req("store", 13, hashes=hashes * 3), b"x" * (12 * BLOCK_BYTES)), 13, ErrorCode.TOO_LARGE),
            ((req("lookup", 14, hashes=[b"\0" * 16] * 70000),), 14, ErrorCode.TOO_LARGE),
            ((encode({"v": 1, "op": "lookup", "id": 15, "sid": "nope", "hashes": []}),), 15, ErrorCode.UNKNOWN_SESSION),
            ((req("allocate", 16, req="r", hashes=[], num_tokens=1),), 16, ErrorCode.WRONG_MODE),
            ((req("restore", 17, hashes=hashes, plane="shm", slots=[0, 1, 2, 3]),), 17, ErrorCode.INVALID_STATE),
            ((req("unregister_kv", 18, name="nothing"),), 18, ErrorCode.NOT_FOUND),
        ]
        for frames, rid, code in cases:
            assert error_of(raw, *frames) == (rid, int(code)), (frames[0][:40], code)
        # An oversize header (below the hard limit) gets a reply too, with id 0: it is never decoded.
        assert error_of(raw, b"\x00" * (MAX_HEADER_BYTES + 1)) == (0, int(ErrorCode.TOO_LARGE))

        # Nothing stored was lost or changed, and the session still works.
        got = c.restore(hashes)
        assert bytes(got.data) == data
        stats = c.stats()
        after = stats["pools"]["victim"]
        assert after["stores"] == before["stores"] and after["cpu_used_blocks"] == before["cpu_used_blocks"]
        errors = stats["daemon"]["protocol_errors_total"]
        for name in ("MALFORMED", "UNSUPPORTED_VERSION", "UNKNOWN_OP", "INVALID_FIELD", "TOO_LARGE"):
            assert errors[f"code={name}"] >= 1, name
        assert stats["daemon"]["errors_total"]["code=UNKNOWN_SESSION"] >= 1


def test_frame_over_the_hard_limit_drops_only_that_peer(daemon) -> None:  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(daemon.endpoint)
    try:
        with Client(daemon.endpoint, "bystander", LAYOUT) as c:
            # libzmq's MAXMSGSIZE disconnects the sender: no reply can exist.
            bad.send_multipart([encode({"v": 1, "op": "health", "id": 1}), b"\0" * (2 * MAX_HEADER_BYTES + 1)])
            assert not bad.poll(500)
            assert c.health()["status"] == "ok"
    finally:
        bad.close()
        ctx.term()
    assert daemon.alive


def test_replies_carry_request_ids_in_order_of_completion(daemon, raw: zmq.Socket) -> None:  # type: ignore[no-untyped-def]
    for rid in (1, 2**40, 2**63 - 1):
        header, _ = ask(raw, encode({"v": 1, "op": "health", "id": rid}))
        assert header["id"] == rid and header["ok"] is True
    # Pipelined requests: exactly one reply each.
    for rid in range(100, 120):
        raw.send(encode({"v": 1, "op": "health", "id": rid}))
    seen = []
    while len(seen) < 20 and raw.poll(2000):
        seen.append(decode(raw.recv_multipart()[0])["id"])
    assert sorted(seen) == list(range(100, 120))
    assert not raw.poll(200)
