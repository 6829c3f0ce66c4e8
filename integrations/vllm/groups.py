"""A vLLM engine's KV-cache groups as kvtier holds them (``adapter.groups.KvGroup``), read from vLLM's config.

Contract
========

vLLM's hybrid KV-cache manager (kept on: the connector is ``SupportsHMA``)
splits a model's layers into KV-cache groups, each with its own block table:
all layers of one attention type and window in one group (Gemma 3: one
group of full-attention layers, five of sliding-window layers). A block id
names memory in one group at a time, and each group's table has its own ids
for the same tokens. kvtier follows:

- ``kv_groups(kv_cache_config) -> list[KvGroup]``: called by both halves of
  the connector at start-up, on the ``KVCacheConfig`` vLLM gave it. One
  ``KvGroup`` per vLLM group, in vLLM's order (``index`` is the group's
  position in ``KVCacheBlocks.get_block_ids()``). Raises
  ``UnsupportedLayout`` (a ``ValueError``) naming the group and what kvtier
  cannot hold in it, for a group that is not full attention (MLA included)
  or sliding-window attention, or that vLLM itself does not prefix-cache or
  transfer; and for groups whose blocks differ in bytes (vLLM pads a group
  of fewer layers: kvtier keeps all groups of an engine in one pool, of one
  block size). Never a silent fallback: an engine kvtier cannot hold does
  not start with the connector.

``KvGroup`` itself, and the rule of which blocks a hit needs, are
engine-free (``kvtier.integrations.adapter.groups``); this module fills
them in from vLLM's objects:

- ``KvGroup.domain``: what the group's keys are derived with
  (``BlockHasher.derive``), so no two groups share a key: empty for an
  engine of one group (its keys are the request's, as before hybrid
  support), else the group's kind, window and layer names.
- ``KvGroup.window_tokens`` / ``retained_tokens``: the sliding window and
  vLLM's ``extra_retained_tokens``, which ``KvGroup.first_needed_block``
  turns into vLLM's own rule (vLLM hands its null block for the blocks
  skipped); vLLM's ``find_longest_cache_hit`` asks the same of its cache.

Imports nothing from vLLM: it reads vLLM's objects by attribute and type
name, so its rules are tested on vLLM-shaped stand-ins too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.integrations.adapter.groups import KvGroup, UnsupportedLayout

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

# vLLM 0.32's KV cache spec types kvtier holds, by class name (subclasses are
# other kinds: sinks, R-SWA, hidden states, MLA sliding windows).
FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
SLIDING_SPECS = ("SlidingWindowSpec",)
# What stops the others, for the start-up error.
UNSUPPORTED_WHY = {
    "MambaSpec": "Mamba/linear-attention state: vLLM caches it only at block boundaries a scheduler step "
                 "ended on (mamba_cache_mode 'align'), which kvtier does not track",
    "ChunkedLocalAttentionSpec": "chunked local attention (Llama 4) with the hybrid manager on",
    "SlidingWindowMLASpec": "sliding-window MLA (DeepSeek V4)",
    "CrossAttentionSpec": "cross-attention (encoder-decoder)",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "SinkFullAttentionSpec": "attention sinks",
    "UniformTypeKVCacheSpecs": "layers of one attention type with different KV shapes (an MLA indexer)",
}


def kv_groups(kv_cache_config: KVCacheConfig) -> list[KvGroup]:
    """The engine's groups (see the contract); ``UnsupportedLayout`` for a layout kvtier cannot hold."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()))
    if not groups:
        raise UnsupportedLayout("this engine has no KV cache group: nothing for kvtier to hold")
    out = [_group(i, g) for i, g in enumerate(groups)]
    sizes = {(g.block_size, g.block_bytes) for g in out}
    if len(sizes) > 1:
        detail = ", ".join(f"group {g.index} ({g.describe()}, {len(g.layer_names)} layer"
                           f"{'' if len(g.layer_names) == 1 else 's'}): {g.block_bytes} bytes per {g.block_size} tokens"
                           for g in out)
        raise UnsupportedLayout(
            "kvtier keeps an engine's KV-cache groups in one pool of one block size, and this model's groups "
            f"differ in bytes per block ({detail}); vLLM pads groups of fewer layers, which kvtier does not "
            "hold yet: run this model without the kvtier connector")
    if len(out) > 1:
        out = [_with_domain(g) for g in out]
    return out


def _group(index: int, group: Any) -> KvGroup:
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    where = f"KV-cache group {index} ({kind}, layers {', '.join(list(group.layer_names)[:3])}"
    where += ", ...)" if len(group.layer_names) > 3 else ")"
    if not getattr(group, "enable_kv_transfer", True):
        raise UnsupportedLayout(f"{where}: vLLM does not transfer this group's KV (enable_kv_transfer off)")
    if not getattr(spec, "prefix_cacheable", True):
        raise UnsupportedLayout(f"{where}: vLLM does not prefix-cache this group (per-request scratch)")
    if kind not in FULL_SPECS + SLIDING_SPECS:
        why = UNSUPPORTED_WHY.get(kind, "a KV cache kind kvtier does not know")
        raise UnsupportedLayout(f"{where}: kvtier cannot hold {why}; run this model without the kvtier connector")
    layers = tuple(group.layer_names)
    if not layers:
        raise UnsupportedLayout(f"{where}: the group has no layer")
    window = int(spec.sliding_window) if kind in SLIDING_SPECS else None
    return KvGroup(
        index=index,
        kind="sliding_window" if window is not None else "full",
        layer_names=layers,
        block_size=int(spec.block_size),
        block_bytes=int(spec.page_size_bytes) * len(layers),
        window_tokens=window,
        retained_tokens=int(getattr(spec, "extra_retained_tokens", 0) or 0) if window is not None else 0,
    )


def _with_domain(g: KvGroup) -> KvGroup:
    domain = f"vllm-kv-group:{g.describe()}:{','.join(g.layer_names)}".encode()
    return KvGroup(g.index, g.kind, g.layer_names, g.block_size, g.block_bytes, g.window_tokens,
                   g.retained_tokens, domain)
