"""Policy memory is bounded by the pool's size, whatever the traffic (issue 32, item 1).

``chain`` keeps history for at most ``history_keys`` blocks besides the resident ones (default
``max(64 x capacity, 4,096)``); ``+session`` keeps at most ``chain_keys`` keys in its streams'
chains together (default ``max(64 x capacity, 16,384)``) and at most 4 events per stream (plus a
slack) in its heap. Below the bounds nothing changes (the golden digests); past them the oldest
history goes first, censored, and the least recently active streams are forgotten.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies import make_policy
from kvtier.tiers.policies.chain import FOLD_KEYS, HISTORY_KEYS_PER_BLOCK, MIN_HISTORY_KEYS, ChainPolicy
from kvtier.tiers.policies.lru import LRUPolicy
from kvtier.tiers.policies.session import _EVENTS_SLACK, CHAIN_KEYS_PER_BLOCK, MIN_CHAIN_KEYS, SessionWrapper
from tests.tiers.test_policies_chain_steps import GOLDEN, Workload, check_balanced, check_consistent, state


def fresh(tag: str, n: int) -> list[bytes]:
    return [f"{tag}/{i}".encode() for i in range(n)]


# ---- chain ---------------------------------------------------------------------------------------


def test_the_default_bounds_scale_with_the_capacity() -> None:
    assert ChainPolicy(50).history_keys == MIN_HISTORY_KEYS
    assert ChainPolicy(10_000).history_keys == HISTORY_KEYS_PER_BLOCK * 10_000
    p = make_policy("chain+session", 10_000)
    assert isinstance(p, SessionWrapper) and p.chain_keys == CHAIN_KEYS_PER_BLOCK * 10_000
    assert make_policy("chain+session", 10).chain_keys == MIN_CHAIN_KEYS


def test_never_seen_keys_do_not_grow_chain_past_its_history_bound() -> None:
    """The issue's flood: every request 3,000 keys nobody asked for before."""
    p = ChainPolicy(50, horizon=4096, bucket_width=32, history_keys=2_000)
    resident = fresh("resident", 50)
    for key in resident:
        p.on_insert(key)
    for r in range(60):
        p.record_request(fresh(f"flood{r}", 3_000))
        assert p._history <= p.history_keys
        assert p.remembered_keys() == len(p._meta) <= len(resident) + p.history_keys
        assert p._entries <= 2 * p._history + p.history_keys
        check_balanced(p)
    assert p.forgotten_uses == 60 * 3_000 - 2_000
    check_consistent(p, set(resident))  # resident blocks keep their records and their order


def test_unbounded_chain_keeps_every_key_of_the_horizon() -> None:
    """The same flood without the bound: the history grows with the traffic (what the bound stops)."""
    p = ChainPolicy(50, horizon=4096, bucket_width=32, history_keys=10**9)
    for r in range(20):
        p.record_request(fresh(f"flood{r}", 3_000))
    assert len(p._meta) == 60_000 and p.forgotten_uses == 0


def test_one_request_longer_than_the_bound_keeps_its_head() -> None:
    p = ChainPolicy(10, history_keys=100)
    keys = fresh("long", 1_000)
    p.record_request(keys)
    assert set(p._meta) == set(keys[:100])  # the deepest blocks are forgotten first
    p.record_request(keys[:50])
    assert all(p._meta[key].uses == 2 for key in keys[:50])  # a reuse, with its gap counted
    check_balanced(p)


def test_a_long_request_folds_its_counts_at_once() -> None:
    p = ChainPolicy(10, history_keys=10 * FOLD_KEYS)
    p.record_request(fresh("long", FOLD_KEYS + 1))
    assert not p._born and p._pend.sum() == FOLD_KEYS + 1


