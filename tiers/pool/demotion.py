"""Demotion: blocks leaving the GPU tier go to the CPU tier, urgently or ahead of time.

- ``vacate(evicted, op)``: the GPU tier evicted these blocks for ``op``; each
  one the CPU tier does not hold yet (nor a duplicate left in the GPU tier)
  is demoted at high priority, and the op waits for those copies (and for
  any copy still touching the slots) before the slots are reused. A lost
  demotion is not the op's failure.
- ``clean_ahead()``: after each call, demote at low priority the cached
  blocks nearest the head of the GPU free queue (up to the pool's
  ``clean_ahead_blocks``), so an allocation in steady state finds them in the
  CPU tier already and waits for no device-to-host copy. With
  ``depth_blocks``/``max_blocks`` it goes deeper in bounded batches: the
  pool's idle-time pass (``TieredPool.clean_when_idle``).
- ``dropped(hashes)``: the GPU tier let these hashes go without a demotion
  (withdrawn, cleared, detached); each one it holds no copy of any more is
  reported to the CPU tier's policy (``on_gpu_drop``). ``vacate`` reports
  its own evictions: those the CPU tier holds before it picks any victim
  (a spare must not be evicted at the moment its GPU copy goes), the others
  after their demotions were planned.
- ``protected``: the calling op's keys (a store's); the room made in the CPU
  tier for these demotions is never made by evicting them.
- A demotion the CPU tier's policy does not admit, or that finds no room, is
  dropped and counted (``demotions_not_admitted``, ``demotions_dropped_full``).

It works on the GPU tier of the pool's ``PoolState``, the CPU tier and the
copy scheduler it is given.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tiers.block_manager import Evicted
from kvtier.tiers.cpu_tier import CpuTier, CpuTierFull
from kvtier.tiers.pool.copies import Copy, CopyScheduler, Op
from kvtier.tiers.pool.counters import Counters
from kvtier.tiers.pool.state import PoolState
from kvtier.tiers.copy_types import CopyKind


class Demoter:
    def __init__(self, state: PoolState, cpu: CpuTier, copies: CopyScheduler, counters: Counters) -> None:
        self.state = state
        self.cpu = cpu
        self.copies = copies
        self.counters = counters

    def vacate(self, evicted: Sequence[Evicted], op: Op, protected: frozenset[bytes] = frozenset()) -> set[Copy]:
        """Make evicted blocks' slots safe to reuse; returns the copies reuse must follow."""
        copies = self.copies
        cpu = self.cpu
        bm = self.state.bm
        counters = self.counters
        must_follow: set[Copy] = set()
        urgent: list[Evicted] = []
        urgent_keys: set[bytes] = set()
        held: list[bytes] = []  # CPU copies of blocks the GPU tier now holds no copy of
        for ev in evicted:
            h = ev.block_hash
            must_follow |= copies.busy_copies([ev.block_id])
            if cpu.get(h) is not None:
                cpu.keep(h)  # the GPU copy goes: a clear racing its demotion must not take this one too
                counters.demotions_skipped_clean += 1
                if bm is None or bm.get_cached(h) is None:
                    held.append(h)
            elif bm is not None and bm.get_cached(h) is not None:
                continue  # a duplicate copy still lives in the GPU tier
            elif h in urgent_keys:
                continue  # two copies of one hash evicted at once: one demotion
            else:
                urgent.append(ev)
                urgent_keys.add(h)
        # Those CPU copies are spares no more: the policy hears it before the demotions below
        # choose any victim. It hears of the demoted blocks once their demotions are planned.
        cpu.gpu_dropped(held)
        if urgent:
            demote = self.demote(urgent, high_priority=True, protected=protected)
            if demote is not None:
                counters.demotions_urgent += len(demote.src_slots)
                must_follow.add(demote)
        # The caller writes the reused slots once the op is done: it waits for
        # these copies, but their failure (a lost demotion) is not its failure.
        copies.wait_for(op, must_follow)
        cpu.gpu_dropped([ev.block_hash for ev in urgent])
        return must_follow

    def dropped(self, hashes: Sequence[bytes]) -> None:
        """The GPU tier let ``hashes`` go without demoting them (withdrawn, cleared, detached)."""
        bm = self.state.bm
        self.cpu.gpu_dropped(list(hashes) if bm is None else [h for h in hashes if bm.get_cached(h) is None])

    def demote(self, evicted: Sequence[Evicted], *, high_priority: bool,
               protected: frozenset[bytes] = frozenset()) -> Copy | None:
        cpu = self.cpu
        counters = self.counters
        answers = cpu.admit([ev.block_hash for ev in evicted])
        admitted = [ev for ev, yes in zip(evicted, answers) if yes]
        counters.demotions_not_admitted += len(evicted) - len(admitted)
        if not admitted or cpu.capacity_blocks == 0:
            counters.demotions_dropped_full += len(admitted)
            return None
        try:
            entries = cpu.reserve([ev.block_hash for ev in admitted], protected)
        except CpuTierFull:
            counters.demotions_dropped_full += len(admitted)
            return None
        copies = self.copies
        ids = [ev.block_id for ev in admitted]
        copy = copies.copy(CopyKind.DEMOTE, self.state.gpu, ids, cpu.storage, [e.slot for e in entries],
                           after=copies.busy_copies(ids, writes_only=True), high_priority=high_priority)
        copies.track_cpu_write(copy, cpu, entries)
        copies.mark_gpu_busy(copy, ids)
        counters.demotions += len(admitted)
        return copy

    def clean_ahead(self, protected: frozenset[bytes] = frozenset(), *, depth_blocks: int | None = None,
                    max_blocks: int | None = None, asked: set[tuple[int, bytes]] | None = None) -> tuple[int, int]:
        """Demote the cached blocks the next allocations will evict, before they do.

        Those the CPU tier lacks among the first ``depth_blocks`` of the free
        queue (default: the pool's ``clean_ahead_blocks``), at most
        ``max_blocks`` of them, skipping the (block, hash) pairs in ``asked``
        and adding those it demotes or the CPU tier refuses. Returns (blocks
        found to demote, blocks whose demotion was submitted).
        """
        state = self.state
        bm = state.bm
        cpu = self.cpu
        if depth_blocks is None:
            depth_blocks = state.clean_ahead_blocks
            state.idle_clean_pending = True  # a call changed the free queue: the idle pass has work again
        if bm is None or depth_blocks <= 0 or cpu.capacity_blocks == 0:
            return 0, 0
        busy = self.copies.gpu_busy
        dirty: list[Evicted] = []
        for i, block in enumerate(bm.iter_free()):
            if i >= depth_blocks or (max_blocks is not None and len(dirty) >= max_blocks):
                break
            h = block.block_hash
            if h is None or cpu.get(h) is not None or block.block_id in busy:
                continue
            if bm.get_cached(h) is not block:
                continue  # a duplicate: its twin carries the hash
            if asked is not None:
                if (block.block_id, h) in asked:
                    continue
                asked.add((block.block_id, h))
            dirty.append(Evicted(block.block_id, h))
        if not dirty:
            return 0, 0
        copy = self.demote(dirty, high_priority=False, protected=protected)
        if copy is None:
            return len(dirty), 0
        self.copies.submit_ready()
        return len(dirty), len(copy.src_slots)
