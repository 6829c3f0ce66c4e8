"""Store then restore through each data plane, every byte checked, through the CPU tier and back.

The daemon runs with a 4-block GPU tier and a 16-block CPU tier, so storing
three 4-block chains demotes the first two to the CPU tier.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest

from kvtier.client.client import Client, DaemonError, PoolLayout
from kvtier.client.protocol import ErrorCode, StoreReply, TiersReply

BLOCK_BYTES = 1024
GPU_BLOCKS = 4
CPU_BLOCKS = 16


def layout(**kw: object) -> PoolLayout:
    base = dict(model="test-model", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=2,
                kv_heads=2, head_dim=64, mode="store")
    base.update(kw)
    return PoolLayout(**base)  # type: ignore[arg-type]


def chain(rng: random.Random, n: int) -> tuple[list[bytes], bytes]:
    return [rng.randbytes(16) for _ in range(n)], rng.randbytes(n * BLOCK_BYTES)


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    # Each test uses its own pool: pools share nothing but the daemon.
    return kvtierd_module_factory(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES,
                                  max_message_bytes=8 * BLOCK_BYTES)


def test_inline_store_restore_through_cpu_tier(daemon) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(1)
    with Client(daemon.endpoint, "inline", layout()) as c:
        chains = [chain(rng, 4) for _ in range(3)]
        for hashes, data in chains:
            assert c.store(hashes, data) == (4, 0)
        # The first two chains were demoted when the GPU tier filled up.
        assert c.lookup(chains[0][0]) == ["cpu"] * 4
        assert c.lookup(chains[1][0]) == ["cpu"] * 4
        assert c.lookup(chains[2][0]) == ["gpu"] * 4
        for hashes, data in chains:
            got = c.restore(hashes)
            assert len(got) == 4 and bytes(got.data) == data
        # Storing again is a no-op: content-addressed.
        assert c.store(chains[0][0], chains[0][1]) == (0, 4)
        # A prefix: the miss ends it.
        got = c.restore(chains[0][0][:2] + [b"\xee" * 16] + chains[0][0][2:])
        assert got.tiers == ["cpu", "cpu"] and bytes(got.data) == chains[0][1][: 2 * BLOCK_BYTES]
        assert c.restore([b"\xee" * 16]).tiers == []
        stats = c.stats()["pools"]["inline"]
        assert stats["demotions"] >= 8 and stats["copy_failures"] == 0


def test_inline_restore_lends_one_run_in_place_and_gives_it_back(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    # A prefix in one run of one tier's slots is sent straight from the tier
    # (lent_bytes); one spread over both tiers is gathered into a staging
    # buffer (load copy bytes). Both byte-exact; once the replies have left,
    # the daemon holds nothing: clear drops every block. Only host memory is
    # lent, so this daemon runs on the CPU everywhere (on CUDA the GPU tier's
    # blocks are always copied: test_inline_store_restore_through_cpu_tier).
    daemon = kvtierd_factory(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES,
                             max_message_bytes=8 * BLOCK_BYTES, device="cpu")
    rng = random.Random(7)
    with Client(daemon.endpoint, "inline-lent", layout()) as c:
        a, b = chain(rng, 4), chain(rng, 2)
        c.store(*a)

        def counters() -> tuple[int, int]:
            p = c.stats()["pools"]["inline-lent"]
            return p["lent_bytes"], p["bytes_load"]

        before = counters()
        got = c.restore(a[0])
        assert list(got.tiers) == ["gpu"] * 4 and bytes(got.data) == a[1]
        after = counters()
        assert after == (before[0] + 4 * BLOCK_BYTES, before[1])  # lent, not copied
        # The lent blocks are held until libzmq has let go of the frame, which
        # the daemon learns a moment after the client has the reply.
        deadline = time.monotonic() + 5
        while (c.stats()["pools"]["inline-lent"]["gpu_free_blocks"] < GPU_BLOCKS
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert c.stats()["pools"]["inline-lent"]["gpu_free_blocks"] == GPU_BLOCKS
        c.store(*b)  # two of a's blocks demoted to the CPU tier
        tiers = c.lookup(a[0])
        assert sorted(tiers) == ["cpu", "cpu", "gpu", "gpu"]
        for _ in range(3):
            got = c.restore(a[0])
            assert list(got.tiers) == tiers and bytes(got.data) == a[1]
        # The copy counters of a finished copy may show a moment after its reply.
        deadline = time.monotonic() + 5
        while counters()[1] < after[1] + 3 * 4 * BLOCK_BYTES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counters() == (after[0], after[1] + 3 * 4 * BLOCK_BYTES)  # scattered: staged copies
        # The daemon hands lent blocks back when libzmq lets go of the frames,
        # which it learns a moment after the client has the reply.
        cleared, deadline = 0, time.monotonic() + 5
        while time.monotonic() < deadline:
            cleared += c.clear()
            if c.lookup(a[0]) == [] and c.lookup(b[0]) == []:
                break
            time.sleep(0.01)
        assert c.lookup(a[0]) == [] and c.lookup(b[0]) == []
        assert cleared >= 6  # both tiers may hold a block (the CPU tier is inclusive)


def test_inline_accepts_per_block_buffers_and_tensors(daemon) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch

    rng = random.Random(2)
    hashes, data = chain(rng, 3)
    with Client(daemon.endpoint, "inline2", layout()) as c:
        parts = [data[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES] for i in range(3)]
        assert c.store(hashes[:2], parts[:2]) == (2, 0)
        assert c.store(hashes[2:], torch.frombuffer(bytearray(parts[2]), dtype=torch.uint8)) == (1, 0)
        got = c.restore(hashes)
        assert bytes(got.data) == data
        # The reply is zero-copy: wrap it without copying.
        assert np.frombuffer(got.data, dtype=np.uint8).nbytes == 3 * BLOCK_BYTES


def test_shm_store_restore_through_cpu_tier(daemon) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    with Client(daemon.endpoint, "shm", layout()) as c:
        arena = c.open_arena(8)
        assert os.path.exists(arena.path)
        chains = [chain(rng, 4) for _ in range(3)]
        for hashes, data in chains:
            arena.buffer[: 4 * BLOCK_BYTES] = data
            assert c.store(hashes, slots=[0, 1, 2, 3]) == (4, 0)
        assert c.lookup(chains[0][0]) == ["cpu"] * 4
        for hashes, data in chains:
            arena.buffer[:] = b"\0" * arena.size_bytes
            # Restore into other slots, in reverse order.
            got = c.restore(hashes, slots=[7, 6, 5, 4])
            assert len(got) == 4 and got.data is None
            for i in range(4):
                assert bytes(arena.slot_view(7 - i)) == data[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]
        with pytest.raises(DaemonError) as info:
            c.restore(chains[0][0], slots=[0, 1, 2, 99])
        assert info.value.code == ErrorCode.INVALID_FIELD
        path = arena.path
    # Session over: the client unlinked its arena (and the daemon would have).
    assert not os.path.exists(path)


def test_store_larger_than_payload_limit_is_refused_locally(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "limits", layout()) as c:
        assert c.limits["max_payload_bytes"] == 8 * BLOCK_BYTES
        hashes, data = chain(random.Random(4), 9)
        with pytest.raises(Exception) as info:
            c.store(hashes, data)
        assert info.value.code == ErrorCode.TOO_LARGE  # type: ignore[attr-defined]


def test_wrong_mode_and_layout_mismatch(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "modes", layout()) as c:
        with pytest.raises(DaemonError) as info:
            c.allocate("r", [], 3)
        assert info.value.code == ErrorCode.WRONG_MODE
    with pytest.raises(DaemonError) as info:
        Client(daemon.endpoint, "modes", layout(num_layers=3))
    assert info.value.code == ErrorCode.LAYOUT_MISMATCH and "num_layers" in info.value.message
    with pytest.raises(DaemonError) as info:
        Client(daemon.endpoint, "other", layout(hash_algo="sha256"))
    assert info.value.code == ErrorCode.LAYOUT_MISMATCH


def test_registered_kv_store_restore_through_cpu_tier(daemon) -> None:  # type: ignore[no-untyped-def]
    import torch

    from kvtier.client.kv_share import allocate_shared_kv

    # An engine layout unlike the daemon's slabs: one tensor per layer,
    # [K/V, block, token, dim] with the block in dimension 1.
    layers = [allocate_shared_kv((2, 8, 4, 32), "float16", 1)[0] for _ in range(2)]

    def canonical(slot: int) -> bytes:
        return b"".join(t.select(1, slot).contiguous().view(torch.uint8).numpy().tobytes() for t in layers)

    gen = torch.Generator().manual_seed(6)
    rng = random.Random(6)
    with Client(daemon.endpoint, "kv", layout()) as c:
        assert c.register_kv("engine", layers, 1) == 8
        chains = []
        for _ in range(3):
            for t in layers:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(torch.float16))
            hashes = [rng.randbytes(16) for _ in range(4)]
            chains.append((hashes, [canonical(s) for s in range(4)]))
            assert c.store(hashes, slots=[0, 1, 2, 3], reg="engine") == (4, 0)
        assert c.lookup(chains[0][0]) == ["cpu"] * 4
        for hashes, blocks in chains:
            for t in layers:
                t.zero_()
            assert len(c.restore(hashes, slots=[7, 6, 5, 4], reg="engine")) == 4
            assert [canonical(s) for s in (7, 6, 5, 4)] == blocks
            # Every plane sees the same canonical bytes.
            assert bytes(c.restore(hashes).data) == b"".join(blocks)
        with pytest.raises(DaemonError) as info:
            c.store([rng.randbytes(16)], slots=[0], reg="nope")
        assert info.value.code == ErrorCode.NOT_FOUND
        c.unregister_kv("engine")


def test_stores_and_restores_of_client_memory_carry_their_deadline_and_a_late_one_does_nothing(daemon) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(11)
    with Client(daemon.endpoint, "deadline", layout(), timeout_s=5.0) as c:
        assert "deadlines" in c.features and c.deadlines  # one host, one clock
        sent: list[tuple[str, dict]] = []
        roundtrip = c._roundtrip

        def recording(op: str, fields: dict, *args: object, **kw: object) -> object:
            sent.append((op, dict(fields)))
            return roundtrip(op, fields, *args, **kw)  # type: ignore[arg-type]

        c._roundtrip = recording  # type: ignore[method-assign]
        hashes, data = chain(rng, 4)
        c.store(hashes, data)
        arena = c.open_arena(4)
        arena.buffer[: 4 * BLOCK_BYTES] = data
        t0_ns = time.monotonic_ns()
        c.store(hashes, slots=[0, 1, 2, 3])
        c.restore(hashes, slots=[3, 2, 1, 0], timeout_s=2.0)
        t1_ns = time.monotonic_ns()
        by_op = [(op, f.get("deadline_ns")) for op, f in sent if op in ("store", "restore")]
        # Inline bytes travel in the message: no deadline. The others carry the call's own.
        assert by_op[0] == ("store", None)
        assert by_op[1][0] == "store" and t0_ns + 4_900_000_000 < by_op[1][1] <= t1_ns + 5_000_000_000
        assert by_op[2][0] == "restore" and t0_ns + 1_900_000_000 < by_op[2][1] <= t1_ns + 2_000_000_000
        # A request that arrives past its deadline is refused, and changes nothing.
        late, late_data = chain(rng, 4)
        arena.buffer[: 4 * BLOCK_BYTES] = late_data
        c._session.deadlines = False  # so that the deadline sent is the one below
        _, wire = c._wire_hashes(late)
        past_ns = time.monotonic_ns() - 1
        for op in ("store", "restore"):
            with pytest.raises(DaemonError) as err:
                c._call(op, {"hashes": wire, "plane": "shm", "slots": [0, 1, 2, 3], "deadline_ns": past_ns})
            assert err.value.code == ErrorCode.DEADLINE_EXCEEDED and "nothing was done" in err.value.message
        assert c.lookup(late) == []
        _, wire = c._wire_hashes(hashes)
        with pytest.raises(DaemonError) as err:
            c._call("restore", {"hashes": wire, "plane": "shm", "slots": [0, 1, 2, 3], "deadline_ns": past_ns})
        assert err.value.code == ErrorCode.DEADLINE_EXCEEDED
        assert bytes(arena.buffer[: 4 * BLOCK_BYTES]) == late_data  # not written
        # With time left to write, the same restore goes through.
        far_ns = time.monotonic_ns() + 10_000_000_000
        c._call("restore", {"hashes": wire, "plane": "shm", "slots": [0, 1, 2, 3], "deadline_ns": far_ns})
        assert bytes(arena.buffer[: 4 * BLOCK_BYTES]) == data


@pytest.mark.parametrize("kind", ["shm", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_registered_kv_is_neither_read_nor_written_past_the_deadline(daemon, kind: str) -> None:  # type: ignore[no-untyped-def]
    # On CUDA the daemon copies by IPC straight between its tiers and the engine's tensor (the pool's
    # copies carry the deadline); on the CPU through the loop's fault-safe copies.
    import torch

    from kvtier.client.kv_share import allocate_shared_kv

    shape = (8, BLOCK_BYTES // 2)  # 8 blocks of float16 along dim 0
    if kind == "cuda":
        kv = torch.zeros(shape, dtype=torch.float16, device="cuda")
    else:
        kv, _handle = allocate_shared_kv(shape, "float16", 0)

    def blocks(first: int) -> bytes:
        if kv.is_cuda:
            torch.cuda.synchronize(kv.device)
        return kv[first:first + 4].contiguous().view(torch.uint8).cpu().numpy().tobytes()

    hashes, data = chain(random.Random(13), 4)
    kv[:4] = torch.frombuffer(bytearray(data), dtype=torch.float16).view(4, -1).to(kv.device)
    with Client(daemon.endpoint, f"deadline-{kind}", layout(), timeout_s=10.0) as c:
        assert c.register_kv("kv", [kv], 0) == 8
        c._session.deadlines = False  # so that the deadlines sent are the ones below
        _, wire = c._wire_hashes(hashes)
        past_ns = time.monotonic_ns() - 1
        far_ns = time.monotonic_ns() + 30_000_000_000

        def call(op: str, slots: list[int], deadline_ns: int) -> Any:  # the op's reply Struct
            rh, _ = c._call(op, {"hashes": wire, "plane": "kv", "reg": "kv", "slots": slots, "deadline_ns": deadline_ns})
            return rh

        with pytest.raises(DaemonError) as err:
            call("store", [0, 1, 2, 3], past_ns)
        assert err.value.code == ErrorCode.DEADLINE_EXCEEDED and c.lookup(hashes) == []
        assert (stored := call("store", [0, 1, 2, 3], far_ns)).stored == 4 and isinstance(stored, StoreReply)
        with pytest.raises(DaemonError) as err:
            call("restore", [4, 5, 6, 7], past_ns)
        assert err.value.code == ErrorCode.DEADLINE_EXCEEDED
        assert blocks(4) == bytes(4 * BLOCK_BYTES)  # not written
        assert len((restored := call("restore", [4, 5, 6, 7], far_ns)).tiers) == 4 and isinstance(restored, TiersReply)
        assert blocks(4) == data
        c.unregister_kv("kv")
