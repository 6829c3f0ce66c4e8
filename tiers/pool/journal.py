"""The pool's key journal: which keys it started and stopped holding, in order, for routers.

A KV-aware router (llm-d, Dynamo) routes a request to the node whose caches
hold its prefix. It learns what a node holds from events: vLLM publishes
its own GPU cache's, and the kvtier connector adds kvtierd's (``events``
verb, docs/protocol.md). This module is where those come from.

Contract
========

- A key is *held* while the GPU tier's index or the CPU tier's entries
  (ready or being written) have it: what ``Resolver.holds`` says.
- ``KeyJournal(capacity_events)`` records ``STORED`` when a key becomes held
  and ``REMOVED`` when it stops being held, each with a sequence number
  (1, 2, ...). A key moving between tiers is held throughout: no event
  (clean-ahead copies a block to the CPU tier before the GPU tier lets it
  go). A block the GPU tier evicts before its CPU copy exists shows as
  ``REMOVED`` then ``STORED`` in the same call: readers apply events in
  order. A duplicate GPU block of a held key changes nothing.
- ``since(cursor, max_events)`` returns ``(events, next_cursor, lost)``: the
  events numbered above ``cursor``, oldest first, at most ``max_events``;
  ``next_cursor`` is the cursor to ask with next time; ``lost`` is True when
  events after ``cursor`` were dropped from the ring (it keeps the last
  ``capacity_events``): the reader missed some and should assume nothing
  about keys it was told of (resynchronise).
- ``cursor`` is the number of the last event recorded (0 before any): a new
  reader starts there to follow from now on. ``held`` is the number of keys
  held now (each once, whatever its tiers).
- ``continue_after(reserved, reserve)``, before any event: a pool whose
  CPU tier outlived the process that numbered its events (an adopted arena)
  numbers past ``reserved`` (what that process may have handed out), so a
  follower's old cursor reads as ``lost``; ``reserve(up_to) -> limit`` is
  called before a number past the last limit is used, to persist the new
  limit. ``reserved == 0`` (nothing handed out) leaves no gap.
- ``observer(other_has)`` returns the object one tier calls
  (``added(key)``/``removed(key)``: ``BlockManager.key_observer``,
  ``CpuTier.key_observer``); ``other_has(key)`` asks the other tier, which
  tells a key changing tiers from one arriving or leaving.

Cost: one call per key a tier adds or drops, only where a pool has a journal
(the daemon's pools; trace replay runs without).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

STORED = 1
REMOVED = 2


class KeyJournal:
    def __init__(self, capacity_events: int) -> None:
        if capacity_events < 1:
            raise ValueError(f"a journal keeps at least one event, got capacity {capacity_events}")
        self.capacity_events = capacity_events
        self._events: deque[tuple[int, bytes]] = deque(maxlen=capacity_events)
        self.cursor = 0  # the number of the last event recorded
        self.held = 0  # keys held now: stored less removed
        self._reserve: Callable[[int], int] | None = None
        self._limit = 0  # numbers up to this are reserved (with _reserve)

    def continue_after(self, reserved: int, reserve: Callable[[int], int]) -> None:
        if self.cursor or self._events:
            raise ValueError("continue_after must come before the first event")
        if reserved:
            self.cursor = reserved + 1  # a gap: no event has this number, so every cursor <= reserved is lost
        self._reserve = reserve
        self._limit = reserve(self.cursor)

    def record(self, kind: int, key: bytes) -> None:
        self._events.append((kind, key))
        self.cursor += 1
        if self.cursor > self._limit and self._reserve is not None:
            self._limit = self._reserve(self.cursor)
        self.held += 1 if kind == STORED else -1

    def since(self, cursor: int, max_events: int) -> tuple[list[tuple[int, bytes]], int, bool]:
        if cursor < 0 or max_events < 1:
            raise ValueError(f"need cursor >= 0 and max_events >= 1, got {cursor} and {max_events}")
        if cursor >= self.cursor:
            # A cursor from the future (another daemon's, before a restart) reads as nothing
            # missed here; the reader follows from now on.
            return [], self.cursor, cursor > self.cursor
        first = self.cursor - len(self._events) + 1  # the number of the oldest event kept
        lost = cursor + 1 < first
        start = max(cursor + 1, first)
        end = min(self.cursor, start + max_events - 1)
        offset = start - first
        return list(itertools.islice(self._events, offset, offset + end - start + 1)), end, lost

    def observer(self, other_has: Callable[[bytes], bool]) -> TierKeys:
        return TierKeys(self, other_has)


@dataclass(slots=True)
class TierKeys:
    """One tier's view into the journal: a key it adds or drops is news unless the other tier has it."""

    journal: KeyJournal
    other_has: Callable[[bytes], bool]

    def added(self, key: bytes) -> None:
        if not self.other_has(key):
            self.journal.record(STORED, key)

    def removed(self, key: bytes) -> None:
        if not self.other_has(key):
            self.journal.record(REMOVED, key)
