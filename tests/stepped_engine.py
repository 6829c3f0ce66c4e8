"""A transfer engine for tests whose copies run only when the test runs them (``SteppedEngine``)."""

from __future__ import annotations

from collections import deque

from kvtier.blocks.layout import copy_blocks
from kvtier.tiers.transfer import CopyKind, TransferEngine, TransferError, CopyJob


class SteppedEngine(TransferEngine):
    """A transfer engine whose copies run only when the test runs them.

    Copies are real (``copy_blocks`` on real tensors), queued per priority
    class and run in order within a class, as the contract says; which class
    makes progress when is a hypothesis choice, so completion orders across
    classes are explored deterministically (a failure replays exactly).
    Copies of the kinds in ``failing`` at submission fail when they run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.queues: dict[bool, deque[CopyJob]] = {True: deque(), False: deque()}
        self.failing: set[CopyKind] = set()
        self._doomed: set[int] = set()
        self.doomed_restore_slots: set[int] = set()  # a restore into any of these fails (once)

    def _enqueue(self, job: CopyJob) -> None:
        if job.transfer.kind in self.failing:
            self._doomed.add(job.transfer.transfer_id)
        self.queues[job.transfer.high_priority].append(job)

    def run(self, high: bool, n: int) -> int:
        done = 0
        q = self.queues[high]
        while q and done < n:
            job = q.popleft()
            error = None
            try:
                if job.transfer.transfer_id in self._doomed:
                    raise RuntimeError(f"injected {job.transfer.kind.value} failure")
                if job.transfer.kind is CopyKind.RESTORE and self.doomed_restore_slots & set(job.dst_slots):
                    self.doomed_restore_slots -= set(job.dst_slots)
                    raise RuntimeError("injected restore failure")
                copy_blocks(job.src, job.src_slots, job.dst, job.dst_slots)
            except Exception as exc:
                error = TransferError(f"{job.transfer.kind.value} failed: {exc}")
            self._complete(job.transfer, error)
            done += 1
        return done

    @property
    def queued(self) -> int:
        return len(self.queues[True]) + len(self.queues[False])

    def close(self, timeout_s: float = 10.0) -> None:
        self._closed = True
