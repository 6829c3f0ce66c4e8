"""Pins: an owner's hold on a held prefix (GPU: a reference; CPU: a pin count).

A remote hit is pinned in the CPU tier, where ``TieredPool.pin`` fetched it.

Each pin records the tier, the holder and the hash pinned (not the block's
hash: a failed write may withdraw that). ``unpin`` drops, per hash asked for
(last first), the owner's newest pin on it; ``unpin_all`` drops all of them.
When the GPU tier goes away its pins go with it; CPU pins stay.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tiers.block_manager import Block
from kvtier.tiers.cpu_tier import CpuEntry, CpuTier
from kvtier.tiers.pool.base import Held, Tier
from kvtier.tiers.pool.state import PoolState


class Pins:
    def __init__(self, state: PoolState, cpu: CpuTier) -> None:
        self.state = state  # its GPU tier (bm), read at each call
        self.cpu = cpu
        self.by_owner: dict[str, list[tuple[Tier, Block | CpuEntry, bytes]]] = {}  # (tier, holder, hash pinned)

    def __len__(self) -> int:
        return sum(len(p) for p in self.by_owner.values())

    def pin(self, owner: str, hashes: Sequence[bytes], held: Held) -> None:
        bm = self.state.bm
        pins = self.by_owner.setdefault(owner, [])
        for key, (tier, obj) in zip(hashes, held):
            if tier is Tier.GPU:
                assert bm is not None and isinstance(obj, Block)
                bm.touch([obj])
            else:
                assert isinstance(obj, CpuEntry)  # a CPU hit, or a remote one fetched into the CPU tier
                self.cpu.pin(obj)
                tier = Tier.CPU
            # The hash pinned, not the block's: a failed write may withdraw that.
            pins.append((tier, obj, key))

    def unpin(self, owner: str, hashes: Sequence[bytes]) -> int:
        pins = self.by_owner.get(owner, [])
        # Each hash asked for (last first) drops the owner's newest pin on it. An
        # index of pin positions per hash keeps this linear: scanning the pins
        # for every hash stalled the caller for minutes at 65536 x 65536.
        positions: dict[bytes, list[int]] = {}
        for i, (_tier, _obj, key) in enumerate(pins):
            positions.setdefault(key, []).append(i)
        dropped: set[int] = set()
        for h in reversed(hashes):
            newest = positions.get(h)
            if newest:
                i = newest.pop()
                self._release(pins[i][0], pins[i][1])
                dropped.add(i)
        if dropped:
            pins[:] = [pin for i, pin in enumerate(pins) if i not in dropped]
            if not pins:
                # Owners come and go (a pin tag per request): none is kept once it holds nothing.
                del self.by_owner[owner]
        return len(dropped)

    def unpin_all(self, owner: str) -> int:
        pins = self.by_owner.pop(owner, [])
        for tier, obj, _key in reversed(pins):
            self._release(tier, obj)
        return len(pins)

    def detach_gpu(self) -> None:
        """The GPU tier is going away: its pins go (the blocks with it), CPU pins stay."""
        for owner, pins in self.by_owner.items():
            self.by_owner[owner] = [pin for pin in pins if pin[0] is Tier.CPU]

    def _release(self, tier: Tier, obj: Block | CpuEntry) -> None:
        if tier is Tier.GPU:
            bm = self.state.bm
            if bm is not None:
                assert isinstance(obj, Block)
                bm.release([obj])
        else:
            assert isinstance(obj, CpuEntry)
            self.cpu.unpin(obj)
