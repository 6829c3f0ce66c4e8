"""Packed hashes and packed tiers against a live kvtierd (real process, real ipc socket).

The same scripts run on two pools of one daemon: once through a Client that
packs (the daemon advertises ``packed_hashes``), once through a Client that
sends arrays as a client from before the feature does; every result must be
the same. Raw sockets check the wire forms and the error replies.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvtier.client.client import Client, PoolLayout, TierList
from kvtier.client.protocol import (
    FEATURE_PACKED_HASHES,
    TIER_CODES,
    ErrorCode,
    decode,
    encode,
    ok_reply,
)

BLOCK_BYTES = 1024
GPU_BLOCKS = 4
CPU_BLOCKS = 16


def store_layout() -> PoolLayout:
    return PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                      kv_heads=1, head_dim=8, mode="store")


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    # Pins up to the whole (tiny) pool: these tests pin long prefixes; the cap has its own tests.
    return kvtierd_module_factory(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, max_pinned_share=1.0,
                                  max_message_bytes=8 * BLOCK_BYTES)


def array_client(endpoint: str, pool: str, layout: PoolLayout) -> Client:
    """A client that sends hash arrays, as one that predates the feature does."""
    c = Client(endpoint, pool, layout)
    c._packed_hashes = False
    return c


def ask(sock: zmq.Socket, header: dict[str, Any], *payload: bytes) -> tuple[dict[str, Any], list[bytes]]:
    sock.send_multipart([encode(header), *payload])
    assert sock.poll(5000), "no reply"
    reply = sock.recv_multipart()
    return decode(reply[0]), reply[1:]


def tiers_form(tiers: Any, packed: bool) -> list[str]:
    """The tiers as a list, after checking they came back in the caller's form."""
    assert isinstance(tiers, TierList) if packed else type(tiers) is list, type(tiers)
    return list(tiers)


def test_hello_advertises_packed_hashes_and_the_client_uses_it(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "hello", store_layout()) as c:
        assert c._packed_hashes
        h = [b"\x01" * 16]
        assert isinstance(c.lookup(h), TierList) and c.lookup(h) == []


def store_script(c: Client, packed: bool) -> list[Any]:
    """Store mode: every verb that takes hashes, over both tiers, misses and pins included."""
    rng = random.Random(11)  # the same hashes and bytes for both forms
    chains = [([rng.randbytes(16) for _ in range(4)], rng.randbytes(4 * BLOCK_BYTES)) for _ in range(3)]
    out: list[Any] = []
    for hashes, data in chains:
        out.append(("store", c.store(hashes, data)))
    a, b, g = (h for h, _ in chains)  # a and b were demoted to the CPU tier, g is in the GPU tier
    miss = [b"\xee" * 16]
    for name, hs in (("cpu", a), ("gpu", g), ("gap", a[:2] + miss + a[2:]), ("miss", miss), ("none", [])):
        out.append(("lookup", name, tiers_form(c.lookup(hs), packed)))
    out.append(("lookup pin", tiers_form(c.lookup(g[:2], pin=True), packed)))
    out.append(("pin", tiers_form(c.pin(a[:3] + miss), packed)))
    out.append(("unpin", c.unpin(g[:2] + a[:3])))
    out.append(("unpin again", c.unpin(a[:3])))
    for name, hs in (("cpu", a), ("gpu", g), ("prefix", b[:2] + miss), ("miss", miss)):
        got = c.restore(hs)
        out.append(("restore inline", name, tiers_form(got.tiers, packed), bytes(got.data) if got.data else b""))
    arena = c.open_arena(8)
    got = c.restore(b, slots=list(range(4)))
    out.append(("restore shm", tiers_form(got.tiers, packed), bytes(arena.buffer[: 4 * BLOCK_BYTES])))
    out.append(("store shm", c.store([rng.randbytes(16)], slots=[0])))
    stats = c.stats()["pools"][c.pool]
    out.append(("stats", {k: stats[k] for k in ("lookups", "hit_blocks_gpu", "hit_blocks_cpu", "miss_blocks",
                                                "pinned_blocks", "stores", "restores")}))
    return out


def test_store_mode_packed_and_array_forms_give_identical_results(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "store-packed", store_layout()) as p, \
            array_client(daemon.endpoint, "store-array", store_layout()) as a:
        assert p._packed_hashes and not a._packed_hashes
        packed, arrays = store_script(p, True), store_script(a, False)
    assert packed == arrays
    # The script did see both tiers, misses and pins.
    seen = {tuple(x[2]) for x in packed if x[0] == "lookup"}
    assert ("cpu",) * 4 in seen and ("gpu",) * 4 in seen and ("cpu", "cpu") in seen and () in seen
    assert ("pin", ["cpu"] * 3) in packed and ("unpin", 5) in packed and ("unpin again", 0) in packed


