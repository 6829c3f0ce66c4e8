"""Which kvtier pool a vLLM engine uses: one per (model, KV layout, KV shard), holding every KV-cache group.

Both halves of the connector derive the pool from vLLM's ``KVCacheConfig``
alone, so the scheduler (which never sees a KV tensor) and every worker
name the same pool with the same layout. The worker then checks the layout
against its real tensors (``block_dim_of``) before it registers them.

- Groups (``groups.py``): a hybrid model's KV-cache groups (full attention,
  sliding window) share one pool, each under keys derived for it, so they
  never mix; the pool's name lists them (``.../full+5xswa128/...``) and its
  block is one group's block. An engine of one group keeps the name and keys
  it always had.
- Shards: the pool is the rank's KV shard, ``tp{shard}of{shards}``. Where
  vLLM says the KV is the same on several ranks (``kv_tp_replicas``: MLA's
  latent KV is one copy on every rank), those ranks are one shard: one pool,
  in which only the first rank of the shard stores (``PoolChoice.stores``)
  and every rank loads. MLA at any TP size is ``tp0of1``, the pool of TP=1,
  whose bytes are the same.

``choose_pool`` raises ``ValueError`` (``UnsupportedLayout``, naming the
part) for a layout kvtier cannot hold, at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.client.client import PoolLayout
from kvtier.client.protocol import MAX_POOL_NAME, MAX_STR_LEN, ProtocolError, check_text
from kvtier.integrations.adapter.groups import KvGroup
from kvtier.integrations.vllm.groups import kv_groups

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True, slots=True)
class PoolChoice:
    name: str
    layout: PoolLayout
    groups: tuple[KvGroup, ...]  # vLLM's KV-cache groups, in its order; their blocks are the pool's
    block_size: int  # tokens per block (vLLM's, which kvtier takes as is)
    stores: bool = True  # this rank stores; False: another rank of its shard stores the same KV
    replicas: int = 1  # ranks holding this KV (vLLM's kv_tp_replicas)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer's KV tensor, group by group."""
        return tuple(name for g in self.groups for name in g.layer_names)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @classmethod
    def single(cls, name: str, layout: PoolLayout, layer_names: tuple[str, ...], block_size: int) -> PoolChoice:
        """The pool of an engine of one full-attention group (tests and benchmarks that drive a half alone)."""
        group = KvGroup(0, "full", tuple(layer_names), block_size, layout.block_bytes)
        return cls(name, layout, (group,), block_size)


def choose_pool(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, model_id: str | None,
                hash_algo: str, tp_rank: int) -> PoolChoice:
    """The pool of this engine's TP rank ``tp_rank``; raises ValueError for a layout kvtier cannot hold, and
    for a pool or model name kvtierd refuses (naming ``model_id``, which makes them)."""
    groups = tuple(kv_groups(kv_cache_config))
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype", "page_size_bytes", "block_size"):
        if not hasattr(spec, attr):
            raise ValueError(f"kvtier caches attention KV; this model's KV spec is {type(spec).__name__}")
    model = model_id or _model_name(vllm_config)
    dtype = str(spec.dtype).removeprefix("torch.")
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    replicas = _replicas(kv_cache_config, tp_size)
    shard, shards = tp_rank // replicas, tp_size // replicas
    layout = PoolLayout(
        model=model,
        block_size=groups[0].block_size,
        block_bytes=groups[0].block_bytes,
        dtype=dtype,
        num_layers=len(groups[0].layer_names),
        kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        tp_rank=shard,
        tp_size=shards,
        hash_algo=hash_algo,
        mode="store",
    )
    kinds = f"/{group_names(groups)}" if len(groups) > 1 else ""
    name = f"vllm/{model}/{dtype}/b{layout.block_size}{kinds}/tp{shard}of{shards}"
    _check_names(name, model, model_id)
    return PoolChoice(name, layout, groups, layout.block_size, stores=tp_rank % replicas == 0, replicas=replicas)


def group_names(groups: tuple[KvGroup, ...]) -> str:
    """The groups of a pool, by kind and count, in first-seen order: ``full+5xswa128``."""
    counts: dict[str, int] = {}
    for g in groups:
        counts[g.describe()] = counts.get(g.describe(), 0) + 1
    return "+".join(kind if n == 1 else f"{n}x{kind}" for kind, n in counts.items())


def _replicas(kv_cache_config: KVCacheConfig, tp_size: int) -> int:
    """Consecutive TP ranks holding the same KV (vLLM's ``kv_tp_replicas``); 1 where vLLM does not say."""
    replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)
    if replicas < 1 or tp_size % replicas:
        raise ValueError(f"vLLM says {replicas} TP ranks hold the same KV, which does not divide TP size {tp_size}")
    return replicas


def _check_names(pool: str, model: str, model_id: str | None) -> None:
    """Refuse (ValueError naming model_id) a pool name or model kvtierd's hello refuses: at every connect, for good."""
    fix = ("shorten kv_connector_extra_config.model_id" if model_id is not None
           else "set kv_connector_extra_config.model_id to a shorter name for this model")
    for what, value, max_len in (("the pool name", pool, MAX_POOL_NAME), ("the model name", model, MAX_STR_LEN)):
        try:
            check_text(what, value, max_len)
        except ProtocolError:
            raise ValueError(f"kv_connector_extra_config.model_id: {what} {value[:80]!r}... is {len(value)} "
                             f"characters, kvtierd takes at most {max_len}: {fix}") from None


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
