"""Acceptance tests for the GPU-tier block manager (vLLM v1's automatic prefix caching).

The reference is vLLM's design doc "Automatic Prefix Caching"
(docs.vllm.ai/en/latest/design/prefix_caching.html): its worked example (10
blocks, block size 4, Times 1-7) and its "duplicated blocks" example must
come out exactly, first on the bare block manager, then through a TieredPool
that moves real bytes.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
import torch

from kvtier.client.hashing import BlockHasher
from kvtier.tiers.block_manager import Block, BlockManager, Evicted, NoFreeBlocks
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import PoolSpec, Tier, TieredPool
from kvtier.tiers.transfer import ThreadTransferEngine

BS = 4  # tokens per block in every test here (the reference example's size)


# ---- helpers -----------------------------------------------------------------------------


def free_ids(bm: BlockManager) -> list[int]:
    return [b.block_id for b in bm.iter_free()]


def check_invariants(bm: BlockManager) -> None:
    """Walk the free queue and the index; fail on any inconsistency."""
    q = bm.free_queue
    seen: list[Block] = []
    node = q._head
    while node.next_free is not q._tail:
        nxt = node.next_free
        assert nxt is not None, "free queue chain broken"
        assert nxt.prev_free is node, f"asymmetric links at block {nxt.block_id}"
        seen.append(nxt)
        node = nxt
        assert len(seen) <= bm.num_blocks, "cycle in the free queue"
    assert q._tail.prev_free is node
    assert len(seen) == q.num_free == bm.num_free_blocks
    assert len({id(b) for b in seen}) == len(seen), "a block is in the free queue twice"
    in_queue = {b.block_id for b in seen}
    for b in bm.blocks:
        assert b.ref_cnt >= 0, f"block {b.block_id} has ref count {b.ref_cnt}"
        if b.ref_cnt == 0:
            assert b.block_id in in_queue, f"free block {b.block_id} missing from the free queue"
        else:
            assert b.block_id not in in_queue, f"referenced block {b.block_id} is in the free queue"
            assert b.prev_free is None and b.next_free is None
    for h, b in bm._index.items():
        assert b.block_hash == h, f"index maps {h.hex()} to block {b.block_id} carrying another hash"
    for h, dups in bm._duplicates.items():
        assert dups, "empty duplicates list kept"
        assert h in bm._index, "duplicates of a hash that is not indexed"
        for d in dups:
            assert d.block_hash == h and d is not bm._index[h]
    for b in bm.blocks:
        if b.block_hash is not None:
            assert bm._index[b.block_hash] is b or b in bm._duplicates.get(b.block_hash, []), (
                f"block {b.block_id} carries a hash that is neither indexed nor a duplicate"
            )


def snapshot(bm: BlockManager) -> tuple:
    return (
        free_ids(bm),
        [b.ref_cnt for b in bm.blocks],
        [b.block_hash for b in bm.blocks],
        {h: b.block_id for h, b in bm._index.items()},
        {h: [b.block_id for b in d] for h, d in bm._duplicates.items()},
        {r: bm.block_table(r) for r in bm.request_ids()},
    )


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def hasher() -> BlockHasher:
    return BlockHasher(BS)


# ---- the worked example of vLLM's "Automatic Prefix Caching" design doc ---------------------


class WorkedExample:
    """Token sequences of the reference example, with distinct suffixes."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.r0 = tokens(1000, 17)  # 15 prompt tokens + 2 decoded
        self.r1 = self.r0[:10] + tokens(2000, 4)  # 14 tokens, first 10 shared
        self.r2 = self.r0[:12] + tokens(3000, 17)  # 29 tokens, first 12 shared
        self.h = hasher.hash_blocks
        assert self.r2[12] != self.r0[12]


