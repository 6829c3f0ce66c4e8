"""Protected keys: a call never evicts a key it names to make room for its other keys.

The bug this pins down: ``TieredPool.store`` dropped the keys it already held
and asked the CPU tier (``CpuTier.reserve``) and the GPU tier
(``BlockManager.allocate_blocks``) for room for the new ones only, so the
room could be made by evicting the present ones. Storing [1,2], then [3],
then [1,2,3,4,5] into a CPU tier of 4 blocks answered ``present: 3`` and
evicted key 1: ``lookup([1..5])`` was ``[]``, the whole chain unreachable.

Now every key of the call is protected (as vLLM's offloading manager does
with its ``protected`` set): room comes from other blocks, and where there is
not enough the store raises ``NoSpace`` having changed nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.tiers.block_manager import BlockManager, NoFreeBlocks
from kvtier.tiers.cpu_tier import CpuTier, CpuTierFull
from kvtier.tiers.policies import make_policy
from kvtier.tiers.policies.lru import LRUPolicy
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import NoSpace, PoolSpec, Tier, TieredPool
from kvtier.tiers.transfer import ThreadTransferEngine

BS = 4
BB = 32
POLICIES = ["chain", "lru", "arc", "s3fifo", "chain+admit2", "lru+admit2", "arc+admit2", "s3fifo+admit2"]


def k(i: int) -> bytes:
    return f"key:{i}".encode().ljust(16, b".")


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def content(key: bytes) -> torch.Tensor:
    seed = int.from_bytes(key[:8], "little") ^ int.from_bytes(key[8:], "little")
    return torch.randint(0, 256, (BB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class Pools:
    """Builds pools (bookkeeping or with real bytes) and closes their transfer engines."""

    def __init__(self) -> None:
        self.engines: list[ThreadTransferEngine] = []

    def make(self, *, policy: str = "lru", gpu_blocks: int | None = None, cpu_blocks: int,
             data: bool = False, clean_ahead: int = 0) -> TieredPool:
        engine = cpu_storage = gpu = None
        if data:
            engine = ThreadTransferEngine()
            self.engines.append(engine)
            cpu_storage = BlockLayout.contiguous(cpu_blocks, BB) if cpu_blocks else None
        pool = TieredPool(PoolSpec("p", BS, BB), cpu_blocks=cpu_blocks, policy=policy, transfer=engine, data=data,
                          cpu_storage=cpu_storage, clean_ahead_blocks=clean_ahead)
        if gpu_blocks:
            if data:
                gpu = BlockLayout.contiguous(gpu_blocks, BB)
                pool.attach_gpu(gpu)
            else:
                pool.attach_gpu(num_blocks=gpu_blocks)
        pool._test_gpu = gpu  # type: ignore[attr-defined]
        return pool

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.engines.clear()


@pytest.fixture
def pools():
    p = Pools()
    yield p
    p.close()


def store(pool: TieredPool, hashes: list[bytes]):
    src = None
    if pool.data:
        src = BlockLayout.contiguous(len(hashes), BB)
        for i, key in enumerate(hashes):
            src.slab()[i] = content(key)
    return pool.store(hashes, src, list(range(len(hashes))))


def held_keys(pool: TieredPool) -> set[bytes]:
    keys = set(pool.cpu._entries)
    if pool.bm is not None:
        keys |= set(pool.bm._index)
    return keys


def state(pool: TieredPool) -> tuple:
    bm = pool.bm
    return (
        None if bm is None else (
            [b.block_id for b in bm.iter_free()],
            [(b.ref_cnt, b.block_hash) for b in bm.blocks],
            {key: b.block_id for key, b in bm._index.items()},
        ),
        {key: (e.slot, e.pins, e.readers, e.ready) for key, e in pool.cpu._entries.items()},
        list(pool.cpu.policy.victims()),
    )


def check_bytes(pool: TieredPool) -> None:
    """Every ready CPU entry and every cached GPU block with nothing in flight holds its key's bytes."""
    if not pool.data:
        return
    if pool.cpu.storage is not None:
        for key, e in pool.cpu._entries.items():
            if e.ready:
                assert torch.equal(pool.cpu.storage.slab()[e.slot], content(key))
    gpu = pool._test_gpu  # type: ignore[attr-defined]
    if gpu is not None:
        for b in pool.bm.blocks:
            if b.block_hash is not None and b.block_id not in pool._copies.gpu_busy:
                assert torch.equal(gpu.slab()[b.block_id], content(b.block_hash))


