"""The ``"lru"`` eviction policy: least recently used first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.tiers.policies.base import EvictionPolicy

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

    def on_hit(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[bytes]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
