"""Tests for ARC, S3-FIFO and the admit2 wrapper (kvtier.tiers.policies).

Each policy is driven through a tiny simulated cache that calls the policy the
way the CPU tier does: record the request, hit or (admit, evict the first
evictable victim, insert).
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.policies import POLICIES, WRAPPERS, EvictionPolicy, make_policy
from kvtier.tiers.policies.admit2 import AdmissionWrapper
from kvtier.tiers.policies.arc import ARCPolicy
from kvtier.tiers.policies.lru import LRUPolicy
from kvtier.tiers.policies.s3fifo import S3FIFOPolicy


def k(i: int) -> bytes:
    return i.to_bytes(8, "little")


class SimCache:
    """The tier's side of the contract, without bytes: a set of resident keys."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.resident: set[bytes] = set()
        self.evicted: list[bytes] = []

    def access(self, key: bytes, pinned_first: int = 0) -> bool:
        """Look up and, on a miss, try to cache ``key``. Returns True on a hit.

        ``pinned_first`` pretends the first that many victims are pinned, so
        the cache must take a later one (or the last, if there are fewer).
        """
        self.policy.record([key])
        if key in self.resident:
            self.policy.on_access([key])
            return True
        if self.capacity == 0 or not self.policy.admit([key])[0]:
            return False
        if len(self.resident) >= self.capacity:
            # Consume the iterator before changing anything, as the tier does.
            order = list(self.policy.victims())
            victim = order[min(pinned_first, len(order) - 1)]
            self.policy.on_remove(victim)
            self.resident.discard(victim)
            self.evicted.append(victim)
        self.policy.on_insert(key)
        self.resident.add(key)
        return False

    def drop(self, key: bytes) -> None:
        """Explicit removal (clear/drop) of a resident key."""
        if key in self.resident:
            self.policy.on_remove(key)
            self.resident.discard(key)

    def run(self, keys: Sequence[int]) -> list[bool]:
        return [self.access(k(i)) for i in keys]


def base_policy(policy: EvictionPolicy) -> EvictionPolicy:
    return policy.inner if isinstance(policy, AdmissionWrapper) else policy


def check_invariants(sim: SimCache) -> None:
    policy = sim.policy
    assert len(policy) == len(sim.resident)
    order = list(policy.victims())
    assert len(order) == len(set(order)), "victims() yielded a key twice"
    assert set(order) == sim.resident
    # Asking again without changes must not reorder (S3-FIFO settles eagerly).
    assert list(policy.victims()) == order
    c = policy.capacity_blocks
    inner = base_policy(policy)
    if isinstance(inner, ARCPolicy):
        t1, t2, b1, b2 = (set(x) for x in (inner._t1, inner._t2, inner._b1, inner._b2))
        assert t1 | t2 == sim.resident
        assert not (t1 & t2) and not (b1 & b2) and not ((b1 | b2) & sim.resident)
        assert len(t1) + len(b1) <= max(c, len(t1))
        assert len(t1) + len(t2) + len(b1) + len(b2) <= max(2 * c, len(t1) + len(t2))
        assert 0.0 <= inner.p <= c
    elif isinstance(inner, S3FIFOPolicy):
        s, m, g = set(inner._small), set(inner._main), set(inner._ghost)
        assert s | m == sim.resident and not (s & m)
        assert not (g & sim.resident)
        assert inner.ghosts <= inner.ghost_capacity
        assert all(0 <= f <= S3FIFOPolicy.MAX_FREQ for f in (*inner._small.values(), *inner._main.values()))
    if isinstance(policy, AdmissionWrapper):
        assert policy.tracked <= policy.seen_bound


SPECS = ["lru", "arc", "s3fifo", "lru+admit2", "arc+admit2", "s3fifo+admit2", "s3fifo/small=0.3", "s3fifo/threshold=2"]


def build(spec: str, capacity: int) -> EvictionPolicy:
    # Non-default S3-FIFO shapes: with 10% of a small cache, S's share is one
    # key and the "S below its share" branch would hardly ever run.
    if spec == "s3fifo/small=0.3":
        return S3FIFOPolicy(capacity, small_ratio=0.3)
    if spec == "s3fifo/threshold=2":
        return S3FIFOPolicy(capacity, move_to_main_threshold=2)
    return make_policy(spec, capacity)

