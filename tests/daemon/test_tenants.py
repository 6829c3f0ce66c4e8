"""kvtier.daemon.tenancy.tenants: identities, namespaces, quotas (no daemon process; pools in bookkeeping mode)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.client.protocol import ErrorCode, ProtocolError
from kvtier.daemon.config import TenantConfig
from kvtier.daemon.tenancy.tenants import ANONYMOUS, TenantQuotaPolicy, TenantRegistry, tenant_tag, user_id_for_key
from kvtier.tiers.cpu_tier import CpuTier, CpuTierFull
from kvtier.tiers.policies.lru import LRUPolicy
from kvtier.tiers.pool import PoolSpec, TieredPool

KEY_A = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
TOKEN_B = "bob-token-0123456789abcdef"
BLOCK = 64


def registry(quota_a: int | None = None, quota_b: int | None = None) -> TenantRegistry:
    return TenantRegistry({
        "alice": TenantConfig(public_key=KEY_A, cpu_quota_bytes=quota_a),
        "bob": TenantConfig(token_sha256=hashlib.sha256(TOKEN_B.encode()).hexdigest(), cpu_quota_bytes=quota_b),
    })


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 8 for i in range(n)]


def test_disabled_registry_is_the_identity() -> None:
    reg = TenantRegistry({})
    assert not reg.enabled
    assert reg.resolve(None, None) == ANONYMOUS
    assert reg.namespace(ANONYMOUS, hashes(3)) == hashes(3)
    with pytest.raises(ProtocolError) as info:
        reg.resolve(None, "a-token-nobody-configured")
    assert info.value.code == ErrorCode.INVALID_FIELD


def test_resolve_by_key_by_token_and_refusals() -> None:
    reg = registry()
    assert reg.resolve(user_id_for_key(KEY_A, reg.tenant_by_key), None) == "alice"
    assert reg.resolve(None, TOKEN_B) == "bob"
    assert reg.resolve("key:someotherkey", TOKEN_B) == "bob"  # an authorised non-tenant key plus a token
    refusals = [
        (None, None),  # no identity at all
        ("key:someotherkey", None),  # authorised key that is no tenant's
        (None, "wrong-token-0123456789"),
        (user_id_for_key(KEY_A, reg.tenant_by_key), TOKEN_B),  # alice's key with bob's token
        (user_id_for_key(KEY_A, reg.tenant_by_key), "wrong-token-0123456789"),
    ]
    messages = set()
    for user_id, token in refusals:
        with pytest.raises(ProtocolError) as info:
            reg.resolve(user_id, token)
        assert info.value.code == ErrorCode.UNAUTHORIZED
        messages.add(info.value.message)
    assert len(messages) == 1, "every refusal reads the same: it must not tell which part was wrong"


def test_namespaces_are_disjoint_deterministic_and_16_bytes() -> None:
    reg = registry()
    h = hashes(100)
    a, b = reg.namespace("alice", h), reg.namespace("bob", h)
    assert all(len(k) == 16 for k in a + b)
    assert not set(a) & set(b) and not set(a) & set(h)
    assert len(set(a)) == 100
    assert a == registry().namespace("alice", h), "stable across daemons (restarts)"
    assert {reg.tenant_of(k) for k in a} == {"alice"} and {reg.tenant_of(k) for k in b} == {"bob"}
    assert a[0][:2] == tenant_tag("alice")


def make_pool(reg: TenantRegistry, *, gpu_blocks: int = 4, cpu_blocks: int = 16) -> TieredPool:
    pool = TieredPool(PoolSpec("p", 4, BLOCK), cpu_blocks=cpu_blocks, policy="lru", data=False, clean_ahead_blocks=0,
                      policy_wrapper=reg.policy_wrapper(BLOCK))
    pool.attach_gpu(num_blocks=gpu_blocks)
    assert isinstance(pool.policy, TenantQuotaPolicy)
    return pool


def store(pool: TieredPool, keys: list[bytes]) -> None:
    op = pool.store(keys, None, list(range(len(keys))))
    assert op.done and op.error is None


def test_demotions_over_quota_are_dropped_and_counted() -> None:
    reg = registry(quota_a=2 * BLOCK)
    pool = make_pool(reg)
    alice = reg.namespace("alice", hashes(8))
    bob = reg.namespace("bob", hashes(8))
    store(pool, alice[:4])
    store(pool, bob[:4])  # evicts alice's 4 from the GPU tier: demotions, only 2 fit her quota
    assert reg.resident_bytes["alice"] == 2 * BLOCK and reg.resident_blocks["alice"] == 2
    assert reg.dropped_demotions["alice"] == 2
    assert reg.pending_bytes["alice"] == 0
    store(pool, alice[4:8])  # evicts bob's 4: bob has no quota
    assert reg.resident_blocks["bob"] == 4 and reg.dropped_demotions["bob"] == 0
    # The GPU tier evicts a chain tail first: the tail got the quota's room.
    assert pool.lookup(alice[2:4]) == ["cpu", "cpu"] and pool.lookup(alice[:2]) == []
    stats = reg.stats()
    assert stats["alice"]["cpu_quota_bytes"] == 2 * BLOCK and stats["bob"]["cpu_resident_blocks"] == 4
    assert list(reg.stats(only="bob")) == ["bob"]


def test_residency_follows_evictions_and_clear_is_per_tenant() -> None:
    reg = registry()
    pool = make_pool(reg, gpu_blocks=4, cpu_blocks=4)
    alice = reg.namespace("alice", hashes(8))
    bob = reg.namespace("bob", hashes(8))
    store(pool, alice[:4])
    store(pool, bob[:4])  # alice's four demoted
    assert reg.resident_blocks["alice"] == 4
    store(pool, bob[4:8])  # bob's first four demoted, evicting alice's from the 4-block CPU tier
    assert reg.resident_blocks["alice"] == 0 and reg.resident_blocks["bob"] == 4
    assert reg.resident_bytes["alice"] == 0
    # bob's clear drops bob's blocks in both tiers and leaves alice's alone
    store(pool, alice[:2])
    assert reg.clear(pool, "bob") == 4 + 2  # 4 in the CPU tier, 2 left cached in the GPU tier
    assert reg.resident_blocks["bob"] == 0
    assert pool.lookup(alice[:2]) == ["gpu", "gpu"]
    assert pool.lookup(bob[4:8]) == []


def test_store_spilling_into_the_cpu_tier_past_the_quota_is_refused() -> None:
    reg = registry(quota_b=2 * BLOCK)
    pool = make_pool(reg, gpu_blocks=4)
    bob = reg.namespace("bob", hashes(8))
    reg.check_store("bob", pool, bob[:4], BLOCK)  # all fit in the GPU tier: fine
    reg.check_store("bob", pool, bob[:6], BLOCK)  # 2 spill, quota 2: fine
    with pytest.raises(ProtocolError) as info:
        reg.check_store("bob", pool, bob[:7], BLOCK)  # 3 would spill
    assert info.value.code == ErrorCode.NO_SPACE and "quota" in info.value.message
    assert reg.refused_stores["bob"] == 1
    reg.check_store("alice", pool, reg.namespace("alice", hashes(8)), BLOCK)  # no quota


def test_an_admitted_demotion_that_never_lands_stops_counting() -> None:
    reg = registry(quota_a=2 * BLOCK)
    pool = make_pool(reg, cpu_blocks=0)  # a CPU tier without room: reservations never happen
    policy = pool.policy
    assert isinstance(policy, TenantQuotaPolicy)
    alice = reg.namespace("alice", hashes(4))
    assert policy.admit(alice[:3]) == [True, True, False], "the batch itself counts"
    assert reg.pending_bytes["alice"] == 2 * BLOCK
    assert policy.admit(alice[3:]) == [True], "keys of the failed batch were pruned"
    assert reg.pending_bytes["alice"] == BLOCK


# ---- the quota does not depend on the order of the pool's calls ----------------------------------

# Calls that change nothing an LRU policy decides: the old wrapper read them as "a batch of
# admissions ended", so whether they came between two batches changed its answers.
NOISE = ("victims", "stats", "gpu_drop", "learn", "access_absent")


def run_quota(ops: list[tuple[str, int]], quota_blocks: int) -> tuple[list[list[bool]], dict[str, int]]:
    """Drive a CPU tier whose policy is the quota wrapper (as a pool builds it) through ``ops``; returns
    each demotion batch's answers and the final counters. Checks the counts against the tier's state."""
    reg = registry(quota_a=quota_blocks * BLOCK)
    cpu = CpuTier(6, LRUPolicy(6))
    cpu.policy = TenantQuotaPolicy(cpu.policy, reg, BLOCK, cpu)
    alice, bob = reg.namespace("alice", hashes(12)), reg.namespace("bob", hashes(12))
    writing: list = []
    answers: list[list[bool]] = []

    def count(tenant: str, *, ready: bool) -> int:
        return sum(1 for key, e in cpu._entries.items() if e.ready == ready and reg.tenant_of(key) == tenant)

    for op, n in ops:
        if op == "demote":  # a batch of 1-3 of alice's (and one of bob's) blocks the tier lacks
            keys = [key for key in (alice[n % 12], alice[(n + 1) % 12], bob[n % 12], alice[(n + 5) % 12])[: 1 + n % 4]
                    if cpu.get(key) is None]
            keys = list(dict.fromkeys(keys))
            got = cpu.admit(keys)
            answers.append(got)
            batch = sum(1 for key, yes in zip(keys, got) if yes and reg.tenant_of(key) == "alice")
            assert reg.pending_bytes["alice"] == BLOCK * (count("alice", ready=False) + batch)
            admitted = [key for key, yes in zip(keys, got) if yes]
            try:
                writing += cpu.reserve(admitted)
            except CpuTierFull:
                pass  # admitted, never reserved: stops counting at the next batch
        elif op == "land" and writing:
            cpu.commit(writing.pop(n % len(writing)))
        elif op == "fail" and writing:
            cpu.abort(writing.pop(n % len(writing)))
        elif op == "drop":
            cpu.discard([alice[n % 12], bob[n % 12]])
        elif op == "victims":
            list(cpu.policy.victims())
        elif op == "stats":
            cpu.policy.stats()
        elif op == "gpu_drop":
            cpu.gpu_dropped([alice[n % 12]])
        elif op == "learn":
            cpu.policy.record([alice[n % 12], bob[n % 12]])
        elif op == "access_absent":
            cpu.accessed([bytes(16)])
        assert reg.resident_bytes["alice"] == BLOCK * count("alice", ready=True)
        assert reg.resident_blocks["bob"] == count("bob", ready=True)
    return answers, {"resident": reg.resident_bytes["alice"], "pending": reg.pending_bytes["alice"],
                     "dropped": reg.dropped_demotions["alice"]}


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(("demote", "demote", "land", "fail", "drop") + NOISE),
                              st.integers(0, 11)), max_size=40),
       quota_blocks=st.integers(1, 4), data=st.data())
def test_quota_answers_do_not_depend_on_the_order_of_other_calls(ops: list[tuple[str, int]], quota_blocks: int,
                                                                 data: st.DataObject) -> None:
    """The same demotions, landings and failures with the other calls removed, or moved anywhere
    else in any order: the same answers, the same counts (which match the tier's state)."""
    core = [op for op in ops if op[0] not in NOISE]
    noise = data.draw(st.permutations([op for op in ops if op[0] in NOISE]))
    moved = list(core)
    for op in noise:
        moved.insert(data.draw(st.integers(0, len(moved))), op)
    assert run_quota(ops, quota_blocks) == run_quota(core, quota_blocks) == run_quota(moved, quota_blocks)


def test_a_failed_demotion_stops_counting_whatever_came_between() -> None:
    """Two batches with nothing between them: the first one's copies failed (aborted) before the
    second was asked. The old wrapper only pruned after some other policy call, so here it kept
    counting them and refused the second batch."""
    ops = [("demote", 1), ("fail", 0), ("fail", 0), ("demote", 4)]
    quiet, _ = run_quota(ops, 2)
    noisy, _ = run_quota(ops[:3] + [("victims", 0)] + ops[3:], 2)
    assert quiet == noisy == [[True, True], [True]]
