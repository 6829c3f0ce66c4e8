"""The engine-free half of an engine adapter: what every ``integrations/<engine>/`` builds on.

Contract
========

Nothing here imports an engine (``tests/test_architecture.py`` checks that
importing every module of this package loads no ``vllm`` or ``sglang``),
nor ``kvtier.tiers`` or ``kvtier.daemon``: an adapter talks to kvtierd only
through ``kvtier.client``. torch is imported only where KV tensors are
copied (``planes``). What an adapter gets:

- ``link.DaemonLink``: the line to kvtierd, connected and reconnected on a
  thread of its own; a call while kvtierd is down is a miss at once, never
  an error or a wait in the engine.
- ``background.Background``: one thread that runs daemon calls in order,
  off the engine's threads (lookups batched per round trip, stores).
- ``hits.find_hits``: the prefix of each request kvtierd can serve in every
  KV-cache group (``groups.KvGroup``), looked up and pinned in pipelined
  rounds.
- ``keys.PrefixKeys``: a request's kvtier block keys, hashed as it grows,
  per group; ``keys.epoch_salt`` for a cache reset.
- ``hints``: a request's session, retention and priority checked as kvtier
  hints, softly (a bad value is dropped, logged once).
- ``load_modes``: whether a load runs before the engine's step or beside
  it (``sync``, ``async``, ``adaptive``).
- ``transfers.StepTransfers``: the loads and stores of one engine step, as
  block keys paired with the engine's block ids.
- ``planes``: the data path between the engine's KV tensors and kvtierd
  (registered tensors, or copies through a shared-memory arena).
- ``layer_copies.LayerCopies``: a lent restore's later layers copied beside
  the engine's forward, each waited for by its layer.
- ``stats.STAT_NAMES``: the transfer counters an adapter reports.

What the adapter supplies itself (vLLM's, in ``kvtier.integrations.vllm``):
the engine's hook points and their threading (when to look up, load,
store; what to report back), its KV-cache groups as ``KvGroup``s and its
KV tensors with their block dimension, a request's tokens and extra keys
(LoRA, multimodal items, salt) for ``PrefixKeys``, where a request carries
its hints, the pool it names (model, layout, shard), its settings and their
validation, and how its stats and events are shown.
"""
