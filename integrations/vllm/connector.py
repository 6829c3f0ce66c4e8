"""``KvtierConnector``: kvtierd as vLLM's KV-cache tier (vLLM's ``KVConnectorBase_V1``).

vLLM builds one instance per role: the scheduler's (``scheduler.py``) and one
per worker (``worker.py``). This class only routes vLLM's calls to the half
that exists in this process; the halves hold the logic. Use::

    --kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_connector_extra_config": {"socket": "ipc:///run/kvtier-0/kvtierd.sock"}}'

Settings: ``settings.py``; documentation: ``docs/vllm.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvtier.integrations.vllm.metadata import KvtierMetadata, KvtierWorkerMetadata
from kvtier.integrations.vllm.pool import choose_pool
from kvtier.integrations.vllm.prefix_support import engine_support
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.settings import ConnectorSettings
from kvtier.integrations.vllm.stats import KvtierPromMetrics, KvtierStats
from kvtier.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.integrations.vllm")


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV-cache manager (``SupportsHMA``): every KV-cache group is looked up, stored and
    restored with its own block ids (``groups.py``), so vLLM keeps it on with this connector."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # vLLM's scheduler reads the policy right after building this
            # connector. kvtier is a cache: a block it cannot restore is
            # recomputed, never an error for the user.
            self._kv_transfer_config.kv_load_failure_policy = settings.load_failure_policy
            # Lookups and pins go to rank 0's pool; each rank restores from its own.
            pool = choose_pool(vllm_config, kv_cache_config, model_id=settings.model_id,
                               hash_algo=settings.hash_algo, tp_rank=0)
            log.info("kvtier: pool %s: %d KV-cache group%s (%s), %d bytes per block of %d tokens%s", pool.name,
                     len(pool.groups), "s" if pool.hybrid else "", ", ".join(g.describe() for g in pool.groups),
                     pool.layout.block_bytes, pool.block_size,
                     f"; one copy for {pool.replicas} TP ranks (rank 0 stores, every rank loads)"
                     if pool.replicas > 1 else "")
            events = vllm_config.kv_events_config
            # vLLM's final config: where it cannot compute on a prefix, nothing is loaded (prefix_support.py).
            self._scheduler = SchedulerSide(settings, pool,
                                            kv_events=events is not None and bool(events.enable_kv_cache_events),
                                            support=engine_support(vllm_config, kv_cache_config))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            pool = choose_pool(vllm_config, kv_cache_config, model_id=settings.model_id,
                               hash_algo=settings.hash_algo, tp_rank=get_tensor_model_parallel_rank())
            self._worker = WorkerSide(settings, pool, int(kv_cache_config.num_blocks))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a store that does not happen is a future miss, not lost output

    # ---- worker side -------------------------------------------------------------------

    def _w(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._w().wait_for_stores()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        self._w().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w().wait_for_layer_load(layer_name)  # at once unless layer_overlap deferred that layer's restore

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # whole blocks are stored after the forward (wait_for_save), all layers at once

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        self._w().wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        received = self._w().get_finished()  # background loads that ran; no request waits on a store
        return None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        received = self._w().get_finished()
        # A hybrid engine's failed loads, by request: vLLM recomputes those requests (it takes no block ids).
        return KVConnectorTransferResults(finished_recving=received, failed_recving=self._w().take_failed())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        stats = KvtierStats(data=self._worker.take_stats())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        loaded = self._w().take_loaded()
        blocks, seconds = self._w().take_load_timing()
        return KvtierWorkerMetadata(loaded, blocks, seconds) if loaded or blocks else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # ---- scheduler side ----------------------------------------------------------------

    def _s(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker's connector"
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s().kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self._s().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_connector_output(connector_output)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self._s().get_external_cache_hit_sources(request, num_external_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's call for a SupportsHMA connector, one or many groups: blocks may go now, as request_finished says.
        return self._s().request_finished(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._s().take_events() if self._scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        # vLLM's reset_prefix_cache(reset_connector=True): the scheduler's call; keys live there.
        return self._s().reset_cache() if self._scheduler is not None else None
