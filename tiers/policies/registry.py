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

__all__ = ["DEFAULT_POLICY", "POLICIES", "WRAPPERS", "PolicyFactory", "WrapperFactory", "make_policy",
           "policy_names"]

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


def make_policy(spec: str, capacity_blocks: int) -> EvictionPolicy:
    """Build a policy from a name like ``"lru"`` or ``"arc+admit2"``."""
    base, *wrappers = spec.split("+")
    if base not in POLICIES:
        raise ValueError(f"unknown eviction policy {base!r}; choose one of {', '.join(policy_names())}")
    policy = POLICIES[base](capacity_blocks)
    for wrapper in wrappers:
        if wrapper not in WRAPPERS:
            raise ValueError(f"unknown policy wrapper {wrapper!r}; choose one of {', '.join(sorted(WRAPPERS))}")
        policy = WRAPPERS[wrapper](policy)
    return policy
