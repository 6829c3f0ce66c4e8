"""A restored block's CPU copy is a spare while the GPU tier holds the block (``chain+session``).

The CPU tier is inclusive: a restore keeps the CPU copy. Under session hints that copy is the first
victim while the GPU tier keeps the block, and the GPU tier demotes the block again when it evicts it,
so the CPU tier's room goes to blocks held nowhere else. Bookkeeping pools, real pool code.
"""

from __future__ import annotations

from kvtier.tiers.hints import RequestHints
from kvtier.tiers.pool import PoolSpec, Tier, TieredPool
from kvtier.tiers.policies.session import SessionWrapper

BLOCK_TOKENS = 4


def keys(name: str, n: int = 2) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(n)]


def run(pool: TieredPool, name: str, at_s: float) -> list[str]:
    hashes = keys(name)
    op = pool.allocate("r", hashes, len(hashes) * BLOCK_TOKENS, hints=RequestHints(session=name.encode(), at_s=at_s))
    assert op.error is None
    pool.free("r")
    return list(op.result["tiers"])


def held(pool: TieredPool, name: str) -> list[Tier]:
    return pool.lookup(keys(name), count=False)


def test_a_spare_makes_room_before_any_block_held_nowhere_else_and_comes_back_when_the_gpu_evicts_it() -> None:
    pool = TieredPool(PoolSpec("t", BLOCK_TOKENS, 64), cpu_blocks=8, policy="chain+session", transfer=None,
                      data=False, clean_ahead_blocks=0)
    pool.attach_gpu(num_blocks=6)
    policy = pool.cpu.policy
    assert isinstance(policy, SessionWrapper)
    policy.admission = False  # every demotion lands: the test is about which block makes room
    for t, name in enumerate("abcdef"):  # a, b, c demoted as d, e, f arrive: the CPU tier holds a, b, c
        run(pool, name, t)
    assert run(pool, "a", 6) == ["cpu", "cpu"]  # restored; d demoted: the CPU tier is full (a b c d)
    assert len(pool.cpu) == 8 and list(policy.spares._spares) == keys("a")[::-1]
    run(pool, "g", 7)  # the GPU tier evicts e: its demotion needs two slots
    assert held(pool, "a") == [Tier.GPU, Tier.GPU]  # a's CPU copies made the room...
    for name in "bcde":  # ...so every other block is still held
        assert held(pool, name) == [Tier.CPU, Tier.CPU]
    demotions = pool.counters.demotions
    run(pool, "h", 8)  # evicts f
    run(pool, "i", 9)  # evicts a from the GPU tier: demoted again
    assert pool.counters.demotions == demotions + 4
    assert held(pool, "a") == [Tier.CPU, Tier.CPU]
    assert not policy.spares and not policy.spares._above


def test_without_hints_a_restored_copy_stays_where_it_is() -> None:
    pool = TieredPool(PoolSpec("t", BLOCK_TOKENS, 64), cpu_blocks=8, policy="chain+session", transfer=None,
                      data=False, clean_ahead_blocks=0)
    pool.attach_gpu(num_blocks=6)
    for name in "abcdefa":
        op = pool.allocate("r", keys(name), 2 * BLOCK_TOKENS)
        pool.free("r")
    assert op.result["tiers"] == ["cpu", "cpu"]
    assert not pool.cpu.policy.spares  # type: ignore[attr-defined]
    assert pool.cpu.get(keys("a")[0]) is not None
