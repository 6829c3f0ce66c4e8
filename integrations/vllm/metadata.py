"""What the scheduler half tells the worker half each step, and what comes back.

Both travel between vLLM's processes by pickle; they hold plain lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.client.protocol import Hints

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(slots=True)
class BlockTransfer:
    keys: list[bytes]  # kvtier block keys, prefix order
    block_ids: list[int]  # vLLM's block ids, one per key
    req_id: str = ""
    hints: Hints | None = None  # the request's (stores only)


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)  # restore before this step's forward
    stores: list[BlockTransfer] = field(default_factory=list)  # full blocks this step computes


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Requests whose loads ran this step (done or failed): their pins can go."""

    loaded_req_ids: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        return KvtierWorkerMetadata(self.loaded_req_ids | other.loaded_req_ids)
