"""A pool's defaults, importable without loading any tier (stdlib only).

``TieredPool``'s constructor and the daemon's configuration (``[default_pool]``)
take their defaults from here, so a pool built by hand (a tool, a test, a
benchmark) and a pool the daemon builds start alike.

- ``DEFAULT_POLICY``: the CPU tier's eviction policy (chosen, and why, in
  ``kvtier.tiers.policies.names``).
- ``DEFAULT_CLEAN_AHEAD_BLOCKS``: free GPU blocks kept already demoted ahead of
  allocation (``TieredPool``'s clean-ahead).
"""

from kvtier.tiers.policies.names import DEFAULT_POLICY

__all__ = ["DEFAULT_CLEAN_AHEAD_BLOCKS", "DEFAULT_POLICY"]

DEFAULT_CLEAN_AHEAD_BLOCKS = 64
