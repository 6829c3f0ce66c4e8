"""Prefix resolution across the tiers: which tier holds each block of a prefix.

- ``held_prefix(hashes)`` -> the longest prefix some tier holds, each block
  from the first tier holding it (GPU, then CPU), as ``Held`` (``(Tier,
  holder)`` per block). ``held_tiers`` is the same without holders (a
  lookup's path); ``lower_tiers`` continues a lookup's path through the
  tiers below the CPU tier (``lower``: disk, then remote).
- ``held_with_lower`` goes on past the local tiers through the lower
  tiers, pulling their runs into the CPU tier (they come back as
  ``(Tier.DISK or Tier.REMOTE, CpuEntry)``), at most the CPU tier's size of
  blocks per run: a fetch never holds more than that in memory.
- ``holds(key)``: whether the GPU tier has it cached or the CPU tier has an
  entry for it (ready or being written).
- ``WriteBack``: the CPU tier's eviction hook, handing the block to every
  lower tier. It holds the CPU tier's storage, not the tier: the tier holds
  the hook.

Nothing here changes what the tiers hold except ``pull`` (and so
``held_with_lower``), which fills CPU slots from a lower tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtier.tiers.cpu_tier import CpuEntry, CpuTier, CpuTierFull
from kvtier.tiers.pool.base import Held, Tier
from kvtier.tiers.pool.counters import Counters
from kvtier.tiers.pool.state import PoolState

if TYPE_CHECKING:
    from kvtier.tiers.disk_tier import DiskTier
    from kvtier.blocks.layout import BlockLayout
    from kvtier.tiers.remote import RemoteStore

# The tiers below the CPU tier, in the order lookups and fetches try them: (Tier.DISK, DiskTier), then
# (Tier.REMOTE, RemoteStore).
LowerTiers = tuple[tuple[Tier, Any], ...]


class Resolver:
    def __init__(self, state: PoolState, cpu: CpuTier, counters: Counters, *, lower: LowerTiers,
                 enable_caching: bool) -> None:
        self.state = state  # its GPU tier (bm), read at each call
        self.cpu = cpu
        self.counters = counters
        self.lower = lower
        self.enable_caching = enable_caching

    def holds(self, key: bytes) -> bool:
        bm = self.state.bm
        if bm is not None and bm.get_cached(key) is not None:
            return True
        return self.cpu.get(key) is not None

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
        if not self.enable_caching:
            return []
        bm = self.state.bm
        gpu_run = bm.longest_cached_prefix(hashes) if bm is not None else []
        held: Held = [(Tier.GPU, b) for b in gpu_run]
        if len(gpu_run) < len(hashes):
            held += self.held_after(hashes, len(gpu_run), gpu_after_cpu)
        return held

    def held_after(self, hashes: Sequence[bytes], start: int, gpu_after_cpu: bool) -> Held:
        """``held_prefix`` from ``start`` on, where the leading GPU run has ended."""
        bm = self.state.bm if gpu_after_cpu else None
        cpu = self.cpu
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
        if not self.enable_caching:
            return []
        bm = self.state.bm
        n = len(bm.longest_cached_prefix(hashes)) if bm is not None else 0
        tiers = [Tier.GPU] * n
        if n < len(hashes):
            tiers += [tier for tier, _ in self.held_after(hashes, n, True)]
        return tiers

    def lower_tiers(self, hashes: Sequence[bytes], start: int) -> list[Tier]:
        """The tiers of the prefix from ``start`` on, where the local tiers' run ended (a lookup's: nothing is fetched).

        Each lower tier in order (disk, then remote) is asked how far it
        continues the prefix; after its run the local tiers may continue it
        again, then the lower tiers, until none does. The disk's answer is in
        memory; the remote tier's costs a round trip.
        """
        tiers: list[Tier] = []
        if not self.lower or not self.enable_caching:
            return tiers
        pos = start
        while pos < len(hashes):
            for tier, store in self.lower:
                n = store.exists_prefix(hashes[pos:])
                if n:
                    tiers += [tier] * n
                    pos += n
                    break
            else:
                break
            local = [t for t, _ in self.held_after(hashes, pos, True)] if pos < len(hashes) else []
            tiers += local
            pos += len(local)
        return tiers

    def pull(self, tier: Tier, store: Any, hashes: Sequence[bytes],
             protected: frozenset[bytes] = frozenset()) -> list[CpuEntry]:
        """Fetch blocks from a lower tier (``store``, the ``DiskTier`` or ``RemoteStore`` of ``lower``) into the
        CPU tier; the verified prefix only.

        ``protected``: the calling request's keys, which the room made for the
        fetched blocks must not evict. The remote tier hands back payloads,
        copied into the reserved slots; the disk tier reads straight into them.
        """
        cpu = self.cpu
        counters = self.counters
        if tier is Tier.DISK:
            entries = self._reserve_most(hashes, protected)
            if not entries:
                return []
            hashes = hashes[: len(entries)]
            storage = cpu.storage
            if storage is None:
                raise ValueError("a disk tier needs a pool that moves bytes")
            slab = storage.slab()
            good = store.read_into(hashes, [slab[e.slot].numpy() for e in entries])
            if good < len(hashes):
                counters.disk_fetch_short += 1
            for entry in entries[good:]:
                cpu.abort(entry)
            return self._filled(entries[:good], None)
        payloads = store.fetch(hashes)
        good = 0
        while good < len(payloads) and payloads[good] is not None:
            good += 1
        if good < len(hashes):
            counters.remote_fetch_short += 1
        if good == 0:
            return []
        return self._filled(self._reserve_most(hashes[:good], protected), payloads)

    def _reserve_most(self, hashes: Sequence[bytes], protected: frozenset[bytes]) -> list[CpuEntry]:
        """CPU entries for the longest prefix of ``hashes`` the CPU tier can make room for (halving on refusal):
        a run longer than the room there is still gives the prefix that fits."""
        cpu = self.cpu
        n = len(hashes)
        while n:
            try:
                return cpu.reserve(list(hashes[:n]), protected)
            except CpuTierFull:
                n //= 2
        return []

    def _filled(self, entries: list[CpuEntry], payloads: Sequence[object] | None) -> list[CpuEntry]:
        """Reserved entries whose bytes are in place (``payloads`` copied in first, if given): committed."""
        cpu = self.cpu
        slab = cpu.storage.slab() if cpu.storage is not None and payloads is not None else None
        for i, entry in enumerate(entries):
            if slab is not None:
                slab[entry.slot].numpy()[:] = memoryview(payloads[i])  # type: ignore[index, arg-type]
            cpu.commit(entry)
        return entries

    def held_with_lower(self, hashes: Sequence[bytes], *, gpu_after_cpu: bool = True) -> Held:
        """The held prefix with the runs of lower tiers (disk, remote) pulled into the CPU tier.

        Blocks pulled from a lower tier come back as ``(Tier.DISK or
        Tier.REMOTE, CpuEntry)``: they are CPU-tier entries now, attributed to
        the tier they came from. A lower run stops at a block the CPU tier
        already has (it is not fetched twice); the prefix then goes on through
        the local tiers and, past them, through the lower tiers again.
        """
        held = self.held_prefix(hashes, gpu_after_cpu=gpu_after_cpu)
        if not self.lower or not self.enable_caching:
            return held
        cpu = self.cpu
        bm = self.state.bm if gpu_after_cpu else None
        # Room made for fetched blocks must evict none of the request's blocks:
        # the CPU hits before them are read-held, the rest protected.
        protected = frozenset(hashes)
        reading = [obj for tier, obj in held if tier is Tier.CPU]
        for e in reading:
            cpu.begin_read(e)  # type: ignore[arg-type]
        try:
            while len(held) < len(hashes):
                pos = len(held)
                entries: list[CpuEntry] = []
                short = False
                for tier, store in self.lower:
                    run = store.exists_prefix(hashes[pos:])
                    if not run:
                        continue
                    cut = next((i for i in range(run) if cpu.get(hashes[pos + i]) is not None), run)
                    # Fetched blocks land in the CPU tier: more than it holds could never be reserved,
                    # and would only cost memory (up to a request's 65,536 blocks) and time.
                    cut = min(cut, cpu.capacity_blocks)
                    entries = self.pull(tier, store, hashes[pos : pos + cut], protected) if cut else []
                    for e in entries:
                        cpu.begin_read(e)
                        reading.append(e)
                        held.append((tier, e))
                    short = len(entries) < cut
                    break
                if short:
                    break  # a block missing or bad in a lower tier ends the prefix
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


class WriteBack:
    """The CPU tier's eviction hook with lower tiers (``CpuTier.on_evict``): hand the block to each, never
    waited for. In bookkeeping mode (replay) the remote tier is a stand-in that tracks keys only and gets
    None."""

    def __init__(self, storage: BlockLayout | None, counters: Counters, *, disk: DiskTier | None,
                 remote: RemoteStore | None) -> None:
        self.storage = storage
        self.counters = counters
        self.disk = disk
        self.remote = remote

    def __call__(self, entry: CpuEntry) -> None:
        storage = self.storage
        data = None if storage is None else memoryview(storage.slab()[entry.slot].numpy())
        counters = self.counters
        if self.disk is not None and data is not None and self.disk.write_back(entry.key, data, copy=True):
            counters.disk_write_backs += 1
        if self.remote is not None and self.remote.write_back(entry.key, data, copy=True):
            counters.remote_write_backs += 1
