"""The pool with a disk tier: CPU-tier evictions spill to a directory and come back byte-exact."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from kvtier.tiers.disk_settings import DiskTierSettings
from kvtier.tiers.disk_tier import DiskTier
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import PoolSpec, Tier, TieredPool
from kvtier.tiers.transfer import ThreadTransferEngine

BLOCK = 8192
FAST = DiskTierSettings(index_sync_interval_s=0.05, error_backoff_s=0.2, reader_threads=3)


def make_pool(root: Path, *, gpu_blocks: int = 4, cpu_blocks: int = 4, disk_blocks: int = 64,
              policy: str = "lru", **disk_kw: object) -> TieredPool:
    disk = DiskTier(root, "p", {"layout": "test"}, block_bytes=BLOCK, capacity_blocks=disk_blocks,
                    settings=disk_kw.pop("settings", FAST), **disk_kw)  # type: ignore[arg-type]
    assert disk.wait_ready(5.0)
    pool = TieredPool(PoolSpec("p", 16, BLOCK), cpu_blocks=cpu_blocks, policy=policy,
                      transfer=ThreadTransferEngine(), cpu_storage=BlockLayout.contiguous(cpu_blocks, BLOCK),
                      clean_ahead_blocks=0, disk=disk)
    if gpu_blocks:
        pool.attach_gpu(BlockLayout.contiguous(gpu_blocks, BLOCK))
    return pool


def close(pool: TieredPool) -> None:
    pool.close(5.0)
    assert pool.disk is not None
    pool.disk.close(5.0)


@pytest.fixture
def src() -> BlockLayout:
    layout = BlockLayout.contiguous(24, BLOCK)
    layout.slab().copy_(torch.randint(0, 256, (24, BLOCK), dtype=torch.uint8))
    return layout


def keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def spill(pool: TieredPool, src: BlockLayout, first: list[bytes]) -> None:
    """Store ``first`` from src slots 0.., then 8 more blocks, so ``first`` leaves GPU and CPU tiers for the disk."""
    assert pool.store(first, src, range(len(first))).wait(5).error is None
    more = keys(8, 99)
    for i in range(0, 8, 4):
        assert pool.store(more[i:i + 4], src, range(16 + i, 20 + i)).wait(5).error is None
    assert pool.disk is not None and pool.disk.flush(5.0)


def test_evicted_blocks_restore_byte_exact_from_disk(tmp_path: Path, src: BlockLayout) -> None:
    pool = make_pool(tmp_path)
    first = keys(4, 1)
    spill(pool, src, first)
    assert pool.counters["disk_write_backs"] >= 4
    assert pool.lookup(first, count=False) == [Tier.DISK] * 4

    dst = BlockLayout.contiguous(4, BLOCK)
    dst.slab().fill_(0xA5)
    op = pool.restore(first, dst, range(4)).wait(5)
    assert op.error is None and op.result["tiers"] == ["disk"] * 4
    assert torch.equal(dst.slab(), src.slab()[:4])
    assert pool.counters["hit_blocks_disk"] == 4
    stats = pool.stats()["disk"]
    assert stats["disk_hits"] == 4 and stats["bytes_read"] == 4 * BLOCK
    # Read blocks sit in the CPU tier now: the next lookup is a CPU hit.
    assert pool.lookup(first, count=False) == [Tier.CPU] * 4
    close(pool)


def test_disk_blocks_survive_a_new_pool_on_the_same_directory(tmp_path: Path, src: BlockLayout) -> None:
    pool = make_pool(tmp_path)
    first = keys(4, 1)
    spill(pool, src, first)
    close(pool)

    again = make_pool(tmp_path)
    assert again.disk is not None and again.disk.stats()["adopted_blocks"] >= 4
    dst = BlockLayout.contiguous(4, BLOCK)
    op = again.restore(first, dst, range(4)).wait(5)
    assert op.result["tiers"] == ["disk"] * 4
    assert torch.equal(dst.slab(), src.slab()[:4])
    close(again)


def test_a_corrupt_block_ends_the_prefix_and_is_never_served(tmp_path: Path, src: BlockLayout) -> None:
    pool = make_pool(tmp_path)
    first = keys(4, 1)
    spill(pool, src, first)
    disk = pool.disk
    assert disk is not None
    slot = disk._catalog.begin_read([first[2]])[0]  # which slot holds block 2
    disk._catalog.end_read([slot], [True])
    with open(disk.directory / "blocks", "r+b") as f:  # flip a byte behind the tier's back
        f.seek(slot.slot * disk.slot_bytes + 100)
        b = f.read(1)
        f.seek(slot.slot * disk.slot_bytes + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    dst = BlockLayout.contiguous(4, BLOCK)
    op = pool.restore(first, dst, range(4)).wait(5)
    assert op.result["tiers"] == ["disk", "disk"]
    assert torch.equal(dst.slab()[:2], src.slab()[:2])
    assert disk.stats()["disk_corrupt"] == 1
    assert pool.lookup(first, count=False) == [Tier.CPU, Tier.CPU]  # block 2 is gone from the disk tier
    close(pool)


def test_a_failing_disk_is_a_miss_never_an_error(tmp_path: Path, src: BlockLayout) -> None:
    failing = {"read": False, "write": False}

    def faults(op: str, slot: int) -> None:
        if failing.get(op):
            raise OSError(errno.EIO if op == "read" else errno.ENOSPC, f"injected {op} failure")

    pool = make_pool(tmp_path, faults=faults)
    first = keys(4, 1)
    spill(pool, src, first)
    failing["read"] = True
    dst = BlockLayout.contiguous(4, BLOCK)
    op = pool.restore(first, dst, range(4)).wait(5)
    assert op.error is None and op.result["tiers"] == []
    disk = pool.disk
    assert disk is not None
    assert disk.stats()["read_errors"] >= 1 and not disk.available
    assert pool.lookup(first, count=False) == []  # reads rest after an error: misses
    # Writes failing with ENOSPC: counted, nothing kept, no error for the caller.
    failing["read"] = False
    failing["write"] = True
    second = keys(4, 2)
    assert pool.store(second, src, range(4, 8)).wait(5).error is None
    more = keys(8, 98)
    for i in range(0, 8, 4):
        assert pool.store(more[i:i + 4], src, range(16 + i, 20 + i)).wait(5).error is None
    assert disk.flush(5.0)
    assert disk.stats()["write_errors"] >= 1
    close(pool)


def test_disk_admission_follows_admit2(tmp_path: Path, src: BlockLayout) -> None:
    # No GPU tier: stores go straight into the CPU tier, so what reaches the disk's door is
    # decided by the disk's admission alone.
    pool = make_pool(tmp_path, gpu_blocks=0, policy="lru+admit2")
    disk = pool.disk
    assert disk is not None and disk.admission is not None
    first, other = keys(4, 1), keys(4, 2)

    def evict(by: list[bytes]) -> None:
        assert pool.store(by, src, range(4, 8)).wait(5).error is None
        assert disk.flush(5.0)

    assert pool.store(first, src, range(4)).wait(5).error is None
    evict(other)
    # Stored, never looked up: its eviction is its first sighting, and admit2 keeps it out.
    assert disk.stats()["writes_not_admitted"] == 4
    assert pool.lookup(first, count=False) == []
    assert pool.store(first, src, range(4)).wait(5).error is None
    evict(keys(4, 3))
    # The second sighting is admitted: on disk now, byte-exact.
    assert pool.lookup(first, count=False) == [Tier.DISK] * 4
    dst = BlockLayout.contiguous(4, BLOCK)
    assert pool.restore(first, dst, range(4)).wait(5).result["tiers"] == ["disk"] * 4
    assert torch.equal(dst.slab(), src.slab()[:4])
    close(pool)

    lru = make_pool(tmp_path / "lru", gpu_blocks=0, policy="lru")
    assert lru.disk is not None and lru.disk.admission is None  # no admit2: everything is admitted
    close(lru)


def test_clear_drops_the_disk_tier_too(tmp_path: Path, src: BlockLayout) -> None:
    pool = make_pool(tmp_path)
    first = keys(4, 1)
    spill(pool, src, first)
    assert pool.lookup(first, count=False) == [Tier.DISK] * 4
    assert pool.clear() >= 4
    assert pool.lookup(first, count=False) == []
    close(pool)
    again = make_pool(tmp_path)  # the records went too
    assert again.lookup(first, count=False) == []
    close(again)


def test_an_allocation_restores_disk_hits_into_its_gpu_blocks(tmp_path: Path, src: BlockLayout) -> None:
    pool = make_pool(tmp_path)
    first = keys(4, 1)
    spill(pool, src, first)
    op = pool.allocate("r1", first, 4 * 16).wait(5)
    assert op.error is None
    assert op.result["tiers"] == ["disk"] * 4 and op.result["num_disk_hits"] == 4
    assert pool.gpu is not None
    for block_id, i in zip(op.result["block_ids"], range(4)):
        assert torch.equal(pool.gpu.slab()[block_id], src.slab()[i])
    pool.free("r1")
    close(pool)


def test_clear_matching_drops_only_the_matching_disk_blocks(tmp_path: Path, src: BlockLayout) -> None:
    # What a tenant's clear does: its keys (here: tag 1) go from every tier, the others stay.
    pool = make_pool(tmp_path, disk_blocks=64)
    first, second = keys(4, 1), keys(4, 2)
    assert pool.store(second, src, range(4, 8)).wait(5).error is None
    spill(pool, src, first)
    assert pool.lookup(first, count=False) == [Tier.DISK] * 4
    assert pool.lookup(second, count=False) == [Tier.DISK] * 4
    pool.clear_matching(lambda key: key[0] == 1, [])
    assert pool.lookup(first, count=False) == []
    assert pool.lookup(second, count=False) == [Tier.DISK] * 4
    close(pool)
