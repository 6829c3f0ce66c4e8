"""``RankOrder`` (``kvtier.tiers.policies.rank_order``), the heap with lazy deletion that orders the
streams of ``+session``, against a plain dict of live ranks."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.policies.rank_order import Rank, RankOrder


@dataclass(eq=False)
class Item:
    name: int
    rank: Rank = (0, 0, 0, 0.0)
    heap_seq: int = -1


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 7), st.booleans(), st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0])),
                    max_size=200))
def test_the_order_is_the_live_ranks_sorted_ties_by_the_latest_push(ops: list[tuple[int, bool, int, float]]) -> None:
    items = [Item(i) for i in range(8)]
    order: RankOrder[Item] = RankOrder()
    model: dict[int, tuple[Rank, int]] = {}  # live item -> (rank, when it was last pushed)
    for step, (i, push, band, x) in enumerate(ops):
        if push:
            order.push(items[i], (0, 0, band, x), live_bound=2)  # a small bound: rebuilds happen
            model[i] = ((0, 0, band, x), step)
        else:
            order.remove(items[i])
            model.pop(i, None)
        expected = [i for i, _ in sorted(model.items(), key=lambda e: e[1])]
        assert [item.name for item in order] == expected
        first = order.first()
        assert (first.name if first is not None else None) == (expected[0] if expected else None)
        assert sorted(item.name for item in order.live()) == sorted(model)
