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
from kvtier.tiers.pool.verb_part import VerbCollaborators, VerbPart

if TYPE_CHECKING:
    from kvtier.tiers.disk_tier import DiskTier


class Lender(VerbPart):
    """``TieredPool.borrow``'s body (see the module docstring)."""

    def __init__(self, shared: VerbCollaborators, *, block_bytes: int, data: bool, consults_remote: bool,
                 disk: DiskTier | None) -> None:
        super().__init__(shared)
        self.block_bytes = block_bytes
        self.data = data
        self.consults_remote = consults_remote  # a remote tier, with caching on: restore() fetches from it
        self.disk = disk  # the DiskTier below the CPU tier (with caching on), or None

    def borrow(self, hashes: Sequence[bytes], *, max_views: int | None,
               cpu_only: bool = False, with_views: bool = True) -> Borrowed | None:
        if not self.data or self.consults_remote:
            return None  # bookkeeping has no bytes; remote blocks are fetched by restore()
        state = self.state
        gpu = state.gpu
        gpu_slab = gpu.slab() if gpu is not None and gpu.is_slab else None
        if gpu_slab is not None and gpu_slab.device.type != "cpu":
            gpu_slab = None
        cpu = self.cpu
        cpu_layout = cpu.storage
        cpu_slab = cpu_layout.slab() if cpu_layout is not None and cpu_layout.is_slab else None
        held = self.resolver.held_prefix(hashes)
        if self.disk is not None and self.disk.exists_prefix(hashes[len(held):]):
            return None  # the disk tier continues the prefix: restore() reads it into the CPU tier
        blocks = [obj for tier, obj in held if tier is Tier.GPU]
        entries = [obj for tier, obj in held if tier is Tier.CPU]
        if blocks and cpu_only:
            return None
        if blocks:
            ids = [b.block_id for b in blocks]  # type: ignore[union-attr]
            if gpu_slab is None or self.copies.busy_copies(ids, writes_only=True):
                return None
        if entries and cpu_slab is None:
            return None
        runs: list[tuple[Any, int, int]] = []  # (slab, first slot, count)
        # Runs only where views are made or counted: a lend (slots only) skips
        # this per-block pass and the numpy views (20-50 us a lend).
        for tier, obj in (held if with_views or max_views is not None else ()):
            slab, slot = (gpu_slab, obj.block_id) if tier is Tier.GPU else (cpu_slab, obj.slot)  # type: ignore[union-attr]
            if runs and runs[-1][0] is slab and runs[-1][1] + runs[-1][2] == slot:
                runs[-1] = (slab, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((slab, slot, 1))
        if max_views is not None and len(runs) > max_views:
            return None
        # Planned; from here on nothing fails.
        tiers = [tier for tier, _ in held]
        counters = self.counters
        counters.count_request(hashes, tiers)
        self.learning.note(hashes, is_lookup=False)
        bm = state.bm
        if blocks:
            assert bm is not None
            bm.touch(blocks)  # type: ignore[arg-type]
        for e in entries:
            cpu.begin_read(e)  # type: ignore[arg-type]
        cpu.accessed([e.key for e in reversed(entries)])  # type: ignore[union-attr]  # tail first (see EngineMode.allocate)
        counters.loads += len(held)
        counters.lent_bytes += len(held) * self.block_bytes
        views = [slab[first : first + n].numpy() for slab, first, n in runs] if with_views else []
        released = False
        demoter = self.demoter

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            if blocks and state.bm is bm:
                bm.release(reversed(blocks))  # type: ignore[arg-type, union-attr]
            for e in entries:
                cpu.end_read(e)  # type: ignore[arg-type]
            demoter.clean_ahead()

        slots = [obj.block_id if tier is Tier.GPU else obj.slot for tier, obj in held]  # type: ignore[union-attr]
        return Borrowed(tiers, views, release, slots)