def run_worked_example(bm: BlockManager, ex: WorkedExample) -> list:
    """Times 1-7 of the reference; asserts every intermediate state. Returns request 2's allocation."""
    # Time 1: request 0, 15 tokens: 4 blocks, 3 full and cached.
    a0 = bm.allocate("r0", ex.h(ex.r0[:15]), 15)
    assert a0.block_ids == [0, 1, 2, 3] and a0.num_hit_blocks == 0 and a0.evicted == []
    assert [bm.blocks[i].block_hash for i in range(4)] == ex.h(ex.r0[:15]) + [None]
    assert bm.num_cached_blocks == 3
    # Time 2-3: decode: the 16th token fills (and commits) block 3, the 17th needs block 4.
    a = bm.append("r0", 1, ex.h(ex.r0[:16])[3:])
    assert a.new_block_ids == [] and a.block_ids == [0, 1, 2, 3]
    assert bm.blocks[3].block_hash == ex.h(ex.r0[:16])[3]
    a = bm.append("r0", 1, [])
    assert a.new_block_ids == [4] and a.block_ids == [0, 1, 2, 3, 4]
    assert bm.blocks[4].block_hash is None and bm.num_cached_blocks == 4
    assert free_ids(bm) == [5, 6, 7, 8, 9]
    # Time 4: request 1, 14 tokens sharing the first 10: only 2 blocks hit.
    a1 = bm.allocate("r1", ex.h(ex.r1), 14)
    assert a1.num_hit_blocks == 2 and a1.block_ids == [0, 1, 5, 6] and a1.new_block_ids == [5, 6]
    assert bm.blocks[0].ref_cnt == bm.blocks[1].ref_cnt == 2
    assert bm.blocks[5].block_hash == ex.h(ex.r1)[2] != ex.h(ex.r0[:12])[2]
    # Time 5: free request 0: blocks 4, 3, 2 go to the tail in reverse order (0, 1 still used).
    bm.free("r0")
    assert free_ids(bm) == [7, 8, 9, 4, 3, 2]
    assert bm.blocks[2].block_hash is not None and bm.blocks[3].block_hash is not None
    # Time 6: free request 1.
    bm.free("r1")
    assert free_ids(bm) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    check_invariants(bm)
    # Time 7: request 2, 29 tokens sharing the first 12: hits 0, 1, 2 are touched out of
    # the queue (7 8 9 4 3 6 5), then 5 blocks are popped: 7, 8, 9, 4, 3 (evicted).
    old_h3 = bm.blocks[3].block_hash
    a2 = bm.allocate("r2", ex.h(ex.r2), 29)
    assert a2.num_hit_blocks == 3
    assert a2.block_ids == [0, 1, 2, 7, 8, 9, 4, 3]
    assert a2.new_block_ids == [7, 8, 9, 4, 3]
    assert a2.evicted == [Evicted(3, old_h3)]
    assert free_ids(bm) == [6, 5]
    assert bm.get_cached(old_h3) is None
    # Block 3 now holds request 2's last, partial block (29 = 7 * 4 + 1): no hash at all.
    assert bm.blocks[3].block_hash is None
    assert bm.blocks[4].block_hash == ex.h(ex.r2)[6]
    check_invariants(bm)
    return a2


def test_reference_worked_example(hasher: BlockHasher) -> None:
    bm = BlockManager(10, BS)
    assert free_ids(bm) == list(range(10))
    run_worked_example(bm, WorkedExample(hasher))


# Two float16 "layers" [2, num_blocks, block_size, heads, dim]: a GPU stand-in on the CPU.
LAYERS, HEADS, DIM = 2, 2, 8


def make_gpu_layout(num_blocks: int) -> BlockLayout:
    gen = torch.Generator().manual_seed(1234)
    tensors = [
        torch.randint(0, 256, (2, num_blocks, BS, HEADS, DIM * 2), dtype=torch.uint8, generator=gen).view(
            torch.float16
        )
        for _ in range(LAYERS)
    ]
    return BlockLayout(tensors, [1] * LAYERS)


