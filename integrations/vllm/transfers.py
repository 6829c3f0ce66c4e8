"""The blocks one engine step moves, in engine-free terms.

``StepTransfers`` is what the scheduler half decides per step and the worker
half (``worker.WorkerSide``) carries out: ``loads`` are restored into vLLM's
KV tensors, before the step's forward or (``background``) beside it while
their request waits, ``stores`` (full blocks the step computes) are copied
out after it. Each ``BlockTransfer`` pairs kvtier block
keys, in prefix order, with the vLLM block ids they live in, in one
KV-cache group (``group``: vLLM's group id; 0 for an engine of one group).

vLLM needs its own base classes on what travels between its processes; those
wrappers are in ``metadata.py``. Nothing here imports vLLM, so the worker's
data path runs (and is tested, on CUDA too) where vLLM is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.client.protocol import Hints

__all__ = ["BlockTransfer", "StepTransfers"]


@dataclass(slots=True)
class BlockTransfer:
    keys: list[bytes]  # kvtier block keys, prefix order
    block_ids: list[int]  # vLLM's block ids, one per key
    req_id: str = ""
    hints: Hints | None = None  # the request's (stores only)
    background: bool = False  # loads: vLLM runs steps without the request until the worker reports it loaded
    group: int = 0  # vLLM's KV-cache group whose block ids these are
    inline: bool = False  # a background load the worker runs in start_load_kv, after the forward (no thread)


@dataclass
class StepTransfers:
    loads: list[BlockTransfer] = field(default_factory=list)  # restore before this step's forward
    stores: list[BlockTransfer] = field(default_factory=list)  # full blocks this step computes
