"""Store mode: clients ``store`` blocks by hash and ``restore`` them into their own slots.

- ``store`` answers a block some tier holds as ``present``; one whose own
  store is still being copied in is acknowledged only with that copy (the op
  waits for it, and fails if it fails). It copies the blocks not held yet
  into the GPU tier, or the CPU tier
  where the GPU tier (its free queue less the call's own present blocks) has
  no room or there is none; they are left cached and evictable. Every key of
  the call is protected (see the pool's contract); a store that would have to
  evict one raises ``NoSpace`` and changes nothing but ``stores_failed``.
- ``cpu_spill(hashes)`` says how many of a store's new blocks would go to
  the CPU tier, by the same split (the daemon's tenant quotas check it).
- ``restore`` copies the longest held prefix (disk and remote runs fetched first)
  into the caller's slots, at most ``max_blocks`` of it (a caller that sized
  its buffer by an earlier lookup: the remote tier may hold more by now).
  Lending in place is ``lending.Lender``.
- ``read_by_ns`` (store) and ``start_by_ns`` (restore) are the client's
  deadline where ``src`` / ``dst`` is the client's own memory (see
  ``copies``): past it a store stores nothing and a restore writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.tiers.block_manager import NoFreeBlocks
from kvtier.tiers.cpu_tier import CpuTierFull
from kvtier.tiers.pool.base import NoSpace, PoolError, Tier
from kvtier.tiers.pool.copies import Copy, Op, OpDriver
from kvtier.tiers.pool.verb_part import VerbCollaborators, VerbPart
from kvtier.tiers.copy_types import CopyKind

if TYPE_CHECKING:
    from kvtier.blocks.layout import BlockLayout


class StoreMode(VerbPart):
    """``TieredPool.store``, ``restore`` and ``cpu_spill`` (see the module docstring)."""

    def __init__(self, shared: VerbCollaborators, driver: OpDriver, *, block_bytes: int, data: bool) -> None:
        super().__init__(shared)
        self.driver = driver  # what its ops poll (polling.Poller)
        self.block_bytes = block_bytes
        self.data = data

    def cpu_spill(self, hashes: Sequence[bytes]) -> int:
        holds = self.resolver.holds
        new = sum(1 for k in hashes if not holds(k))
        bm = self.state.bm
        return max(0, new - (bm.num_free_unprotected(frozenset(hashes)) if bm is not None else 0))

    def store(self, hashes: Sequence[bytes], src: BlockLayout | None, src_slots: Sequence[int], *,
              read_by_ns: int | None = None) -> Op:
        if len(hashes) != len(src_slots):
            raise PoolError(f"{len(hashes)} hashes but {len(src_slots)} source slots")
        if len(set(hashes)) != len(hashes):
            raise PoolError("store got the same hash twice")
        if self.data and (src is None or src.block_bytes != self.block_bytes):
            raise PoolError(f"source blocks must be {self.block_bytes} bytes")
        holds = self.resolver.holds
        new = [(h, s) for h, s in zip(hashes, src_slots) if not holds(h)]
        op = Op(self.driver, "store", {"stored": len(new), "present": len(hashes) - len(new)})
        counters = self.counters
        copies = self.copies
        # "Present" must mean held: a present block whose own store is still in
        # flight is acknowledged only with that copy, and fails if it fails.
        present = [h for h in hashes if holds(h)]
        for h in present:
            self.cpu.keep(h)  # acknowledged as held: a clear racing its copy must not drop it after all
        for copy in self._writes_in_flight(present):
            copies.attach(op, copy)
        if not new:
            counters.stores_present += len(hashes)
            copies.settle(op)
            return op
        # Every key of the call is protected: making room for the new blocks
        # must not evict the present ones (they are what the reply counts as
        # held, and the chain the new blocks extend).
        protected = op.protected = frozenset(hashes)
        bm = self.state.bm
        if bm is None:
            self._store_cpu(op, new, src, protected, read_by_ns)
        else:
            # What the GPU tier cannot take (its free queue, less the present
            # blocks waiting in it, is shorter than the batch) goes straight to
            # the CPU tier: the chain's tail, which is evicted first anyway.
            # CPU first: it is the part that can fail.
            fits = min(len(new), bm.num_free_unprotected(protected))
            if fits < len(new):
                self._store_cpu(op, new[fits:], src, protected, read_by_ns)
            if fits:
                self._store_gpu(op, new[:fits], src, protected, read_by_ns)
        # Counted once the store cannot fail any more: a NoSpace changes nothing
        # but stores_failed.
        counters.stores += len(new)
        counters.stores_present += len(hashes) - len(new)
        copies.settle(op)
        self.demoter.clean_ahead(protected)
        return op

    def _writes_in_flight(self, present: Sequence[bytes]) -> set[Copy]:
        """The copies still writing the only copy of a present block (a block some tier holds ready needs none)."""
        copies = self.copies
        found: set[Copy] = set()
        bm = self.state.bm
        cpu = self.cpu
        for h in present:
            block = bm.get_cached(h) if bm is not None else None
            gpu_writes = copies.busy_copies([block.block_id], writes_only=True) if block is not None else set()
            if block is not None and not gpu_writes:
                continue
            entry = cpu.get(h)
            cpu_write = copies.cpu_writes.get(entry.slot) if entry is not None else None
            if entry is not None and cpu_write is None:
                continue
            found |= gpu_writes
            if cpu_write is not None:
                found.add(cpu_write)
        return found

    def _store_gpu(self, op: Op, new: list[tuple[bytes, int]], src: BlockLayout | None,
                   protected: frozenset[bytes], read_by_ns: int | None) -> None:
        state = self.state
        bm = state.bm
        assert bm is not None
        copies = self.copies
        demoter = self.demoter
        try:
            blocks, evicted = bm.allocate_blocks(len(new), protected)
        except NoFreeBlocks as exc:
            self.counters.stores_failed += 1
            raise NoSpace(f"GPU tier full: {exc}") from None
        vacate = demoter.vacate(evicted, op, protected)
        for block, (h, _) in zip(blocks, new):
            bm.commit(block, h)
        dst = [b.block_id for b in blocks]
        copy = copies.copy(CopyKind.STORE, src, [s for _, s in new], state.gpu, dst,
                           after=vacate | copies.busy_copies(dst), read_by_ns=read_by_ns)
        copies.mark_gpu_busy(copy, dst)
        copies.attach(op, copy)

        def forget(ok: bool) -> None:
            # By this copy's outcome, not the op's: the op may fail for a block
            # another store is copying in, while this copy's blocks are good
            # (and another store may already be acknowledged for them).
            bm = state.bm
            if not ok and bm is not None:
                gone = [block.block_hash for block in blocks if block.block_hash is not None]
                for block in blocks:
                    bm.discard_hash(block)
                demoter.dropped(gone)

        copy.on_done.append(forget)

        def release(ok: bool) -> None:
            bm = state.bm
            if bm is None:
                return
            # Reverse order: the chain's tail sits nearest the head of the free queue.
            bm.release(reversed(blocks))

        op._finalizers.append(release)

    def _store_cpu(self, op: Op, new: list[tuple[bytes, int]], src: BlockLayout | None,
                   protected: frozenset[bytes], read_by_ns: int | None) -> None:
        cpu = self.cpu
        try:
            entries = cpu.reserve([h for h, _ in new], protected)
        except CpuTierFull as exc:
            self.counters.stores_failed += 1
            raise NoSpace(str(exc)) from None
        copies = self.copies
        copy = copies.copy(CopyKind.STORE, src, [s for _, s in new], cpu.storage, [e.slot for e in entries],
                           read_by_ns=read_by_ns)
        copies.track_cpu_write(copy, cpu, entries)
        copies.attach(op, copy)

    def restore(self, hashes: Sequence[bytes], dst: BlockLayout | None, dst_slots: Sequence[int], *,
                count: bool, start_by_ns: int | None = None, max_blocks: int | None = None) -> Op:
        if len(dst_slots) < len(hashes):
            raise PoolError(f"{len(hashes)} hashes but only {len(dst_slots)} destination slots")
        if self.data and (dst is None or dst.block_bytes != self.block_bytes):
            raise PoolError(f"destination blocks must be {self.block_bytes} bytes")
        held = self.resolver.held_with_lower(hashes)
        if max_blocks is not None:
            del held[max_blocks:]  # nothing is referenced yet: the rest stays where it is
        tiers = [tier for tier, _ in held]
        if count:
            self.counters.count_request(hashes, tiers)
            self.learning.note(hashes, is_lookup=False)
        op = Op(self.driver, "restore", {"tiers": [t.value for t in tiers]})
        copies = self.copies
        state = self.state
        gpu = [(obj, dst_slots[i]) for i, (tier, obj) in enumerate(held) if tier is Tier.GPU]
        cpu_held = [(obj, dst_slots[i]) for i, (tier, obj) in enumerate(held) if tier is not Tier.GPU]
        if gpu:
            bm = state.bm
            assert bm is not None
            blocks = [b for b, _ in gpu]
            bm.touch(blocks)  # type: ignore[arg-type]
            ids = [b.block_id for b in blocks]  # type: ignore[union-attr]
            copy = copies.copy(CopyKind.LOAD, state.gpu, ids, dst, [d for _, d in gpu],
                               after=copies.busy_copies(ids, writes_only=True), start_by_ns=start_by_ns)
            copies.mark_gpu_busy(copy, ids)
            copy.on_done.append(lambda ok, bl=blocks, bm=bm: bm.release(reversed(bl)) if state.bm is bm else None)
            copies.attach(op, copy)
        if cpu_held:
            cpu = self.cpu
            entries = [e for e, _ in cpu_held]
            for e in entries:
                cpu.begin_read(e)  # type: ignore[arg-type]
            cpu.accessed([e.key for e in reversed(entries)])  # type: ignore[union-attr]  # tail first (see EngineMode.allocate)
            copy = copies.copy(CopyKind.LOAD, cpu.storage, [e.slot for e in entries], dst,  # type: ignore[union-attr]
                               [d for _, d in cpu_held], start_by_ns=start_by_ns)
            copy.on_done.append(lambda ok, es=entries: [cpu.end_read(e) for e in es])  # type: ignore[arg-type]
            copies.attach(op, copy)
        self.counters.loads += len(held)
        copies.settle(op)
        self.demoter.clean_ahead()
        return op
