"""The blocks one engine step moves, in engine-free terms.

``StepTransfers`` is what an adapter's scheduling side decides per step and
its worker side carries out (vLLM's: ``SchedulerSide`` and
``worker.WorkerSide``): ``loads`` are restored into the engine's KV
tensors, before the step's forward or (``background``) beside it while
their request waits, ``stores`` (full blocks the step computes) are copied
out after it. Each ``BlockTransfer`` pairs kvtier block keys, in prefix
order, with the engine's block ids they live in, in one KV-cache group
(``group``: the engine's group id; 0 for an engine of one group).

vLLM needs its own base classes on what travels between its processes; those
wrappers are in ``kvtier.integrations.vllm.metadata``. Nothing here imports
an engine, so the worker's data path runs (and is tested, on CUDA too) where
vLLM is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.client.protocol import Hints

__all__ = ["BlockTransfer", "StepTransfers"]


@dataclass(slots=True)
class BlockTransfer:
    keys: list[bytes]  # kvtier block keys, prefix order
    block_ids: list[int]  # the engine's block ids, one per key
    req_id: str = ""
    hints: Hints | None = None  # the request's (stores only)
    background: bool = False  # loads: the engine runs steps without the request until the worker reports it loaded
    group: int = 0  # the engine's KV-cache group whose block ids these are
    inline: bool = False  # a background load the worker runs in start_load_kv, after the forward (no thread)


@dataclass
class StepTransfers:
    loads: list[BlockTransfer] = field(default_factory=list)  # restore before this step's forward
    stores: list[BlockTransfer] = field(default_factory=list)  # full blocks this step computes
