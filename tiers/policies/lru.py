"""The ``"lru"`` eviction policy: least recently used first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvtier.tiers.policies.base import EvictionPolicy, PolicyStats

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """Least recently used first. O(1) per operation."""

    name = "lru"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, keys: Sequence[bytes], promoted: bool = False) -> None:
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[bytes]:
        return iter(self._order)

    def stats(self) -> PolicyStats:
        return PolicyStats(len(self._order), len(self._order))