class Engine:
    """An engine stand-in: 'computes' a block by writing random bytes into its slot."""

    def __init__(self, layout: BlockLayout, seed: int = 7) -> None:
        self.layout = layout
        self.gen = torch.Generator().manual_seed(seed)

    def compute(self, slots: list[int]) -> dict[int, torch.Tensor]:
        if not slots:
            return {}
        data = torch.randint(0, 256, (len(slots), self.layout.block_bytes), dtype=torch.uint8, generator=self.gen)
        self.layout.scatter(slots, data)
        return {s: data[i].clone() for i, s in enumerate(slots)}


@pytest.mark.parametrize("clean_ahead", [0, 64])
def test_reference_worked_example_through_pool_moves_block_3_to_cpu(hasher: BlockHasher, clean_ahead: int) -> None:
    ex = WorkedExample(hasher)
    gpu = make_gpu_layout(10)
    bb = gpu.block_bytes
    assert bb == LAYERS * 2 * BS * HEADS * DIM * 2
    engine = ThreadTransferEngine()
    try:
        cpu_storage = BlockLayout.contiguous(16, bb)
        cpu_storage.slab().fill_(0xA5)
        pool = TieredPool(
            PoolSpec("worked", BS, bb), cpu_blocks=16, policy="lru", transfer=engine, cpu_storage=cpu_storage,
            clean_ahead_blocks=clean_ahead,
        )
        pool.attach_gpu(gpu)
        kv = Engine(gpu)
        bm = pool.bm
        assert bm is not None

        op = pool.allocate("r0", ex.h(ex.r0[:15]), 15).wait()
        assert op.error is None and op.result["block_ids"] == [0, 1, 2, 3]
        content = kv.compute([0, 1, 2, 3])
        op = pool.append("r0", 1, ex.h(ex.r0[:16])[3:]).wait()
        assert op.error is None
        content.update(kv.compute([3]))  # block 3 is full now: its final bytes
        block3 = content[3].clone()
        op = pool.append("r0", 1, []).wait()
        assert op.result["new_block_ids"] == [4]
        content.update(kv.compute([4]))
        op = pool.allocate("r1", ex.h(ex.r1), 14).wait()
        assert op.result["block_ids"] == [0, 1, 5, 6] and op.result["tiers"] == ["gpu", "gpu"]
        content.update(kv.compute([5, 6]))
        pool.free("r0")
        pool.free("r1")
        assert free_ids(bm) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
        assert pool.wait_idle(10)
        demotions_before = pool.counters["demotions"]

        op = pool.allocate("r2", ex.h(ex.r2), 29)
        op.wait(10)
        assert op.error is None
        assert op.result["block_ids"] == [0, 1, 2, 7, 8, 9, 4, 3]
        assert op.result["tiers"] == ["gpu", "gpu", "gpu"]
        assert free_ids(bm) == [6, 5]
        h3 = ex.h(ex.r0[:16])[3]
        assert bm.get_cached(h3) is None
        if clean_ahead == 0:
            # Block 3 had to be demoted on the spot: exactly one urgent demotion.
            assert pool.counters["demotions"] == demotions_before + 1
            assert pool.counters["demotions_urgent"] == 1
        else:
            # Clean-ahead had already copied it: the eviction needed no copy.
            assert pool.counters["demotions"] == demotions_before
            assert pool.counters["demotions_skipped_clean"] >= 1
            assert pool.counters["demotions_urgent"] == 0
        assert pool.wait_idle(10)
        # Block 3's bytes are in the CPU tier, byte-exact.
        entry = pool.cpu.get_ready(h3)
        assert entry is not None
        assert torch.equal(pool.cpu.storage.block_view(entry.slot), block3)
        # The engine computes request 2's new blocks, overwriting slot 3.
        content.update(kv.compute([7, 8, 9, 4, 3]))
        assert not torch.equal(gpu.block_view(3), block3)

        # A new request with request 0's first 16 tokens: 3 GPU hits, block 3 from the CPU.
        assert pool.lookup(ex.h(ex.r0[:16])) == [Tier.GPU, Tier.GPU, Tier.GPU, Tier.CPU]
        op = pool.allocate("r3", ex.h(ex.r0[:16]), 16).wait(10)
        assert op.error is None
        assert op.result["tiers"] == ["gpu", "gpu", "gpu", "cpu"]
        table = op.result["block_ids"]
        assert table[:3] == [0, 1, 2] and table[3] == 6  # the head of the free queue (6, 5)
        assert torch.equal(gpu.block_view(table[3]), block3)
        for slot in (0, 1, 2):
            assert torch.equal(gpu.block_view(slot), content[slot])
        assert pool.cpu.get_ready(h3) is not None  # inclusive: the CPU copy stays
        check_invariants(bm)
    finally:
        engine.close()