ops_strategy = st.lists(
    st.tuples(st.sampled_from(["access", "access", "access", "drop", "noise"]), st.integers(0, 40), st.integers(0, 3)),
    max_size=300,
)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 24), ops=ops_strategy)
def test_invariants_under_random_workload(spec: str, capacity: int, ops: list[tuple[str, int, int]]) -> None:
    policy = build(spec, capacity)
    if isinstance(policy, AdmissionWrapper):
        # Small bound so the seen-set's LRU trimming is exercised too.
        policy.seen_bound = 8
    sim = SimCache(policy, capacity)
    for op, i, skip in ops:
        key = k(i)
        if op == "access":
            sim.access(key, pinned_first=skip)
        elif op == "drop":
            sim.drop(key)
        elif key not in sim.resident:
            # Calls about non-resident keys must be harmless no-ops.
            policy.on_access([key])
            policy.on_remove(key)
        check_invariants(sim)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(1, 24), ops=ops_strategy)
def test_victims_order_is_successive_evictions(spec: str, capacity: int, ops: list[tuple[str, int, int]]) -> None:
    # The CPU tier evicts a batch from one walk of victims(); that batch must
    # be what the policy would have chosen one eviction at a time.
    policy = build(spec, capacity)
    sim = SimCache(policy, capacity)
    for op, i, skip in ops:
        if op == "drop":
            sim.drop(k(i))
        else:
            sim.access(k(i), pinned_first=skip)
    batch = list(policy.victims())
    one_by_one = copy.deepcopy(policy)
    singles: list[bytes] = []
    for _ in range(len(batch)):
        victim = next(iter(one_by_one.victims()))
        one_by_one.on_remove(victim)
        singles.append(victim)
    assert batch == singles
    assert len(one_by_one) == 0


# --- registry ---------------------------------------------------------------


def test_registered_names_and_composition() -> None:
    assert POLICIES["arc"] is ARCPolicy and POLICIES["s3fifo"] is S3FIFOPolicy
    assert WRAPPERS["admit2"] is AdmissionWrapper
    wrapped = make_policy("arc+admit2", 10)
    assert isinstance(wrapped, AdmissionWrapper) and isinstance(wrapped.inner, ARCPolicy)
    assert wrapped.capacity_blocks == 10 and wrapped.seen_bound == 1024
    assert make_policy("s3fifo+admit2", 1000).seen_bound == 4000
    with pytest.raises(ValueError):
        make_policy("arc+admit3", 10)


# --- ARC --------------------------------------------------------------------


def reference_arc_hits(trace: Sequence[int], c: int) -> list[bool]:
    """The ARC of the paper as one function, hit or miss per access.

    Written with the two deviations ``ARCPolicy`` documents, so the comparison
    is exact: REPLACE runs before ``p`` adapts (the tier evicts, then inserts),
    and REPLACE ignores the ``x in B2 and |T1| == p`` tie.
    """
    t1: OrderedDict[int, None] = OrderedDict()
    t2: OrderedDict[int, None] = OrderedDict()
    b1: OrderedDict[int, None] = OrderedDict()
    b2: OrderedDict[int, None] = OrderedDict()
    p = 0.0

    def replace() -> None:
        if t1 and (len(t1) > p or not t2):
            b1[t1.popitem(last=False)[0]] = None
        else:
            b2[t2.popitem(last=False)[0]] = None

    hits: list[bool] = []
    for x in trace:
        if x in t1:
            del t1[x]
            t2[x] = None
            hits.append(True)
            continue
        if x in t2:
            t2.move_to_end(x)
            hits.append(True)
            continue
        hits.append(False)
        if x in b1:
            replace()
            p = min(p + (1.0 if len(b1) >= len(b2) else len(b2) / len(b1)), float(c))
            del b1[x]
            t2[x] = None
        elif x in b2:
            replace()
            p = max(p - (1.0 if len(b2) >= len(b1) else len(b1) / len(b2)), 0.0)
            del b2[x]
            t2[x] = None
        else:
            if len(t1) + len(b1) == c:
                if len(t1) < c:
                    b1.popitem(last=False)
                    replace()
                else:
                    t1.popitem(last=False)
            elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                    b2.popitem(last=False)
                replace()
            t1[x] = None
    return hits


@pytest.mark.parametrize("seed", range(6))
def test_arc_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    c = rng.choice([1, 2, 5, 8, 16])
    # A skewed mix with a hot set and loops, so both ghost lists see hits.
    trace = [int(rng.paretovariate(1.0)) % (4 * c) if rng.random() < 0.7 else rng.randrange(6 * c) for _ in range(3000)]
    policy = ARCPolicy(c)
    sim = SimCache(policy, c)
    assert sim.run(trace) == reference_arc_hits(trace, c)
    assert 0.0 < policy.p or policy.ghosts > 0  # the trace exercised the adaptive part


