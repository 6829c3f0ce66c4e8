"""Streams in rank order, for ``+session``: a binary heap with lazy deletion.

A stream's rank changes often (each request, each age bucket its silence
crosses, each refresh of the return model), while the wrapper reads the order
rarely: the lowest-ranked stream for admission, every stream in order for
``victims()``. So re-ranking an item pushes a new entry and kills its old one:
an entry is live only while its sequence number is the item's
``heap_seq``. Dead entries are skipped where they surface, and the heap is
rebuilt once they outnumber the live ones.

Cost: ``push`` O(log n) amortized; ``first`` O(log n) amortized; iteration
O(log n) per item visited, without popping; ``live`` O(n).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["Rank", "RankOrder", "Ranked"]

Rank = tuple[int, int, int, float]


class Ranked(Protocol):
    rank: Rank
    heap_seq: int  # the sequence number of its live entry; -1: not in the order


R = TypeVar("R", bound=Ranked)


class RankOrder(Generic[R]):
    """Items lowest rank first; equal ranks in the order they were (re)ranked."""

    def __init__(self) -> None:
        self._heap: list[tuple[Rank, int, R]] = []
        self._seq = itertools.count()

    def push(self, item: R, rank: Rank, live_bound: int) -> None:
        """Place ``item`` at ``rank``; an earlier entry of it dies. ``live_bound``: how many items may
        be live at most (the caller knows; it sizes the rebuild)."""
        item.rank = rank
        item.heap_seq = next(self._seq)
        heapq.heappush(self._heap, (rank, item.heap_seq, item))
        if len(self._heap) > 2 * live_bound + 64:
            live = [e for e in self._heap if e[2].heap_seq == e[1]]
            heapq.heapify(live)
            self._heap = live

    @staticmethod
    def remove(item: R) -> None:
        """Take ``item`` out of the order (its entry dies where it lies)."""
        item.heap_seq = -1

    def first(self) -> R | None:
        """The lowest-ranked live item, or None."""
        heap = self._heap
        while heap and heap[0][2].heap_seq != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def __iter__(self) -> Iterator[R]:
        """The live items, lowest rank first, without popping: a frontier of heap indices. The caller
        changes no rank while it iterates."""
        heap = self._heap
        if not heap:
            return
        frontier = [(heap[0][0], heap[0][1], 0)]
        while frontier:
            _, _, i = heapq.heappop(frontier)
            _, seq, item = heap[i]
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], heap[child][1], child))
            if item.heap_seq == seq:
                yield item

    def live(self) -> list[R]:
        """The live items in no particular order (a snapshot: the caller may re-rank them)."""
        return [item for _, seq, item in self._heap if item.heap_seq == seq]