# ---- free-queue order and eviction order ---------------------------------------------------


@pytest.mark.parametrize("a_first", [True, False])
def test_free_queue_order_after_freeing_two_requests_with_shared_prefix(hasher: BlockHasher, a_first: bool) -> None:
    bm = BlockManager(8, BS)
    ta = tokens(0, 12)  # blocks 0 1 2
    tb = ta[:8] + tokens(500, 8)  # shares 2 blocks: 0 1 3 4
    assert bm.allocate("a", hasher.hash_blocks(ta), 12).block_ids == [0, 1, 2]
    assert bm.allocate("b", hasher.hash_blocks(tb), 16).block_ids == [0, 1, 3, 4]
    if a_first:
        bm.free("a")
        assert free_ids(bm) == [5, 6, 7, 2]
        bm.free("b")
        assert free_ids(bm) == [5, 6, 7, 2, 4, 3, 1, 0]
    else:
        bm.free("b")
        assert free_ids(bm) == [5, 6, 7, 4, 3]
        bm.free("a")
        assert free_ids(bm) == [5, 6, 7, 4, 3, 2, 1, 0]
    check_invariants(bm)
    assert bm.num_cached_blocks == 5


def test_eviction_order_of_a_later_large_request(hasher: BlockHasher) -> None:
    bm = BlockManager(8, BS)
    ta = tokens(0, 12)
    tb = ta[:8] + tokens(500, 8)
    ha, hb = hasher.hash_blocks(ta), hasher.hash_blocks(tb)
    bm.allocate("a", ha, 12)
    bm.allocate("b", hb, 16)
    bm.free("a")
    bm.free("b")
    order = free_ids(bm)
    assert order == [5, 6, 7, 2, 4, 3, 1, 0]
    hash_of = {b.block_id: b.block_hash for b in bm.blocks}

    # 5 blocks: the three never-used blocks, then the two cached blocks at the head.
    big = bm.allocate("c", hasher.hash_blocks(tokens(9000, 20)), 20)
    assert big.num_hit_blocks == 0
    assert big.new_block_ids == [5, 6, 7, 2, 4]
    assert big.evicted == [Evicted(2, hash_of[2]), Evicted(4, hash_of[4])]
    assert bm.get_cached(ha[2]) is None and bm.get_cached(hb[3]) is None
    # The shared prefix and b's third block survive, head first in eviction order.
    assert [b.block_id for b in bm.longest_cached_prefix(hb)] == [0, 1, 3]
    assert free_ids(bm) == [3, 1, 0]
    bm.free("c")
    # c's blocks follow, tail first: [5 6 7 2 4] freed last to first.
    assert free_ids(bm) == [3, 1, 0, 4, 2, 7, 6, 5]
    rest = bm.allocate("d", hasher.hash_blocks(tokens(7000, 32)), 32)
    assert [e.block_id for e in rest.evicted] == [3, 1, 0, 4, 2, 7, 6, 5]
    assert bm.num_cached_blocks == 8  # d's 8 full blocks, nothing else
    check_invariants(bm)


