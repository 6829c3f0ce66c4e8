"""Prefix resolution across the tiers: which tier holds each block of a prefix.

- ``held_prefix(hashes)`` -> the longest prefix some tier holds, each block
  from the first tier holding it (GPU, then CPU), as ``Held`` (``(Tier,
  holder)`` per block). ``held_tiers`` is the same without holders (a
  lookup's path).
- ``held_with_remote`` goes on past the local tiers through the remote
  tier, fetching its runs into the CPU tier (they come back as ``(Tier.REMOTE,
  CpuEntry)``), at most the CPU tier's size of blocks per run: a fetch never
  holds more than that in memory.
- ``holds(key)``: whether the GPU tier has it cached or the CPU tier has an
  entry for it (ready or being written).

Nothing here changes what the tiers hold except ``pull_remote`` (and so
``held_with_remote``), which fills CPU slots from the remote tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.tiers.cpu_tier import CpuEntry, CpuTierFull
from kvtier.tiers.pool.base import Held, Tier

if TYPE_CHECKING:
    from kvtier.tiers.pool.facade import TieredPool


class Resolver:
    def __init__(self, pool: TieredPool) -> None:
        self.pool = pool

    def holds(self, key: bytes) -> bool:
        pool = self.pool
        if pool.bm is not None and pool.bm.get_cached(key) is not None:
            return True
        return pool.cpu.get(key) is not None

    def held_prefix(self, hashes: Sequence[bytes], *, gpu_after_cpu: bool = True) -> Held:
        """The longest prefix some tier holds, each block from the first tier holding it.

        With ``gpu_after_cpu=False`` (allocation), a block only the GPU tier
        holds after the GPU run has ended ends the prefix: that block sits in
        the free queue and could be the very block the allocation evicts.
        LRU with last-to-first freeing keeps a chain's head at least as recent
        as its tail, so in engine-managed mode that case is rare; in store
        mode (chains stored in batches) the tail often sits in the GPU tier
        behind a demoted head, and lookups and restores take it from there.
        """
        pool = self.pool
        if not pool.enable_caching:
            return []
        gpu_run = pool.bm.longest_cached_prefix(hashes) if pool.bm is not None else []
        held: Held = [(Tier.GPU, b) for b in gpu_run]
        if len(gpu_run) < len(hashes):
            held += self.held_after(hashes, len(gpu_run), gpu_after_cpu)
        return held

    def held_after(self, hashes: Sequence[bytes], start: int, gpu_after_cpu: bool) -> Held:
        """``held_prefix`` from ``start`` on, where the leading GPU run has ended."""
        pool = self.pool
        bm = pool.bm if gpu_after_cpu else None
        cpu = pool.cpu
        held: Held = []
        for h in hashes[start:]:
            entry = cpu.get_ready(h)
            if entry is not None:
                held.append((Tier.CPU, entry))
                continue
            block = bm.get_cached(h) if bm is not None else None
            if block is None:
                break
            held.append((Tier.GPU, block))
        return held

    def held_tiers(self, hashes: Sequence[bytes]) -> list[Tier]:
        """The tiers of ``held_prefix(hashes)``: a lookup's path, which needs no holders."""
        pool = self.pool
        if not pool.enable_caching:
            return []
        n = len(pool.bm.longest_cached_prefix(hashes)) if pool.bm is not None else 0
        tiers = [Tier.GPU] * n
        if n < len(hashes):
            tiers += [tier for tier, _ in self.held_after(hashes, n, True)]
        return tiers

    def remote_run(self, hashes: Sequence[bytes], start: int) -> int:
        """How many hashes from ``start`` on the remote tier holds (one round trip)."""
        pool = self.pool
        if pool.remote is None or start >= len(hashes) or not pool.enable_caching:
            return 0
        return pool.remote.exists_prefix(hashes[start:])  # type: ignore[no-any-return]

    def pull_remote(self, hashes: Sequence[bytes], protected: frozenset[bytes] = frozenset()) -> list[CpuEntry]:
        """Fetch blocks from the remote tier into the CPU tier; the verified prefix only.

        ``protected``: the calling request's keys, which the room made for the
        fetched blocks must not evict.
        """
        pool = self.pool
        assert pool.remote is not None
        cpu = pool.cpu
        payloads = pool.remote.fetch(hashes)
        good = 0
        while good < len(payloads) and payloads[good] is not None:
            good += 1
        if good < len(hashes):
            pool.counters.remote_fetch_short += 1
        if good == 0:
            return []
        try:
            entries = cpu.reserve(list(hashes[:good]), protected)
        except CpuTierFull:
            return []
        slab = cpu.storage.slab() if cpu.storage is not None else None
        for entry, payload in zip(entries, payloads):
            if slab is not None:
                slab[entry.slot].numpy()[:] = memoryview(payload)
            cpu.commit(entry)
        return entries

    def held_with_remote(self, hashes: Sequence[bytes], *, gpu_after_cpu: bool = True) -> Held:
        """The held prefix with remote runs pulled into the CPU tier.

        Blocks fetched from the remote tier come back as ``(Tier.REMOTE,
        CpuEntry)``: they are CPU-tier entries now, attributed to the remote
        tier. A remote run stops at a block the CPU tier already has (it is
        not fetched twice); the prefix then goes on through the local tiers
        and, past them, through the remote tier again.
        """
        pool = self.pool
        held = self.held_prefix(hashes, gpu_after_cpu=gpu_after_cpu)
        if pool.remote is None:
            return held
        cpu = pool.cpu
        bm = pool.bm if gpu_after_cpu else None
        # Room made for fetched blocks must evict none of the request's blocks:
        # the CPU hits before them are read-held, the rest protected.
        protected = frozenset(hashes)
        reading = [obj for tier, obj in held if tier is Tier.CPU]
        for e in reading:
            cpu.begin_read(e)  # type: ignore[arg-type]
        try:
            while len(held) < len(hashes):
                pos = len(held)
                run = self.remote_run(hashes, pos)
                cut = next((i for i in range(run) if cpu.get(hashes[pos + i]) is not None), run)
                # Fetched blocks land in the CPU tier: more than it holds could never be reserved, and
                # would only cost memory (up to a request's 65,536 blocks) and time.
                cut = min(cut, cpu.capacity_blocks)
                entries = self.pull_remote(hashes[pos : pos + cut], protected) if cut else []
                for e in entries:
                    cpu.begin_read(e)
                    reading.append(e)
                    held.append((Tier.REMOTE, e))
                if len(entries) < cut:
                    break  # a block missing or bad in the remote tier ends the prefix
                extended = False
                for h in hashes[len(held):]:
                    entry = cpu.get_ready(h)
                    block = bm.get_cached(h) if entry is None and bm is not None else None
                    if entry is not None:
                        cpu.begin_read(entry)
                        reading.append(entry)
                        held.append((Tier.CPU, entry))
                    elif block is not None:
                        held.append((Tier.GPU, block))
                    else:
                        break
                    extended = True
                if not extended and not entries:
                    break
        finally:
            for e in reading:
                cpu.end_read(e)  # type: ignore[arg-type]
        return held

    def write_back(self, entry: CpuEntry) -> None:
        """The CPU tier's eviction hook with a remote tier: hand the block to it (never waited for)."""
        pool = self.pool
        assert pool.remote is not None
        storage = pool.cpu.storage
        data = None if storage is None else memoryview(storage.slab()[entry.slot].numpy())
        if pool.remote.write_back(entry.key, data, copy=True):
            pool.counters.remote_write_backs += 1
