"""The transfer counters an engine adapter keeps, and what each one means.

Contract
========

An adapter counts what it moved between its engine and kvtierd under the
names of ``STAT_NAMES`` (vLLM's worker half: ``WorkerSide.take_stats``, the
growth since the last step) and shows them in its engine's own stats
(vLLM's: ``kvtier.integrations.vllm.stats``) with ``STAT_DOCS`` as their
help text. A name ending in ``_s`` counts seconds; the others count blocks
or loads. kvtierd's own metrics (``docs/metrics.md``) say what the daemon
holds; these say what this engine moved. Imports no engine.
"""

from __future__ import annotations

# Blocks restored, blocks that were not (recomputed), loads run beside the
# forward, seconds the forward waited for synchronous loads, blocks handed to
# kvtierd to store, and blocks whose synchronous restore finished beside the forward, layer by layer.
STAT_NAMES = ("blocks_loaded", "blocks_load_failed", "loads_background", "load_s", "blocks_stored",
              "blocks_loaded_by_layer")

STAT_DOCS = {
    "blocks_loaded": "KV blocks kvtier restored into this engine (prefill it skipped).",
    "blocks_load_failed": "KV blocks kvtier was asked for but could not restore (recomputed).",
    "loads_background": "Requests whose kvtier restore ran beside the forward (vLLM's async loads).",
    "load_s": "Seconds the forward waited for synchronous kvtier restores.",
    "blocks_stored": "KV blocks this engine handed to kvtierd to store.",
    "blocks_loaded_by_layer": "KV blocks whose restore finished beside the forward, layer by layer (layer_overlap).",
}
assert set(STAT_DOCS) == set(STAT_NAMES)
