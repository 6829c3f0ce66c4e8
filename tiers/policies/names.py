"""The default policy's name, importable without loading any policy (or numpy).

The default for the daemon and the replay tool: on the Mooncake traces it
beats LRU by 3.6 points (conversation) and 2 points (synthetic) at 100k GPU +
3M CPU tokens (docs/results.md, "Hit rates per policy"). Measured with `kvtier replay --sweep`.
"""

__all__ = ["DEFAULT_POLICY"]

DEFAULT_POLICY = "chain"