def test_arc_keeps_working_set_through_scan_where_lru_loses_it() -> None:
    c = 10
    hot = list(range(5))
    scan = list(range(100, 150))
    warmup = hot * 3
    results: dict[str, list[bool]] = {}
    for name, policy in (("lru", LRUPolicy(c)), ("arc", ARCPolicy(c))):
        sim = SimCache(policy, c)
        sim.run(warmup)
        sim.run(scan)
        results[name] = sim.run(hot)
    assert results["arc"] == [True] * 5, "ARC should keep the twice-used set in T2 through a scan"
    assert results["lru"] == [False] * 5


def test_arc_ghost_hits_move_target() -> None:
    c = 4
    policy = ARCPolicy(c)
    sim = SimCache(policy, c)
    sim.run([1, 2, 3, 4, 4])  # T1 = [1, 2, 3], T2 = [4]
    sim.run([5])  # evicts 1 from T1 into B1
    assert k(1) in policy._b1 and policy.p == 0.0
    sim.run([1])  # B1 ghost hit (2 makes room): recency wanted more room
    assert policy.p == 1.0 and k(1) in policy._t2 and k(2) in policy._b1
    sim.run([3, 5])  # hits: T1 = [], T2 = [4, 1, 3, 5]
    assert next(iter(policy.victims())) == k(4)
    sim.run([6])  # evicts 4 from T2 into B2
    assert k(4) in policy._b2
    sim.run([4])  # B2 ghost hit: frequency wanted more room
    assert policy.p == 0.0 and k(4) in policy._t2


def test_arc_victims_follow_target() -> None:
    policy = ARCPolicy(8)
    for i in range(4):
        policy.on_insert(k(i))
    policy.on_access([k(0)])
    policy.on_access([k(1)])  # T1 = [2, 3], T2 = [0, 1]
    assert list(policy.victims()) == [k(2), k(3), k(0), k(1)]  # |T1| = 2 > p = 0
    policy._p = 2.0
    assert list(policy.victims()) == [k(0), k(1), k(2), k(3)]  # T1 within target: T2 first


def test_arc_zero_capacity_keeps_no_ghosts() -> None:
    policy = ARCPolicy(0)
    policy.on_insert(k(1))
    policy.on_remove(k(1))
    assert len(policy) == 0 and policy.ghosts == 0


# --- S3-FIFO ----------------------------------------------------------------


def test_s3fifo_sizes() -> None:
    assert (S3FIFOPolicy(100).small_target, S3FIFOPolicy(100).ghost_capacity) == (10, 90)
    assert (S3FIFOPolicy(3).small_target, S3FIFOPolicy(3).ghost_capacity) == (1, 2)
    assert (S3FIFOPolicy(0).small_target, S3FIFOPolicy(0).ghost_capacity) == (0, 0)
    with pytest.raises(ValueError):
        S3FIFOPolicy(10, small_ratio=1.0)
    with pytest.raises(ValueError):
        S3FIFOPolicy(10, move_to_main_threshold=0)


def test_s3fifo_evicts_one_hit_wonders_quickly() -> None:
    c = 10
    hot = list(range(5))
    wonders = list(range(100, 200))
    results: dict[str, tuple[list[bool], list[bytes]]] = {}
    for name, policy in (("lru", LRUPolicy(c)), ("s3fifo", S3FIFOPolicy(c))):
        sim = SimCache(policy, c)
        sim.run(hot * 2)
        sim.run(wonders)
        results[name] = (sim.run(hot), sim.evicted)
    hits, evicted = results["s3fifo"]
    assert hits == [True] * 5, "used keys were promoted to M and survive the stream"
    assert evicted == [k(i) for i in wonders[: len(evicted)]], "only one-hit wonders, oldest first"
    # Each wonder lived through at most the 5 insertions it takes to cross S.
    assert len(evicted) == len(wonders) - 5
    lru_hits, _ = results["lru"]
    assert lru_hits == [False] * 5


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    policy = S3FIFOPolicy(10)
    sim = SimCache(policy, 10)
    sim.run(range(11))  # 0 evicted from S into G
    assert sim.evicted == [k(0)] and k(0) in policy._ghost
    sim.run([0])
    assert k(0) in policy._main and k(0) not in policy._ghost and policy.freq(k(0)) == 0


