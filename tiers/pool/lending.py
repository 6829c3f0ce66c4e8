"""Lending: ``borrow`` hands out the held prefix in place instead of copying it.

A restore reply sent inline would otherwise copy every block into a staging
buffer first: 16 MiB costs ~0.9 ms of memcpy before ZMQ moves the same bytes
again. The views are held (GPU blocks referenced, CPU entries read-held: not
evicted, not overwritten) until ``Borrowed.release()``. Declined (None,
nothing changed) where a view would be unsafe or impossible: bookkeeping
mode, device memory, a write in flight into a block, a remote tier to
consult (restore fetches from it), a disk tier that continues the prefix,
or more runs of slots than ``max_views``. ``cpu_only`` also declines a prefix
with a block held in the GPU tier (a lend of CPU-tier slots by offset).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtier.tiers.pool.base import Borrowed, Tier

if TYPE_CHECKING:
    from kvtier.tiers.pool.facade import TieredPool


def borrow(pool: TieredPool, hashes: Sequence[bytes], *, max_views: int | None,
           cpu_only: bool = False) -> Borrowed | None:
    if not pool.data or (pool.remote is not None and pool.enable_caching):
        return None  # bookkeeping has no bytes; remote blocks are fetched by restore()
    gpu_slab = pool.gpu.slab() if pool.gpu is not None and pool.gpu.is_slab else None
    if gpu_slab is not None and gpu_slab.device.type != "cpu":
        gpu_slab = None
    cpu = pool.cpu
    cpu_layout = cpu.storage
    cpu_slab = cpu_layout.slab() if cpu_layout is not None and cpu_layout.is_slab else None
    held = pool._resolve.held_prefix(hashes)
    if pool.disk is not None and pool.enable_caching and pool.disk.exists_prefix(hashes[len(held):]):
        return None  # the disk tier continues the prefix: restore() reads it into the CPU tier
    blocks = [obj for tier, obj in held if tier is Tier.GPU]
    entries = [obj for tier, obj in held if tier is Tier.CPU]
    if blocks and cpu_only:
        return None
    if blocks:
        ids = [b.block_id for b in blocks]  # type: ignore[union-attr]
        if gpu_slab is None or pool._copies.busy_copies(ids, writes_only=True):
            return None
    if entries and cpu_slab is None:
        return None
    runs: list[tuple[Any, int, int]] = []  # (slab, first slot, count)
    for tier, obj in held:
        slab, slot = (gpu_slab, obj.block_id) if tier is Tier.GPU else (cpu_slab, obj.slot)  # type: ignore[union-attr]
        if runs and runs[-1][0] is slab and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (slab, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((slab, slot, 1))
    if max_views is not None and len(runs) > max_views:
        return None
    # Planned; from here on nothing fails.
    tiers = [tier for tier, _ in held]
    pool._count(hashes, tiers)
    bm = pool.bm
    if blocks:
        assert bm is not None
        bm.touch(blocks)  # type: ignore[arg-type]
    for e in entries:
        cpu.begin_read(e)  # type: ignore[arg-type]
    cpu.accessed([e.key for e in reversed(entries)])  # type: ignore[union-attr]  # tail first (see engine.allocate)
    pool.counters.loads += len(held)
    pool.counters.lent_bytes += len(held) * pool.spec.block_bytes
    views = [slab[first : first + n].numpy() for slab, first, n in runs]
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        if blocks and pool.bm is bm:
            bm.release(reversed(blocks))  # type: ignore[arg-type, union-attr]
        for e in entries:
            cpu.end_read(e)  # type: ignore[arg-type]
        pool._demoter.clean_ahead()

    slots = [obj.block_id if tier is Tier.GPU else obj.slot for tier, obj in held]  # type: ignore[union-attr]
    return Borrowed(tiers, views, release, slots)
