"""Policy learning: which requests the CPU tier's policy records, and when.

Every counted lookup, allocation, restore or borrow is one request to the
policy, except a repeat: a lookup followed by the allocate (or restore) of
the same hashes is one request (history-based policies would read the second
call as a reuse after zero requests), and so is a lookup repeated with
nothing in between (a scheduler polling a request that waits for room).

History-based policies learn from every request (hundreds of microseconds
for a long one). Without ``defer`` the policy records each request at once;
with it, requests queue until ``learn()``, which a server calls between
requests, in steps when asked to yield (``EvictionPolicy.learn``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from collections.abc import Callable, Iterator, Sequence

from kvtier.tiers.cpu_tier import CpuTier
from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies.base import ALL_KEYS, PolicyRequest

# Keys a yielding learn() records between two checks of its should_yield: at
# about 0.5 us a key, a reply waits at most ~20 us behind bookkeeping.
LEARN_CHUNK_KEYS = 32
_DONE = object()


class LearningQueue:
    def __init__(self, cpu: CpuTier, *, defer: bool) -> None:
        self.cpu = cpu  # its .policy learns (read at each call: the policy it has now)
        self.defer = defer
        # Requests to learn, and follow-ups (a store's hints alone), in order.
        self.queue: deque[PolicyRequest] = deque()
        self._learning: Iterator[None] | None = None  # the first request of the queue, being learnt step by step
        self.backlog_keys = 0  # keys counted but not yet learnt
        self._looked_up: list[bytes] | None = None  # hashes of the last counted lookup

    def note(self, hashes: Sequence[bytes], *, is_lookup: bool, hints: RequestHints | None = None) -> None:
        """A counted request: learn it (now, or queued), unless it repeats the last lookup."""
        if hints is not None and hints.empty:
            hints = None
        # A list compares as it is (no copy of 256 references per lookup); a tuple, as a list.
        keys = hashes if type(hashes) is list else list(hashes)
        if self._looked_up is not None and keys == self._looked_up:
            if not is_lookup:
                self._looked_up = None
            if hints is not None:
                self.note_hints(hashes, hints)  # the repeat may say more than the lookup did
            return
        self._looked_up = list(keys) if is_lookup else None
        self._add(PolicyRequest(hashes, hints))

    def note_hints(self, hashes: Sequence[bytes], hints: RequestHints) -> None:
        """Hints without a request to count (a store's, a repeat's): in order with the requests, marked
        ``continues`` so that a policy does not read them as a new request."""
        if hints.empty:
            return
        self._add(PolicyRequest(hashes, replace(hints, continues=True)))

    def _add(self, request: PolicyRequest) -> None:
        if self.defer:
            self.queue.append(request)
            self.backlog_keys += len(request.keys)  # a server learns only while something is owed
        else:
            for _ in self.cpu.policy.learn(request):
                pass

    def learn(self, should_yield: Callable[[], bool] | None = None, *, chunk_keys: int = LEARN_CHUNK_KEYS) -> bool:
        """See ``TieredPool.learn``."""
        policy = self.cpu.policy
        queue = self.queue
        while True:
            if self._learning is None:
                if not queue:
                    return True
                request = queue[0]  # stays first in the queue (and in the backlog) until learnt
                # The policy takes the hints now, whatever is waiting: a retention counts before the next eviction.
                self._learning = policy.learn(request, ALL_KEYS if should_yield is None else chunk_keys)
                at_once = should_yield is None or not request.counted  # a follow-up: its hints were all of it
            else:
                at_once = should_yield is None
            if at_once:
                for _ in self._learning:
                    pass
            elif should_yield():  # type: ignore[misc]  # not at once: there is a should_yield
                return False
            elif next(self._learning, _DONE) is not _DONE:
                continue
            self._learning = None
            self.backlog_keys -= len(queue.popleft().keys)
