"""The CPU tier's eviction policies by name: ``make_policy("lru")``, ``make_policy("arc+admit2")``.

The registry is a table written here, not filled in by the policy modules as
a side effect of being imported: every policy module imports only
``kvtier.tiers.policies.base``, and this module imports each of them, so the
imports point one way and a name is known as soon as this module is loaded.
To add a policy, write a module beside the others and add one line to
``POLICIES`` (or ``WRAPPERS`` for a wrapper, named after a ``+``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.tiers.policies.admit2 import AdmissionWrapper
from kvtier.tiers.policies.arc import ARCPolicy
from kvtier.tiers.policies.base import EvictionPolicy
from kvtier.tiers.policies.chain import ChainPolicy
from kvtier.tiers.policies.lru import LRUPolicy
from kvtier.tiers.policies.names import DEFAULT_POLICY
from kvtier.tiers.policies.s3fifo import S3FIFOPolicy
from kvtier.tiers.policies.session import SessionWrapper

__all__ = ["DEFAULT_POLICY", "POLICIES", "WRAPPERS", "PolicyFactory", "WrapperFactory", "check_policy_name",
           "make_policy", "policy_names"]

PolicyFactory = Callable[[int], EvictionPolicy]
WrapperFactory = Callable[[EvictionPolicy], EvictionPolicy]

# Base policies: name -> factory(capacity_blocks). No name contains "+".
POLICIES: dict[str, PolicyFactory] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "chain": ChainPolicy,
}
# Wrappers, named after a "+": name -> factory(wrapped policy).
WRAPPERS: dict[str, WrapperFactory] = {
    "admit2": AdmissionWrapper,
    "session": SessionWrapper,
}


def policy_names() -> list[str]:
    return sorted(POLICIES) + [f"<policy>+{w}" for w in sorted(WRAPPERS)]


def check_policy_name(spec: str) -> None:
    """Raise ``ValueError`` (saying what to write) unless ``spec`` names a policy ``make_policy`` builds.

    A base policy, then wrappers after ``+``, each known and each at most
    once: a wrapper wraps a policy that has no copy of it inside (a second
    ``+session`` would track every stream twice, a second ``+admit2`` filter
    twice). Builds nothing, so the daemon's configuration checks names
    without allocating a policy.
    """
    if not isinstance(spec, str):
        raise ValueError(f"a policy name is a string such as 'lru', got {type(spec).__name__}")
    base, *wrappers = spec.split("+")
    if base not in POLICIES:
        raise ValueError(f"unknown eviction policy {base!r}; choose one of {', '.join(policy_names())}")
    for i, wrapper in enumerate(wrappers):
        if wrapper not in WRAPPERS:
            raise ValueError(f"unknown policy wrapper {wrapper!r}; choose one of {', '.join(sorted(WRAPPERS))}")
        if wrapper in wrappers[:i]:
            raise ValueError(f"policy wrapper {wrapper!r} is named twice in {spec!r}; each wrapper at most once")


def make_policy(spec: str, capacity_blocks: int) -> EvictionPolicy:
    """Build a policy from a name like ``"lru"`` or ``"arc+admit2"`` (``check_policy_name``'s rules)."""
    check_policy_name(spec)
    base, *wrappers = spec.split("+")
    policy = POLICIES[base](capacity_blocks)
    for wrapper in wrappers:
        policy = WRAPPERS[wrapper](policy)
    return policy
