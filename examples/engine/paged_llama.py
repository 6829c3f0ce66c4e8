"""A Llama-architecture causal LM over a paged KV pool: the model half of the example engine.

Contract
========

- ``build_model(preset, seed=0, device="cpu")`` returns a Hugging Face
  ``LlamaForCausalLM`` built from a ``LlamaConfig`` with RANDOM weights drawn
  with ``torch.manual_seed(seed)``, in float32, in eval mode. No weights are
  downloaded (this machine has no network). Random weights are fine for what
  the example proves: KV reuse must give the same logits as recomputing, and
  that holds for any weights. They are not fine for judging text quality; the
  tokens here are synthetic ids, not text.
- ``PagedKVPool`` is the engine's KV cache: ONE tensor of shape
  ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
  (2 = K, V). Dimension ``BLOCK_DIM = 2`` indexes blocks; a block holds the
  K and V of ``block_size`` consecutive tokens for all layers. This tensor is
  what the engine registers with kvtier (it becomes the GPU tier), so the
  daemon can demote a block's bytes and restore them into any slot.
- ``PagedKVPool.make_cache(block_ids, num_cached_tokens, write_from_token)``
  returns a transformers ``Cache`` for one request. It is pre-filled, layer
  by layer, with the K/V of the request's first ``num_cached_tokens`` tokens
  read from the pool slots ``block_ids`` (token ``p`` lives in slot
  ``block_ids[p // block_size]`` at offset ``p % block_size``). Running the
  model with this cache on the tokens that follow writes their K/V both into
  the cache's working buffers and into the pool slots, except for positions
  below ``write_from_token`` (those slots are shared cache hits that already
  hold these exact values and another request may be reading them).
  ``PagedCache.set_block_table`` extends the slot mapping as the request grows.
- ``KVWorkspace`` holds the contiguous per-layer buffers the attention reads;
  an engine keeps one and passes it to every ``make_cache`` so that serving a
  request allocates nothing large (one request at a time per workspace).
- Keys are cached after rotary embedding (transformers applies RoPE before
  ``Cache.update``), so a cached block is only valid at the positions it was
  computed at. Block hashes chain over the whole prefix, so a hit always sits
  at the same positions.

The "paged attention" here is a gather into a contiguous per-request buffer
followed by the stock attention kernel: simple and exact, not the fastest
possible (a fused paged kernel would read the slots in place).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache, DynamicLayer

BLOCK_DIM = 2  # [layers, K/V, *blocks*, tokens, heads, head_dim]
DEFAULT_BLOCK_SIZE = 16

# name -> LlamaConfig fields. Head dim is 64 everywhere (hidden / heads).
MODEL_PRESETS: dict[str, dict[str, int]] = {
    # Tests: a forward of a few hundred tokens takes milliseconds.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    # The demo default: ~56M parameters, big enough that a prefill of 1-2k
    # tokens visibly costs time on a 2-core CPU, small enough for a 1-2 minute demo.
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000),
    # The benchmark model of issue 5: ~200M parameters, 12 layers, 4 KV heads.
    "200m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000),
    # A GPU's benchmark model: Llama-3.2-1B's shape (~1.2B parameters, 16 layers,
    # 8 KV heads, 64 KiB of float32 KV per token), where an 8k-token prefill
    # costs a GPU real time. Too slow for a 2-core CPU.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}


def model_config(preset: str, *, max_position_embeddings: int = 8192, attn_implementation: str = "sdpa") -> LlamaConfig:
    """The ``LlamaConfig`` of a preset (see ``MODEL_PRESETS``)."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(MODEL_PRESETS)}")
    return LlamaConfig(
        **MODEL_PRESETS[preset],
        max_position_embeddings=max_position_embeddings,
        attn_implementation=attn_implementation,
        tie_word_embeddings=False,
    )


