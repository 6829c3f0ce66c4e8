"""The CPU tier's eviction policies: one module per policy, a registry that names them.

Layout (imports point down this list, never up):

- ``registry``  ``make_policy(name, capacity)``, ``check_policy_name(name)``, ``DEFAULT_POLICY``, ``policy_names()``,
                the ``POLICIES``/``WRAPPERS`` tables; imports every policy module.
- ``lru``, ``arc``, ``s3fifo``, ``chain``  one policy each; ``admit2``: the
                ``+admit2`` admission wrapper; ``session``: the ``+session`` wrapper
                (session-aware eviction from request hints). Each imports only ``base``
                (and ``kvtier.tiers.hints``).
- ``base``      the ``EvictionPolicy`` contract and ``PolicyWrapper``, the base of every wrapper (it
                forwards every hook); ``names``: ``DEFAULT_POLICY`` (both stdlib only).

This package re-exports the registry's API (loaded on first use) and the
contract, so ``from kvtier.tiers.policies import make_policy`` is the usual import.

Notes that hold for ARC, S3-FIFO and admit2 (each module documents its own
algorithm and its differences from the paper): they follow the
``EvictionPolicy`` contract (``base``): the tier, not the policy, decides *when* to evict. It asks ``victims()`` for
resident keys best-victim-first, takes the first ones it may evict (not
pinned, no copy in flight; the CPU tier takes a whole batch from one walk)
and then calls ``on_remove`` for them, followed by ``on_insert`` for the
newcomers. The classic algorithms are written as "on a miss, evict then
insert"; here that single step is split across those calls, and the
differences that follow are listed in each policy's module.

Both ``victims()`` of ARC and S3-FIFO yield, in order, exactly the keys that as many
successive evictions would take (``victims()``, evict the first, repeat) as
long as nothing is skipped, so a batch eviction is the algorithm's own
sequence. A skipped (pinned) key is treated as if it had gone, which keeps
the rest of the order sensible without the policy knowing about pins.

Re-inserting a key that is already resident counts as a use (``on_access``),
as it does for ``LRUPolicy``. ``on_access``/``on_remove`` of a key that is not
resident are no-ops.
"""

from typing import Any

from kvtier.tiers.policies.base import EvictionPolicy, PolicyRequest, PolicyStats, PolicyWrapper
from kvtier.tiers.policies.names import DEFAULT_POLICY

__all__ = ["DEFAULT_POLICY", "POLICIES", "WRAPPERS", "EvictionPolicy", "PolicyFactory", "PolicyRequest",
           "PolicyStats", "PolicyWrapper", "WrapperFactory", "check_policy_name", "make_policy", "policy_names"]

_FROM_REGISTRY = frozenset({"POLICIES", "WRAPPERS", "PolicyFactory", "WrapperFactory", "check_policy_name", "make_policy",
                            "policy_names"})


def __getattr__(name: str) -> Any:
    """The registry's names, loaded on first use: ``DEFAULT_POLICY`` and ``EvictionPolicy`` load no
    policy, so ``kvtier --help`` and the daemon's config do not pay for numpy (the chain policy's)."""
    if name in _FROM_REGISTRY:
        from kvtier.tiers.policies import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
