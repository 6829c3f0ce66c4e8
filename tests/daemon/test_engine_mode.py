"""Engine-managed mode: the worked example of vLLM's "Automatic Prefix Caching" design doc, driven through the client.

The "engine" is this test: it registers a KV tensor of 10 blocks (block
size 4) as the pool's GPU tier, asks the daemon for block tables, and writes
each token's KV into its slot the way a model would. The tensor is shared
memory, or on a GPU a CUDA tensor the daemon opens by CUDA IPC (the daemon
then runs on CUDA too: its device is 'auto').
"""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.client.client import Client, PoolLayout
from kvtier.client.kv_share import allocate_shared_kv

NUM_BLOCKS = 10
BLOCK_SIZE = 4
NUM_LAYERS = 2
KV_HEADS = 1
HEAD_DIM = 8
# One tensor for all layers: [layer, K/V, block, token in block, head, dim].
SHAPE = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
BLOCK_DIM = 2
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2  # float16


def layout() -> PoolLayout:
    return PoolLayout(model="worked-example", block_size=BLOCK_SIZE, block_bytes=BLOCK_BYTES, dtype="float16",
                      num_layers=NUM_LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, mode="engine")


class Engine:
    """Writes a token's KV where the block table says: what prefill/decode would compute."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def compute(self, table: list[int], tokens: list[int], start: int = 0) -> None:
        for pos in range(start, len(tokens)):
            slot, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            # Depends on the token and everything before it, like real KV.
            value = float((sum(tokens[: pos + 1]) * 7 + pos) % 2039)
            for layer in range(NUM_LAYERS):
                self.kv[layer, 0, slot, offset] = value + layer
                self.kv[layer, 1, slot, offset] = -value - layer

    def synchronize(self) -> None:
        if self.kv.is_cuda:
            torch.cuda.synchronize(self.kv.device)

    def block_bytes(self, slot: int) -> bytes:
        return self.kv.select(BLOCK_DIM, slot).contiguous().view(torch.uint8).cpu().numpy().tobytes()


def engine_kv(kind: str) -> torch.Tensor:
    if kind == "cuda":
        return torch.zeros(SHAPE, dtype=torch.float16, device="cuda")
    kv, _handle = allocate_shared_kv(SHAPE, "float16", BLOCK_DIM)
    return kv


@pytest.mark.parametrize("kind", ["shm", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_worked_example_of_reference_doc_000(kvtierd_factory, kind: str) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(cpu_bytes=16 * BLOCK_BYTES)
    kv = engine_kv(kind)
    engine = Engine(kv)
    r0 = list(range(1000, 1017))  # request 0: 15 prompt tokens, then 2 decoded
    r1 = r0[:10] + [2000, 2001, 2002, 2003]  # 14 tokens, the first 10 shared with request 0
    r2 = r0[:12] + list(range(3000, 3017))  # 29 tokens, the first 12 shared with request 0
    with Client(daemon.endpoint, "example", layout(), lease_s=5.0) as c:
        assert c.register_kv("kv", [kv], BLOCK_DIM) == NUM_BLOCKS

        # Time 1: request 0, 15 prompt tokens -> 4 blocks, 3 of them full and cached.
        alloc = c.allocate_tokens("r0", r0[:15])
        assert alloc.block_ids == [0, 1, 2, 3] and alloc.tiers == []
        engine.compute(alloc.block_ids, r0[:15])
        # Times 2-3: decoding fills block 3 (cached at once) and needs block 4.
        table, new = c.append_tokens("r0", [r0[15]])
        assert table == [0, 1, 2, 3] and new == []
        engine.compute(table, r0[:16], start=15)
        block3 = engine.block_bytes(3)
        table, new = c.append_tokens("r0", [r0[16]])
        assert table == [0, 1, 2, 3, 4] and new == [4]
        engine.compute(table, r0[:17], start=16)

        # Time 4: request 1 hits only the first 2 blocks (its 3rd block differs).
        alloc = c.allocate_tokens("r1", r1)
        assert alloc.block_ids == [0, 1, 5, 6] and alloc.tiers == ["gpu", "gpu"]
        engine.compute(alloc.block_ids, r1, start=8)

        # Times 5-6: both finish; free queue 7 8 9 4 3 2 6 5 1 0. Freed blocks
        # may be demoted at once: an engine's writes are complete before it frees.
        engine.synchronize()
        c.free("r0")
        c.free("r1")

        # Time 7: request 2 hits 0,1,2 and takes 7,8,9,4,3 -- evicting block 3.
        alloc = c.allocate_tokens("r2", r2)
        assert alloc.block_ids == [0, 1, 2, 7, 8, 9, 4, 3]
        assert alloc.tiers == ["gpu"] * 3 and alloc.num_gpu_hits == 3 and alloc.num_cpu_hits == 0
        engine.compute(alloc.block_ids, r2, start=12)  # overwrites slot 3
        assert engine.block_bytes(3) != block3

        # Block 3's content now lives in the CPU tier.
        h = c.hashes_for(r0[:16])
        assert c.lookup(h) == ["gpu", "gpu", "gpu", "cpu"]

        # A later request with request 0's first 16 tokens: no recompute of
        # block 3, its KV is restored from the CPU tier into a fresh slot.
        alloc = c.allocate_tokens("r3", r0[:16])
        assert alloc.tiers == ["gpu", "gpu", "gpu", "cpu"] and alloc.num_cpu_hits == 1
        assert alloc.block_ids[:3] == [0, 1, 2] and alloc.block_ids[3] not in (0, 1, 2, 7, 8, 9, 4, 3)
        assert engine.block_bytes(alloc.block_ids[3]) == block3

        stats = c.stats()["pools"]["example"]
        assert stats["restores"] >= 1 and stats["gpu_blocks"] == NUM_BLOCKS and stats["gpu_registered"]
        engine.synchronize()
        c.free("r2")
        c.free("r3")
        c.unregister_kv("kv")
        assert not c.stats()["pools"]["example"]["gpu_registered"]
        # The CPU tier outlives the registration (clean-ahead demoted the
        # freed head blocks, the eviction demoted block 3).
        assert c.lookup(h) == ["cpu"] * 4


def test_registration_goes_with_the_session(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(cpu_bytes=16 * BLOCK_BYTES)
    kv, _handle = allocate_shared_kv(SHAPE, "float16", BLOCK_DIM)
    with Client(daemon.endpoint, "bye", layout()) as c:
        c.register_kv("kv", [kv], BLOCK_DIM)
        c.allocate_tokens("r", list(range(9)))
        with Client(daemon.endpoint, "bye", layout()) as other:
            # One GPU tier per engine pool.
            try:
                other.register_kv("kv2", [kv], BLOCK_DIM)
                raise AssertionError("second registration accepted")
            except Exception as exc:  # noqa: BLE001
                assert "already has a GPU tier" in str(exc)
    with Client(daemon.endpoint, "bye", layout()) as c:
        stats = c.stats()["pools"]["bye"]
        assert not stats["gpu_registered"] and stats["gpu_blocks"] == 0
        # A new engine can register again.
        assert c.register_kv("kv", [kv], BLOCK_DIM) == NUM_BLOCKS


def test_free_with_valid_tokens_keeps_unwritten_blocks_out_of_the_cache(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(cpu_bytes=16 * BLOCK_BYTES)
    kv, _handle = allocate_shared_kv(SHAPE, "float16", BLOCK_DIM)
    engine = Engine(kv)
    tokens = list(range(500, 516))  # 4 full blocks
    with Client(daemon.endpoint, "abort", layout(), lease_s=5.0) as c:
        c.register_kv("kv", [kv], BLOCK_DIM)
        alloc = c.allocate_tokens("a", tokens)
        engine.compute(alloc.block_ids, tokens[:8])  # the engine got through 2 blocks, then failed
        c.free("a", valid_tokens=8)
        h = c.hashes_for(tokens)
        assert c.lookup(h) == ["gpu", "gpu"]
        # A retry recomputes blocks 2-3 instead of hitting bytes nobody wrote.
        retry = c.allocate_tokens("b", tokens)
        assert retry.tiers == ["gpu", "gpu"] and retry.block_ids[:2] == alloc.block_ids[:2]
        c.free("b")


def test_an_idle_daemon_demotes_ahead_so_the_next_long_allocation_waits_for_none(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    # Clean-ahead after each call keeps 2 blocks clean here; a request of all
    # 10 would wait for 8 urgent demotions, unless the daemon used its idle time.
    daemon = kvtierd_factory(cpu_bytes=32 * BLOCK_BYTES, clean_ahead_blocks=2)
    kv, _handle = allocate_shared_kv(SHAPE, "float16", BLOCK_DIM)
    engine = Engine(kv)
    first = list(range(5000, 5000 + NUM_BLOCKS * BLOCK_SIZE))
    second = list(range(6000, 6000 + NUM_BLOCKS * BLOCK_SIZE))
    with Client(daemon.endpoint, "idle", layout(), lease_s=5.0) as c:
        c.register_kv("kv", [kv], BLOCK_DIM)
        alloc = c.allocate_tokens("r", first)
        engine.compute(alloc.block_ids, first)
        c.free("r")

        def pool() -> dict:
            return c.stats()["pools"]["idle"]

        deadline = time.monotonic() + 10
        while pool()["demotions"] < NUM_BLOCKS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool()["demotions"] == NUM_BLOCKS and pool()["demotions_urgent"] == 0
        alloc = c.allocate_tokens("s", second)  # evicts all ten: none waits for a copy
        assert pool()["demotions_urgent"] == 0
        assert c.lookup(c.hashes_for(first)) == ["cpu"] * NUM_BLOCKS
