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
from collections.abc import Callable, Iterator, Sequence

from kvtier.tiers.cpu_tier import CpuTier

# Keys a yielding learn() records between two checks of its should_yield: at
# about 0.5 us a key, a reply waits at most ~20 us behind bookkeeping.
LEARN_CHUNK_KEYS = 32
_DONE = object()


class LearningQueue:
    def __init__(self, cpu: CpuTier, *, defer: bool) -> None:
        self.cpu = cpu  # its .policy learns (read at each call: the policy it has now)
        self.defer = defer
        self.queue: deque[Sequence[bytes]] = deque()
        self._learning: Iterator[None] | None = None  # the request being recorded, step by step
        self.backlog_keys = 0  # keys counted but not yet recorded
        self._looked_up: list[bytes] | None = None  # hashes of the last counted lookup

    def note(self, hashes: Sequence[bytes], *, is_lookup: bool) -> None:
        """A counted request: record it (now, or queued), unless it repeats the last lookup."""
        if self._looked_up is not None and list(hashes) == self._looked_up:
            if not is_lookup:
                self._looked_up = None
            return
        self._looked_up = list(hashes) if is_lookup else None
        if self.defer:
            self.queue.append(hashes)
            self.backlog_keys += len(hashes)
        else:
            self.cpu.policy.record_request(hashes)

    def learn(self, should_yield: Callable[[], bool] | None = None, *, chunk_keys: int = LEARN_CHUNK_KEYS) -> bool:
        """See ``TieredPool.learn``."""
        policy = self.cpu.policy
        while True:
            if self._learning is None:
                if not self.queue:
                    return True
                if should_yield is None:
                    hashes = self.queue.popleft()
                    policy.record_request(hashes)
                    self.backlog_keys -= len(hashes)
                    continue
                # Stays first in the queue (and in the backlog) until recorded.
                self._learning = policy.record_request_steps(self.queue[0], chunk_keys)
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
        self.backlog_keys -= len(self.queue.popleft())
