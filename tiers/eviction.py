"""Former home of the eviction-policy contract and registry; now ``kvtier.tiers.policies``.

Kept so that importers not yet moved keep working (``tiers/pool``, which is
being split, and the daemon's ``config`` and ``tenants``): it re-exports the
package's names and defines nothing. New code imports ``kvtier.tiers.policies``
(``make_policy``, ``DEFAULT_POLICY``, ``EvictionPolicy``) or a policy module
(``kvtier.tiers.policies.lru.LRUPolicy``). Nothing in ``kvtier.tiers.policies``
imports this module, so there is no cycle.
"""

from kvtier.tiers.policies import (
    DEFAULT_POLICY,
    POLICIES,
    WRAPPERS,
    EvictionPolicy,
    PolicyFactory,
    WrapperFactory,
    make_policy,
    policy_names,
)
from kvtier.tiers.policies.lru import LRUPolicy

__all__ = ["DEFAULT_POLICY", "POLICIES", "WRAPPERS", "EvictionPolicy", "LRUPolicy", "PolicyFactory",
           "WrapperFactory", "make_policy", "policy_names"]
