"""Counters.count_request against a plain model: one count per tier, misses the rest."""

from __future__ import annotations

from hypothesis import given, strategies as st

from kvtier.tiers.pool.base import Tier
from kvtier.tiers.pool.counters import Counters


@given(st.lists(st.sampled_from(list(Tier)), max_size=40), st.integers(0, 8), st.integers(1, 3))
def test_count_request_matches_model(tiers: list[Tier], misses: int, requests: int) -> None:
    hashes = [b"h%d" % i for i in range(len(tiers) + misses)]
    counters = Counters()
    for _ in range(requests):
        counters.count_request(hashes, tiers)
    assert counters.lookups == requests
    assert counters.looked_up_blocks == requests * len(hashes)
    assert counters.hit_blocks_gpu == requests * sum(t is Tier.GPU for t in tiers)
    assert counters.hit_blocks_cpu == requests * sum(t is Tier.CPU for t in tiers)
    assert counters.hit_blocks_remote == requests * sum(t is Tier.REMOTE for t in tiers)
    assert counters.hit_blocks_disk == requests * sum(t is Tier.DISK for t in tiers)
    assert counters.miss_blocks == requests * misses