def test_failed_allocation_changes_nothing(hasher: BlockHasher) -> None:
    bm = BlockManager(8, BS)
    ta = tokens(0, 12)
    tb = ta[:8] + tokens(500, 8)
    bm.allocate("a", hasher.hash_blocks(ta), 12)
    bm.allocate("b", hasher.hash_blocks(tb), 16)
    bm.free("a")  # queue: 5 6 7 2 ; b holds 0 1 3 4
    bm.allocate("c", hasher.hash_blocks(tokens(100, 3)), 3)  # takes 5
    check_invariants(bm)
    before = snapshot(bm)
    assert before[0] == [6, 7, 2]

    # Needs 4 new blocks, 3 free.
    with pytest.raises(NoFreeBlocks):
        bm.allocate("x", hasher.hash_blocks(tokens(300, 16)), 16)
    assert snapshot(bm) == before
    # Hits a's third block (in the free queue, ref 0) and needs 3 more: the hit leaves the
    # queue, so only 2 are available for new blocks -> refused with no touch applied.
    tx = ta + tokens(800, 12)
    with pytest.raises(NoFreeBlocks):
        bm.allocate("x", hasher.hash_blocks(tx), len(tx))
    assert snapshot(bm) == before
    assert bm.blocks[2].ref_cnt == 0 and bm.blocks[0].ref_cnt == 1
    # Growing a running request past the free blocks.
    tc = tokens(100, 3) + tokens(400, 14)
    with pytest.raises(NoFreeBlocks):
        bm.append("c", 14, hasher.hash_blocks(tc))
    assert snapshot(bm) == before
    with pytest.raises(NoFreeBlocks):
        bm.allocate_blocks(4)
    assert snapshot(bm) == before
    # Bad input is refused with nothing changed as well.
    with pytest.raises(ValueError):
        bm.allocate("y", hasher.hash_blocks(tokens(0, 8))[:1], 8)  # 2 full blocks, 1 hash
    with pytest.raises(ValueError):
        bm.append("c", 1, hasher.hash_blocks(tokens(0, 8)))  # fills one block, got two hashes
    with pytest.raises(ValueError):
        bm.allocate("b", [], 1)  # already running
    with pytest.raises(KeyError):
        bm.free("nope")
    with pytest.raises(KeyError):
        bm.append("nope", 1, [])
    assert snapshot(bm) == before
    check_invariants(bm)
    # And the same calls succeed once there is room: c's block back, x fits now.
    bm.free("c")
    ax = bm.allocate("x", hasher.hash_blocks(tx), len(tx))
    assert ax.num_hit_blocks == 3 and ax.block_ids[:3] == [0, 1, 2]


def test_reused_block_loses_its_old_hash(hasher: BlockHasher) -> None:
    bm = BlockManager(2, BS)
    ha = hasher.hash_blocks(tokens(0, 8))
    bm.allocate("a", ha, 8)
    bm.free("a")  # queue: 1 0, both cached
    # A partial block reuses block 1: it is evicted and carries no hash at all.
    alloc = bm.allocate("p", [], 3)
    assert alloc.block_ids == [1] and alloc.evicted == [Evicted(1, ha[1])]
    assert bm.blocks[1].block_hash is None
    assert bm.get_cached(ha[1]) is None
    assert bm.longest_cached_prefix(ha) == [bm.blocks[0]]
    # A full block reuses block 0: it carries the new hash, the old one is gone.
    hn = hasher.hash_blocks(tokens(50, 4))
    alloc = bm.allocate("n", hn, 4)
    assert alloc.block_ids == [0] and alloc.evicted == [Evicted(0, ha[0])]
    assert bm.blocks[0].block_hash == hn[0]
    assert bm.get_cached(ha[0]) is None and bm.get_cached(hn[0]) is bm.blocks[0]
    assert bm.longest_cached_prefix(ha) == []
    assert bm.num_cached_blocks == 1
    check_invariants(bm)


