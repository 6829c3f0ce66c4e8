"""The connector's transfer counters as vLLM's ``KVConnectorStats``, so vLLM's own stats show them.

Each worker's ``WorkerSide.take_stats`` (``adapter.stats.STAT_NAMES``, growth since
the last step) travels to vLLM's stats logger as ``KvtierStats.data``;
vLLM sums the workers' and the steps' with ``aggregate`` and, where stats
logging is on (``vllm serve`` by default; ``LLM(disable_log_stats=False)``),
logs ``reduce()`` each interval as ``KV Transfer metrics:
kvtier_blocks_loaded=..., ...``. ``KvtierPromMetrics`` adds the same
counters to vLLM's Prometheus endpoint (``/metrics`` of ``vllm serve``) as
``vllm:kvtier_<name>_total``, labelled per engine like vLLM's own. kvtierd's
own metrics (``docs/metrics.md``) say what the daemon holds; these say what
this engine moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvtier.integrations.adapter.stats import STAT_DOCS, STAT_NAMES

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KvtierPromMetrics", "KvtierStats"]


@dataclass
class KvtierStats(KVConnectorStats):
    def __post_init__(self) -> None:
        self.data = {name: self.data.get(name, 0) for name in STAT_NAMES}

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_NAMES, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in STAT_NAMES:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name in STAT_NAMES:
            value: Any = self.data[name]
            out[f"kvtier_{name}"] = round(float(value), 4) if name.endswith("_s") else int(value)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_<name>`` counters, one child per engine, fed by ``KvtierStats.data``."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, PromMetric]] = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvtier_{name}", documentation=STAT_DOCS[name], labelnames=labelnames),
                per_engine_labelvalues)
            for name in STAT_NAMES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value > 0:
                per_engine[engine_idx].inc(value)
