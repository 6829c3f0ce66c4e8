"""The ``"+admit2"`` policy wrapper (second-sighting admission).

``"<policy>+admit2"`` -- ``AdmissionWrapper``
    Second-sighting admission (the "doorkeeper" idea of TinyLFU, G. Einziger,
    R. Friedman, B. Manes, "TinyLFU: A Highly Efficient Cache Admission
    Policy", ACM ToS 2017, and the "cache on second hit" rule of CDNs, B. M.
    Maggs and R. K. Sitaraman, "Algorithmic Nuggets in Content Delivery", ACM
    SIGCOMM CCR 2015): a key is cached only once it has been seen before, so blocks of
    one-off prompts never displace reused ones. The rule is spelled out on
    the class. The seen-set is a bounded LRU of keys. Every hook but
    ``admit``, ``learn`` and ``stats`` is the wrapped policy's
    (``PolicyWrapper``).
    Cost: O(len(keys)) per ``learn``, O(1) per key of ``admit``, plus the
    wrapped policy's costs.

The notes every policy of this package shares (how the tier's calls map onto
the classic algorithms) are in ``kvtier.tiers.policies``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier.tiers.policies.base import ALL_KEYS, EvictionPolicy, PolicyRequest, PolicyStats, PolicyWrapper


__all__ = ["AdmissionWrapper", "SecondSightingAdmission"]


@dataclass(slots=True)
class _Sighting:
    """What the admission filter remembers about one key."""

    # Distinct requests (counted ``learn`` calls) that looked the key up.
    requests: int = 0
    # An admit() was rejected while no request had looked the key up: a
    # sighting that no lookup accounts for (e.g. an engine storing blocks
    # it never looked up).
    rejected_unrequested: bool = False


class AdmissionWrapper(PolicyWrapper):
    """Admit a key on its second sighting ("admit2").

    Rule: ``admit(key)`` is True iff, counting only sightings *before* the one
    that produced the block being admitted, the key was seen at least once:

    - at least two distinct requests looked it up (``learn``): the
      latest lookup is the request that computed the block, the one before it
      is the earlier sighting; or
    - an earlier ``admit(key)`` was rejected while no request had yet looked
      it up. That rejection is itself a sighting (a store no lookup explains),
      so the next ``admit`` of a never-looked-up key passes, and so does the
      next after one lookup.

    A rejection after a lookup adds nothing: it is the same request's block,
    and counting it would let every key in on its first request. A key is
    counted once per request however often it repeats in it; a follow-up
    (``PolicyRequest.counted`` False) is not a request.

    The seen-set is an LRU of at most ``seen_bound`` keys (default
    ``max(4 * capacity, 1024)``); a key that falls out of it starts over. If
    this rule admits, the wrapped policy's ``admit`` has the last word.
    """

    name = "admit2"

    def __init__(self, inner: EvictionPolicy, seen_bound: int | None = None) -> None:
        super().__init__(inner)
        if seen_bound is None:
            seen_bound = max(4 * inner.capacity_blocks, 1024)
        if seen_bound < 1:
            raise ValueError(f"seen_bound must be >= 1, got {seen_bound}")
        self.seen_bound = seen_bound
        self._seen: OrderedDict[bytes, _Sighting] = OrderedDict()

    @property
    def tracked(self) -> int:
        """Number of keys in the seen-set."""
        return len(self._seen)

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """This wrapper's rule per key; the wrapped policy answers for the keys it lets through."""
        passed = [self.second_sighting(key) for key in keys]
        if not any(passed):
            return passed
        inner = iter(self.inner.admit([key for key, yes in zip(keys, passed) if yes]))
        return [yes and next(inner) for yes in passed]

    def second_sighting(self, key: bytes) -> bool:
        """This wrapper's rule alone, without the wrapped policy's word (a rejection counts as above)."""
        sighting = self._touch(key)
        if sighting.requests >= 2 or sighting.rejected_unrequested:
            return True
        if sighting.requests == 0:
            sighting.rejected_unrequested = True
        return False

    def learn(self, request: PolicyRequest, chunk_keys: int = ALL_KEYS) -> Iterator[None]:
        steps = self.inner.learn(request, chunk_keys)  # the wrapped policy takes the hints now
        return self._count_then(request.keys, steps) if request.counted else steps  # a follow-up is no sighting

    def _count_then(self, keys: Sequence[bytes], steps: Iterator[None]) -> Iterator[None]:
        # The seen-set is counted in the first step (cheap next to the wrapped policy's work),
        # then the wrapped policy learns in its own steps.
        for key in dict.fromkeys(keys):
            self._touch(key).requests += 1
        yield from steps

    def stats(self) -> PolicyStats:
        inner = self.inner.stats()
        return PolicyStats(inner.resident_keys, len(self._seen) + inner.remembered_keys)

    def _touch(self, key: bytes) -> _Sighting:
        sighting = self._seen.get(key)
        if sighting is None:
            sighting = self._seen[key] = _Sighting()
            # The new record sits at the MRU end, so trimming never drops it.
            while len(self._seen) > self.seen_bound:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(key)
        return sighting


class SecondSightingAdmission:
    """An ``AdmissionWrapper``'s rule as an admission filter of its own: a tier below the CPU tier
    (the disk tier) admits what the pool's ``+admit2`` would, from the same sightings."""

    __slots__ = ("wrapper",)

    def __init__(self, wrapper: AdmissionWrapper) -> None:
        self.wrapper = wrapper

    def admit(self, key: bytes) -> bool:
        return self.wrapper.second_sighting(key)