# ---- duplicated blocks (the same design doc) --------------------------------------------------


def test_duplicated_blocks_reference_example(hasher: BlockHasher) -> None:
    bm = BlockManager(5, BS)
    A, B, C, D, E, F, G, H, I = range(101, 110)
    seq = [A, B, C, D, E, F, G, H, I]

    def run(rid: str) -> list[int]:
        bm.allocate(rid, hasher.hash_blocks(seq[:7]), 7)  # prompt ABCDEF + G
        bm.append(rid, 1, hasher.hash_blocks(seq[:8])[1:])  # H fills EFGH
        return bm.block_table(rid)

    h_abcd, h_efgh = hasher.hash_blocks(seq[:8])
    assert run("r1") == [0, 1]
    bm.append("r1", 1, [])  # I
    assert bm.block_table("r1") == [0, 1, 2]
    assert bm.num_cached_blocks == 2
    # Request 2, same prompt, greedy: block table [0, 3]; block 3 becomes a duplicate of 1.
    assert run("r2") == [0, 3]
    assert bm.blocks[3].block_hash == bm.blocks[1].block_hash == h_efgh
    assert bm.get_cached(h_efgh) is bm.blocks[1]  # the index keeps the first copy
    assert [b.block_id for b in bm._duplicates[h_efgh]] == [3]
    assert bm.num_cached_blocks == 2  # hashes, not copies
    check_invariants(bm)
    # Free request 1: blocks 2 and 1 go to the tail (0 is still used by request 2).
    bm.free("r1")
    assert free_ids(bm) == [4, 2, 1]
    # Evict the first copy: the duplicate becomes the indexed one.
    alloc = bm.allocate("r3", hasher.hash_blocks(tokens(5000, 8)), 3 * BS - 1)
    assert alloc.new_block_ids == [4, 2, 1]
    assert alloc.evicted == [Evicted(1, h_efgh)]
    assert bm.get_cached(h_efgh) is bm.blocks[3]
    assert h_efgh not in bm._duplicates
    assert [b.block_id for b in bm.longest_cached_prefix([h_abcd, h_efgh])] == [0, 3]
    check_invariants(bm)


def test_evicting_the_duplicate_keeps_the_first_copy_indexed(hasher: BlockHasher) -> None:
    bm = BlockManager(4, BS)
    h = hasher.hash_blocks(tokens(0, 4))
    bm.allocate("a", h, 4)  # block 0
    bm.allocate("b", [], 1)  # block 1, partial
    bm.append("b", 3, h)  # ... fills with the same hash: a duplicate (not a real chain, but allowed)
    assert bm.get_cached(h[0]) is bm.blocks[0]
    bm.free("b")  # queue: 2 3 1
    assert free_ids(bm) == [2, 3, 1]
    # Evict the duplicate (block 1) with a request that takes every free block.
    alloc = bm.allocate("d", hasher.hash_blocks(tokens(700, 8)), 2 * BS + 1)
    assert alloc.new_block_ids == [2, 3, 1]
    assert alloc.evicted == [Evicted(1, h[0])]
    assert bm.get_cached(h[0]) is bm.blocks[0]
    assert bm.blocks[1].block_hash is None and h[0] not in bm._duplicates
    check_invariants(bm)


# ---- isolation, decode growth, caching off ---------------------------------------------------


