"""The connector's transfer counters as vLLM's ``KVConnectorStats``, so vLLM's own stats show them.

Each worker's ``WorkerSide.take_stats`` (``worker.STAT_NAMES``, growth since
the last step) travels to vLLM's stats logger as ``KvtierStats.data``;
vLLM sums the workers' and the steps' with ``aggregate`` and, where stats
logging is on (``vllm serve`` by default; ``LLM(disable_log_stats=False)``),
logs ``reduce()`` each interval as ``KV Transfer metrics:
kvtier_blocks_loaded=..., ...``. kvtierd's own metrics (``docs/metrics.md``)
say what the daemon holds; these say what this engine moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.integrations.vllm.worker import STAT_NAMES

__all__ = ["KvtierStats"]


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
