"""What the scheduler half tells the worker half each step, and what comes back, as vLLM's types.

Both travel between vLLM's processes by pickle; they hold plain lists. The
content is ``transfers.StepTransfers``; these add vLLM's base classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.integrations.adapter.transfers import BlockTransfer, StepTransfers

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

__all__ = ["BlockTransfer", "KvtierMetadata", "KvtierWorkerMetadata"]


@dataclass
class KvtierMetadata(StepTransfers, KVConnectorMetadata):
    """This step's loads and stores (``StepTransfers``)."""


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Requests whose loads ran this step (done or failed): their pins can go.

    With them, the blocks the worker restored and the seconds that took
    (``WorkerSide.take_load_timing``), for the scheduler half's load mode.
    """

    loaded_req_ids: set[str] = field(default_factory=set)
    load_blocks: int = 0
    load_s: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        # Tensor-parallel ranks restore their shares of the same blocks at
        # once: the step waited for the slowest, not for their sum.
        return KvtierWorkerMetadata(self.loaded_req_ids | other.loaded_req_ids,
                                    max(self.load_blocks, other.load_blocks), max(self.load_s, other.load_s))