def test_salt_and_lora_isolation(hasher: BlockHasher) -> None:
    toks = tokens(0, 16)
    variants = {
        "plain": hasher.hash_blocks(toks),
        "salt-a": hasher.hash_blocks(toks, cache_salt="tenant-a"),
        "salt-b": hasher.hash_blocks(toks, cache_salt="tenant-b"),
        "lora-1": hasher.hash_blocks(toks, lora_id=1),
        "lora-2": hasher.hash_blocks(toks, lora_id=2),
        "lora-1-salt-a": hasher.hash_blocks(toks, lora_id=1, cache_salt="tenant-a"),
    }
    # Every variant differs from every other in every block (the salt rides the chain).
    all_hashes = [h for hs in variants.values() for h in hs]
    assert len(set(all_hashes)) == len(all_hashes)
    bm = BlockManager(64, BS)
    for name, hs in variants.items():
        alloc = bm.allocate(f"first-{name}", hs, 16)
        assert alloc.num_hit_blocks == 0, f"{name} hit another tenant's or adapter's blocks"
        bm.free(f"first-{name}")
    for name, hs in variants.items():
        alloc = bm.allocate(f"again-{name}", hs, 16)
        assert alloc.num_hit_blocks == 4, f"{name} missed its own blocks"
        bm.free(f"again-{name}")
    check_invariants(bm)


def test_decode_growth_commits_a_block_exactly_when_it_fills(hasher: BlockHasher) -> None:
    bm = BlockManager(8, BS)
    seq = tokens(4242, 4 * BS + 1)
    all_h = hasher.hash_blocks(seq)
    bm.allocate("r", [], 1)
    assert bm.block_table("r") == [0]
    for n in range(2, len(seq) + 1):
        committed_before = (n - 1) // BS
        new_hashes = hasher.hash_blocks(seq[:n])[committed_before:]
        if n % BS != 0:
            # Offering a hash for a block that is not full yet is refused, nothing changed.
            before = snapshot(bm)
            with pytest.raises(ValueError):
                bm.append("r", 1, [all_h[committed_before]] if committed_before < len(all_h) else [b"x" * 16])
            assert snapshot(bm) == before
        alloc = bm.append("r", 1, new_hashes)
        table = bm.block_table("r")
        assert len(table) == -(-n // BS)
        # A new block exactly when a token starts one.
        assert alloc.new_block_ids == ([table[-1]] if n % BS == 1 else [])
        # Committed exactly: the full blocks carry their hashes, the partial one none.
        for i, bid in enumerate(table):
            expected = all_h[i] if i < n // BS else None
            assert bm.blocks[bid].block_hash == expected, f"after {n} tokens, block {i}"
        assert bm.num_cached_blocks == n // BS
        check_invariants(bm)
    # The committed prefix is usable at once by another request.
    assert bm.allocate("s", all_h, 4 * BS).num_hit_blocks == 4


def test_enable_caching_false_gives_no_hits(hasher: BlockHasher) -> None:
    bm = BlockManager(8, BS, enable_caching=False)
    h = hasher.hash_blocks(tokens(0, 8))
    a = bm.allocate("a", h, 8)
    assert a.num_hit_blocks == 0
    assert all(b.block_hash is None for b in bm.blocks)
    bm.free("a")
    b = bm.allocate("b", h, 8)
    assert b.num_hit_blocks == 0 and b.evicted == []
    assert bm.longest_cached_prefix(h) == [] and bm.get_cached(h[0]) is None
    assert bm.num_cached_blocks == 0
    bm.append("b", 4, hasher.hash_blocks(tokens(0, 12))[2:])
    assert all(blk.block_hash is None for blk in bm.blocks)
    check_invariants(bm)


def test_own_hits_are_never_evicted_to_make_room(hasher: BlockHasher) -> None:
    bm = BlockManager(4, BS)
    ta = tokens(0, 8)
    ha = hasher.hash_blocks(ta)
    bm.allocate("a", ha, 8)  # blocks 0 1
    bm.free("a")  # queue: 2 3 1 0
    bm.allocate("x", [], 3)  # takes 2 (partial, no hash)
    bm.allocate("y", [], 3)  # takes 3
    bm.free("x")
    bm.free("y")  # queue: 1 0 2 3 -- a's blocks at the head
    assert free_ids(bm) == [1, 0, 2, 3]
    tc = ta + tokens(900, 8)
    hc = hasher.hash_blocks(tc)
    before = snapshot(bm)
    # One block more than the two non-hit free blocks: refused, nothing changed.
    with pytest.raises(NoFreeBlocks):
        bm.allocate("too-big", hc + hasher.hash_blocks(tc + tokens(950, 4))[4:], 20)
    assert snapshot(bm) == before
    # Exactly enough: the hits are touched out of the queue first, the new blocks come
    # from the other two; nothing is evicted.
    alloc = bm.allocate("c", hc, 16)
    assert alloc.num_hit_blocks == 2
    assert alloc.block_ids == [0, 1, 2, 3]
    assert alloc.evicted == []
    assert bm.get_cached(ha[0]) is bm.blocks[0] and bm.get_cached(ha[1]) is bm.blocks[1]
    assert bm.num_free_blocks == 0
    check_invariants(bm)


def test_primitives_touch_release_and_evict_free_cached(hasher: BlockHasher) -> None:
    bm = BlockManager(4, BS)
    h = hasher.hash_blocks(tokens(0, 12))
    blocks, evicted = bm.allocate_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2] and evicted == []
    for b, hh in zip(blocks, h):
        bm.commit(b, hh)
    with pytest.raises(ValueError):
        bm.commit(blocks[0], h[1])
    bm.release(reversed(blocks))
    assert free_ids(bm) == [3, 2, 1, 0]
    with pytest.raises(ValueError):
        bm.release([blocks[0]])  # ref 0 already
    bm.touch([blocks[1]])
    assert free_ids(bm) == [3, 2, 0] and blocks[1].ref_cnt == 1
    dropped = bm.evict_free_cached()
    assert sorted(e.block_id for e in dropped) == [0, 2]
    assert bm.get_cached(h[1]) is blocks[1] and bm.num_cached_blocks == 1
    bm.discard_hash(blocks[1])
    assert bm.num_cached_blocks == 0 and blocks[1].block_hash is None
    check_invariants(bm)


