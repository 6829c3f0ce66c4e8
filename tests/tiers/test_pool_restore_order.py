"""A restore records its CPU-tier hits tail first, so a recency policy keeps a restored chain's head.

Before the fix the hits went in prefix order: under ``lru`` the head of a restored chain became
its oldest entry, the next eviction took it, and the rest of the chain was unreachable (hits stop
at the first missing block).
"""

from __future__ import annotations

import pytest

from kvtier.tiers.pool import PoolSpec, Tier, TieredPool

BLOCK_TOKENS = 4


def keys(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(n)]


def bookkeeping_pool(policy: str, gpu_blocks: int, cpu_blocks: int) -> TieredPool:
    pool = TieredPool(PoolSpec("t", BLOCK_TOKENS, 64), cpu_blocks=cpu_blocks, policy=policy, transfer=None,
                      data=False, clean_ahead_blocks=0)
    pool.attach_gpu(num_blocks=gpu_blocks)
    return pool


def run(pool: TieredPool, hashes: list[bytes]) -> list[str]:
    op = pool.allocate("r", hashes, len(hashes) * BLOCK_TOKENS)
    assert op.error is None
    pool.free("r")
    return list(op.result["tiers"])


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_restored_chain_keeps_its_head_through_one_eviction(policy: str) -> None:
    pool = bookkeeping_pool(policy, gpu_blocks=4, cpu_blocks=4)
    a = keys("a", 4)
    run(pool, a)
    run(pool, keys("b", 4))  # a demoted: the CPU tier is full of a
    assert pool.lookup(a, count=False) == [Tier.CPU] * 4
    assert run(pool, a) == ["cpu"] * 4  # restored: four CPU-tier hits
    run(pool, keys("c", 4))  # a leaves the GPU tier; its CPU copies stay (inclusive)
    # One more block demoted into the full CPU tier: exactly one of a's blocks is evicted.
    run(pool, keys("d", 1))
    assert pool.stats()["cpu_evictions"] == 1
    # The tail went, not the head: three of four blocks still hit.
    assert pool.lookup(a, count=False) == [Tier.CPU] * 3