def build_model(preset: str, *, seed: int = 0, device: str | torch.device = "cpu",
                attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    """A random-init float32 Llama of the given preset, in eval mode (see the module docstring)."""
    config = model_config(preset, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    # Initialised on its device: a 1B model's random init takes the CPU many
    # seconds, the GPU milliseconds. The same seed gives the same weights on
    # one device, which is all a comparison within one run needs.
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=torch.float32).eval()


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class KVGeometry:
    """What one KV block of a model looks like (this is the kvtier pool layout)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, config: LlamaConfig, block_size: int = DEFAULT_BLOCK_SIZE) -> KVGeometry:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, block_size)

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class PagedKVPool:
    """The engine's paged KV cache: one tensor, blocks along ``BLOCK_DIM`` (see the module docstring)."""

    def __init__(self, tensor: torch.Tensor, geometry: KVGeometry) -> None:
        expected = geometry.pool_shape(tensor.shape[BLOCK_DIM]) if tensor.dim() == 6 else None
        if expected is None or tuple(tensor.shape) != expected or tensor.dtype != geometry.dtype:
            raise ValueError(f"KV pool tensor {tuple(tensor.shape)} {tensor.dtype} does not match {geometry}")
        if not tensor.is_contiguous():
            raise ValueError("the KV pool tensor must be contiguous")
        self.tensor = tensor
        self.geometry = geometry
        self.num_blocks = tensor.shape[BLOCK_DIM]

    @classmethod
    def allocate(cls, geometry: KVGeometry, num_blocks: int, device: str | torch.device = "cpu") -> PagedKVPool:
        """A pool in ordinary (process-private) memory: for the in-process backend."""
        return cls(torch.zeros(geometry.pool_shape(num_blocks), dtype=geometry.dtype, device=device), geometry)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def slot_index(self, block_ids: Sequence[int], start_token: int, end_token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block slot, offset in block) of each token position in ``[start_token, end_token)``."""
        bs = self.geometry.block_size
        pos = torch.arange(start_token, end_token, dtype=torch.int64)
        table = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if end_token > start_token and (end_token - 1) // bs >= table.numel():
            raise IndexError(f"token {end_token - 1} needs block {(end_token - 1) // bs}, table has {table.numel()}")
        return table[pos // bs].to(self.device), (pos % bs).to(self.device)

    def read_tokens(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        """K/V of a request's first ``num_tokens`` tokens: ``[layers, 2, heads, num_tokens, head_dim]`` (a copy)."""
        g = self.geometry
        nb = g.blocks_for(num_tokens)
        idx = torch.as_tensor(list(block_ids[:nb]), dtype=torch.int64, device=self.device)
        kv = self.tensor.index_select(BLOCK_DIM, idx)  # [L, 2, nb, bs, H, D]
        kv = kv.reshape(g.num_layers, 2, nb * g.block_size, g.num_kv_heads, g.head_dim)[:, :, :num_tokens]
        return kv.permute(0, 1, 3, 2, 4)

    def read_layer_into(self, layer: int, block_ids: Sequence[int], num_tokens: int, k_out: torch.Tensor,
                        v_out: torch.Tensor) -> None:
        """Copy one layer's K/V of a request's first ``num_tokens`` tokens into ``[1, heads, >=num_tokens, head_dim]``."""
        g = self.geometry
        nb = g.blocks_for(num_tokens)
        idx = torch.as_tensor(list(block_ids[:nb]), dtype=torch.int64, device=self.device)
        for kv, out in ((0, k_out), (1, v_out)):
            # One layer at a time keeps the gathered blocks (a few MiB) in cache for the transposing copy.
            blocks = self.tensor[layer, kv].index_select(0, idx).view(nb * g.block_size, g.num_kv_heads, g.head_dim)
            out[0, :, :num_tokens].copy_(blocks[:num_tokens].transpose(0, 1))

    def make_cache(self, block_ids: Sequence[int], num_cached_tokens: int, *, write_from_token: int | None = None,
                   capacity_tokens: int = 0, workspace: KVWorkspace | None = None) -> PagedCache:
        return PagedCache(self, block_ids, num_cached_tokens,
                          write_from_token=num_cached_tokens if write_from_token is None else write_from_token,
                          capacity_tokens=capacity_tokens, workspace=workspace)


class KVWorkspace:
    """Contiguous per-layer K/V buffers ``[1, heads, capacity, head_dim]`` that the attention reads.

    Reused from request to request, so serving a request does not allocate
    (and fault in) tens of MiB of fresh memory. One request at a time: a
    cache built on a workspace takes its buffers over from the previous one.
    """

    def __init__(self, geometry: KVGeometry, device: str | torch.device = "cpu", capacity_tokens: int = 0) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.capacity_tokens = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure(max(capacity_tokens, 1))

    def _empty(self, capacity: int) -> torch.Tensor:
        g = self.geometry
        return torch.empty((1, g.num_kv_heads, capacity, g.head_dim), dtype=g.dtype, device=self.device)

    def ensure(self, capacity_tokens: int) -> None:
        """Make room for ``capacity_tokens`` tokens per layer (contents are not kept)."""
        if capacity_tokens <= self.capacity_tokens:
            return
        # Round up to whole blocks, with headroom so that decode rarely reallocates.
        bs = self.geometry.block_size
        cap = -(-int(capacity_tokens * 1.25) // bs) * bs
        self.k = [self._empty(cap) for _ in range(self.geometry.num_layers)]
        self.v = [self._empty(cap) for _ in range(self.geometry.num_layers)]
        self.capacity_tokens = cap

    def grow_layer(self, layer: int, needed_tokens: int, used_tokens: int) -> None:
        """Reallocate one layer's buffers to hold ``needed_tokens``, keeping the first ``used_tokens``."""
        cap = max(needed_tokens, 2 * self.k[layer].shape[2])
        for bufs in (self.k, self.v):
            new = self._empty(cap)
            new[:, :, :used_tokens].copy_(bufs[layer][:, :, :used_tokens])
            bufs[layer] = new


class PagedLayer(DynamicLayer):
    """One layer of a ``PagedCache``: the workspace buffer the attention reads, plus writes into the pool.

    ``update`` (called by the attention module with the new tokens' post-RoPE
    K/V, shape ``[1, heads, n, head_dim]``) appends them to the buffer, writes
    them into the pool at their slots, and returns views of the whole sequence.
    """

    def __init__(self, cache: PagedCache, layer_idx: int, num_cached_tokens: int) -> None:
        super().__init__()
        pool = cache.pool
        self._cache = cache
        self._ws = cache.workspace
        self._layer_idx = layer_idx
        self._len = num_cached_tokens
        if num_cached_tokens:
            pool.read_layer_into(layer_idx, cache.block_ids, num_cached_tokens, self._ws.k[layer_idx],
                                 self._ws.v[layer_idx])
        self.dtype, self.device = pool.geometry.dtype, pool.device
        self.is_initialized = True
        self._sync_views()

    def _sync_views(self) -> None:
        self.keys = self._ws.k[self._layer_idx][:, :, : self._len]
        self.values = self._ws.v[self._layer_idx][:, :, : self._len]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True  # the buffers exist from construction

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != 1:
            raise ValueError("the paged example engine runs one sequence at a time (batch 1)")
        n = key_states.shape[-2]
        start = self._len
        layer = self._layer_idx
        if start + n > self._ws.k[layer].shape[2]:
            self._ws.grow_layer(layer, start + n, start)
        self._ws.k[layer][:, :, start : start + n].copy_(key_states)
        self._ws.v[layer][:, :, start : start + n].copy_(value_states)
        self._len = start + n
        self._cache._write_pool(layer, start, key_states, value_states)
        self._sync_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._len + query_length, 0

    def reset(self) -> None:
        self._len = 0
        self._sync_views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a paged cache is not cropped; free the request instead")


class PagedCache(Cache):
    """A transformers ``Cache`` over a request's pool slots (see the module docstring)."""

    def __init__(self, pool: PagedKVPool, block_ids: Sequence[int], num_cached_tokens: int, *,
                 write_from_token: int, capacity_tokens: int = 0, workspace: KVWorkspace | None = None) -> None:
        g = pool.geometry
        if num_cached_tokens > len(block_ids) * g.block_size:
            raise ValueError(f"{num_cached_tokens} cached tokens do not fit in {len(block_ids)} blocks")
        self.pool = pool
        self.block_ids = list(block_ids)
        self.write_from_token = write_from_token
        self.workspace = workspace or KVWorkspace(g, pool.device)
        self.workspace.ensure(max(capacity_tokens, num_cached_tokens, 1))
        super().__init__(layers=[PagedLayer(self, i, num_cached_tokens) for i in range(g.num_layers)])

    def set_block_table(self, block_ids: Sequence[int]) -> None:
        """The request's block table after an append (it only grows at the end)."""
        if list(block_ids[: len(self.block_ids)]) != self.block_ids:
            raise ValueError("a request's block table may only grow at its end")
        self.block_ids = list(block_ids)

    def _write_pool(self, layer_idx: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens ``[start, start + n)`` of one layer into their pool slots (skipping shared hits)."""
        n = k.shape[-2]
        skip = max(0, min(n, self.write_from_token - start))
        if skip == n:
            return
        blocks, offsets = self.pool.slot_index(self.block_ids, start + skip, start + n)
        layer = self.pool.tensor[layer_idx]  # [2, N, bs, H, D]
        # [1, H, n, D] -> [n, H, D], the pool's per-token layout.
        layer[0].index_put_((blocks, offsets), k[0, :, skip:].transpose(0, 1))
        layer[1].index_put_((blocks, offsets), v[0, :, skip:].transpose(0, 1))


def parameters_millions(model: torch.nn.Module) -> float:
    return count_parameters(model) / 1e6
