"""The ``"+admit2"`` policy wrapper (second-sighting admission).

``"<policy>+admit2"`` -- ``AdmissionWrapper``
    Second-sighting admission (the "doorkeeper" idea of TinyLFU, G. Einziger,
    R. Friedman, B. Manes, "TinyLFU: A Highly Efficient Cache Admission
    Policy", ACM ToS 2017, and the "cache on second hit" rule of CDNs, B. M.
    Maggs and R. K. Sitaraman, "Algorithmic Nuggets in Content Delivery", ACM
    SIGCOMM CCR 2015): a key is cached only once it has been seen before, so blocks of
    one-off prompts never displace reused ones. The rule is spelled out on
    the class. The seen-set is a bounded LRU of keys. Everything but
    ``admit`` and ``record_request`` (and its resumable form
    ``record_request_steps``) is delegated to the wrapped policy.
    Cost: O(len(keys)) per ``record_request``, O(1) per ``admit``, plus the
    wrapped policy's costs.

The notes every policy of this package shares (how the tier's calls map onto
the classic algorithms) are in ``kvtier.tiers.policies``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies.base import EvictionPolicy


__all__ = ["AdmissionWrapper", "SecondSightingAdmission"]


@dataclass(slots=True)
class _Sighting:
    """What the admission filter remembers about one key."""

    # Distinct requests (record_request calls) that looked the key up.
    requests: int = 0
    # An admit() was rejected while no request had looked the key up: a
    # sighting that no lookup accounts for (e.g. an engine storing blocks
    # it never looked up).
    rejected_unrequested: bool = False


class AdmissionWrapper(EvictionPolicy):
    """Admit a key on its second sighting ("admit2").

    Rule: ``admit(key)`` is True iff, counting only sightings *before* the one
    that produced the block being admitted, the key was seen at least once:

    - at least two distinct requests looked it up (``record_request``): the
      latest lookup is the request that computed the block, the one before it
      is the earlier sighting; or
    - an earlier ``admit(key)`` was rejected while no request had yet looked
      it up. That rejection is itself a sighting (a store no lookup explains),
      so the next ``admit`` of a never-looked-up key passes, and so does the
      next after one lookup.

    A rejection after a lookup adds nothing: it is the same request's block,
    and counting it would let every key in on its first request. A key is
    counted once per ``record_request`` call however often it repeats in it.

    The seen-set is an LRU of at most ``seen_bound`` keys (default
    ``max(4 * capacity, 1024)``); a key that falls out of it starts over. If
    this rule admits, the wrapped policy's ``admit`` has the last word.
    """

    name = "admit2"

    def __init__(self, inner: EvictionPolicy, seen_bound: int | None = None) -> None:
        super().__init__(inner.capacity_blocks)
        if seen_bound is None:
            seen_bound = max(4 * inner.capacity_blocks, 1024)
        if seen_bound < 1:
            raise ValueError(f"seen_bound must be >= 1, got {seen_bound}")
        self.inner = inner
        self.seen_bound = seen_bound
        self._seen: OrderedDict[bytes, _Sighting] = OrderedDict()

    @property
    def tracked(self) -> int:
        """Number of keys in the seen-set."""
        return len(self._seen)

    def admit(self, key: bytes) -> bool:
        return self.second_sighting(key) and self.inner.admit(key)

    def second_sighting(self, key: bytes) -> bool:
        """This wrapper's rule alone, without the wrapped policy's word (a rejection counts as above)."""
        sighting = self._touch(key)
        if sighting.requests >= 2 or sighting.rejected_unrequested:
            return True
        if sighting.requests == 0:
            sighting.rejected_unrequested = True
        return False

    def record_hints(self, keys: Sequence[bytes], hints: RequestHints) -> None:
        self.inner.record_hints(keys, hints)

    def record_request(self, keys: Sequence[bytes]) -> None:
        self._count_request(keys)
        self.inner.record_request(keys)

    def record_request_steps(self, keys: Sequence[bytes], chunk_keys: int = 64) -> Iterator[None]:
        # The seen-set is counted in the first step (cheap next to the wrapped policy's work),
        # then the wrapped policy records in its own steps.
        self._count_request(keys)
        yield from self.inner.record_request_steps(keys, chunk_keys)

    def _count_request(self, keys: Sequence[bytes]) -> None:
        for key in dict.fromkeys(keys):
            self._touch(key).requests += 1

    def on_insert(self, key: bytes) -> None:
        self.inner.on_insert(key)

    def on_hit(self, key: bytes) -> None:
        self.inner.on_hit(key)

    def on_remove(self, key: bytes) -> None:
        self.inner.on_remove(key)

    def on_promote(self, keys: Sequence[bytes]) -> None:
        self.inner.on_promote(keys)

    def on_gpu_drop(self, keys: Sequence[bytes]) -> None:
        self.inner.on_gpu_drop(keys)

    def victims(self) -> Iterator[bytes]:
        return self.inner.victims()

    def __len__(self) -> int:
        return len(self.inner)

    def remembered_keys(self) -> int:
        return len(self._seen) + self.inner.remembered_keys()

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