# ---- the reported scenario, every policy ----------------------------------------------------


@pytest.mark.parametrize("data", [False, True], ids=["bookkeeping", "bytes"])
@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_only_store_does_not_evict_its_present_keys(pools, policy: str, data: bool) -> None:
    pool = pools.make(policy=policy, cpu_blocks=4, data=data)
    store(pool, ks(1, 2)).wait(10)
    store(pool, ks(3)).wait(10)
    before = state(pool)
    counters = dict(pool.counters)
    # 3 held, 1 slot free, 2 new keys: the only room there is would come from the
    # call's own present keys. Refused, nothing changed; the prefix stays whole.
    with pytest.raises(NoSpace, match="3 more held for this call"):
        store(pool, ks(1, 2, 3, 4, 5))
    assert state(pool) == before
    assert dict(pool.counters, stores_failed=0) == dict(counters, stores_failed=0)
    assert pool.counters["stores_failed"] == counters["stores_failed"] + 1
    assert pool.lookup(ks(1, 2, 3, 4, 5), count=False) == [Tier.CPU] * 3
    check_bytes(pool)


@pytest.mark.parametrize("data", [False, True], ids=["bookkeeping", "bytes"])
@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_only_store_makes_room_from_other_keys(pools, policy: str, data: bool) -> None:
    pool = pools.make(policy=policy, cpu_blocks=5, data=data)
    store(pool, ks(1, 2)).wait(10)
    store(pool, ks(3)).wait(10)
    store(pool, ks(9)).wait(10)  # an unrelated key: the only one the next store may evict
    op = store(pool, ks(1, 2, 3, 4, 5)).wait(10)
    assert op.error is None and op.result == {"stored": 2, "present": 3}
    assert pool.cpu.get(k(9)) is None and pool.cpu.evictions == 1
    assert pool.lookup(ks(1, 2, 3, 4, 5), count=False) == [Tier.CPU] * 5
    check_bytes(pool)


@pytest.mark.parametrize("data", [False, True], ids=["bookkeeping", "bytes"])
def test_gpu_store_without_cpu_tier_does_not_evict_its_present_keys(pools, data: bool) -> None:
    pool = pools.make(gpu_blocks=4, cpu_blocks=0, data=data)
    store(pool, ks(1, 2)).wait(10)
    store(pool, ks(3)).wait(10)
    # Free queue: [empty, 2, 1, 3]; the old store popped the empty block and key 2.
    before = state(pool)
    with pytest.raises(NoSpace):
        store(pool, ks(1, 2, 3, 4, 5))
    assert state(pool) == before
    assert pool.lookup(ks(1, 2, 3, 4, 5), count=False) == [Tier.GPU] * 3
    check_bytes(pool)


@pytest.mark.parametrize("data", [False, True], ids=["bookkeeping", "bytes"])
def test_gpu_store_without_cpu_tier_makes_room_from_other_blocks(pools, data: bool) -> None:
    pool = pools.make(gpu_blocks=5, cpu_blocks=0, data=data)
    store(pool, ks(1, 2)).wait(10)
    store(pool, ks(3)).wait(10)
    store(pool, ks(9)).wait(10)
    # Free queue: [empty, 2, 1, 3, 9]: key 2 sits nearer the head than 9, yet 9 goes.
    assert [b.block_hash for b in pool.bm.iter_free()] == [None] + ks(2, 1, 3, 9)
    op = store(pool, ks(1, 2, 3, 4, 5)).wait(10)
    assert op.error is None and op.result == {"stored": 2, "present": 3}
    assert pool.bm.get_cached(k(9)) is None
    assert pool.lookup(ks(1, 2, 3, 4, 5), count=False) == [Tier.GPU] * 5
    # The present blocks kept their place in the queue (protected, not touched).
    assert [b.block_hash for b in pool.bm.iter_free()] == ks(2, 1, 3, 5, 4)
    check_bytes(pool)


