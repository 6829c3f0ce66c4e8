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
    real_record = policy.record_request
    policy.record_request = lambda keys: (recorded.append(list(keys)), real_record(keys))[1]  # type: ignore[method-assign]
    pool.lookup(h)
    assert recorded == []  # nothing reaches the policy on the request path
    pool.learn()
    assert recorded == [h, hashes(2, 2), h]
    pool.learn()
    assert len(recorded) == 3
    assert policy.admit(h[0])  # two requests asked for it


def test_lookup_then_allocate_of_one_request_is_one_sighting() -> None:
    pool = TieredPool(PoolSpec("p", 16, 64), cpu_blocks=8, policy="lru+admit2", data=False)
    pool.attach_gpu(num_blocks=4)
    h = hashes(3, 2)
    pool.lookup(h)
    pool.allocate("r", h, 32)
    assert not pool.cpu.policy.admit(h[0])  # one request, not two
    pool.free("r")
    pool.allocate("r2", h, 32)  # a second request
    assert pool.cpu.policy.admit(h[1])
