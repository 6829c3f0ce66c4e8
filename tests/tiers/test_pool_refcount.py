"""A dropped pool is freed by reference count, its tiers' memory with it (issue 36, item 1).

The pool's parts used to hold the whole ``TieredPool`` (and ops, finished
copies and the key journal's observers held it too), so a dropped pool sat
in reference cycles until the cyclic collector ran, with its CPU tier's
memory: the daemon ran a full ``gc.collect()`` on its loop after closing a
pool. Now no part holds the facade and finished copies drop their
callbacks: each test here drives a pool through its verbs, closes it, drops
it with the cyclic collector off, and checks that the pool, its CPU tier and
the tiers' memory are gone at once.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.persistent_arena import ArenaDirectory
from kvtier.tiers.pool import PoolSpec, Tier, TieredPool
from kvtier.tiers.transfer import ThreadTransferEngine
from kvtier.tools.replay.nodes import SimulatedRemoteTier

BS = 4
BB = 128
LAYOUT = {"mode": "store", "block_size": BS, "block_bytes": BB, "dtype": "bfloat16", "hash_algo": "xxh3_128"}


def keys(name: str, n: int) -> list[bytes]:
    return [f"{name}:{i}".encode().ljust(16, b".") for i in range(n)]


@contextmanager
def no_cyclic_collector() -> Iterator[None]:
    gc.collect()  # what earlier tests left
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def alive(refs: dict[str, weakref.ref[Any]]) -> list[str]:
    return [name for name, ref in refs.items() if ref() is not None]


def referrers_of(refs: dict[str, weakref.ref[Any]]) -> str:
    """What still holds the survivors (for the failure message)."""
    lines = []
    for name in alive(refs):
        obj = refs[name]()
        lines += [f"{name} <- {type(r).__name__}: {str(r)[:120]}" for r in gc.get_referrers(obj)
                  if not isinstance(r, dict) or r.get("__name__") != __name__]
        del obj
    return "\n".join(lines)


def drive_store_mode(pool: TieredPool, src: BlockLayout) -> None:
    a, b = keys("a", 12), keys("b", 12)
    pool.store(a, src, range(12)).wait(10)
    pool.store(b, src, range(12, 24)).wait(10)  # evicts a's blocks from the GPU tier: demotions
    assert len(pool.lookup(a + b)) == 24  # a's blocks demoted into the CPU tier, b's in the GPU tier
    assert pool.counters.demotions > 0
    pool.learn()
    pool.restore(a + b, src, range(24)).wait(10)
    pool.pin("owner", a[:4])
    pool.unpin_all("owner")
    lent = pool.borrow(b[:4])
    assert lent is not None
    lent.release()
    pool.clean_when_idle()
    pool.clear()


def test_a_closed_store_mode_pool_with_a_journal_is_freed_by_reference_count() -> None:
    with no_cyclic_collector():
        engine = ThreadTransferEngine()
        cpu_storage = BlockLayout.contiguous(32, BB)
        gpu = BlockLayout.contiguous(16, BB)
        src = BlockLayout.contiguous(24, BB)
        pool = TieredPool(PoolSpec("p", BS, BB), cpu_blocks=32, policy="chain", transfer=engine,
                          cpu_storage=cpu_storage, clean_ahead_blocks=4, journal_events=1000)
        pool.attach_gpu(gpu)
        drive_store_mode(pool, src)
        assert pool.journal is not None and pool.journal.cursor > 0
        pool.close()
        engine.close(5.0)  # as the daemon closes a pool's (an idle copy thread holds its last job)
        refs = {"pool": weakref.ref(pool), "cpu tier": weakref.ref(pool.cpu), "block manager": weakref.ref(pool.bm),
                "CPU tier memory": weakref.ref(cpu_storage), "GPU tier memory": weakref.ref(gpu)}
        del pool, cpu_storage, gpu
        assert alive(refs) == [], referrers_of(refs)


def test_a_closed_engine_mode_pool_is_freed_by_reference_count() -> None:
    with no_cyclic_collector():
        engine = ThreadTransferEngine()
        cpu_storage = BlockLayout.contiguous(32, BB)
        gpu = BlockLayout.contiguous(8, BB)
        pool = TieredPool(PoolSpec("p", BS, BB), cpu_blocks=32, policy="lru", transfer=engine,
                          cpu_storage=cpu_storage, clean_ahead_blocks=2, journal_events=100, defer_learning=True)
        pool.attach_gpu(gpu)
        for i in range(4):  # each request evicts the last one's blocks: demotions, then restores
            pool.allocate(f"r{i}", keys(f"x{i % 2}", 6), 6 * BS).wait(10)
            pool.append(f"r{i}", BS, keys(f"y{i}", 1)).wait(10)
            pool.free(f"r{i}")
            pool.learn()
        assert pool.counters.restores > 0
        pool.detach_gpu()
        pool.attach_gpu(gpu)
        pool.close()
        engine.close(5.0)  # as the daemon closes a pool's (an idle copy thread holds its last job)
        refs = {"pool": weakref.ref(pool), "cpu tier": weakref.ref(pool.cpu),
                "CPU tier memory": weakref.ref(cpu_storage), "GPU tier memory": weakref.ref(gpu)}
        del pool, cpu_storage, gpu
        assert alive(refs) == [], referrers_of(refs)


def test_a_closed_bookkeeping_pool_with_a_remote_tier_is_freed_by_reference_count() -> None:
    with no_cyclic_collector():
        remote = SimulatedRemoteTier()
        pool = TieredPool(PoolSpec("p", BS, BB), cpu_blocks=4, policy="lru", data=False, remote=remote,
                          clean_ahead_blocks=2, journal_events=100)
        pool.attach_gpu(num_blocks=4)
        chain = keys("c", 12)
        for start in range(0, 12, 4):
            pool.store(chain[start:start + 4], None, range(4)).wait(1)  # the CPU tier evicts: write-backs
        assert pool.counters.remote_write_backs > 0
        pool.restore(chain, None, range(12)).wait(1)  # fetched back from the remote tier
        pool.close()
        refs = {"pool": weakref.ref(pool), "cpu tier": weakref.ref(pool.cpu)}
        del pool
        assert alive(refs) == [], referrers_of(refs)
        assert remote.exists_prefix(chain[:1]) == 1  # the shared remote tier is not the pool's to drop


def test_a_closed_pool_that_adopted_an_arena_is_freed_by_reference_count(tmp_path: Path) -> None:
    endpoint = "ipc:///run/kvtier-test/kvtierd.sock"
    first = ArenaDirectory(tmp_path, endpoint).open("p", LAYOUT, 16, BB, pin=False)
    engine = ThreadTransferEngine()
    pool = TieredPool(PoolSpec("p", BS, BB), cpu_blocks=16, transfer=engine, cpu_storage=first.layout,
                      journal_events=100)
    pool.attach_arena(first)
    pool.store(keys("p", 8), BlockLayout.contiguous(8, BB), range(8)).wait(10)
    pool.close()
    engine.close(5.0)
    first.close(remove=False)
    del pool, first
    with no_cyclic_collector():
        arena = ArenaDirectory(tmp_path, endpoint).open("p", LAYOUT, 16, BB, pin=False)
        assert arena.opened.state == "adopted"
        engine = ThreadTransferEngine()
        pool = TieredPool(PoolSpec("p", BS, BB), cpu_blocks=16, transfer=engine, cpu_storage=arena.layout,
                          journal_events=100)
        woken: list[int] = []
        pool.attach_arena(arena, lambda: woken.append(1))
        assert pool.lookup(keys("p", 8)) == [Tier.CPU] * 8  # adopted; verified by the lookup or the thread
        pool.poll()
        pool.close()
        engine.close(5.0)  # as the daemon closes a pool's (an idle copy thread holds its last job)
        refs = {"pool": weakref.ref(pool), "cpu tier": weakref.ref(pool.cpu), "arena": weakref.ref(arena),
                "CPU tier memory": weakref.ref(arena.layout)}
        arena.close(remove=True)
        del pool, arena
        assert alive(refs) == [], referrers_of(refs)
