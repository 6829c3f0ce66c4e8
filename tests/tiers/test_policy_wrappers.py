"""Every policy wrapper forwards every hook of the contract (``kvtier.tiers.policies.base``).

A wrapper that forgets to forward a hook swallows it silently (the tenant quota wrapper once
dropped every hint that way). So: ``HOOKS`` is the interface, ``PolicyWrapper`` forwards each of
them, every wrapper derives from it, and each hook called on each wrapper reaches the wrapped
policy with what it was given. A hook added to the interface fails here until the spy below and
every wrapper handle it; a wrapper added anywhere (a subclass of ``PolicyWrapper``) fails here
until it has a factory in ``FACTORIES``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvtier.daemon.config import TenantConfig
from kvtier.daemon.tenancy.tenants import TenantQuotaPolicy, TenantRegistry
from kvtier.tiers.cpu_tier import CpuTier
from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies import WRAPPERS, EvictionPolicy, PolicyRequest, PolicyStats, PolicyWrapper
from kvtier.tiers.policies.admit2 import AdmissionWrapper
from kvtier.tiers.policies.base import ALL_KEYS, HOOKS
from kvtier.tiers.policies.lru import LRUPolicy
from kvtier.tiers.policies.session import SessionWrapper

BLOCK = 64


class Spy(EvictionPolicy):
    """Records every hook call (name, the keys it carried, its other arguments)."""

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self.calls: list[tuple[str, list[bytes], tuple[Any, ...]]] = []
        self.resident: list[bytes] = []

    def on_insert(self, key: bytes) -> None:
        self.calls.append(("on_insert", [key], ()))
        self.resident.append(key)

    def on_remove(self, key: bytes) -> None:
        self.calls.append(("on_remove", [key], ()))
        if key in self.resident:
            self.resident.remove(key)

    def victims(self) -> Iterator[bytes]:
        self.calls.append(("victims", [], ()))
        return iter(list(self.resident))

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        self.calls.append(("admit", list(keys), ()))
        return [True] * len(keys)

    def on_access(self, keys: Sequence[bytes], promoted: bool = False) -> None:
        self.calls.append(("on_access", list(keys), (promoted,)))

    def on_gpu_drop(self, keys: Sequence[bytes]) -> None:
        self.calls.append(("on_gpu_drop", list(keys), ()))

    def learn(self, request: PolicyRequest, chunk_keys: int = ALL_KEYS) -> Iterator[None]:
        self.calls.append(("learn", list(request.keys), (request.hints, chunk_keys)))
        yield

    def stats(self) -> PolicyStats:
        self.calls.append(("stats", [], ()))
        return PolicyStats(len(self.resident), len(self.resident))


def _tenant_quota(inner: EvictionPolicy) -> TenantQuotaPolicy:
    registry = TenantRegistry({"alice": TenantConfig(token_sha256="0" * 64, cpu_quota_bytes=1 << 20)})
    return TenantQuotaPolicy(inner, registry, BLOCK, CpuTier(8, LRUPolicy(8)))


# Every wrapper class -> how to build it around a policy.
FACTORIES: dict[type[PolicyWrapper], Callable[[EvictionPolicy], PolicyWrapper]] = {
    AdmissionWrapper: AdmissionWrapper,
    SessionWrapper: SessionWrapper,
    TenantQuotaPolicy: _tenant_quota,
}


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _subclasses(sub)
    return found


def test_the_hooks_are_the_interface_and_the_base_wrapper_forwards_each() -> None:
    overridable = {name for name, value in vars(EvictionPolicy).items()
                   if inspect.isfunction(value) and not name.startswith("_")}
    assert overridable - {"record"} == set(HOOKS), "a hook not in HOOKS (or a helper not excluded here)"
    assert set(HOOKS) <= set(vars(PolicyWrapper)), "PolicyWrapper must forward every hook"
    assert set(HOOKS) <= set(vars(Spy)), "the spy must record every hook"


def test_every_wrapper_derives_from_the_forwarding_base() -> None:
    wrappers = set(WRAPPERS.values()) | {TenantQuotaPolicy}
    assert all(isinstance(w, type) and issubclass(w, PolicyWrapper) for w in wrappers)
    known = {c for c in _subclasses(PolicyWrapper) if c.__module__.startswith("kvtier.")}
    assert known <= set(FACTORIES), f"wrappers without a factory here: {known - set(FACTORIES)}"
    assert wrappers <= set(FACTORIES)
    for cls in FACTORIES:
        for hook in HOOKS:
            owner = next(c for c in cls.__mro__ if hook in vars(c))
            assert issubclass(owner, PolicyWrapper), f"{cls.__name__}.{hook} comes from {owner.__name__}"


def _call(policy: EvictionPolicy, hook: str, keys: list[bytes]) -> tuple[list[bytes], tuple[Any, ...]]:
    """Call ``hook`` as an owner would; returns the keys and extra arguments the wrapped policy must see."""
    hints = RequestHints(session=b"s", at_s=1.0)
    if hook == "on_insert":
        policy.on_insert(keys[0])
        return keys[:1], ()
    if hook == "on_remove":
        policy.on_remove(keys[0])
        return keys[:1], ()
    if hook == "victims":
        list(policy.victims())
        return [], ()
    if hook == "admit":
        assert policy.admit(keys) == [True] * len(keys)
        return keys, ()
    if hook == "on_access":
        policy.on_access(keys, True)
        return keys, (True,)
    if hook == "on_gpu_drop":
        policy.on_gpu_drop(keys)
        return keys, ()
    if hook == "learn":
        assert list(policy.learn(PolicyRequest(keys, hints), 7)) == [None]
        return keys, (hints, 7)
    if hook == "stats":
        assert policy.stats().resident_keys == len(policy)
        return [], ()
    raise AssertionError(f"hook {hook!r} has no call here: add one")


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("wrapper", sorted(FACTORIES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_hook_reaches_the_wrapped_policy(wrapper: type[PolicyWrapper], hook: str) -> None:
    spy = Spy(8)
    policy = FACTORIES[wrapper](spy)
    keys = [bytes([i]) * 16 for i in range(3)]
    for _ in range(2):  # two sightings: +admit2 lets the keys through to the wrapped policy's word
        policy.record(keys)
    spy.calls.clear()
    want_keys, want_args = _call(policy, hook, keys)
    seen = [(k, args) for name, k, args in spy.calls if name == hook]
    assert seen, f"{wrapper.__name__} swallowed {hook}"
    assert [key for k, _ in seen for key in k] == want_keys  # a wrapper may split a batch, in order
    assert all(args == want_args for _, args in seen)


def test_nested_wrappers_forward_to_the_innermost() -> None:
    spy = Spy(8)
    policy = _tenant_quota(AdmissionWrapper(SessionWrapper(spy)))
    keys = [bytes([i]) * 16 for i in range(3)]
    policy.record(keys, RequestHints(session=b"s", at_s=1.0))
    policy.on_access(keys, True)
    policy.on_gpu_drop(keys)
    assert [name for name, _, _ in spy.calls] == ["learn", "on_access", "on_gpu_drop"]
    assert spy.calls[0][2][0] == RequestHints(session=b"s", at_s=1.0)  # the hints reach it too
