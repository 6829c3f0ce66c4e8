"""Who manages the engine's KV blocks: kvtier in this process, or kvtierd over ZMQ.

Contract
========

The example engine never decides which slot holds which block. It asks a
``BlockBackend`` (engine-managed mode, docs/protocol.md "allocate / append / free"):

- ``allocate(request_id, hashes, num_tokens) -> Allocation``: the block table
  for a new request of ``num_tokens`` tokens whose FULL blocks have the chained
  ``hashes``. The leading ``len(tiers)`` blocks are cache hits: ``"gpu"`` hits
  are slots that already hold the K/V; ``"cpu"`` hits have been restored into
  their slots before ``allocate`` returns. The other slots are the request's to
  write.
- ``append(request_id, num_new_tokens, new_hashes) -> list[int]``: grow the
  request; ``new_hashes`` are the hashes of exactly the blocks these tokens
  filled. Returns the whole block table (it only grows at the end).
- ``free(request_id)``: the request is done; its blocks stay cached in the
  GPU tier (LRU) until they are evicted, i.e. demoted to the CPU tier.
- ``abort(request_id, num_valid_blocks)``: the request failed part-way.
  kvtier commits a block's hash when the block is allocated (full) or
  appended, before the engine has written its K/V, so the blocks after the
  first ``num_valid_blocks`` may be cached under hashes whose bytes were
  never written. ``abort`` withdraws them and frees the request, so no later
  request can hit garbage (the daemon backend, for want of a verb that
  withdraws hashes, frees and then clears the pool's unused cached blocks).
- ``stats() -> dict``: the pool's counters; ``close()``.

Two implementations share it:

- ``InProcessBackend``: a ``kvtier.tiers.TieredPool`` in this process whose
  GPU tier is the engine's KV tensor (``pool.attach_gpu``). Used by the tests
  and whenever no daemon is wanted.
- ``DaemonBackend``: a ``kvtier.client`` session with kvtierd. The KV tensor
  is allocated as a shared tensor (``/dev/shm`` on a CPU, CUDA IPC on a GPU)
  and registered with ``register_kv``; the daemon then copies blocks between
  the engine's slots and its CPU tier itself.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvtier.tiers.host_memory import allocate_host_slab
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import PoolSpec, TieredPool
from kvtier.tiers.pool_defaults import DEFAULT_CLEAN_AHEAD_BLOCKS, DEFAULT_POLICY
from kvtier.tiers.transfer import make_transfer_engine

from paged_llama import BLOCK_DIM, KVGeometry, PagedKVPool

log = logging.getLogger(__name__)

RESTORE_TIMEOUT_S = 60.0


@dataclass
class Allocation:
    block_ids: list[int]
    tiers: list[str] = field(default_factory=list)  # one per leading hit block: "gpu" | "cpu"

    @property
    def num_hit_blocks(self) -> int:
        return len(self.tiers)

    @property
    def num_gpu_hits(self) -> int:
        return self.tiers.count("gpu")

    @property
    def num_cpu_hits(self) -> int:
        return self.tiers.count("cpu")


class BlockBackend(Protocol):
    kv: PagedKVPool
    hash_algo: str

    def allocate(self, request_id: str, hashes: Sequence[bytes], num_tokens: int) -> Allocation: ...

    def append(self, request_id: str, num_new_tokens: int, new_hashes: Sequence[bytes]) -> list[int]: ...

    def free(self, request_id: str) -> None: ...

    def abort(self, request_id: str, num_valid_blocks: int) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def layout_identity(model_name: str, geometry: KVGeometry, hash_algo: str) -> dict[str, Any]:
    """The pool layout both backends describe (the daemon's ``hello`` layout map)."""
    return {
        "model": model_name,
        "block_size": geometry.block_size,
        "block_bytes": geometry.block_bytes,
        "dtype": str(geometry.dtype).removeprefix("torch."),
        "num_layers": geometry.num_layers,
        "kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "tp_rank": 0,
        "tp_size": 1,
        "hash_algo": hash_algo,
        "mode": "engine",
    }


class InProcessBackend:
    """kvtier's ``TieredPool`` in this process, over the engine's own KV tensor."""

    def __init__(self, kv: PagedKVPool, *, cpu_blocks: int, model_name: str = "example",
                 policy: str = DEFAULT_POLICY, enable_caching: bool = True, hash_algo: str = "xxh3_128",
                 clean_ahead_blocks: int = DEFAULT_CLEAN_AHEAD_BLOCKS) -> None:
        self.kv = kv
        self.hash_algo = hash_algo
        g = kv.geometry
        identity = layout_identity(model_name, g, hash_algo)
        spec = PoolSpec(name=f"{model_name}/tp0", block_size=g.block_size, block_bytes=g.block_bytes,
                        extra=tuple(sorted(identity.items())))
        self._transfer = make_transfer_engine(kv.device)
        self.pool = TieredPool(spec, cpu_blocks=cpu_blocks, policy=policy, transfer=self._transfer,
                               cpu_storage=allocate_host_slab(cpu_blocks, g.block_bytes) if cpu_blocks else None,
                               enable_caching=enable_caching, clean_ahead_blocks=clean_ahead_blocks)
        self.pool.attach_gpu(BlockLayout([kv.tensor], [BLOCK_DIM]))

    def allocate(self, request_id: str, hashes: Sequence[bytes], num_tokens: int) -> Allocation:
        op = self.pool.allocate(request_id, list(hashes), num_tokens).wait(RESTORE_TIMEOUT_S)
        if op.error is not None:
            raise RuntimeError(f"allocate {request_id!r}: {op.error}") from op.error
        return Allocation(list(op.result["block_ids"]), list(op.result["tiers"]))

    def append(self, request_id: str, num_new_tokens: int, new_hashes: Sequence[bytes]) -> list[int]:
        op = self.pool.append(request_id, num_new_tokens, list(new_hashes)).wait(RESTORE_TIMEOUT_S)
        if op.error is not None:
            raise RuntimeError(f"append {request_id!r}: {op.error}") from op.error
        return list(op.result["block_ids"])

    def free(self, request_id: str) -> None:
        self.pool.free(request_id)
        # Apply finished background demotions now, so the next allocation
        # finds them clean (the pool only learns of them when polled).
        self.pool.poll()

    def abort(self, request_id: str, num_valid_blocks: int) -> None:
        # Blocks past the valid prefix lose their hash: their K/V was never written.
        self.pool.free(request_id, valid_tokens=num_valid_blocks * self.kv.geometry.block_size)
        self.pool.poll()

    def stats(self) -> dict[str, Any]:
        self.pool.poll()
        return self.pool.stats()

    def close(self) -> None:
        self.pool.close()
        self._transfer.close()


class DaemonBackend:
    """Block management by kvtierd over ZMQ, the KV tensor shared with it (see the module docstring).

    On a CPU the tensor lives in ``/dev/shm`` (``kv_share.allocate_shared_kv``);
    on a GPU it is ordinary ``cudaMalloc`` memory that travels as a CUDA IPC
    handle. Either way the daemon copies blocks in and out of it directly.
    """

    def __init__(self, geometry: KVGeometry, num_blocks: int, *, endpoint: str, model_name: str = "example",
                 device: str | torch.device = "cpu", hash_algo: str = "xxh3_128", timeout_s: float = 60.0) -> None:
        # Imported here: the in-process backend must work where the client library does not exist yet.
        from kvtier.client import kv_share
        from kvtier.client.client import Client

        device = torch.device(device)
        shape = geometry.pool_shape(num_blocks)
        if device.type == "cpu":
            tensor, _handle = kv_share.allocate_shared_kv(shape, geometry.dtype, BLOCK_DIM)
        else:
            tensor = torch.zeros(shape, dtype=geometry.dtype, device=device)
        self.kv = PagedKVPool(tensor, geometry)
        self.hash_algo = hash_algo
        self.pool_name = f"{model_name}/tp0"
        self.client = Client(endpoint, self.pool_name, layout_identity(model_name, geometry, hash_algo),
                             timeout_s=timeout_s, client_name="kvtier-example-engine")
        try:
            self.client.register_kv("kv", [tensor], [BLOCK_DIM])
        except BaseException:
            self.client.close()
            raise

    def allocate(self, request_id: str, hashes: Sequence[bytes], num_tokens: int) -> Allocation:
        alloc = self.client.allocate(request_id, list(hashes), num_tokens)
        return Allocation(list(alloc.block_ids), list(alloc.tiers))

    def append(self, request_id: str, num_new_tokens: int, new_hashes: Sequence[bytes]) -> list[int]:
        table, _new = self.client.append(request_id, num_new_tokens, list(new_hashes))
        return list(table)

    def free(self, request_id: str) -> None:
        # The daemon may demote these blocks at once: the engine's writes
        # into them must be complete (the device is idle) before it asks.
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)
        self.client.free(request_id)

    def abort(self, request_id: str, num_valid_blocks: int) -> None:
        # Blocks are hashed as soon as they are full; those this request never
        # wrote must not stay cached: free tells the daemon how far the K/V is valid.
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)
        self.client.free(request_id, valid_tokens=num_valid_blocks * self.kv.geometry.block_size)

    def stats(self) -> dict[str, Any]:
        """This pool's counters (the same keys as ``TieredPool.stats``) plus the daemon's under "daemon"."""
        s = self.client.stats()
        return {**s.get("pools", {}).get(self.pool_name, {}), "daemon": s.get("daemon", {})}

    def close(self) -> None:
        self.client.close()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"

