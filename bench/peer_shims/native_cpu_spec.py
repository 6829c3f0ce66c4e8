# Vendored for bench/peers.py from ../shared/peers/native_cpu_spec.py (issue 35's set-up of kvtier's peers on
# vLLM's CPU build; see ../shared/peers/README.md), unchanged below this header.
"""Workaround: vLLM's native OffloadingConnector on vLLM's CPU backend.

vLLM 0.32's ``CPUOffloadingSpec.get_worker`` refuses any platform but CUDA-alike / XPU
("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs",
vllm/v1/kv_offload/cpu/spec.py), and its ``CPUOffloadingWorker`` asserts ``gpu_tensor.is_cuda or
gpu_tensor.is_xpu`` and copies with CUDA streams / swap_blocks kernels. Everything else of the
native path -- the OffloadingConnector's scheduler half, the CPUOffloadingManager (LRU over CPU
chunks), lookups by vLLM's block hashes, store/load job bookkeeping -- is platform-neutral.

This module is an out-of-tree offloading spec (vLLM loads it from ``kv_connector_extra_config``:
``"spec_name": "CPUTorchOffloadingSpec", "spec_module_path": "native_cpu_spec"``): the native spec
with only the copy engine replaced by a synchronous ``index_select`` / ``index_copy_`` between vLLM's
KV tensors and a host tensor of the same per-block shape. On a GPU the native worker copies
asynchronously on CUDA streams; on a CPU a copy is a memcpy on the worker's thread either way.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class TorchCopyWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_cpu_chunks: int) -> None:
        if len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError("one KV cache group only")
        self.bpc = blocks_per_chunk
        self.dev = [t.tensor for t in kv_caches.tensors]
        self.host = [torch.zeros((num_cpu_chunks * blocks_per_chunk, *t.shape[1:]), dtype=t.dtype, device="cpu")
                     for t in self.dev]
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in self.dev)
        self._done: list[TransferResult] = []
        self.stores = self.loads = 0
        self.store_s = self.load_s = 0.0

    def _rows(self, chunk_ids: np.ndarray, first_block_index: int, count: int) -> torch.Tensor:
        """Host rows of ``count`` blocks held in ``chunk_ids`` (each chunk = bpc blocks), skipping the
        part of the first chunk before the request's block ``first_block_index``."""
        ids = chunk_ids.astype(np.int64)
        if self.bpc == 1:
            return torch.from_numpy(ids[:count].copy())
        rows = (ids[:, None] * self.bpc + np.arange(self.bpc)).reshape(-1)
        skip = first_block_index % self.bpc
        return torch.from_numpy(rows[skip:skip + count].copy())

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:  # GPU (vLLM's KV) -> host
        t0 = time.perf_counter()
        g = torch.from_numpy(src_spec.block_ids.astype(np.int64))
        rows = self._rows(dst_spec.block_ids, int(src_spec.block_indices[0]), len(g))
        for dev, host in zip(self.dev, self.host):
            host.index_copy_(0, rows, dev.index_select(0, g))
        dt = time.perf_counter() - t0
        self.stores += 1
        self.store_s += dt
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=len(g) * self.block_bytes,
                                         transfer_time=dt))
        return True

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:  # host -> vLLM's KV
        t0 = time.perf_counter()
        g = torch.from_numpy(dst_spec.block_ids.astype(np.int64))
        rows = self._rows(src_spec.block_ids, int(dst_spec.block_indices[0]), len(g))
        for dev, host in zip(self.dev, self.host):
            dev.index_copy_(0, g, host.index_select(0, rows))
        dt = time.perf_counter() - t0
        self.loads += 1
        self.load_s += dt
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=len(g) * self.block_bytes,
                                         transfer_time=dt))
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return None


class CPUTorchOffloadingSpec(CPUOffloadingSpec):
    def _uses_shared_region(self) -> bool:
        return False

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            self._worker = TorchCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]
