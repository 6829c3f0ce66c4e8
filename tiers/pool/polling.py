"""The pool's ``poll``: apply what finished in the background, on the pool's thread.

- ``poll(wait_s)`` hands the adoption verifier's verdicts to the CPU tier
  (``adoption`` set: a persistent CPU tier), finishes the copies the
  transfer engine completed (waiting up to ``wait_s`` for the oldest), and
  returns the ops that completed. Completed ops may have released blocks
  into the free queue (as bookkeeping mode does at once, inside the call):
  the clean-ahead that follows is still part of those calls, so their keys
  stay protected.
- ``wait_idle(timeout_s)`` polls until no copy is in flight; False at the
  timeout.
- It is every ``Op``'s driver (``copies.OpDriver``): what ``Op.wait`` polls.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvtier.tiers.pool.copies import CopyScheduler, Op
from kvtier.tiers.pool.demotion import Demoter

if TYPE_CHECKING:
    from kvtier.tiers.pool.adoption import Adoption


class Poller:
    def __init__(self, copies: CopyScheduler, demoter: Demoter) -> None:
        self.copies = copies
        self.demoter = demoter
        self.adoption: Adoption | None = None  # set by TieredPool.attach_arena
        self._completed: list[Op] | None = None  # set while poll() runs

    def note_completed(self, op: Op) -> None:
        if self._completed is not None:
            self._completed.append(op)

    def poll(self, wait_s: float = 0.0) -> list[Op]:
        completed = self._completed = []
        if self.adoption is not None:
            self.adoption.apply()
        try:
            self.copies.poll(wait_s)
            if completed:
                self.demoter.clean_ahead(frozenset().union(*(op.protected for op in completed)))
            return completed
        finally:
            self._completed = None

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.copies.busy:
            if time.monotonic() >= deadline:
                return False
            self.poll(wait_s=0.01)
        return True
