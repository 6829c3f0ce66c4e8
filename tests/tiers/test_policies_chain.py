"""Tests for the "chain" policy (kvtier.tiers.policies.chain): contract, learning, admission, measured rates."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.policies import make_policy
from kvtier.tiers.policies.chain import ChainPolicy

TRACES = Path("/work/shared/traces")


def k(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_registered_by_name() -> None:
    assert isinstance(make_policy("chain", 10), ChainPolicy)
    assert make_policy("chain+admit2", 10).inner.name == "chain"


def test_victims_are_the_resident_keys_once_each_tail_first() -> None:
    p = ChainPolicy(100, horizon=64, bucket_width=1)  # one window per request
    p.record([k(0), k(1), k(2)])
    p.record([k(10), k(11)])
    for i in (0, 1, 2, 10, 11):
        p.on_insert(i.to_bytes(8, "little"))
    p.on_insert(k(1))  # already resident: no-op
    assert len(p) == 5
    order = list(p.victims())
    assert sorted(order) == sorted([k(0), k(1), k(2), k(10), k(11)])
    # No statistics yet: oldest request first, each request's chain from its tail.
    assert order == [k(2), k(1), k(0), k(11), k(10)]
    p.on_remove(k(2))
    p.on_remove(k(2))  # not resident any more: no-op
    p.on_remove(k(99))
    assert len(p) == 4 and k(2) not in list(p.victims())


def test_learns_which_class_comes_back() -> None:
    """Conversations (chains used again and again every 40 requests) against one-off documents
    (8 new blocks never seen again): once learned, the one-offs are evicted first even when the
    conversation blocks are older."""
    p = ChainPolicy(1000, horizon=512, bucket_width=8)
    convs = [[k(1_000_000 + 100 * c + j) for j in range(2)] for c in range(40)]
    fresh = iter(range(10**6))
    for t in range(2400):
        if t % 2 == 0:
            c = (t // 2) % 40  # conversation c comes back every 40 requests
            p.record(convs[c])
        else:
            p.record([k(next(fresh)) for _ in range(8)])
    # Keys resident now: one conversation used 10 requests ago and a document used just now.
    p.on_insert(convs[(2398 // 2) % 40 - 5][0])
    doc = [k(next(fresh)) for _ in range(8)]
    p.record(doc)
    for key in doc:
        p.on_insert(key)
    order = list(p.victims())
    assert set(order[:8]) == set(doc)
    assert order[8] == convs[(2398 // 2) % 40 - 5][0]


def test_admission_rejects_what_is_worse_than_the_victims() -> None:
    """Learned: the chain [1,2,3] comes back every other request, one-off blocks never. In a full
    tier whose last victim was a chain block, a one-off is not worth admitting; a chain block is."""
    p = ChainPolicy(2, horizon=512, bucket_width=1)
    chain = [k(1), k(2), k(3)]
    fresh = iter(range(100, 10**6))
    for t in range(1200):
        p.record(chain if t % 2 == 0 else [k(next(fresh))])
    one_off = k(next(fresh))
    p.record([one_off])
    assert p.admit([one_off])[0]  # not full: everything is admitted
    p.on_insert(chain[0])
    p.on_insert(chain[1])
    p.on_remove(chain[1])  # the tier evicted a chain block ...
    p.on_insert(chain[1])  # ... and the tier is full again
    assert not p.admit([one_off])[0]
    assert p.admit([chain[2]])[0]
    assert ChainPolicy(2, admission=False).admit([one_off])[0]


def test_metadata_stays_bounded() -> None:
    p = ChainPolicy(10, horizon=256, bucket_width=8)
    for i in range(3000):
        p.record([k(10 * i + j) for j in range(5)])
    assert len(p._meta) <= 256 * 5 + 10
    assert len(p._pending) <= 256 * 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["req", "ins", "rem", "vic"]),
                          st.lists(st.integers(0, 30), min_size=1, max_size=6)), max_size=250))
def test_random_operations_keep_the_contract(ops: list[tuple[str, list[int]]]) -> None:
    p = ChainPolicy(8, horizon=64, bucket_width=4)
    resident: set[bytes] = set()
    for op, ids in ops:
        keys = [k(i) for i in ids]
        if op == "req":
            p.record(keys)
        elif op == "ins":
            p.on_insert(keys[0])
            resident.add(keys[0])
        elif op == "rem":
            p.on_remove(keys[0])
            resident.discard(keys[0])
        else:
            p.admit([keys[0]])[0]
        order = list(p.victims())
        assert len(order) == len(set(order)) == len(p) == len(resident)
        assert set(order) == resident


@pytest.mark.slow
@pytest.mark.parametrize("trace, lru_floor_gap, floor", [
    ("mooncake_conversation_trace.jsonl", None, 0.18),
    ("mooncake_synthetic_trace.jsonl", 0.01, None),
])
def test_measured_on_the_shared_traces(trace: str, lru_floor_gap: float | None, floor: float | None) -> None:
    """The issue's bar at GPU 195 / CPU 5,859 blocks: >= 0.18 on conversation, within 1 point of LRU on
    synthetic."""
    path = TRACES / trace
    if not path.exists():
        pytest.skip(f"{path} not present")
    from kvtier.tools.replay import ReplayConfig, replay
    from kvtier.tools.traces import load_trace

    reqs = load_trace(path)
    chain = replay(reqs, ReplayConfig(195, 5859, "chain"))
    assert chain.hit_blocks + chain.miss_blocks == chain.looked_up_blocks
    if floor is not None:
        assert chain.block_hit_rate() >= floor
    if lru_floor_gap is not None:
        lru = replay(reqs, ReplayConfig(195, 5859, "lru"))
        assert chain.block_hit_rate() >= lru.block_hit_rate() - lru_floor_gap
