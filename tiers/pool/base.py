"""The pool's vocabulary: tiers, identities, errors, and the held-prefix record."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from kvtier.tiers.block_manager import Block
from kvtier.tiers.cpu_tier import CpuEntry


class Tier(str, enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    REMOTE = "remote"
    DISK = "disk"


# One block of a held prefix: the tier it is counted for and what holds it
# there (a GPU ``Block``; a ``CpuEntry`` for CPU, and for DISK and REMOTE once
# fetched into the CPU tier). Plain tuples: resolution runs on every lookup, and a
# record object per block would cost more than the lookup itself.
HeldBlock = tuple[Tier, Union[Block, CpuEntry]]
Held = list[HeldBlock]


@dataclass(slots=True)
class Borrowed:
    """A held prefix lent in place (``TieredPool.borrow``): ``views`` are uint8 arrays over tier
    memory whose concatenation is the blocks in order. Call ``release`` once, on the pool's
    thread, when nothing reads them any more."""

    tiers: list[Tier]
    views: list[Any]
    release: Callable[[], None]
    # Each block's slot in its tier (``cpu_only`` borrows: slots of the CPU tier's slab, which a
    # persistent arena's file holds: ``kvtier.daemon.clients.lends`` hands them to same-user clients).
    slots: list[int] = field(default_factory=list)


class PoolError(ValueError):
    """A request that contradicts the pool's state or its layout."""


class NoSpace(RuntimeError):
    """The GPU tier cannot give the blocks asked for (nothing changed)."""


class NotFound(KeyError):
    """A block or request that the pool does not hold."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A pool's identity: blocks of different pools never mix."""

    name: str
    block_size: int  # tokens per block
    block_bytes: int
    extra: tuple[tuple[str, Any], ...] = ()  # model, dtype, geometry, tp rank ... (compared for equality)
