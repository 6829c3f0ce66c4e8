"""The key journal (kvtier.tiers.pool.journal): cursors, the ring's bound, and the events a pool's tiers make.

The journal's agreement with what a pool holds under random traffic is an
invariant of tests/tiers/test_pool_state_machine.py; here are its reading
rules and the cases a router relies on, one by one.
"""

from __future__ import annotations

import pytest

from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import PoolSpec, TieredPool
from kvtier.tiers.pool.journal import REMOVED, STORED, KeyJournal
from kvtier.tiers.transfer import ThreadTransferEngine

BB = 32


def keys(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def test_since_reads_in_order_in_pages_and_says_when_events_were_lost() -> None:
    j = KeyJournal(4)
    assert j.cursor == 0 and j.since(0, 10) == ([], 0, False)
    for k in keys(6):
        j.record(STORED, k)
    assert j.cursor == 6
    # Events 1 and 2 left the ring: a reader at 0 gets 3..6 and is told it missed some.
    assert j.since(0, 10) == ([(STORED, k) for k in keys(6)[2:]], 6, True)
    assert j.since(2, 10) == ([(STORED, k) for k in keys(6)[2:]], 6, False)
    assert j.since(3, 2) == ([(STORED, k) for k in keys(6)[3:5]], 5, False)
    assert j.since(6, 10) == ([], 6, False)
    # A cursor past the end (from a daemon before a restart): nothing here, flagged, follow from now.
    assert j.since(9, 10) == ([], 6, True)


def test_bad_reads_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one event"):
        KeyJournal(0)
    j = KeyJournal(2)
    with pytest.raises(ValueError, match="cursor >= 0"):
        j.since(-1, 1)
    with pytest.raises(ValueError, match="max_events >= 1"):
        j.since(0, 0)


def make_pool(cpu_blocks: int, clean_ahead_blocks: int) -> tuple[TieredPool, ThreadTransferEngine]:
    engine = ThreadTransferEngine()
    p = TieredPool(PoolSpec("j", 4, BB), cpu_blocks=cpu_blocks, policy="lru", transfer=engine,
                   cpu_storage=BlockLayout.contiguous(cpu_blocks, BB), clean_ahead_blocks=clean_ahead_blocks,
                   journal_events=1000)
    p.attach_gpu(BlockLayout.contiguous(4, BB))
    return p, engine


@pytest.fixture
def pool() -> TieredPool:
    p, engine = make_pool(cpu_blocks=4, clean_ahead_blocks=0)
    yield p
    p.close()
    engine.close()


def read(pool: TieredPool, cursor: int) -> tuple[list[tuple[int, bytes]], int]:
    pool.wait_idle(10)
    events, nxt, lost = pool.journal.since(cursor, 1000)
    assert not lost
    return events, nxt


def test_a_pool_reports_stores_and_evictions(pool: TieredPool) -> None:
    src = BlockLayout.contiguous(4, BB)
    first = keys(4, 1)
    pool.store(first, src, [0, 1, 2, 3]).wait(10)
    events, cur = read(pool, 0)
    assert events == [(STORED, k) for k in first]
    # Four more: the GPU tier (4 blocks) evicts the first four before any CPU copy exists (no
    # clean-ahead here): each leaves and comes back with its demotion, in that order.
    second = keys(4, 2)
    pool.store(second, src, [0, 1, 2, 3]).wait(10)
    events, cur = read(pool, cur)
    for k in first:
        assert [e for e in events if e[1] == k] == [(REMOVED, k), (STORED, k)]
    assert [e for e in events if e[1] in second] == [(STORED, k) for k in second]
    # Four more again: the CPU tier (4 slots) must let the first four go for good.
    third = keys(4, 3)
    pool.store(third, src, [0, 1, 2, 3]).wait(10)
    events, cur = read(pool, cur)
    for k in first:
        assert [e for e in events if e[1] == k] == [(REMOVED, k)]
        assert pool.lookup([k], count=False) == []


def test_a_block_cleaned_ahead_changes_tiers_without_an_event() -> None:
    pool, engine = make_pool(cpu_blocks=8, clean_ahead_blocks=4)
    try:
        src = BlockLayout.contiguous(4, BB)
        first = keys(4, 1)
        pool.store(first, src, [0, 1, 2, 3]).wait(10)
        _, cur = read(pool, 0)  # clean-ahead has copied them to the CPU tier by now
        pool.store(keys(4, 2), src, [0, 1, 2, 3]).wait(10)
        events, _ = read(pool, cur)
        assert events == [(STORED, k) for k in keys(4, 2)]
        assert all(pool.lookup([k], count=False) for k in first)
    finally:
        pool.close()
        engine.close()


def test_detaching_the_gpu_tier_removes_what_only_it_held(pool: TieredPool) -> None:
    src = BlockLayout.contiguous(4, BB)
    ks = keys(2, 4)
    pool.store(ks, src, [0, 1]).wait(10)
    _, cur = read(pool, 0)
    pool.detach_gpu()
    events, cur = read(pool, cur)
    assert events == [(REMOVED, k) for k in ks]

