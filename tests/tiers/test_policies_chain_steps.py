"""The "chain" policy's decisions pinned by a golden digest, and its resumable ``record_request_steps``.

The digest covers every decision a tier sees (victims order, admit answers), the learned densities
and the admission threshold over seeded workloads small enough (capacity, horizon, bucket width)
that epochs roll, densities are re-estimated and blocks are evicted and refused many times. It was
produced by the implementation before ``record_request`` was made faster: a change to the digest
means a change of behaviour, not of speed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

import pytest

from kvtier.tiers.policies_chain import ChainPolicy


def k(i: int) -> bytes:
    return i.to_bytes(8, "little")


class _WideUses(ChainPolicy):
    """Overrides ``classify`` with use counts far past the default buckets (up to 9), so the
    per-request class cache is exercised with a classify that is not the default one."""

    num_classes = 10 * 3

    def classify(self, turns: int, uses: int, new: int) -> int:
        return min(uses, 10) - 1 + 10 * min(turns - 1, 2) if new else min(uses, 10) - 1


class _SlowRefresh(ChainPolicy):
    """Re-estimates every other bucket, so the re-sort-only branch runs too."""

    REFRESH = 2


# name -> (policy factory, capacity); every factory uses small windows so that a few thousand
# operations roll several epochs.
CONFIGS: dict[str, tuple[Callable[[int], ChainPolicy], int]] = {
    "w4": (lambda c: ChainPolicy(c, horizon=64, bucket_width=4, epochs=2, min_samples=20.0), 24),
    "w8-pooled": (lambda c: ChainPolicy(c, horizon=128, bucket_width=8, epochs=3), 50),
    "w1": (lambda c: ChainPolicy(c, horizon=32, bucket_width=1, epochs=2, min_samples=5.0), 16),
    "no-admission": (lambda c: ChainPolicy(c, horizon=64, bucket_width=4, min_samples=10.0,
                                           admission=False), 24),
    "wide-uses": (lambda c: _WideUses(c, horizon=64, bucket_width=4, min_samples=10.0), 24),
    "slow-refresh": (lambda c: _SlowRefresh(c, horizon=64, bucket_width=4, min_samples=10.0), 24),
}


class Workload:
    """A seeded mix of requests (growing conversations, shared system prompts, one-off documents,
    repeated blocks in one request), tier-like insertions with admission and eviction, explicit
    removals, and probes of ``victims()``/``admit()``. Every answer goes into ``log``.

    ``record`` is how a request reaches the policy, so the same workload can drive
    ``record_request`` or a drained ``record_request_steps``.
    """

    def __init__(self, policy: ChainPolicy, capacity: int, seed: int,
                 record: Callable[[ChainPolicy, list[bytes]], None] | None = None) -> None:
        self.p = policy
        self.capacity = capacity
        self.rng = random.Random(seed)
        self.record = record or (lambda p, keys: p.record_request(keys))
        self.resident: set[bytes] = set()
        self.chains: list[list[bytes]] = []
        self.systems = [[k(10**6 + 100 * s + j) for j in range(3)] for s in range(3)]
        self.next_id = 0
        self.recent: list[bytes] = []
        self.log: list[str] = []
        self._density: object = None

    def fresh(self, n: int) -> list[bytes]:
        keys = [k(self.next_id + i) for i in range(n)]
        self.next_id += n
        return keys

    def request_keys(self) -> list[bytes]:
        rng = self.rng
        r = rng.random()
        if self.chains and r < 0.5:  # a conversation's next turn
            chain = rng.choice(self.chains)
            chain.extend(self.fresh(rng.randint(1, 6)))
            keys = list(chain)
        elif r < 0.65:  # a new conversation, often behind a shared system prompt (a hub)
            head = list(rng.choice(self.systems)) if rng.random() < 0.6 else []
            chain = head + self.fresh(rng.randint(1, 8))
            self.chains.append(chain)
            if len(self.chains) > 12:
                self.chains.pop(rng.randrange(len(self.chains)))
            keys = list(chain)
        elif r < 0.85:  # a one-off document
            keys = self.fresh(rng.randint(1, 40))
        elif self.chains:  # a prefix of a known chain asked again
            chain = rng.choice(self.chains)
            keys = chain[: rng.randint(1, len(chain))]
        else:
            keys = self.fresh(2)
        if keys and rng.random() < 0.1:  # the same block twice in one request
            keys.insert(rng.randrange(len(keys) + 1), rng.choice(keys))
        return keys

    def cache(self, key: bytes) -> None:
        """What the tier does with a block it could cache: admit, evict one if full, insert."""
        if key in self.resident:
            return
        ok = self.p.admit(key)
        self.log.append(f"admit {key.hex()} {ok}")
        if not ok:
            return
        if len(self.resident) >= self.capacity:
            order = list(self.p.victims())
            victim = order[min(self.rng.randrange(3), len(order) - 1)]  # the first ones may be pinned
            self.log.append(f"evict {victim.hex()}")
            self.p.on_remove(victim)
            self.resident.discard(victim)
        self.p.on_insert(key)
        self.resident.add(key)

    def snapshot(self) -> None:
        p = self.p
        self.log.append("victims " + ",".join(v.hex() for v in p.victims()))
        self.log.append(f"len {len(p)} meta {len(p._meta)} vd {p._victim_density:.12g}")
        if p._density is not self._density:  # re-estimated: log the new densities
            self._density = p._density
            self.log.append("density " + ",".join(f"{x:.12g}" for row in p._density for x in row))

    def run(self, n_ops: int) -> str:
        rng = self.rng
        for step in range(n_ops):
            r = rng.random()
            if r < 0.55:
                keys = self.request_keys()
                self.record(self.p, keys)
                self.recent = keys
                for key in keys:
                    if rng.random() < 0.5:
                        self.cache(key)
            elif r < 0.65 and self.resident:
                key = rng.choice(sorted(self.resident))
                self.p.on_remove(key)
                self.resident.discard(key)
            elif r < 0.75:
                self.log.append("first " + ",".join(v.hex() for _, v in zip(range(5), self.p.victims())))
            elif r < 0.85:
                key = rng.choice(self.recent) if self.recent and rng.random() < 0.7 else k(rng.randrange(self.next_id + 5))
                self.log.append(f"probe {key.hex()} {self.p.admit(key)}")
            elif self.recent:
                # A store the policy did not see looked up: inserted without asking admit.
                key = rng.choice(self.recent)
                if key not in self.resident and len(self.resident) < self.capacity:
                    self.p.on_insert(key)
                    self.resident.add(key)
            if step % 25 == 0:
                self.snapshot()
        self.snapshot()
        return hashlib.sha256("\n".join(self.log).encode()).hexdigest()


def workload_digest(name: str, seed: int, n_ops: int = 3000,
                    record: Callable[[ChainPolicy, list[bytes]], None] | None = None) -> str:
    factory, capacity = CONFIGS[name]
    return Workload(factory(capacity), capacity, seed, record).run(n_ops)


# Produced by the implementation before the record_request speed-up (see the module docstring).
GOLDEN: dict[tuple[str, int], str] = {
    ("w4", 1): "35a84b77df8a94c3d25c52c14bfb65afe93a61506b0d0cd8ba8e597f39c7586b",
    ("w8-pooled", 1): "d67656a782cd9daa6f4f9bcec03bab8e0c2d424519d75a363b647e12e267c28a",
    ("w1", 1): "0e674d4a2558ce18a423f212a94aae2ca18d0055bea4094393731b096ba8f8a9",
    ("no-admission", 1): "4e97e35d0b18ac299b7f31ef3a35f190dbe9fa8d79ebb7a0855a07f2eebefb26",
    ("wide-uses", 1): "89902253c7bd7af84f7a50febcff0947ef17fc6e0a6ca4009918c450c7077d70",
    ("slow-refresh", 1): "4055f4eaa8e43d5d40226fdfdfd0f1bac5199693ffb83fd7207fdf759cf26975",
}


@pytest.mark.parametrize("name, seed", sorted(GOLDEN))
def test_decisions_match_the_golden_digest(name: str, seed: int) -> None:
    assert workload_digest(name, seed) == GOLDEN[name, seed]
