"""Engine-managed mode: ``allocate``, ``append``, ``free`` over the GPU tier's block manager.

The block manager decides (vLLM v1's prefix caching: hits are referenced
before anything is evicted); the pool turns its decisions into copies:
CPU-tier (and fetched remote) hits are restored into the new slots, and the
blocks it evicts are vacated (demoted) first. The returned ``Op`` completes
only when those bytes are in place and no copy still touches a new block
(with or without a hash: ``clear`` drops the hashes of blocks a demotion is
still reading); if a restore fails, the hashes whose bytes never arrived are
withdrawn and the request is freed.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tiers.block_manager import NoFreeBlocks
from kvtier.tiers.cpu_tier import CpuEntry
from kvtier.tiers.hints import RequestHints
from kvtier.tiers.pool.base import NoSpace, NotFound, PoolError, Tier
from kvtier.tiers.pool.copies import Op, OpDriver
from kvtier.tiers.pool.verb_part import VerbCollaborators, VerbPart
from kvtier.tiers.copy_types import CopyKind


class EngineMode(VerbPart):
    """``TieredPool.allocate``, ``append`` and ``free`` (see the module docstring)."""

    def __init__(self, shared: VerbCollaborators, driver: OpDriver, *, enable_caching: bool) -> None:
        super().__init__(shared)
        self.driver = driver  # what its ops poll (polling.Poller)
        self.enable_caching = enable_caching

    def allocate(self, request_id: str, hashes: Sequence[bytes], num_tokens: int, *, count: bool,
                 hints: RequestHints | None = None) -> Op:
        state = self.state
        bm = state.require_gpu()
        if bm.has_request(request_id):
            raise PoolError(f"request {request_id!r} is already allocated; free it first")
        cpu = self.cpu
        copies = self.copies
        demoter = self.demoter
        # Disk and remote blocks land in the CPU tier first (a side effect that survives
        # a failed allocation: the CPU tier is only warmer for it).
        held = self.resolver.held_with_lower(hashes, gpu_after_cpu=False)
        num_gpu_prefix = sum(1 for tier, _ in held if tier is Tier.GPU)
        try:
            alloc = bm.allocate(request_id, hashes, num_tokens)
        except NoFreeBlocks as exc:
            raise NoSpace(str(exc)) from None
        except ValueError as exc:
            raise PoolError(str(exc)) from None
        assert alloc.num_hit_blocks == num_gpu_prefix or not self.enable_caching
        tiers = [tier for tier, _ in held]
        if count:
            self.counters.count_request(hashes, tiers)
            self.learning.note(hashes, is_lookup=False, hints=hints)
        op = Op(self.driver, "allocate", {
            "block_ids": alloc.block_ids, "tiers": [t.value for t in tiers],
            "num_gpu_hits": tiers.count(Tier.GPU), "num_cpu_hits": tiers.count(Tier.CPU),
            "num_remote_hits": tiers.count(Tier.REMOTE), "num_disk_hits": tiers.count(Tier.DISK)})
        cpu_hits = [(obj, alloc.block_ids[pos]) for pos, (tier, obj) in enumerate(held) if tier is not Tier.GPU]
        entries = [e for e, _ in cpu_hits]
        # Hold the CPU entries before anything can reserve CPU slots: the
        # demotions below must not evict the very blocks we restore.
        for e in entries:
            assert isinstance(e, CpuEntry)
            cpu.begin_read(e)
        # Hits recorded tail first, as vLLM frees: under a recency policy the head ends up the most
        # recent, so an eviction takes the tail, not the head the rest of the chain needs (prefix-stop).
        cpu.accessed([e.key for e in reversed(entries)], promoted=True)
        # A GPU hit whose bytes are still being written (another op's restore or
        # store) is only as good as that write: the op fails if it fails.
        for c in copies.busy_copies(alloc.block_ids[: alloc.num_hit_blocks], writes_only=True):
            copies.attach(op, c)
        vacate = demoter.vacate(alloc.evicted, op)
        # A reused block may still be read by a copy that took it before its hash went (a clean-ahead
        # demotion a clear raced): the engine writes the misses only once the op is done.
        copies.wait_for(op, copies.busy_copies(alloc.block_ids[alloc.num_hit_blocks:]))
        restored_blocks = [dst for _, dst in cpu_hits]
        if cpu_hits:
            copy = copies.copy(CopyKind.RESTORE, cpu.storage, [e.slot for e in entries],  # type: ignore[union-attr]
                               state.gpu, restored_blocks, after=vacate | copies.busy_copies(restored_blocks))
            copy.on_done.append(lambda ok, es=entries: [cpu.end_read(e) for e in es])  # type: ignore[arg-type]
            copies.mark_gpu_busy(copy, restored_blocks)
            self.counters.restores += len(cpu_hits)
            copies.attach(op, copy)

        # Every block this call committed: restored ones, and misses the engine
        # computes only once the op succeeds.
        committed = [(alloc.block_ids[pos], hashes[pos])
                     for pos in range(alloc.num_hit_blocks, min(len(hashes), len(alloc.block_ids)))]

        def undo_on_failure(ok: bool) -> None:
            bm = state.bm
            if ok or bm is None:
                return
            # Withdraw the hashes whose bytes never arrived, also when the
            # request was freed while the copy was in flight.
            withdrawn = []
            for block_id, key in committed:
                if bm.blocks[block_id].block_hash == key:
                    bm.discard_hash(bm.blocks[block_id])
                    withdrawn.append(key)
            demoter.dropped(withdrawn)
            if bm.has_request(request_id):
                bm.free(request_id)

        op._finalizers.append(undo_on_failure)
        copies.settle(op)
        demoter.clean_ahead()
        return op

    def append(self, request_id: str, num_new_tokens: int, new_hashes: Sequence[bytes]) -> Op:
        bm = self.state.require_gpu()
        try:
            alloc = bm.append(request_id, num_new_tokens, new_hashes)
        except NoFreeBlocks as exc:
            raise NoSpace(str(exc)) from None
        except KeyError as exc:
            raise NotFound(str(exc)) from None
        except ValueError as exc:
            raise PoolError(str(exc)) from None
        op = Op(self.driver, "append", {"block_ids": alloc.block_ids, "new_block_ids": alloc.new_block_ids})
        copies = self.copies
        self.demoter.vacate(alloc.evicted, op)
        copies.wait_for(op, copies.busy_copies(alloc.new_block_ids))  # as in allocate
        copies.settle(op)
        return op

    def free(self, request_id: str, *, valid_tokens: int | None) -> None:
        bm = self.state.require_gpu()
        try:
            bm.free(request_id, valid_tokens=valid_tokens)
        except KeyError as exc:
            raise NotFound(str(exc)) from None
        self.demoter.clean_ahead()