@pytest.mark.parametrize("policy", [p for p in POLICIES if "+" not in p])  # admit2 would not demote 1, 2
def test_gpu_store_overflowing_into_the_cpu_tier_keeps_its_cpu_keys(pools, policy: str) -> None:
    """Present keys in the CPU tier survive the demotions the GPU part of the store causes."""
    pool = pools.make(policy=policy, gpu_blocks=2, cpu_blocks=2, data=True)
    store(pool, ks(1, 2)).wait(10)
    store(pool, ks(8, 9)).wait(10)  # 1, 2 demoted to the CPU tier (full now)
    assert pool.lookup(ks(1, 2), count=False) == [Tier.CPU] * 2
    op = store(pool, ks(1, 2, 3, 4)).wait(10)
    # 3, 4 evict 8, 9 from the GPU tier; their demotion would need the slots of 1, 2.
    assert op.error is None and op.result == {"stored": 2, "present": 2}
    assert pool.wait_idle(10)
    assert pool.lookup(ks(1, 2, 3, 4), count=False) == [Tier.CPU, Tier.CPU, Tier.GPU, Tier.GPU]
    assert pool.counters["demotions_dropped_full"] >= 2
    check_bytes(pool)


@pytest.mark.parametrize("policy", [p for p in POLICIES if "+" not in p])
def test_clean_ahead_after_an_asynchronous_store_keeps_its_keys(pools, policy: str) -> None:
    """With bytes, a store's GPU blocks reach the free queue when its copy is done, in poll();
    the clean-ahead that demotes them then is still the store's and must not evict its keys."""
    pool = pools.make(policy=policy, gpu_blocks=2, cpu_blocks=2, data=True, clean_ahead=1)
    op = store(pool, ks(0, 1, 2, 3))  # 0, 1 into the GPU tier; the tail 2, 3 straight into the CPU tier
    assert not op.done
    op.wait(10)
    assert op.error is None and op.result == {"stored": 4, "present": 0}
    assert pool.wait_idle(10)
    # Demoting the head of the free queue (key 1) would have needed the slot of 2 or 3.
    assert pool.lookup(ks(0, 1, 2, 3), count=False) == [Tier.GPU, Tier.GPU, Tier.CPU, Tier.CPU]
    check_bytes(pool)


# ---- the tiers' primitives -------------------------------------------------------------------


def test_allocate_blocks_passes_over_protected_blocks_and_leaves_them_in_place() -> None:
    bm = BlockManager(5, BS)
    blocks, _ = bm.allocate_blocks(4)
    for b, key in zip(blocks, ks(0, 1, 2, 3)):
        bm.commit(b, key)
    bm.release(blocks)  # queue: empty(4), 0, 1, 2, 3
    protected = frozenset(ks(0, 2, 42))
    assert bm.num_free_unprotected(protected) == 3
    with pytest.raises(NoFreeBlocks):
        bm.allocate_blocks(4, protected)
    assert [b.block_id for b in bm.iter_free()] == [4, 0, 1, 2, 3] and bm.num_cached_blocks == 4
    got, evicted = bm.allocate_blocks(3, protected)
    assert [b.block_id for b in got] == [4, 1, 3]
    assert [(e.block_id, e.block_hash) for e in evicted] == [(1, k(1)), (3, k(3))]
    assert [b.block_id for b in bm.iter_free()] == [0, 2] and bm.num_free_blocks == 2
    assert bm.get_cached(k(0)) is bm.blocks[0] and bm.get_cached(k(1)) is None
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in got)


def test_allocate_blocks_protects_every_copy_of_a_protected_hash() -> None:
    bm = BlockManager(3, BS)
    a, _ = bm.allocate_blocks(2)
    bm.commit(a[0], k(1))
    bm.commit(a[1], k(1))  # a duplicate
    bm.release(a)
    assert bm.num_free_unprotected({k(1)}) == 1
    got, evicted = bm.allocate_blocks(1, {k(1)})
    assert got == [bm.blocks[2]] and evicted == []
    with pytest.raises(NoFreeBlocks):
        bm.allocate_blocks(1, [k(1)])


