"""The pool with a remote tier: two pools (two daemons' worth) sharing one Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.testing import redis_servers as rs
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import PoolSpec, Tier, TieredPool
from kvtier.tiers.remote.tier import RemoteTier, RemoteTierSettings
from kvtier.tiers.transfer import ThreadTransferEngine

pytestmark = pytest.mark.skipif(not rs.have_redis(), reason=rs.MISSING_REASON)

BLOCK = 4096
FAST = RemoteTierSettings(timeout_s=0.5, connect_timeout_s=0.5, retry_initial_s=0.02, retry_max_s=0.2,
                          health_interval_s=0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    srv = rs.RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


def _random_layout(n: int) -> BlockLayout:
    layout = BlockLayout.contiguous(n, BLOCK)
    layout.slab().copy_(torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8))
    return layout


def make_pool(url: str, *, gpu_blocks: int = 4, cpu_blocks: int = 4) -> TieredPool:
    remote = RemoteTier(url, b"test-pool", BLOCK, FAST, secret=rs.SECRET)
    assert remote.wait_available(5.0)
    pool = TieredPool(PoolSpec("p", 16, BLOCK), cpu_blocks=cpu_blocks, policy="lru", transfer=ThreadTransferEngine(),
                      cpu_storage=BlockLayout.contiguous(cpu_blocks, BLOCK), clean_ahead_blocks=0, remote=remote)
    pool.attach_gpu(BlockLayout.contiguous(gpu_blocks, BLOCK))
    return pool


def store_in_chunks(pool: TieredPool, hashes: list[bytes], src: BlockLayout, slots: range, chunk: int = 4) -> None:
    for i in range(0, len(hashes), chunk):
        op = pool.store(hashes[i : i + chunk], src, slots[i : i + chunk]).wait(5)
        assert op.error is None


def keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def test_block_stored_through_a_restores_byte_exact_through_b(server: object) -> None:
    server.client().flushall()
    a, b = make_pool(server.url), make_pool(server.url)
    src = BlockLayout.contiguous(12, BLOCK)
    src.slab().copy_(torch.randint(0, 256, (12, BLOCK), dtype=torch.uint8))
    first = keys(4, 1)
    a.store(first, src, range(4)).wait(5)
    # Push `first` out of A's GPU tier (4 blocks) and CPU tier (4 blocks): CPU
    # evictions are written back to Redis.
    store_in_chunks(a, keys(8, 2), src, range(4, 12))
    assert a.remote.flush(5.0)
    assert a.counters["remote_write_backs"] >= 4
    assert a.lookup(first, count=False) == [Tier.REMOTE] * 4

    dst = BlockLayout.contiguous(4, BLOCK)
    dst.slab().fill_(0xA5)
    op = b.restore(first, dst, range(4)).wait(5)
    assert op.error is None and op.result["tiers"] == ["remote"] * 4
    assert torch.equal(dst.slab(), src.slab()[:4])
    assert b.counters["hit_blocks_remote"] == 4
    # Fetched blocks now sit in B's CPU tier: the next restore is a CPU hit.
    assert b.lookup(first, count=False) == [Tier.CPU] * 4
    for p in (a, b):
        p.remote.close(2.0)


def test_corrupt_remote_value_ends_the_prefix_never_a_wrong_block(server: object) -> None:
    server.client().flushall()
    a, b = make_pool(server.url), make_pool(server.url)
    src = BlockLayout.contiguous(12, BLOCK)
    src.slab().copy_(torch.randint(0, 256, (12, BLOCK), dtype=torch.uint8))
    first = keys(4, 3)
    a.store(first, src, range(4)).wait(5)
    store_in_chunks(a, keys(8, 4), src, range(4, 12))
    assert a.remote.flush(5.0)
    redis = server.client()
    k = a.remote.key(first[2])
    value = bytearray(redis.get(k))
    value[-1] ^= 0xFF
    redis.set(k, bytes(value))
    dst = BlockLayout.contiguous(4, BLOCK)
    dst.slab().fill_(0x5A)
    op = b.restore(first, dst, range(4)).wait(5)
    assert op.result["tiers"] == ["remote", "remote"]
    assert torch.equal(dst.slab()[:2], src.slab()[:2])
    assert torch.all(dst.slab()[2:] == 0x5A)
    assert b.remote.stats()["remote_unauthentic"] == 1  # a flipped payload bit fails the MAC
    for p in (a, b):
        p.remote.close(2.0)


def test_remote_down_pool_keeps_serving(tmp_path: Path) -> None:
    srv = rs.RedisServer(tmp_path).start()
    pool = make_pool(srv.url)
    srv.kill()
    store_in_chunks(pool, keys(12, 5), src_big := _random_layout(12), range(12))  # write-backs dropped
    # The writers find out on their own time (the engine path never waits):
    # give them a moment to try, fail and count.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        st = pool.remote.stats()
        if st["writes_dropped_unavailable"] + st["writes_failed"] + st["writes_dropped_full"] >= 1:
            break
        time.sleep(0.05)
    assert st["writes_done"] == 0 and st["writes_dropped_unavailable"] + st["writes_failed"] + st["writes_dropped_full"] >= 1, st
    src = src_big
    dst = BlockLayout.contiguous(8, BLOCK)
    op = pool.restore(keys(12, 5)[8:], dst, range(4)).wait(5)
    assert op.result["tiers"] == ["gpu"] * 4
    assert torch.equal(dst.slab()[:4], src.slab()[8:])
    assert pool.lookup(keys(12, 5)[:4], count=False) == []  # evicted from CPU, Redis is down: a miss
    pool.remote.close(1.0)


def test_pinning_a_remote_run_fetches_it_into_the_cpu_tier_and_holds_it_there(server: object) -> None:
    server.client().flushall()
    a, b = make_pool(server.url), make_pool(server.url, cpu_blocks=8)
    src = _random_layout(12)
    first = keys(4, 3)
    a.store(first, src, range(4)).wait(5)
    store_in_chunks(a, keys(8, 4), src, range(4, 12))  # pushes `first` out of A into Redis
    assert a.remote.flush(5.0)
    assert b.lookup(first, count=False) == [Tier.REMOTE] * 4
    # B pins what only Redis has: fetched, pinned in B's CPU tier, reported as remote hits.
    assert b.pin("engine", first) == [Tier.REMOTE] * 4
    assert b.num_pinned() == 4 and b.lookup(first, count=False) == [Tier.CPU] * 4
    # Pinned: 16 newer blocks through B's 4 GPU and 8 CPU blocks do not evict them.
    store_in_chunks(b, keys(8, 5), src, range(4, 12))
    store_in_chunks(b, keys(8, 6), src, range(4, 12))
    assert b.lookup(keys(8, 5)[:1], count=False) != [Tier.GPU]  # the newer blocks did push older ones out
    assert b.lookup(first, count=False) == [Tier.CPU] * 4
    dst = BlockLayout.contiguous(4, BLOCK)
    op = b.restore(first, dst, range(4)).wait(5)
    assert op.error is None and op.result["tiers"] == ["cpu"] * 4
    assert torch.equal(dst.slab(), src.slab()[:4])
    assert b.unpin("engine", first) == 4 and b.num_pinned() == 0
    for p in (a, b):
        p.remote.close(2.0)


def test_a_remote_run_longer_than_the_cpu_tier_is_fetched_only_as_far_as_the_tier_can_take(server: object) -> None:
    """Found while deriving the hostile stress scenario's memory bound: a restore (or a pinning lookup) of a
    run the remote tier holds fetched the whole run into memory (up to a request's 65,536 blocks), then
    could not reserve it in a CPU tier smaller than the run and pulled nothing. Now it fetches at most the
    CPU tier's size: the daemon's memory for a fetch is bounded by its configuration, and the part that
    fits comes back."""
    server.client().flushall()
    a, b = make_pool(server.url), make_pool(server.url)  # 4 GPU + 4 CPU blocks each
    src = BlockLayout.contiguous(20, BLOCK)
    src.slab().copy_(torch.randint(0, 256, (20, BLOCK), dtype=torch.uint8))
    first = keys(12, 5)
    store_in_chunks(a, first + keys(8, 6), src, range(20))
    assert a.remote.flush(5.0)
    assert b.lookup(first, count=False) == [Tier.REMOTE] * 12
    fetched: list[int] = []
    real_fetch = b.remote.fetch

    def spy(hashes: list[bytes]) -> list[object]:
        fetched.append(len(hashes))
        return real_fetch(hashes)

    b.remote.fetch = spy  # type: ignore[method-assign]
    dst = BlockLayout.contiguous(12, BLOCK)
    op = b.restore(first, dst, range(12)).wait(5)
    assert op.error is None
    assert max(fetched) <= 4, fetched  # never more than the CPU tier holds
    got = len(op.result["tiers"])
    assert got == 4 and op.result["tiers"] == ["remote"] * 4
    assert torch.equal(dst.slab()[:got], src.slab()[:got])
    for p in (a, b):
        p.remote.close(2.0)
