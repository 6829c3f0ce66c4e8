"""The default policy's name, importable without loading any policy (or numpy).

The default for the daemon, ``TieredPool`` and the replay tool
(``kvtier.tiers.pool_defaults``): ``chain+session``. Without hints it decides
exactly as ``chain`` (the session wrapper forwards every decision: the golden
digests of ``chain``), which on the Mooncake traces beats LRU by 3.6 points
(conversation) and 2 points (synthetic) at 100k GPU + 3M CPU tokens (docs/results.md,
"Hit rates per policy"); with the session hints an application or vLLM sends, it ranks
whole sessions' streams: 0.6679 against ``chain``'s 0.5934 on Claude Code
(docs/results.md). Measured with ``kvtier replay --sweep``.

Its cost per request in the daemon, without hints, against ``chain``
(``bench/policy_cost.py``: two kvtierd side by side, lookup + store of 1,500
Mooncake conversation requests, 7 rounds, 2 shared cores at load 16-24): the
daemon's CPU time per request 1.000x (median; rounds 0.98-1.09), p50 round
trip 1.007x; an earlier run of 5 rounds 1.029x. Two daemons of ``chain``
alone differ by 0.94-0.98x in the same bench: the difference is within the
noise, and well within the 1.2x issue 36 allowed, hence the default.
"""

__all__ = ["DEFAULT_POLICY"]

DEFAULT_POLICY = "chain+session"