def test_at_its_peak_history_the_bound_changes_nothing_and_one_key_less_does() -> None:
    """The golden workload "w4" holds at most 789 blocks of history: a bound of 789 decides exactly as
    the golden digest; 788 forgets and decides otherwise."""
    def digest(history_keys: int) -> tuple[str, int]:
        p = ChainPolicy(24, horizon=64, bucket_width=4, epochs=2, min_samples=20.0, history_keys=history_keys)
        return Workload(p, 24, 1).run(3000), p.forgotten_uses

    assert digest(789) == (GOLDEN["w4", 1], 0)
    changed, forgotten = digest(788)
    assert forgotten > 0 and changed != GOLDEN["w4", 1]


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["req", "ins", "rem"]), st.lists(st.integers(0, 60), min_size=1,
                                                                                 max_size=25)), max_size=150),
       history_keys=st.integers(0, 40), chunk_keys=st.sampled_from([1, 7, 64]))
def test_history_stays_bounded_and_balanced_on_any_traffic(ops: list[tuple[str, list[int]]], history_keys: int,
                                                           chunk_keys: int) -> None:
    p = ChainPolicy(8, horizon=32, bucket_width=4, min_samples=5.0, history_keys=history_keys)
    resident: set[bytes] = set()
    for op, ids in ops:
        keys = [i.to_bytes(2, "little") for i in ids]
        if op == "req":
            for _ in p.record_request_steps(keys, chunk_keys):
                pass
            assert p._history <= history_keys
            assert len(p._meta) <= len(resident) + history_keys
            assert p._entries <= 2 * p._history + history_keys
            check_balanced(p)
        elif op == "ins" and len(resident) < 8:
            p.on_insert(keys[0])
            resident.add(keys[0])
        elif op == "rem":
            p.on_remove(keys[0])
            resident.discard(keys[0])
        check_consistent(p, resident)


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.lists(st.integers(0, 80), max_size=30), max_size=60), chunk_keys=st.integers(1, 8),
       history_keys=st.integers(0, 25))
def test_forgetting_in_steps_leaves_the_state_of_record_request(requests: list[list[int]], chunk_keys: int,
                                                               history_keys: int) -> None:
    a, b = (ChainPolicy(6, horizon=16, bucket_width=2, min_samples=3.0, history_keys=history_keys) for _ in range(2))
    for ids in requests:
        keys = [i.to_bytes(2, "little") for i in ids]
        a.record_request(keys)
        for _ in b.record_request_steps(keys, chunk_keys):
            pass
        assert state(a) == state(b)
        assert (a._history, a._entries, a.forgotten_uses) == (b._history, b._entries, b.forgotten_uses)


# ---- +session ------------------------------------------------------------------------------------


def hinted(p: SessionWrapper, keys: list[bytes], session: str, at_s: float, **more: float) -> None:
    p.record_hints(keys, RequestHints(session=session.encode(), at_s=at_s, **more))  # type: ignore[arg-type]
    p.record_request(keys)


def chain_entries(p: SessionWrapper) -> int:
    return sum(len(s.chain) for s in p._streams.values())


def test_a_new_session_per_request_does_not_grow_the_streams_past_the_chain_bound() -> None:
    """The issue's chain+session flood: each lookup a new session of never-stored keys."""
    p = SessionWrapper(ChainPolicy(50, history_keys=2_000), chain_keys=5_000)
    for r in range(40):
        keys = fresh(f"flood{r}", 1_500)
        hinted(p, keys, f"session{r}", float(r))
        assert p._chain_entries == chain_entries(p) <= p.chain_keys
        assert len(p._owner) <= p.chain_keys
        assert p.remembered_keys() <= p.chain_keys + len(p.inner._meta)
        assert p._owner[keys[-1]][0].ident[0] == f"session{r}".encode()  # the latest stream stays
    assert p.forgotten_streams == 40 - 3
    assert len(p._streams) == 3