def test_s3fifo_main_reinsertion_spends_frequency() -> None:
    policy = S3FIFOPolicy(10)
    for i in range(10):
        policy.on_insert(k(i))
        policy.on_access([k(i)])
    for _ in range(5):
        policy.on_access([k(0)])  # capped at 3
    assert policy.freq(k(0)) == 3
    # All ten used: settling promotes all of S into M, then laps M
    # decrementing counters until a head reaches 0. Key 0 heads M twice
    # before key 1 (1 -> 0 in the first lap) comes round again.
    order = list(policy.victims())
    assert order[0] == k(1)
    assert not policy._small and policy.freq(k(0)) == 1
    # The rest continue the laps: the other 0s, then key 0 after its last lap.
    assert order == [k(i) for i in range(1, 10)] + [k(0)]


def test_s3fifo_iterator_does_not_mutate() -> None:
    policy = S3FIFOPolicy(10)
    for i in range(10):
        policy.on_insert(k(i))
        if i % 2:
            policy.on_access([k(i)])
    it = policy.victims()
    snapshot = (list(policy._small.items()), list(policy._main.items()))
    order = list(it)
    assert (list(policy._small.items()), list(policy._main.items())) == snapshot
    # S is over its share, so S's used head (1) was promoted and 0 is next.
    assert order[0] == k(0)
    assert order[:5] == [k(0), k(2), k(4), k(6), k(8)]


def test_s3fifo_pinned_head_takes_next_unused() -> None:
    policy = S3FIFOPolicy(10)
    sim = SimCache(policy, 10)
    sim.run(range(10))
    sim.access(k(10), pinned_first=1)  # 0 is pinned, so 1 goes
    assert sim.evicted == [k(1)] and k(0) in sim.resident


# --- admit2 -----------------------------------------------------------------


def test_admit2_first_request_rejected_second_admitted() -> None:
    policy = make_policy("lru+admit2", 4)
    sim = SimCache(policy, 4)
    assert sim.run([1]) == [False] and not sim.resident  # looked up once: not cached
    assert sim.run([1]) == [False] and sim.resident == {k(1)}  # second request: cached
    assert sim.run([1]) == [True]


def test_admit2_lookup_then_demotion_flow() -> None:
    policy = AdmissionWrapper(LRUPolicy(4))
    blocks = [k(1), k(2), k(3)]
    policy.record(blocks + [k(1)])  # duplicates in one request count once
    # The request's own blocks are demoted: the lookup that produced them is
    # not an earlier sighting, and the rejection does not become one.
    assert not any(policy.admit([b])[0] for b in blocks)
    assert not any(policy.admit([b])[0] for b in blocks)
    policy.record(blocks[:2])
    assert [policy.admit([b])[0] for b in blocks] == [True, True, False]


def test_admit2_unrequested_keys_admitted_on_second_store() -> None:
    policy = AdmissionWrapper(LRUPolicy(4))
    assert policy.admit([k(7)])[0] is False
    assert policy.admit([k(7)])[0] is True
    # A rejected store followed by one lookup is two sightings as well.
    assert policy.admit([k(8)])[0] is False
    policy.record([k(8)])
    assert policy.admit([k(8)])[0] is True


def test_admit2_seen_set_is_bounded_lru() -> None:
    policy = AdmissionWrapper(LRUPolicy(4), seen_bound=3)
    policy.record([k(1)])
    policy.record([k(2), k(3)])
    policy.record([k(1)])  # refreshes 1
    policy.record([k(4)])  # pushes out 2, the oldest
    assert policy.tracked == 3
    policy.record([k(2)])  # 2 starts over (and pushes out 3)
    assert policy.admit([k(1)])[0] is True and policy.admit([k(2)])[0] is False


def test_admit2_delegates_and_defers_to_inner() -> None:
    class Refusing(LRUPolicy):
        def admit(self, keys: Sequence[bytes]) -> list[bool]:
            return [key != k(9) for key in keys]

    inner = Refusing(4)
    policy = AdmissionWrapper(inner)
    policy.on_insert(k(1))
    policy.on_insert(k(2))
    policy.on_access([k(1)])
    assert len(policy) == 2 and list(policy.victims()) == [k(2), k(1)]
    policy.on_remove(k(2))
    assert list(inner.victims()) == [k(1)]
    for _ in range(2):
        policy.record([k(9), k(5)])
    assert policy.admit([k(5)])[0] is True and policy.admit([k(9)])[0] is False
