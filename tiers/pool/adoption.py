"""Adoption: a pool's CPU tier takes over a persistent arena and the blocks a previous kvtierd left in it.

Contract
========

- ``Adoption(cpu, arena, journal, ...)`` (``TieredPool.attach_arena``) makes the
  arena the CPU tier's slot recorder (every write recorded, every slot
  invalidated before reuse: ``CpuTier``'s contract), continues the pool's key
  journal past the numbers the previous process may have handed out (a
  follower's old cursor reads as ``lost``), and adopts the arena's complete
  records as CPU-tier entries, oldest first (the policy's order; learned
  policy state starts fresh), each unverified.
- Verification: an adopted block is served only once the xxh3 of its bytes
  matches its record. A verifier thread hashes the adopted blocks newest
  first (the likeliest to be asked for), off the pool's thread; ``apply()``
  (the pool's ``poll``) hands its verdicts to the CPU tier. A block asked for
  before the thread reached it is verified by the asking call itself
  (``CpuTier.get``): the first hit after a restart waits for one block's
  checksum, not for the whole arena's. A block that fails is dropped, never
  served.
- Counters (``CpuTier``): ``adopted_blocks`` (verified),
  ``adoption_dropped_blocks`` (torn records, blocks a smaller tier had no
  room for and duplicates, counted at open; blocks that failed verification
  or left before it), ``adoption_pending_blocks``.
- ``stop()`` ends the thread (the pool is closing); ``busy`` is True while
  verdicts are outstanding.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.tiers.cpu_tier import CpuEntry, CpuTier

if TYPE_CHECKING:
    from kvtier.tiers.persistent_arena import PersistentArena
    from kvtier.tiers.pool.journal import KeyJournal

log = logging.getLogger("kvtier.tiers.pool")

# Key-journal numbers reserved in the arena at a time (one header write per this many events).
EVENTS_RESERVE_STEP = 1 << 16
# The verifier wakes the loop after this many verdicts (each one is a block hashed).
VERDICTS_PER_WAKEUP = 256


class Adoption:
    """See the module docstring."""

    def __init__(self, cpu: CpuTier, arena: PersistentArena, journal: KeyJournal | None, *, name: str,
                 wakeup: Callable[[], None] | None = None) -> None:
        self.cpu = cpu
        self.arena = arena
        if cpu.storage is not arena.layout:
            raise ValueError("the arena must be the CPU tier's storage (TieredPool(cpu_storage=arena.layout))")
        cpu.slot_recorder = arena
        if journal is not None:
            # Numbers past any the previous process handed out, reserved a step at a time.
            journal.continue_after(arena.events_reserved, _event_reserver(arena))
        opened = arena.opened
        cpu.adoption_dropped_blocks += opened.dropped
        entries = cpu.adopt((r.key, r.slot) for r in opened.records)
        cpu.adoption_dropped_blocks += len(opened.records) - len(entries)  # none expected: keys are unique
        self._verdicts: deque[tuple[CpuEntry, bool]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if entries:
            todo = list(reversed(entries))  # newest first
            self._thread = threading.Thread(target=self._verify_all, args=(todo, wakeup), daemon=True,
                                            name=f"kvtier-verify-{name}"[:15])
            self._thread.start()

    def _verify_all(self, todo: list[CpuEntry], wakeup: Callable[[], None] | None) -> None:
        arena = self.arena
        n = 0
        for entry in todo:
            if self._stop.is_set():
                return
            if entry.verified:
                continue  # a racy read: verified by a hit meanwhile, or dropped (verdict ignored anyway)
            try:
                ok = arena.verify(entry.slot, entry.key)
            except Exception as exc:  # the index was closed under us: the pool is going
                log.debug("verifier stopped: %s", exc)
                return
            self._verdicts.append((entry, ok))
            n += 1
            if wakeup is not None and n % VERDICTS_PER_WAKEUP == 0:
                wakeup()
        if wakeup is not None:
            wakeup()

    def apply(self) -> None:
        """Hand the verifier's verdicts to the CPU tier (the pool's thread)."""
        cpu = self.cpu
        verdicts = self._verdicts
        while verdicts:
            entry, ok = verdicts.popleft()
            cpu.verified(entry, ok)

    @property
    def busy(self) -> bool:
        """Verdicts outstanding: the thread still hashing, or verdicts not applied yet."""
        return bool(self._verdicts) or (self._thread is not None and self._thread.is_alive())

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def _event_reserver(arena: PersistentArena) -> Callable[[int], int]:
    """The journal numbers events up to ``up_to``: reserve past it in the arena; returns the new limit.
    A function of the arena alone: the journal holds it, and the CPU tier holds the journal."""

    def reserve(up_to: int) -> int:
        limit = up_to + EVENTS_RESERVE_STEP
        arena.events_reserved = limit
        return limit

    return reserve