def test_wire_forms_packed_in_packed_out_arrays_in_arrays_out(daemon, raw: zmq.Socket) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    hashes, data = [rng.randbytes(16) for _ in range(3)], rng.randbytes(3 * BLOCK_BYTES)
    with Client(daemon.endpoint, "wire", store_layout()) as c:
        c.store(hashes, data)
        sid = c.sid
        packed = b"".join(hashes) + b"\xee" * 16
        for op, extra in (("lookup", {}), ("lookup", {"pin": True}), ("pin", {})):
            rh, _ = ask(raw, {"v": 1, "op": op, "id": 5, "sid": sid, "hashes": packed, **extra})
            assert rh["ok"] and rh["tiers"] == TIER_CODES["gpu"] * 3, rh
            rh, _ = ask(raw, {"v": 1, "op": op, "id": 6, "sid": sid, "hashes": [*hashes, b"\xee" * 16], **extra})
            assert rh["ok"] and rh["tiers"] == ["gpu"] * 3, rh
        rh, _ = ask(raw, {"v": 1, "op": "unpin", "id": 7, "sid": sid, "hashes": b"".join(hashes)})
        assert rh == ok_reply(7, unpinned=3)
        rh, frames = ask(raw, {"v": 1, "op": "restore", "id": 8, "sid": sid, "hashes": packed})
        assert rh["tiers"] == b"ggg" and b"".join(frames) == data
        rh, frames = ask(raw, {"v": 1, "op": "restore", "id": 9, "sid": sid, "hashes": hashes})
        assert rh["tiers"] == ["gpu"] * 3 and b"".join(frames) == data
        # Zero hashes, packed: an empty bin in, an empty bin out.
        rh, _ = ask(raw, {"v": 1, "op": "lookup", "id": 10, "sid": sid, "hashes": b""})
        assert rh["ok"] and rh["tiers"] == b""
        rh, frames = ask(raw, {"v": 1, "op": "restore", "id": 11, "sid": sid, "hashes": b"\xee" * 16})
        assert rh["tiers"] == b"" and frames == []
        # A packed store (no tiers in its reply) and a packed append-free verb mix fine.
        new = rng.randbytes(16)
        rh, _ = ask(raw, {"v": 1, "op": "store", "id": 12, "sid": sid, "hashes": new}, rng.randbytes(BLOCK_BYTES))
        assert rh == ok_reply(12, stored=1, present=0)


def test_malformed_packed_hashes_get_error_replies_and_the_daemon_serves_on(daemon, raw: zmq.Socket) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(4)
    hashes, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
    with Client(daemon.endpoint, "malformed", store_layout()) as c:
        c.store(hashes, data)
        sid = c.sid
        cases: list[tuple[str, Any, ErrorCode, str]] = [
            ("lookup", b"\x01" * 17, ErrorCode.INVALID_FIELD, "not a multiple of 16"),
            ("pin", b"\x01" * 40, ErrorCode.INVALID_FIELD, "not a multiple of 16"),
            ("restore", b"\x01" * 8, ErrorCode.INVALID_FIELD, "not a multiple of 16"),
            ("lookup", b"\x01" * 16 * 65537, ErrorCode.TOO_LARGE, "65537 packed hashes, limit 65536"),
            ("store", b"\x01" * 16 * 65537, ErrorCode.TOO_LARGE, "65537 packed hashes"),
            ("lookup", "x" * 32, ErrorCode.INVALID_FIELD, "got str"),
            ("unpin", 7, ErrorCode.INVALID_FIELD, "got int"),
            ("lookup", {"packed": b"\x01" * 16}, ErrorCode.INVALID_FIELD, "got dict"),
            ("lookup", [b"\x01" * 32], ErrorCode.INVALID_FIELD, "element 0"),  # packed bins inside an array
        ]
        for rid, (op, value, code, words) in enumerate(cases, start=100):
            rh, _ = ask(raw, {"v": 1, "op": op, "id": rid, "sid": sid, "hashes": value})
            assert rh["ok"] is False and rh["id"] == rid, (op, rh)
            assert rh["error"]["code"] == int(code) and "'hashes'" in rh["error"]["message"], (op, rh)
            assert words in rh["error"]["message"], (op, rh)
        # A packed store whose payload does not match its packed hashes.
        rh, _ = ask(raw, {"v": 1, "op": "store", "id": 200, "sid": sid, "hashes": rng.randbytes(32)}, b"x" * 10)
        assert rh["error"]["code"] == int(ErrorCode.INVALID_FIELD)
        # Served on, nothing lost: the same session, a packed lookup and a restore.
        assert c.health()["status"] == "ok"
        assert c.lookup(hashes) == ["gpu", "gpu"]
        assert bytes(c.restore(hashes).data) == data
        assert c.stats()["pools"]["malformed"]["pinned_blocks"] == 0
    assert daemon.alive


