"""The pool's counters, declared once.

``Counters`` is a slotted dataclass: the pool's code bumps attributes
(``counters.demotions += n``), so a misspelt counter is an AttributeError,
not a new key. ``TieredPool.stats()`` reports them first, in declaration
order, under their field names; the daemon's ``stats`` reply, Prometheus
(``daemon/telemetry/prometheus.py``) and the tools read those names. Item access
(``counters["lookups"]``, ``dict(counters)``) reads them as a mapping.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

from kvtier.tiers.pool.base import Tier


@dataclass(slots=True)
class Counters:
    lookups: int = 0  # lookup/allocate/restore/borrow calls counted (one per request)
    looked_up_blocks: int = 0
    hit_blocks_gpu: int = 0
    hit_blocks_cpu: int = 0
    hit_blocks_remote: int = 0
    hit_blocks_disk: int = 0
    miss_blocks: int = 0
    remote_fetch_short: int = 0  # fetches that came back shorter than asked (missing or bad values)
    remote_write_backs: int = 0
    disk_fetch_short: int = 0  # disk reads that came back shorter than asked (a block bad, unreadable or gone)
    disk_write_backs: int = 0  # CPU-tier evictions the disk tier took (queued, or held already)
    demotions: int = 0  # blocks copied GPU -> CPU
    demotions_skipped_clean: int = 0  # evicted blocks the CPU tier already held
    # Demotions an eviction had to make on the spot (the op waits for them):
    # clean-ahead keeps this near zero in steady state.
    demotions_urgent: int = 0
    demotions_not_admitted: int = 0
    demotions_dropped_full: int = 0
    restores: int = 0  # blocks copied CPU -> GPU for an allocation
    stores: int = 0
    stores_present: int = 0
    stores_failed: int = 0
    loads: int = 0  # blocks restored or lent to a client
    lent_bytes: int = 0
    copy_failures: int = 0

    def count_request(self, hashes: Sequence[bytes], tiers: Sequence[Tier]) -> None:
        """One counted request (lookup, allocation, restore, borrow): its blocks, and the tier of each hit."""
        self.lookups += 1
        self.looked_up_blocks += len(hashes)
        self.miss_blocks += len(hashes) - len(tiers)
        # Most requests hit one or two tiers: stop counting once every hit is
        # accounted for. A pass for a tier that is absent costs a string
        # comparison per block (~9 ns); one for the tier present, an identity check.
        left = len(tiers)
        if not left:
            return
        n = tiers.count(_GPU)
        self.hit_blocks_gpu += n
        left -= n
        if not left:
            return
        n = tiers.count(_CPU)
        self.hit_blocks_cpu += n
        left -= n
        if not left:
            return
        n = tiers.count(_REMOTE)
        self.hit_blocks_remote += n
        left -= n
        if left:
            self.hit_blocks_disk += tiers.count(_DISK)

    def keys(self) -> tuple[str, ...]:
        return NAMES

    def __getitem__(self, name: str) -> int:
        if name not in _NAME_SET:
            raise KeyError(name)
        return getattr(self, name)  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        return iter(NAMES)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in NAMES}


_GPU, _CPU, _REMOTE, _DISK = Tier.GPU, Tier.CPU, Tier.REMOTE, Tier.DISK

NAMES: tuple[str, ...] = tuple(f.name for f in fields(Counters))
_NAME_SET = frozenset(NAMES)
