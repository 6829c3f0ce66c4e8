"""What the pool's parts share and the facade changes at run time: the GPU tier and clean-ahead's settings.

The parts (``copies``, ``resolve``, ``demotion`` ...) are handed the
collaborators they use when the pool is built: the CPU tier, the copy
scheduler, the counters, each other. The GPU tier is the exception: it is
attached and detached while the pool lives (``TieredPool.attach_gpu`` /
``detach_gpu``), so the parts read it here, at each call, and only the
facade writes it. No part holds the facade: the pool's object graph has no
cycle, so a dropped pool (and its tiers' memory) goes by reference count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.tiers.pool.base import PoolError

if TYPE_CHECKING:
    from kvtier.tiers.block_manager import BlockManager
    from kvtier.blocks.layout import BlockLayout


@dataclass(slots=True)
class PoolState:
    name: str  # the pool's (PoolSpec.name), for errors
    clean_ahead_blocks: int  # free-queue blocks kept demoted ahead of allocations (0: off, the idle pass too)
    bm: BlockManager | None = None  # the GPU tier's block manager; None without a GPU tier
    gpu: BlockLayout | None = None  # the GPU tier's memory (None in bookkeeping mode, or without a GPU tier)
    # Set by every call's clean-ahead (the free queue changed), cleared when the idle pass is done.
    idle_clean_pending: bool = False

    def require_gpu(self) -> BlockManager:
        if self.bm is None:
            raise PoolError(f"pool {self.name!r} has no GPU tier (register the engine's KV tensors first)")
        return self.bm

    def gpu_has(self, key: bytes) -> bool:
        """Whether the GPU tier holds ``key`` cached (the CPU tier's journal observer asks)."""
        return self.bm is not None and self.bm.get_cached(key) is not None