def test_a_chain_longer_than_the_bound_keeps_its_head_and_its_stream() -> None:
    p = SessionWrapper(LRUPolicy(10), chain_keys=100)
    keys = fresh("long", 300)
    hinted(p, keys, "s", 0.0)
    (s,) = p._streams.values()
    assert s.chain == keys[:100] and set(p._owner) == set(keys[:100])
    hinted(p, keys + fresh("more", 5), "s", 10.0)  # the next turn continues the same stream
    assert list(p._streams.values()) == [s] and s.requests == 2 and len(s.chain) == 100
    # A store's follow-up does not grow it either.
    p.record_hints(fresh("generated", 50), RequestHints(session=b"s", at_s=11.0, continues=True))
    assert len(s.chain) == 100 and p._chain_entries == 100


def test_follow_ups_grow_a_chain_up_to_the_bound() -> None:
    p = SessionWrapper(LRUPolicy(10), chain_keys=100)
    hinted(p, fresh("prompt", 10), "s", 0.0)
    for i in range(30):
        p.record_hints(fresh(f"generated{i}", 5), RequestHints(session=b"s", at_s=1.0 + i, continues=True))
    (s,) = p._streams.values()
    assert len(s.chain) == 100 and p._chain_entries == 100 and s.chain[:10] == fresh("prompt", 10)


def test_retention_and_age_events_stay_a_few_per_stream() -> None:
    """Every request renews its stream's retention (a new deadline each time) and restarts its silence;
    the stale events go once they outnumber the live ones."""
    p = SessionWrapper(LRUPolicy(1000))
    sessions = 20
    for r in range(20_000):
        hinted(p, fresh(f"s{r % sessions}", 3), f"s{r % sessions}", r * 0.001, retain_s=3600.0 + r)
        assert len(p._events) <= 4 * len(p._streams) + _EVENTS_SLACK + 1
    assert p.events_compacted > 0


def test_forgotten_streams_release_their_chains() -> None:
    """A forgotten stream's record may live on in stale events or spares: its chain does not."""
    p = SessionWrapper(LRUPolicy(10), max_streams=2)
    hinted(p, fresh("a", 50), "a", 0.0)
    first = p._owner[b"a/0"][0]
    hinted(p, fresh("b", 50), "b", 1.0)
    hinted(p, fresh("c", 50), "c", 2.0)
    assert first.age_epoch == -1 and first.chain == [] and p._chain_entries == 100


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 5), st.integers(1, 12)), max_size=100),
       chain_keys=st.integers(1, 30), seed=st.integers(0, 1000))
def test_streams_stay_within_the_chain_bound_and_consistent(ops: list[tuple[int, int, int]], chain_keys: int,
                                                            seed: int) -> None:
    rng = random.Random(seed)
    p = SessionWrapper(ChainPolicy(10, horizon=32, bucket_width=4, history_keys=20), max_streams=4,
                       chain_keys=chain_keys)
    resident: set[bytes] = set()
    t = 0.0
    for kind, session, n in ops:
        t += rng.random() * 20
        keys = [f"s{session}r{rng.randrange(2)}/{i}".encode() for i in range(n)]
        if kind <= 2:
            hinted(p, keys, str(session), t, retain_s=rng.choice([0.0, 30.0]))
        elif kind == 3:
            p.record_hints(keys, RequestHints(session=str(session).encode(), at_s=t, continues=True))
        elif kind == 4:
            for key in keys:
                if key not in resident and len(resident) < 10 and p.admit(key):
                    p.on_insert(key)
                    resident.add(key)
        elif kind == 5 and resident:
            victim = next(iter(p.victims()))
            p.on_remove(victim)
            resident.discard(victim)
        else:
            p.on_promote(keys)
        assert p._chain_entries == chain_entries(p) <= chain_keys
        assert len(p._owner) <= chain_keys + len(resident)
        order = list(p.victims())
        assert len(order) == len(set(order)) and set(order) == resident
        assert p._hinted_resident == sum(1 for key in resident if key in p._owner)
        for stream in p._streams.values():
            assert stream.resident_blocks == sum(1 for key in resident if p._owner.get(key, (None,))[0] is stream)