def test_an_array_client_is_served_as_before(daemon, raw: zmq.Socket) -> None:  # type: ignore[no-untyped-def]
    # What a client from before the feature sends: arrays, and it never looks at "features".
    layout = store_layout().to_wire()
    rh, _ = ask(raw, {"v": 1, "op": "hello", "id": 1, "pool": "old", "layout": layout})
    assert rh["ok"] and FEATURE_PACKED_HASHES in rh["features"]
    sid = rh["sid"]
    rng = random.Random(5)
    hashes, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
    assert ask(raw, {"v": 1, "op": "store", "id": 2, "sid": sid, "hashes": hashes}, data)[0]["stored"] == 2
    rh, _ = ask(raw, {"v": 1, "op": "lookup", "id": 3, "sid": sid, "hashes": hashes, "pin": True})
    assert rh == ok_reply(3, tiers=["gpu", "gpu"], pinned=2)
    assert ask(raw, {"v": 1, "op": "pin", "id": 4, "sid": sid, "hashes": hashes})[0]["tiers"] == ["gpu", "gpu"]
    assert ask(raw, {"v": 1, "op": "unpin", "id": 5, "sid": sid, "hashes": hashes})[0]["unpinned"] == 2
    rh, frames = ask(raw, {"v": 1, "op": "restore", "id": 6, "sid": sid, "hashes": hashes})
    assert rh["tiers"] == ["gpu", "gpu"] and b"".join(frames) == data
    with array_client(daemon.endpoint, "old", store_layout()) as c:
        assert c.lookup(hashes) == ["gpu", "gpu"] and type(c.lookup(hashes)) is list


