"""Policy learning off the reply path: a deferring pool feeds the policy only in learn()."""

from __future__ import annotations

from kvtier.tiers.pool import PoolSpec, TieredPool


def hashes(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def test_deferred_learning_reaches_the_policy_only_in_learn() -> None:
    pool = TieredPool(PoolSpec("p", 16, 64), cpu_blocks=8, policy="lru+admit2", data=False, defer_learning=True)
    pool.attach_gpu(num_blocks=4)
    h = hashes(1, 2)
    pool.lookup(h)
    pool.lookup(hashes(2, 2))
    policy = pool.cpu.policy
    recorded: list[list[bytes]] = []
    real_learn = policy.learn
    policy.learn = lambda request, chunk_keys: (recorded.append(list(request.keys)),  # type: ignore[method-assign]
                                                real_learn(request, chunk_keys))[1]
    pool.lookup(h)
    assert recorded == []  # nothing reaches the policy on the request path
    pool.learn()
    assert recorded == [h, hashes(2, 2), h]
    pool.learn()
    assert len(recorded) == 3
    assert policy.admit([h[0]])[0]  # two requests asked for it


def test_lookup_then_allocate_of_one_request_is_one_sighting() -> None:
    pool = TieredPool(PoolSpec("p", 16, 64), cpu_blocks=8, policy="lru+admit2", data=False)
    pool.attach_gpu(num_blocks=4)
    h = hashes(3, 2)
    pool.lookup(h)
    pool.allocate("r", h, 32)
    assert not pool.cpu.policy.admit([h[0]])[0]  # one request, not two
    pool.free("r")
    pool.allocate("r2", h, 32)  # a second request
    assert pool.cpu.policy.admit([h[1]])[0]


def _victims_after(pool: TieredPool) -> list[bytes]:
    return list(pool.cpu.policy.victims())


def test_yielding_learn_stops_when_asked_and_ends_where_plain_learning_does() -> None:
    # Two pools see the same requests; one learns in yielding steps, asked
    # to stop every other check, the other all at once. Same policy state.
    def run(yielding: bool) -> tuple[TieredPool, int]:
        pool = TieredPool(PoolSpec("p", 16, 64), cpu_blocks=64, policy="chain", data=False, defer_learning=True)
        pool.attach_gpu(num_blocks=8)
        stops = 0
        for r in range(40):
            keys = hashes(r % 7, 3 + r % 40)
            pool.store(keys[:6], None, list(range(len(keys[:6]))))  # GPU evictions fill the CPU tier
            pool.lookup(keys)
            if yielding:
                asks = iter([False, True] * 1000)

                def should_yield() -> bool:
                    return next(asks)

                while not pool.learn(should_yield, chunk_keys=4):
                    stops += 1
            else:
                pool.learn()
        return pool, stops

    stepped, stops = run(True)
    plain, _ = run(False)
    assert stops > 40  # it did stop, many times, and resumed where it was
    assert stepped.learn_backlog_keys == 0 == plain.learn_backlog_keys
    assert _victims_after(stepped) == _victims_after(plain)
    assert len(_victims_after(plain)) > 8
    assert stepped.cpu.policy.now == plain.cpu.policy.now == 40


def test_learn_without_should_yield_finishes_a_half_recorded_request() -> None:
    pool = TieredPool(PoolSpec("p", 16, 64), cpu_blocks=64, policy="chain", data=False, defer_learning=True)
    pool.attach_gpu(num_blocks=8)
    pool.lookup(hashes(1, 40))
    pool.lookup(hashes(2, 40))
    assert pool.learn_backlog_keys == 80
    assert not pool.learn(lambda: True)  # asked to stop before any step
    assert pool.learn_backlog_keys == 80  # a request counts until it is recorded
    calls = iter([False, True])
    assert not pool.learn(lambda: next(calls), chunk_keys=8)  # one step of it
    assert pool.learn_backlog_keys == 80
    assert pool.learn() and pool.learn_backlog_keys == 0
    assert pool.cpu.policy.now == 2


def test_a_lookup_repeated_with_nothing_between_is_one_request() -> None:
    # A scheduler re-checking a waiting request is not a reuse; a lookup after
    # the request was allocated (or another request came) is.
    pool = TieredPool(PoolSpec("p", 16, 64), cpu_blocks=8, policy="chain", data=False)
    pool.attach_gpu(num_blocks=8)
    h, other = hashes(4, 3), hashes(5, 3)
    for _ in range(5):
        pool.lookup(h)
    assert pool.cpu.policy.now == 1 and pool.counters["lookups"] == 5
    pool.allocate("r", h, 48)  # the same request, admitted at last
    assert pool.cpu.policy.now == 1
    pool.free("r")
    pool.lookup(h)  # a new request for the same prefix
    pool.lookup(other)
    pool.lookup(h)
    assert pool.cpu.policy.now == 4


def test_a_stores_hints_alone_count_as_owed_learning_until_recorded() -> None:
    """A server learns only while learn_backlog_keys > 0: hints queued without a request must count."""
    from kvtier.tiers.hints import RequestHints
    from kvtier.tiers.pool import PoolSpec, TieredPool

    p = TieredPool(PoolSpec("h", 4, 64), cpu_blocks=8, policy="lru+session", transfer=None, data=False,
                   clean_ahead_blocks=0, defer_learning=True)
    p.attach_gpu(num_blocks=4)
    keys = [bytes([7, i]) * 8 for i in range(3)]
    p.store(keys, None, [0, 1, 2], hints=RequestHints(session=b"s", retain_s=60.0, at_s=1.0))
    assert p.learn_backlog_keys == 3
    assert p.learn()
    assert p.learn_backlog_keys == 0


def test_a_stores_hints_continue_its_request_under_a_session_policy() -> None:
    """Lookup, allocation and stores of one request are one request to a session-aware policy: the
    store's hints extend its chain and report its output, and count no return."""
    from kvtier.tiers.hints import RequestHints
    from kvtier.tiers.pool import PoolSpec, TieredPool

    p = TieredPool(PoolSpec("h", 4, 64), cpu_blocks=16, policy="lru+session", transfer=None, data=False,
                   clean_ahead_blocks=0)
    p.attach_gpu(num_blocks=8)
    prompt = [bytes([8, i]) * 8 for i in range(3)]
    generated = [bytes([9, i]) * 8 for i in range(2)]
    p.lookup(prompt, count=True, hints=RequestHints(session=b"s", at_s=1.0))
    p.allocate("r", prompt, 3 * 4, count=True, hints=RequestHints(session=b"s", at_s=1.0))
    p.store(generated, None, [0, 1], hints=RequestHints(session=b"s", at_s=2.0, output_tokens=500))
    wrapper = p.cpu.policy
    streams = list(wrapper._streams.values())
    assert len(streams) == 1 and streams[0].requests == 1 and streams[0].output_tokens == 500
    assert list(streams[0].chain) == prompt + generated