def test_free_with_valid_tokens_withdraws_hashes_of_blocks_never_written(hasher: BlockHasher) -> None:
    bm = BlockManager(10, 4)
    shared = list(range(8))
    bm.allocate("a", hasher.hash_blocks(shared), 8)
    bm.free("a")
    tokens = shared + list(range(100, 112))  # 2 shared blocks, then 3 new full blocks
    hashes = hasher.hash_blocks(tokens)
    alloc = bm.allocate("b", hashes, len(tokens))
    assert alloc.num_hit_blocks == 2
    # The engine computed one new block (tokens 8..11), then failed.
    bm.free("b", valid_tokens=12)
    assert [b.block_id for b in bm.longest_cached_prefix(hashes)] == alloc.block_ids[:3]
    assert bm.get_cached(hashes[3]) is None and bm.get_cached(hashes[4]) is None
    assert all(b.ref_cnt == 0 for b in bm.blocks) and bm.num_free_blocks == 10


@settings(max_examples=60, deadline=None)
@given(held=st.integers(0, 200), query=st.lists(st.one_of(st.integers(0, 199), st.just(-1)), max_size=300))
def test_longest_cached_prefix_matches_a_plain_walk(held: int, query: list[int]) -> None:
    """Across chunk boundaries and misses anywhere: the blocks of ``query`` up to its first key not cached."""
    keys = [b"k%03d" % i for i in range(200)]
    bm = BlockManager(256, BS)
    if held:
        bm.allocate("r", keys[:held], held * BS)
        bm.free("r")
    hashes = [keys[i] if i >= 0 else b"unknown" for i in query]
    model = []
    for i in query:
        if not 0 <= i < held:
            break
        model.append(i)
    got = bm.longest_cached_prefix(hashes)
    assert [b.block_hash for b in got] == [keys[i] for i in model]
    assert got == [bm.get_cached(keys[i]) for i in model]