def test_cpu_reserve_never_picks_a_protected_victim() -> None:
    tier = CpuTier(3, LRUPolicy(3))
    for key in ks(1, 2, 3):
        (e,) = tier.reserve([key])
        tier.commit(e)
    before = (dict(tier._entries), list(tier._free_slots), list(tier.policy.victims()))
    with pytest.raises(CpuTierFull, match="2 more held for this call"):
        tier.reserve(ks(4, 5), protected={k(1), k(2)})
    assert (dict(tier._entries), list(tier._free_slots), list(tier.policy.victims())) == before
    (e4,) = tier.reserve(ks(4), protected={k(1), k(2)})
    assert tier.get(k(3)) is None and tier.get(k(1)) is not None and tier.get(k(2)) is not None


# ---- property: no store evicts a key of its own call --------------------------------------------

# Chains that share beginnings, so stores overlap the keys already held.
DOCS = [ks(*range(0, 7)), ks(0, 1, 2, 10, 11, 12, 13), ks(20, 21, 22, 23, 24, 25, 26)]

doc_slice = st.tuples(st.integers(0, len(DOCS) - 1), st.integers(0, 3), st.integers(1, 6))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), doc_slice),
        st.tuples(st.just("store"), doc_slice),
        st.tuples(st.just("lookup"), doc_slice),
        st.tuples(st.just("restore"), doc_slice),
        st.tuples(st.just("pin"), doc_slice),
        st.tuples(st.just("unpin_all"), doc_slice),
        st.tuples(st.just("request"), doc_slice),  # engine-mode allocate + free (GPU tier only)
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    policy=st.sampled_from(POLICIES),
    gpu_blocks=st.sampled_from([None, 2, 3, 5]),
    cpu_blocks=st.integers(0, 6),
    clean_ahead=st.integers(0, 3),
    data=st.booleans(),
    steps=ops,
)
def test_no_store_evicts_a_key_of_its_own_call(pools, policy, gpu_blocks, cpu_blocks, clean_ahead, data,
                                                steps) -> None:
    pool = pools.make(policy=policy, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks, data=data,
                      clean_ahead=clean_ahead)
    try:
        for n, (what, (d, start, length)) in enumerate(steps):
            hashes = DOCS[d][start : start + length]
            if what == "store":
                before = state(pool)
                try:
                    op = store(pool, hashes)
                except NoSpace:
                    assert state(pool) == before, "a refused store changed the pool"
                    continue
                missing = [key for key in hashes if key not in held_keys(pool)]
                assert not missing, f"the store evicted keys of its own call: {missing}"
                op.wait(10)
                assert op.error is None
                assert pool.wait_idle(10)
                missing = [key for key in hashes if key not in held_keys(pool)]
                assert not missing, f"the store's completion evicted keys of its call: {missing}"
                # Nothing has run since: the stored keys are a reachable prefix.
                assert len(pool.lookup(hashes, count=False)) == len(hashes)
            elif what == "lookup":
                pool.lookup(hashes)
            elif what == "restore":
                dst = BlockLayout.contiguous(len(hashes), BB) if data else None
                op = pool.restore(hashes, dst, list(range(len(hashes)))).wait(10)
                if data:
                    for i in range(len(op.result["tiers"])):
                        assert torch.equal(dst.slab()[i], content(hashes[i]))
            elif what == "pin":
                pool.pin("o", hashes[:2])
            elif what == "unpin_all":
                pool.unpin_all("o")
            elif gpu_blocks:
                rid = f"r{n}"
                try:
                    op = pool.allocate(rid, hashes, len(hashes) * BS)
                except NoSpace:
                    continue
                op.wait(10)
                assert op.error is None
                gpu = pool._test_gpu  # type: ignore[attr-defined]
                if gpu is not None:  # the engine computes the misses
                    for pos in range(len(op.result["tiers"]), len(hashes)):
                        gpu.slab()[op.result["block_ids"][pos]] = content(hashes[pos])
                pool.free(rid)
            assert pool.wait_idle(10)
            check_bytes(pool)
    finally:
        pool.unpin_all("o")
        pool.wait_idle(10)
