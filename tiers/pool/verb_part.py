"""What the pool's verb parts work with, and their one way to receive it.

The verb parts (``engine.EngineMode``, ``store.StoreMode``,
``lending.Lender``) each use the same seven collaborators: the ``PoolState``
(the GPU tier, read at each call), the CPU tier, the copy scheduler, prefix
resolution, demotion, policy learning and the counters. The facade builds
one ``VerbCollaborators`` record of them and hands it to each verb part,
whose ``VerbPart.__init__`` makes them its attributes (hot paths read
``self.cpu``: one attribute lookup, not two). What a part uses beyond
these it takes as its own arguments. No part gets the facade.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.tiers.cpu_tier import CpuTier
from kvtier.tiers.pool.copies import CopyScheduler
from kvtier.tiers.pool.counters import Counters
from kvtier.tiers.pool.demotion import Demoter
from kvtier.tiers.pool.learning import LearningQueue
from kvtier.tiers.pool.resolve import Resolver
from kvtier.tiers.pool.state import PoolState


@dataclass(frozen=True, slots=True)
class VerbCollaborators:
    state: PoolState  # its GPU tier (bm, gpu), read at each call
    cpu: CpuTier
    copies: CopyScheduler
    resolver: Resolver
    demoter: Demoter
    learning: LearningQueue
    counters: Counters


class VerbPart:
    """The base of the verb parts: the collaborators, as attributes."""

    def __init__(self, shared: VerbCollaborators) -> None:
        self.state = shared.state
        self.cpu = shared.cpu
        self.copies = shared.copies
        self.resolver = shared.resolver
        self.demoter = shared.demoter
        self.learning = shared.learning
        self.counters = shared.counters
