"""The ``+session`` wrapper (``kvtier.tiers.policies.session``): exactly the wrapped policy without
hints, and with them: streams ranked by the hit density their return model gives them (the
fewest expected returns per second first, streams gone silent past their habit before unhinted
blocks), tails before heads, ``retain_s`` and ``priority`` honoured, admission consistent with
the order."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies import make_policy
from kvtier.tiers.policies.lru import LRUPolicy
from kvtier.tiers.policies.session import SessionWrapper
from kvtier.tiers.policies.session_returns import stream_class
from tests.tiers.test_policies_chain_steps import CONFIGS, GOLDEN, Workload


class _WrappedWorkload(Workload):
    """The golden workload driving a wrapper: decisions from the wrapper, internals from the chain."""

    def snapshot(self) -> None:
        wrapper, self.p = self.p, self.p.inner  # type: ignore[attr-defined]
        try:
            # victims and len are the wrapper's: log them as Workload.snapshot would
            self.log.append("victims " + ",".join(v.hex() for v in wrapper.victims()))
            self.log.append(f"len {len(wrapper)} meta {len(self.p._meta)} vd {self.p._victim_density:.12g}")
            if self.p._density is not self._density:
                self._density = self.p._density
                self.log.append("density " + ",".join(f"{x:.12g}" for row in self.p._density for x in row))
        finally:
            self.p = wrapper


@pytest.mark.parametrize("name, seed", sorted(GOLDEN))
def test_without_hints_chain_session_decides_as_chain(name: str, seed: int) -> None:
    factory, capacity = CONFIGS[name]
    assert _WrappedWorkload(SessionWrapper(factory(capacity)), capacity, seed).run(3000) == GOLDEN[name, seed]


def test_the_registry_builds_chain_session() -> None:
    p = make_policy("chain+session", 10)
    assert isinstance(p, SessionWrapper) and p.inner.name == "chain"


def k(name: str, i: int) -> bytes:
    return f"{name}{i}".encode()


def chain_of(name: str, n: int) -> list[bytes]:
    return [k(name, i) for i in range(n)]


def request(p: SessionWrapper, keys: list[bytes], session: bytes | None, at_s: float, **more: float) -> None:
    p.record(keys, RequestHints(session=session, at_s=at_s, **more))  # type: ignore[arg-type]


def resident(p: SessionWrapper, keys: list[bytes]) -> None:
    for key in keys:
        p.on_insert(key)


def requests_every(p: SessionWrapper, periods_s: dict[str, tuple[float, float, float]], n: int = 2) -> dict[str, list[bytes]]:
    """Stream ``name`` (session ``name.upper()``) requests its chain of ``n`` blocks every ``period_s``
    from ``start_s`` to ``end_s`` (``periods_s[name] = (period_s, start_s, end_s)``), all streams
    interleaved in time order, each chain cached from its first request on: the history a return
    model learns from (it learns from streams with cached blocks only)."""
    chains = {name: chain_of(name, n) for name in periods_s}
    events = sorted((start_s + i * period_s, name)
                    for name, (period_s, start_s, end_s) in periods_s.items()
                    for i in range(int((end_s - start_s) // period_s) + 1))
    for at_s, name in events:
        request(p, chains[name], name.upper().encode(), at_s)
        resident(p, [key for key in chains[name] if key not in p._resident])
    return chains


def test_the_stream_with_fewer_returns_per_second_goes_first_tail_first() -> None:
    p = SessionWrapper(LRUPolicy(100))
    # a comes back every 10 s, b every 50 s (both just made a request at 1000 s): b is expected to
    # bring a fifth of a's hits per block-second.
    chains = requests_every(p, {"a": (10, 0, 1000), "b": (50, 0, 1000)}, n=3)
    a, b = chains["a"], chains["b"]
    resident(p, a + b)
    assert list(p.victims()) == b[::-1] + a[::-1]


def test_a_stream_silent_past_its_habit_goes_before_one_expected_back() -> None:
    p = SessionWrapper(LRUPolicy(100))
    # a came back every 10 s until 500 s and then stopped; b comes back every 100 s. At 1000 s a has
    # been silent 50 times its gap, longer than any stream of its class ever came back after.
    chains = requests_every(p, {"a": (10, 0, 500), "b": (100, 0, 1000), "c": (5, 990, 1000)})
    order = list(p.victims())
    assert order[:2] == chains["a"][::-1] and order.index(chains["b"][1]) < order.index(chains["b"][0])


def test_within_a_class_the_stream_that_usually_comes_back_later_goes_first() -> None:
    p = SessionWrapper(LRUPolicy(100))
    a, b = chain_of("a", 2), chain_of("b", 2)
    # Both came back after ~20 s last time (one class), b just after a (a would go first on a tie).
    # But a always comes back after 20 s, and b had waited ~200 s every time before.
    events = [(20.0 * i, "a") for i in range(41)] + [(t, "b") for t in (0.0, 200.0, 400.0, 600.0, 780.0, 800.5)]
    for at_s, name in sorted(events):
        keys = a if name == "a" else b
        request(p, keys, name.upper().encode(), at_s)
        resident(p, [key for key in keys if key not in p._resident])
    sa, sb = p._owner[a[0]][0], p._owner[b[0]][0]
    assert sa.cls == sb.cls and sa.age_bucket == sb.age_bucket == 0
    assert list(p.victims()) == b[::-1] + a[::-1]


def test_unhinted_blocks_sit_between_streams_below_and_above_the_average_density() -> None:
    p = SessionWrapper(LRUPolicy(100))
    # a stopped long ago (density ~0); b comes back every 10 s, faster than the average stream.
    chains = requests_every(p, {"a": (10, 0, 300), "b": (10, 600, 1000), "c": (100, 0, 1000)})
    a, b = chains["a"], chains["b"]
    assert p._rank_of(p._owner[b[0]][0]) > (0, 0, 1, 0.0) > p._rank_of(p._owner[a[0]][0])
    u = chain_of("u", 3)
    p.record(u)  # no hints
    resident(p, u)
    assert [key for key in p.victims() if key in {*a, *u, *b}] == a[::-1] + u + b[::-1]


def test_retained_blocks_go_last_and_at_most_half_the_capacity_is_retained() -> None:
    p = SessionWrapper(LRUPolicy(8))
    a, b, c = chain_of("a", 3), chain_of("b", 3), chain_of("c", 2)
    request(p, a, b"A", 0, retain_s=1000)
    request(p, b, b"B", 1)
    resident(p, a + b)
    assert list(p.victims())[-3:] == a[::-1]  # a retained: after every other block
    request(p, c, b"C", 2, retain_s=1000)
    resident(p, c)
    # a (3) + c (2) retained > 8 // 2: the oldest retention (a) is dropped, c stays retained.
    assert list(p.victims())[-2:] == c[::-1]
    assert p._retained_blocks <= 4


def test_retention_ends_at_its_time() -> None:
    p = SessionWrapper(LRUPolicy(100))
    a, b = chain_of("a", 2), chain_of("b", 2)
    request(p, a, b"A", 0, retain_s=50)
    request(p, b, b"B", 1, priority=1)
    resident(p, a + b)
    assert list(p.victims()) == b[::-1] + a[::-1]  # retained goes after any priority
    request(p, chain_of("x", 1), b"X", 60)  # past a's retention: priority decides again
    assert list(p.victims()) == a[::-1] + b[::-1]


def test_higher_priority_goes_later() -> None:
    p = SessionWrapper(LRUPolicy(100))
    a, b = chain_of("a", 2), chain_of("b", 2)
    request(p, a, b"A", 0, priority=5)
    request(p, b, b"B", 0)
    resident(p, a + b)
    assert list(p.victims()) == b[::-1] + a[::-1]


def test_a_request_diverging_inside_a_chain_forks_a_stream() -> None:
    p = SessionWrapper(LRUPolicy(100))
    old = chain_of("a", 4)
    request(p, old, b"A", 0)
    resident(p, old)
    new = old[:2] + [k("n", 2)]  # a sub-agent from the shared prefix, or a compacted context
    request(p, new, b"A", 5)
    p.on_insert(new[2])
    assert len(p._streams) == 2
    order = list(p.victims())
    assert sorted(order) == sorted(old + new[2:])
    assert order.index(old[3]) < order.index(old[2]) and order.index(new[2]) < order.index(old[1])
    request(p, old[:3], b"A", 6)  # a repeat of a prefix of the first chain: no new stream, no orphans
    assert len(p._streams) == 2 and not p._orphans


def test_a_stores_hints_grow_the_request_without_counting_a_return() -> None:
    p = SessionWrapper(LRUPolicy(100))
    prompt = chain_of("a", 3)
    request(p, prompt, b"A", 0)
    resident(p, prompt)
    s = p._owner[prompt[0]][0]
    # The engine stores a prompt block it computed, then the blocks it generated, with the count.
    p.record(prompt[2:], RequestHints(session=b"A", at_s=1.0, output_tokens=40, continues=True))
    generated = [k("g", 0), k("g", 1)]
    p.record(generated, RequestHints(session=b"A", at_s=4.0, output_tokens=300, continues=True))
    resident(p, generated)
    assert len(p._streams) == 1 and s.requests == 1 and s.own_returns is None
    assert sum(map(sum, p.model.returned)) == 0
    assert list(s.chain) == prompt + generated and all(p._owner[key] == (s, 3 + i) for i, key in enumerate(generated))
    assert s.output_tokens == 300 and s.cls == stream_class(None, False, False, 300) != stream_class(None, False, False)
    assert list(p.victims()) == (prompt + generated)[::-1]  # one stream, deepest first
    # Its next request is a return after 10 s of silence, from the first request on.
    request(p, prompt + generated + [k("a", 9)], b"A", 10.0)
    assert s.requests == 2 and s.last_gap_s == 10.0 and sum(map(sum, p.model.returned)) == 1


def test_a_store_that_follows_no_request_counts_as_one() -> None:
    p = SessionWrapper(LRUPolicy(100))
    keys = chain_of("a", 2)
    p.record(keys, RequestHints(session=b"A", at_s=1.0, continues=True))
    assert len(p._streams) == 1 and p._owner[keys[0]][0].requests == 1


def test_after_a_long_answer_a_stream_goes_before_one_that_will_be_back_sooner() -> None:
    # Every stream comes back 10 s after a short answer, 40 s after a long one, whatever came before.
    rng = random.Random(5)
    p = SessionWrapper(LRUPolicy(1000))
    events: list[tuple[float, str, int]] = []
    for name in ("h1", "h2", "h3", "h4"):
        t = rng.uniform(0, 10)
        while t < 2000:
            out = rng.choice((100, 2000))
            events.append((t, name, out))
            t += (10 if out == 100 else 40) + rng.uniform(-1, 1)
    events += [(1999.9, "short", 100), (2000.0, "long", 2000)]
    # Both came back after ~40 s last time: one gap class. "short" asked first: on a tie it would go first.
    events += [(1960.5, "short", 2000), (1960.0, "long", 100)]
    chains: dict[str, list[bytes]] = {}
    for at_s, name, out in sorted(events):
        keys = chains.setdefault(name, chain_of(name, 2))
        request(p, keys, name.encode(), at_s, output_tokens=out)
        resident(p, [key for key in keys if key not in p._resident])
    for name in ("h1", "h2", "h3", "h4"):  # the history's own blocks are not the question
        for key in chains[name]:
            p.on_remove(key)
    ss, sl = p._owner[chains["short"][0]][0], p._owner[chains["long"][0]][0]
    assert stream_class(ss.last_gap_s, False, False) == stream_class(sl.last_gap_s, False, False)
    assert list(p.victims()) == chains["long"][::-1] + chains["short"][::-1]


def test_blocks_of_a_forgotten_stream_go_first() -> None:
    p = SessionWrapper(LRUPolicy(100), max_streams=1)
    a, b = chain_of("a", 2), chain_of("b", 2)
    request(p, a, b"A", 0)
    resident(p, a)
    request(p, b, b"B", 1)  # a's stream is forgotten: its blocks are orphans
    resident(p, b)
    assert list(p.victims()) == a + b[::-1]


def test_admission_follows_the_order_when_full() -> None:
    p = SessionWrapper(LRUPolicy(4))
    chains = requests_every(p, {"a": (10, 0, 1000), "b": (50, 0, 1000)}, n=3)  # a back sooner than b
    a, b = chains["a"][:2], chains["b"]
    resident(p, a[:1] + b[:3])  # full
    assert p.admit([a[1]])[0]  # a outranks b, the first victim
    assert p.admit([k("zz", 0)])[0]  # never named by a hinted request: the inner policy (LRU: all) decides
    # b's own block deeper than its deepest resident: it would be the first victim itself
    request(p, b + [k("b", 3)], b"B", 1001)
    assert p.admit([k("b", 3)])[0] is False


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 4), st.integers(1, 6), st.booleans()), max_size=80),
       seed=st.integers(0, 1000))
def test_victims_lists_every_resident_key_once_and_spares_stay_consistent(ops: list[tuple[int, int, int, bool]], seed: int) -> None:
    rng = random.Random(seed)
    p = SessionWrapper(LRUPolicy(12), max_streams=3)
    resident_keys: set[bytes] = set()
    t = 0.0
    for kind, session, n, hinted in ops:
        t += rng.random() * 20
        keys = [k(f"s{session}r{rng.randrange(2)}-", i) for i in range(n)]
        if kind <= 2:
            if hinted and rng.random() < 0.3:  # a store's hints: its prompt blocks, or blocks it generated
                stored = keys if rng.random() < 0.5 else [k(f"s{session}g{rng.randrange(3)}-", i) for i in range(n)]
                p.record(stored, RequestHints(session=str(session).encode(), at_s=t, continues=True,
                                              output_tokens=rng.choice([0, 100, 2000])))
            elif hinted:
                request(p, keys, str(session).encode(), t, retain_s=rng.choice([0.0, 30.0]),
                        priority=rng.choice([0, 0, 1, -1]), output_tokens=rng.choice([0, 300]))
            else:
                p.record(keys)
        elif kind == 3:
            assert p.admit(keys) == [p.admit([key])[0] for key in keys]  # one batch, the same answers
            for key in keys:
                if key not in resident_keys and len(resident_keys) < 12 and p.admit([key])[0]:
                    p.on_insert(key)
                    resident_keys.add(key)
        elif kind == 4 and resident_keys:
            victim = next(iter(p.victims()))
            p.on_remove(victim)
            resident_keys.discard(victim)
        elif kind == 5:
            for key in keys:
                p.on_remove(key)
                resident_keys.discard(key)
        elif kind == 6:  # restored into the GPU tier
            p.on_access(keys, promoted=True)
        else:  # the GPU tier let them go
            p.on_gpu_drop(keys)
        order = list(p.victims())
        assert len(order) == len(set(order)) and set(order) == resident_keys
        assert p._hinted_resident == sum(1 for key in resident_keys if key in p._owner)
        for stream in p._streams.values():
            assert stream.resident_blocks == sum(1 for key in resident_keys if p._owner.get(key, (None,))[0] is stream)
            assert all(p._owner[key] == (stream, d) for d, key in enumerate(stream.chain) if p._owner.get(key, (None,))[0] is stream
                       and stream.chain.index(key) == d)
        assert p._retained_blocks <= p.retained_cap_blocks
        spares, above, coming = p.spares._spares, p.spares._above, p.spares._coming
        assert set(spares) <= resident_keys and not set(above) & resident_keys and coming <= set(above)
        for stream in set(above.values()):
            assert stream.above_blocks == sum(1 for s in above.values() if s is stream)


def test_a_spare_goes_first_and_its_stream_stays_cached_while_the_gpu_tier_holds_it() -> None:
    p = SessionWrapper(LRUPolicy(100))
    chains = requests_every(p, {"a": (10, 0, 1000), "b": (50, 0, 1000)}, n=3)  # b ranks below a
    a, b = chains["a"], chains["b"]
    p.on_access(a[::-1], promoted=True)  # a's request restored its chain into the GPU tier, tail first
    # spares first, the latest promoted first (the GPU tier keeps its copy longest), then the order
    assert list(p.victims()) == a + b[::-1]
    evicted_before = sum(map(sum, p.model.evicted))
    for key in a:  # evicted here as spares: the GPU tier still holds them
        p.on_remove(key)
    s = p._owner[a[0]][0]
    assert s.resident_blocks == 0 and s.above_blocks == 3
    assert sum(map(sum, p.model.evicted)) == evicted_before  # no life ended: a is still cached
    assert list(p.victims()) == b[::-1]
    # The GPU tier evicts a1 and a2: a2's demotion is admitted and lands; a1's is not admitted.
    assert p.admit([a[2]])[0]
    p.on_insert(a[2])
    p.on_gpu_drop([a[2], a[1]])
    assert s.resident_blocks == 1 and s.above_blocks == 1
    assert list(p.victims()) == b[::-1] + [a[2]]
    p.on_remove(a[2])  # not a spare any more: its life here ends...
    assert sum(map(sum, p.model.evicted)) == evicted_before
    p.on_gpu_drop([a[0]])  # ...and with a0 gone from the GPU tier, nothing of a is cached
    assert s.above_blocks == 0 and sum(map(sum, p.model.evicted)) == evicted_before + 1


def test_without_hints_a_promotion_changes_nothing() -> None:
    p = SessionWrapper(LRUPolicy(10))
    u = chain_of("u", 3)
    p.record(u)
    resident(p, u)
    p.on_access(u, promoted=True)
    assert list(p.victims()) == u and not p.spares  # LRU's order: as inserted
    p.on_remove(u[0])
    p.on_gpu_drop(u[:1])
    assert not p.spares._above


@pytest.mark.parametrize("kind", ["admit2", "tenant", "tenant+admit2"])
def test_wrappers_forward_hints_and_the_gpu_tier_calls(kind: str) -> None:
    from kvtier.daemon.tenancy.tenants import TenantQuotaPolicy, TenantRegistry
    from kvtier.tiers.policies.admit2 import AdmissionWrapper

    session = SessionWrapper(LRUPolicy(10))
    p = session if kind == "tenant" else AdmissionWrapper(session)
    if kind.startswith("tenant"):
        p = TenantQuotaPolicy(p, TenantRegistry(), 4096, None)
    a = chain_of("a", 2)
    p.record(a, RequestHints(session=b"A", at_s=1.0))
    for key in a:
        p.on_insert(key)
    p.on_access(a[1:], promoted=True)
    assert session._streams and list(session.spares._spares) == [a[1]]
    p.on_gpu_drop(a[1:])
    assert not session.spares
