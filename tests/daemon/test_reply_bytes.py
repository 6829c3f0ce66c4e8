"""Typed replies on the wire: the daemon encodes a lookup's reply as its Struct (``protocol.encode_reply``),
and the bytes are exactly those of the map it packed before (protocol v1, docs/protocol.md): envelope first,
then ``tiers``, then ``pinned``, in both hash forms, pinned or not, with a stale pin tag, and to a session that
reads disk-tier names and one that does not."""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq

from kvtier.client import session as client_session
from kvtier.client.client import Client, PoolLayout
from kvtier.client.protocol import LookupReply, encode, pack_tiers, request_header

BLOCK_BYTES = 1024
LAYOUT = PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                    kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    return kvtierd_module_factory(gpu_bytes=8 * BLOCK_BYTES, cpu_bytes=16 * BLOCK_BYTES)


def reply_bytes(sock: zmq.Socket, header: dict[str, object]) -> bytes:
    sock.send(encode(header))
    assert sock.poll(5000), "no reply"
    frames = sock.recv_multipart()
    assert len(frames) == 1, frames
    return frames[0]


def old_map(rid: int, tiers: object, pinned: int) -> bytes:
    """The lookup reply as the daemon packed it before typed replies: a dict, through msgpack."""
    return msgpack.packb({"v": 1, "id": rid, "ok": True, "tiers": tiers, "pinned": pinned}, use_bin_type=True)


def test_lookup_replies_are_byte_for_byte_the_maps_of_before(daemon, raw: zmq.Socket) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(5)
    held = [rng.randbytes(16) for _ in range(6)]
    missing = rng.randbytes(16)
    with Client(daemon.endpoint, "bytes", LAYOUT) as c:
        assert c.store(held, bytes(6 * BLOCK_BYTES)) == (6, 0)
        tiers = list(c.lookup(held))
        assert len(tiers) == 6
        sid = c.sid
        ids = iter(range(10, 10_000))
        for packed in (True, False):
            for hashes, n in ((held, 6), (held[:3] + [missing] + held[3:], 3), ([missing], 0), ([], 0)):
                for pin in (False, True):
                    i = next(ids)  # ids of every msgpack int width
                    for rid in (i, 2**40 + i, 2**63 - i):
                        got = reply_bytes(raw, request_header("lookup", rid, sid, packed_hashes=packed, hashes=hashes,
                                                              pin=pin))
                        want_tiers = pack_tiers(tiers[:n]) if packed else tiers[:n]
                        assert got == old_map(rid, want_tiers, n if pin else 0), (packed, n, pin, rid)
                        if pin and n:  # give the pins back (a session may pin half the pool)
                            unpinned = reply_bytes(raw, request_header("unpin", next(ids), sid, hashes=held[:n]))
                            assert msgpack.unpackb(unpinned)["unpinned"] == n
        # A pinning lookup sent before its tag's release pins nothing: pinned 0, the tiers still listed.
        assert c.unpin_tag("t") == 0
        got = reply_bytes(raw, request_header("lookup", 3, sid, packed_hashes=True, hashes=held, pin=True,
                                              pin_tag="t"))
        assert got == old_map(3, pack_tiers(tiers), 0)


def test_a_typed_lookup_reply_decodes_as_the_client_reads_it(daemon, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    # Both kinds of session (with and without the "disk_tier" reply feature) through the real client, both forms.
    rng = random.Random(6)
    held = [rng.randbytes(16) for _ in range(4)]
    for features in (client_session.CLIENT_FEATURES, ()):
        monkeypatch.setattr(client_session, "CLIENT_FEATURES", features)
        with Client(daemon.endpoint, "bytes-typed", LAYOUT) as c:
            c.store(held, bytes(4 * BLOCK_BYTES))
            for packed in (True, False):
                c._packed_hashes = packed
                want = list(c.lookup(held))
                assert len(want) == 4 and set(want) <= {"gpu", "cpu"}
                assert [list(t) for t in c.lookup_many([held, held[:2]])] == [want, want[:2]]
                reply, _ = c._call("lookup", {"hashes": held, "pin": False})
                assert isinstance(reply, LookupReply) and reply.pinned == 0
