"""Which kvtier pool a vLLM engine uses: one per (model, KV layout, TP rank).

Both halves of the connector derive the pool from vLLM's ``KVCacheConfig``
alone, so the scheduler (which never sees a KV tensor) and every worker
name the same pool with the same layout. The worker then checks the layout
against its real tensors (``block_dim_of``) before it registers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.client.client import PoolLayout
from kvtier.client.protocol import LAYOUT_FIELDS, OPS, ProtocolError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True, slots=True)
class PoolChoice:
    name: str
    layout: PoolLayout
    layer_names: tuple[str, ...]  # the KV tensors, in the order their bytes make a block
    block_size: int  # tokens per block (vLLM's, which kvtier takes as is)


def choose_pool(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, model_id: str | None,
                hash_algo: str, tp_rank: int) -> PoolChoice:
    """The pool of this engine's TP rank ``tp_rank``; raises ValueError for a layout kvtier cannot hold, and
    for a pool or model name kvtierd refuses (naming ``model_id``, which makes them)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"kvtier caches models with one KV cache group; this model has {len(groups)} "
            "(hybrid attention): run it without the kvtier connector"
        )
    spec = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype", "page_size_bytes", "block_size"):
        if not hasattr(spec, attr):
            raise ValueError(f"kvtier caches attention KV; this model's KV spec is {type(spec).__name__}")
    layer_names = tuple(groups[0].layer_names)
    model = model_id or _model_name(vllm_config)
    dtype = str(spec.dtype).removeprefix("torch.")
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    layout = PoolLayout(
        model=model,
        block_size=int(spec.block_size),
        block_bytes=int(spec.page_size_bytes) * len(layer_names),
        dtype=dtype,
        num_layers=len(layer_names),
        kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        tp_rank=tp_rank,
        tp_size=tp_size,
        hash_algo=hash_algo,
        mode="store",
    )
    name = f"vllm/{model}/{dtype}/b{layout.block_size}/tp{tp_rank}of{tp_size}"
    _check_names(name, model, model_id)
    return PoolChoice(name, layout, layer_names, layout.block_size)


def _check_names(pool: str, model: str, model_id: str | None) -> None:
    """Refuse (ValueError naming model_id) a pool name or model kvtierd's hello refuses: at every connect, for good."""
    fix = ("shorten kv_connector_extra_config.model_id" if model_id is not None
           else "set kv_connector_extra_config.model_id to a shorter name for this model")
    for what, value, kind in (("the pool name", pool, OPS["hello"].fields["pool"].type),
                              ("the model name", model, LAYOUT_FIELDS["model"].type)):
        try:
            kind.check(what, value)
        except ProtocolError:
            raise ValueError(f"kv_connector_extra_config.model_id: {what} {value[:80]!r}... is {len(value)} "
                             f"characters, kvtierd takes at most {kind.max_len}: {fix}") from None  # type: ignore[attr-defined]


def _model_name(vllm_config: VllmConfig) -> str:
    served: Any = vllm_config.model_config.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or vllm_config.model_config.model)


def block_dim_of(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a vLLM KV tensor that indexes blocks.

    vLLM's backends put it first (``[num_blocks, 2, ...]``, CPU and FlashInfer)
    or second (``[2, num_blocks, ...]``, FlashAttention); the outermost
    dimension of size ``num_blocks`` is taken, by stride, so a permuted
    (HND) layout is read right too.
    """
    dims = [d for d in range(tensor.dim()) if tensor.shape[d] == num_blocks]
    if not dims:
        raise ValueError(f"KV tensor of shape {tuple(tensor.shape)} has no dimension of {num_blocks} blocks")
    return max(dims, key=lambda d: tensor.stride(d))
