"""Policy learning: which requests the CPU tier's policy records, and when.

Every counted lookup, allocation, restore or borrow is one request to the
policy, except a repeat: a lookup followed by the allocate (or restore) of
the same hashes is one request (history-based policies would read the second
call as a reuse after zero requests), and so is a lookup repeated with
nothing in between (a scheduler polling a request that waits for room).

History-based policies learn from every request (hundreds of microseconds
for a long one). Without ``defer`` the policy records each request at once;
with it, requests queue until ``learn()``, which a server calls between
requests, in steps when asked to yield.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from collections.abc import Callable, Iterator, Sequence

from kvtier.tiers.cpu_tier import CpuTier
from kvtier.tiers.hints import RequestHints

# Keys a yielding learn() records between two checks of its should_yield: at
# about 0.5 us a key, a reply waits at most ~20 us behind bookkeeping.
LEARN_CHUNK_KEYS = 32
_DONE = object()


class LearningQueue:
    def __init__(self, cpu: CpuTier, *, defer: bool) -> None:
        self.cpu = cpu  # its .policy learns (read at each call: the policy it has now)
        self.defer = defer
        # (hashes, hints, is_request): a request to record, or hints alone (a store's)
        self.queue: deque[tuple[Sequence[bytes], RequestHints | None, bool]] = deque()
        self._learning: Iterator[None] | None = None  # the request being recorded, step by step
        self.backlog_keys = 0  # keys counted but not yet recorded
        self._looked_up: list[bytes] | None = None  # hashes of the last counted lookup

    def note(self, hashes: Sequence[bytes], *, is_lookup: bool, hints: RequestHints | None = None) -> None:
        """A counted request: record it (now, or queued), unless it repeats the last lookup."""
        if hints is not None and hints.empty:
            hints = None
        if self._looked_up is not None and list(hashes) == self._looked_up:
            if not is_lookup:
                self._looked_up = None
            if hints is not None:
                self.note_hints(hashes, hints)  # the repeat may say more than the lookup did
            return
        self._looked_up = list(hashes) if is_lookup else None
        if self.defer:
            self.queue.append((hashes, hints, True))
            self.backlog_keys += len(hashes)
        else:
            if hints is not None:
                self.cpu.policy.record_hints(hashes, hints)
            self.cpu.policy.record_request(hashes)

    def note_hints(self, hashes: Sequence[bytes], hints: RequestHints) -> None:
        """Hints without a request to count (a store's, a repeat's): in order with the requests, marked
        ``continues`` so that a policy does not read them as a new request."""
        if hints.empty:
            return
        hints = replace(hints, continues=True)
        if self.defer:
            self.queue.append((hashes, hints, False))
            self.backlog_keys += len(hashes)  # a server learns only while something is owed
        else:
            self.cpu.policy.record_hints(hashes, hints)

    def learn(self, should_yield: Callable[[], bool] | None = None, *, chunk_keys: int = LEARN_CHUNK_KEYS) -> bool:
        """See ``TieredPool.learn``."""
        policy = self.cpu.policy
        while True:
            if self._learning is None:
                if not self.queue:
                    return True
                hashes, hints, is_request = self.queue[0]
                if hints is not None:
                    policy.record_hints(hashes, hints)
                    if not is_request:
                        self.queue.popleft()
                        self.backlog_keys -= len(hashes)
                        continue
                    self.queue[0] = (hashes, None, True)  # hints recorded once, even if the steps pause
                if should_yield is None:
                    self.queue.popleft()
                    policy.record_request(hashes)
                    self.backlog_keys -= len(hashes)
                    continue
                # Stays first in the queue (and in the backlog) until recorded.
                self._learning = policy.record_request_steps(hashes, chunk_keys)
            elif should_yield is None:
                for _ in self._learning:
                    pass
                self._finish_learning()
            else:
                if should_yield():
                    return False
                if next(self._learning, _DONE) is _DONE:
                    self._finish_learning()

    def _finish_learning(self) -> None:
        self._learning = None
        self.backlog_keys -= len(self.queue.popleft()[0])