class OldDaemon:
    """A daemon from before the feature, as far as a client can tell: its hello
    lists no features. Records the requests; answers lookups with arrays."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.requests: list[dict[str, Any]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, frame = self._sock.recv_multipart()
            req = decode(frame)
            self.requests.append(req)
            fields: dict[str, Any] = {}
            if req["op"] == "hello":
                fields = {"sid": "0" * 32, "lease_s": 10.0, "heartbeat_s": 3.0, "protocol_version": 1,
                          "daemon_version": "0.0.9", "pool": {"block_bytes": BLOCK_BYTES}, "limits": {}}
            elif req["op"] == "lookup":
                if not isinstance(req["hashes"], list):  # an old daemon refuses a bin here
                    self._sock.send_multipart([identity, encode({"v": 1, "id": req["id"], "ok": False, "error": {
                        "code": 103, "name": "INVALID_FIELD", "message": "field 'hashes': expected an array"}})])
                    continue
                fields = {"tiers": ["gpu"] * len(req["hashes"]), "pinned": 0}
            self._sock.send_multipart([identity, encode(ok_reply(req["id"], **fields))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()


@pytest.fixture
def old_daemon(tmp_path) -> Iterator[OldDaemon]:  # type: ignore[no-untyped-def]
    d = OldDaemon(f"ipc://{tmp_path}/old.sock")
    yield d
    d.close()


def test_a_new_client_sends_arrays_to_an_old_daemon(old_daemon: OldDaemon) -> None:
    hashes = [bytes([i]) * 16 for i in range(3)]
    with Client(old_daemon.endpoint, "p", store_layout(), heartbeat=False) as c:
        assert not c._packed_hashes
        tiers = c.lookup(hashes)
        assert tiers == ["gpu"] * 3 and type(tiers) is list
    sent = [r for r in old_daemon.requests if r["op"] == "lookup"]
    assert sent and sent[0]["hashes"] == hashes


def engine_script(c: Client, packed: bool) -> list[Any]:
    """Engine mode: allocate (GPU hits at once, CPU hits after a restore: the
    Pending path) and append, on a 10-block registered tensor."""
    from kvtier.client.kv_share import allocate_shared_kv

    kv, _handle = allocate_shared_kv((10, 2, 4, 1, 8), "float16", 0)  # 10 blocks of 128 bytes
    out: list[Any] = [("register", c.register_kv("kv", [kv], 0))]
    tokens = list(range(100, 116))  # 4 full blocks
    alloc = c.allocate_tokens("a", tokens)
    out.append(("allocate miss", alloc.block_ids, tiers_form(alloc.tiers, packed)))
    out.append(("append", c.append_tokens("a", [7, 8, 9, 10])))
    c.free("a")
    alloc = c.allocate_tokens("b", tokens)
    out.append(("allocate gpu hits", alloc.block_ids, tiers_form(alloc.tiers, packed), alloc.num_gpu_hits))
    c.free("b")
    filler = c.allocate_tokens("fill", list(range(1000, 1040)))  # all 10 blocks: evicts (demotes) the rest
    out.append(("fill", filler.block_ids))
    c.free("fill")
    h = c.hashes_for(tokens)
    out.append(("lookup", tiers_form(c.lookup(h), packed)))
    alloc = c.allocate_tokens("c", tokens)
    out.append(("allocate cpu hits", alloc.block_ids, tiers_form(alloc.tiers, packed), alloc.num_cpu_hits))
    c.free("c")
    c.unregister_kv("kv")
    return out


def engine_layout(block_bytes: int = 128) -> PoolLayout:
    return PoolLayout(model="e", block_size=4, block_bytes=block_bytes, dtype="float16", num_layers=1,
                      kv_heads=1, head_dim=8, mode="engine")


def test_engine_mode_packed_and_array_forms_give_identical_results(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "engine-packed", engine_layout()) as p, \
            array_client(daemon.endpoint, "engine-array", engine_layout()) as a:
        packed, arrays = engine_script(p, True), engine_script(a, False)
    assert packed == arrays
    by_name = {x[0]: x for x in packed}
    assert by_name["allocate gpu hits"][2] == ["gpu"] * 4
    assert by_name["allocate cpu hits"][2].count("cpu") >= 1, by_name  # went through the restore (Pending)



def test_tiers_are_packed_after_a_copy_too() -> None:
    # allocate and restore reply from Pending.finish when copies were in flight:
    # the packing wraps that as well (in-process, with a stand-in op).
    from kvtier.client.protocol import Request
    from kvtier.daemon.handlers import Pending, Reply, _packs_tiers

    def handler(ctx: Any, req: Request, session: Any) -> Any:
        if req.msg["pending"]:
            return Pending(op="op", finish=lambda op: Reply({"tiers": ["gpu", "cpu"], "n": 2}))  # type: ignore[arg-type]
        return Reply({"tiers": ["cpu", "remote"]})

    wrapped = _packs_tiers(handler)
    for packed in (False, True):
        for pending in (False, True):
            req = Request("restore", 1, "s", {"pending": pending}, [], packed=packed)
            result = wrapped(None, req, None)  # type: ignore[arg-type]
            reply = result.finish(result.op) if pending else result
            want = (["gpu", "cpu"] if pending else ["cpu", "remote"])
            assert reply.fields["tiers"] == (b"".join(TIER_CODES[t] for t in want) if packed else want)


def test_every_tier_of_the_pool_has_a_code() -> None:
    from kvtier.client.protocol import pack_tiers
    from kvtier.tiers.pool import Tier

    assert {t.value for t in Tier} == set(TIER_CODES)
    assert pack_tiers(list(Tier)) == b"".join(TIER_CODES[t.value] for t in Tier)


def test_the_client_refuses_bad_hashes_in_either_form(daemon) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    from kvtier.client.protocol import ProtocolError

    good = b"\x05" * 16
    bad_lists: list[list[Any]] = [
        [good, b"\x01" * 15],
        [b"\x01" * 15, b"\x01" * 17],  # the right total length: only a per-hash check sees it
        [good, "x" * 16],
        [good, 16],
        [None],
        [np.zeros(16, dtype=np.uint32)],  # len() 16, 64 bytes
    ]
    with Client(daemon.endpoint, "client-checks", store_layout()) as p, \
            array_client(daemon.endpoint, "client-checks", store_layout()) as a:
        for c in (p, a):
            for hashes in bad_lists:
                for call in (lambda: c.lookup(hashes), lambda: c.lookup(hashes, pin=True), lambda: c.pin(hashes),
                             lambda: c.unpin(hashes), lambda: c.restore(hashes),
                             lambda: c.store(hashes, b"\0" * (len(hashes) * BLOCK_BYTES))):
                    with pytest.raises(ProtocolError) as info:
                        call()
                    assert info.value.code == ErrorCode.INVALID_FIELD and "block hash" in info.value.message
        # A 16-byte buffer that is not bytes packs to the same bin; pins keep
        # hashes as keys, so they take bytes only.
        assert p.store([bytearray(good)], b"\0" * BLOCK_BYTES) == (1, 0)
        assert p.lookup([memoryview(good)]) == ["gpu"] and p.lookup((good,)) == ["gpu"]
        with pytest.raises(ProtocolError):
            p.pin([bytearray(good)])
        assert p.pin([good]) == ["gpu"] and p.unpin([good]) == 1
        assert p.health()["status"] == "ok"
