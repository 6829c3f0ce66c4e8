"""``clear`` and ``clear_matching`` while copies are in flight (a GPU's copy streams; here a stepped engine).

A clear drops every block nobody holds. A block whose copy into the CPU tier
is still in flight goes when the copy lands, unless something relied on it
first: a pin, a read, a store that acknowledged it as present, or an
eviction that left it the only copy. Found on an H100: a router following
the key journal still held four blocks after ``clear``. The pool state
machine (test_pool_state_machine.py) clears at random points too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import PoolSpec, TieredPool
from kvtier.tiers.pool.journal import STORED
from tests.stepped_engine import SteppedEngine

BB = 32


def keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


@pytest.fixture
def stepped() -> Iterator[tuple[TieredPool, SteppedEngine]]:
    engine = SteppedEngine()
    pool = TieredPool(PoolSpec("c", 4, BB), cpu_blocks=8, policy="lru", transfer=engine,
                      cpu_storage=BlockLayout.contiguous(8, BB), clean_ahead_blocks=4, journal_events=1000)
    pool.attach_gpu(BlockLayout.contiguous(4, BB))
    yield pool, engine
    pool.close()
    engine.close()


def store_with_demotions_in_flight(pool: TieredPool, engine: SteppedEngine, ks: list[bytes]) -> None:
    """Store ``ks``, run the store's copy: the pool then demotes them ahead, at low priority, held back."""
    src = BlockLayout.contiguous(len(ks), BB)
    for i, k in enumerate(ks):
        src.slab()[i].fill_(k[1] + 1)
    op = pool.store(ks, src, list(range(len(ks))))
    engine.run(high=False, n=1)
    pool.poll()
    assert op.done and op.error is None
    assert engine.queues[False], "no demotion in flight: the test would prove nothing"


def settle(pool: TieredPool, engine: SteppedEngine) -> None:
    while engine.queued or pool.busy:
        engine.run(high=True, n=10)
        engine.run(high=False, n=10)
        pool.poll()


def journal_view(pool: TieredPool) -> set[bytes]:
    held: set[bytes] = set()
    for kind, key in pool.journal.since(0, 1000)[0]:
        (held.add if kind == STORED else held.discard)(key)
    return held


@pytest.mark.parametrize("one_tenant", [False, True], ids=["clear", "clear_matching"])
def test_a_clear_while_demotions_are_in_flight_leaves_nothing_held(stepped, one_tenant: bool) -> None:  # type: ignore[no-untyped-def]
    pool, engine = stepped
    ks = keys(4, 6)
    store_with_demotions_in_flight(pool, engine, ks)
    # Four GPU blocks now, their four CPU copies when they land. A tenant's clear names the CPU
    # keys its quota policy knows: none of these yet.
    cleared = pool.clear_matching(lambda key: key[0] == 6, cpu_keys=()) if one_tenant else pool.clear()
    assert cleared == 8
    settle(pool, engine)
    assert pool.lookup(ks, count=False) == [] and len(pool.cpu) == 0
    assert journal_view(pool) == set()


def test_a_store_acknowledged_before_the_copy_lands_keeps_the_block(stepped) -> None:  # type: ignore[no-untyped-def]
    pool, engine = stepped
    ks = keys(4, 7)
    store_with_demotions_in_flight(pool, engine, ks)
    pool.clear()
    # The GPU copies went with the clear; the CPU copies are still being written. A store of the
    # same keys counts them as present and is acknowledged when they land: they must stay.
    src = BlockLayout.contiguous(4, BB)
    op = pool.store(ks, src, [0, 1, 2, 3])
    assert op.result == {"stored": 0, "present": 4}
    settle(pool, engine)
    assert op.done and op.error is None
    assert len(pool.lookup(ks, count=False)) == 4
    assert journal_view(pool) == set(ks)
    restored = BlockLayout.contiguous(4, BB)
    rop = pool.restore(ks, restored, [0, 1, 2, 3])
    settle(pool, engine)
    assert rop.error is None
    assert [int(restored.slab()[i][0]) for i in range(4)] == [k[1] + 1 for k in ks]


def test_a_pin_before_the_copy_lands_keeps_the_block(stepped) -> None:  # type: ignore[no-untyped-def]
    pool, engine = stepped
    ks = keys(2, 8)
    store_with_demotions_in_flight(pool, engine, ks)
    pool.clear()
    assert pool.cpu.get(ks[0]) is not None and not pool.cpu.get(ks[0]).ready
    entry = pool.cpu.get(ks[0])
    pool.cpu.pin(entry)  # as a lookup with pin=True would, were the entry ready
    settle(pool, engine)
    assert pool.cpu.get_ready(ks[0]) is not None and pool.cpu.get_ready(ks[1]) is None
    pool.cpu.unpin(entry)
    assert journal_view(pool) == {ks[0]}


def test_a_block_a_cleared_demotion_still_reads_is_not_handed_out_until_it_is_read(stepped) -> None:  # type: ignore[no-untyped-def]
    # clear took the blocks' hashes, so an allocation reusing them evicts nothing: it must still
    # wait for the demotion reading them, or the engine overwrites what is being copied.
    # Found by the state machine's clear rule: a CPU entry with another block's bytes.
    pool, engine = stepped
    store_with_demotions_in_flight(pool, engine, keys(4, 9))
    pool.clear()
    op = pool.allocate("r", keys(4, 10), 16)
    assert sorted(op.result["block_ids"]) == [0, 1, 2, 3] and op.result["num_gpu_hits"] == 0
    assert not op.done
    engine.run(high=False, n=10)
    pool.poll()
    assert op.done and op.error is None
    assert pool.cpu.get(keys(1, 9)[0]) is None  # and the demotion's copies went, as the clear said


def test_an_append_onto_such_a_block_waits_too(stepped) -> None:  # type: ignore[no-untyped-def]
    pool, engine = stepped
    store_with_demotions_in_flight(pool, engine, keys(4, 11))
    pool.clear()
    assert pool.allocate("r", [], 0).done  # no blocks yet
    op = pool.append("r", 4, keys(1, 12))
    assert len(op.result["new_block_ids"]) == 1 and not op.done
    engine.run(high=False, n=10)
    pool.poll()
    assert op.done and op.error is None
