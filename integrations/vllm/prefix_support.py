"""Whether a vLLM engine, or one request, may be handed a prefix from kvtierd, and whether its KV may be stored.

Contract
========

A loaded prefix is only right if the engine computes the rest of the prompt
on top of it as it would have on its own KV. vLLM says where it cannot: it
turns its own prefix caching off for such models and platforms. The
connector follows vLLM, never second-guesses it:

- ``engine_support(vllm_config, kv_cache_config)``: called once by the
  connector's scheduler half at start-up, on vLLM's final config (vLLM's
  platform and model hooks have run). Returns ``PrefixSupport``: loads and
  stores allowed, or which are off and why. Rules, first match wins:

  1. a KV cache spec says ``non_causal`` (prefix-LM layers): vLLM turns
     prefix caching and chunked prefill off; a block's KV depends on tokens
     after it, so it is neither loaded nor stored;
  2. vLLM does not cache this model's prefixes at all
     (``ModelConfig.is_prefix_caching_supported``: encoder-decoder and
     attention-free models, pooling models with bidirectional or mean/CLS
     pooling): neither;
  3. an architecture for which vLLM turns prefix caching off because the KV
     of generated tokens is not a function of the prefix
     (``NO_PREFIX_REUSE``: vLLM 0.32's Unlimited-OCR, R-SWA): neither;
  4. prefix caching and chunked prefill both off: this engine's prefill never
     starts from computed tokens. vLLM's CPU backend does this for MLA models
     ("MLA is enabled on a non-GPU platform; forcing chunked prefill and
     prefix caching to be disabled"): its MLA prefill attends over the
     prompt's own tokens only, and a loaded prefix would be ignored, giving
     wrong answers. No loads; stores go on: the blocks are right, and an
     engine of the same pool (same model, dtype, block size and rank) that
     computes on a prefix may load them;
  5. prefix caching off under ``VLLM_BATCH_INVARIANT``: vLLM turns it off
     for backends whose prefix hits would break batch invariance; no loads,
     stores go on.

  Prefix caching off by the user alone (chunked prefill on) allows loads:
  chunked prefill is the same computation on a computed prefix, and vLLM's
  P/D connectors load under it too.
- ``request_support(request)``: called once per request. Returns loads and
  stores off for a request with prompt embeddings (vLLM gives it
  placeholder token ids, all 0, so kvtier's keys, hashes of token ids,
  would be the same for any embeddings of that length), and loads off for
  one that skips vLLM's prefix cache (``skip_reading_prefix_cache``: vLLM
  sets it for prompt logprobs, which need the whole prompt computed; a user
  may set it too). vLLM drops a connector's hit for the latter anyway; the
  connector does not look up, so nothing is pinned for it.

Both read vLLM's objects by attribute name and never fail: an attribute a
vLLM version lacks counts as "supported". They import nothing from vLLM
(``VLLM_BATCH_INVARIANT`` is read as vLLM reads it, from the environment).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass(frozen=True, slots=True)
class PrefixSupport:
    loads: bool = True  # blocks from kvtierd may be handed to vLLM
    stores: bool = True  # blocks vLLM computed may go to kvtierd
    why: str = ""  # why loads or stores are off (for the log)

    def effect(self) -> str:
        """What is off, in words: "no loads, no stores", "no loads" or "no stores" ("" when nothing is)."""
        return ", ".join(w for w, off in (("no loads", not self.loads), ("no stores", not self.stores)) if off)


SUPPORTED = PrefixSupport()

# vLLM 0.32 architectures whose config hook turns prefix caching off because
# the KV of generated tokens is not a causal function of the prefix.
NO_PREFIX_REUSE = {
    "UnlimitedOCRForCausalLM": "its R-SWA attention makes the KV of generated tokens depend on more than the prefix",
}

EMBEDS = PrefixSupport(False, False, "it has prompt embeddings: vLLM gives it placeholder token ids (0), "
                                     "so kvtier's keys, hashed from token ids, cannot tell embeddings apart")
SKIPS_PREFIX_CACHE = PrefixSupport(False, True, "it skips vLLM's prefix cache (skip_reading_prefix_cache: "
                                                "prompt logprobs need every prompt token computed)")


def engine_support(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> PrefixSupport:
    """Whether this engine may load prefixes from kvtierd and store its blocks (see the contract)."""
    cache, sched, model = vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.model_config
    prefix_caching = bool(getattr(cache, "enable_prefix_caching", True))
    chunked_prefill = bool(getattr(sched, "enable_chunked_prefill", True))
    for group in getattr(kv_cache_config, "kv_cache_groups", ()):
        if getattr(group.kv_cache_spec, "non_causal", False):
            return PrefixSupport(False, False, "a layer attends non-causally: a block's KV depends on the tokens "
                                               "after it (vLLM turns its prefix caching off for this model too)")
    if model is not None and not getattr(model, "is_prefix_caching_supported", True):
        kind = getattr(model, "attn_type", "this")
        return PrefixSupport(False, False, f"vLLM does not cache prefixes of this model ({kind} attention"
                                           f"{', pooling' if getattr(model, 'pooler_config', None) else ''})")
    for arch in getattr(model, "architectures", None) or ():
        if arch in NO_PREFIX_REUSE and not prefix_caching:
            return PrefixSupport(False, False, f"{arch}: {NO_PREFIX_REUSE[arch]} (vLLM turns its prefix caching off)")
    if not prefix_caching and not chunked_prefill:
        mla = " (vLLM's CPU backend does so for MLA models)" if getattr(model, "use_mla", False) else ""
        return PrefixSupport(False, True, "vLLM runs this engine with prefix caching and chunked prefill off"
                                          f"{mla}: its prefill never starts from computed tokens, so a loaded "
                                          "prefix would be computed on wrongly. Blocks are still stored, for "
                                          "engines of the same pool that can load them")
    if not prefix_caching and os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        return PrefixSupport(False, True, "prefix caching is off under VLLM_BATCH_INVARIANT: a loaded prefix "
                                          "would break batch invariance. Blocks are still stored")
    return SUPPORTED


def request_support(request: Request | Any) -> PrefixSupport:
    """Whether this request may be handed a prefix from kvtierd and have its blocks stored (see the contract)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return EMBEDS
    if getattr(request, "skip_reading_prefix_cache", False):
        return SKIPS_PREFIX_CACHE
    return SUPPORTED
