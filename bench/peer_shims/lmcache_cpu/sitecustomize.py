# Vendored for bench/peers.py from ../shared/peers/lmcache_cpu/sitecustomize.py (issue 35's set-up of kvtier's peers on
# vLLM's CPU build; see ../shared/peers/README.md), unchanged below this header.
"""Workaround: LMCache 0.5.6's LMCacheConnectorV1 on vLLM's CPU backend (the lmcache_cpu system of a side-by-side benchmark).

LMCache 0.5.6 builds its vLLM "GPU connector" (the piece that copies between vLLM's paged KV tensors
and LMCache's memory objects) in ``lmcache.v1.gpu_connector.CreateGPUConnector``, which knows
cuda / xpu / musa / hpu only and raises ``RuntimeError: No supported cpu connector found.`` on CPU;
LMCache then logs "System will operate in degraded mode (recompute)" and vLLM serves every request
without caching. Its pure-torch fallback ``multi_layer_kv_transfer`` (lmcache/v1/platform/torch_ops)
refuses HND layouts ("HND layouts are not supported in the non-CUDA fallback"), and vLLM 0.32's CPU
attention backend keeps KV as [num_blocks, num_kv_heads, block_size, 2 * head_size] (head-major;
per head and block: block_size keys, then block_size values).

The patch is applied when lmcache.v1.gpu_connector is first imported (an import hook): importing
LMCache at interpreter start, before vLLM, breaks vLLM's CPU start-up
("AttributeError: '_lib_fn_wrapper' object has no attribute 'get'" in
vllm/triton_utils/dispatcher.py).

This sitecustomize (on PYTHONPATH of the engine's processes, PEERS_LMCACHE_CPU=1) replaces
CreateGPUConnector for EngineType.VLLM on CPU with ``VLLMPagedMemCPUConnector``: the same
memory-object format as LMCache's VLLMPagedMemGPUConnectorV2 (KV_2LTD: [2, layers, tokens,
kv_heads * head_size]) filled / read back with torch advanced indexing on the CPU KV tensors.
Everything else of LMCache (token database, chunking, local CPU backend, lookups) is unchanged.
"""
import os

import sys


def _patch(_gc):
        import torch

        from lmcache.utils import EngineType
        from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
        from lmcache.v1.memory_management import MemoryFormat

        class VLLMPagedMemCPUConnector(GPUConnectorInterface):
            def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int) -> None:
                self.num_layers, self.H, self.D, self.bs = num_layers, num_kv_heads, head_size, block_size
                self.hidden_dim_size = num_kv_heads * head_size
                self.kvcaches = None
                self._phys = None
                self.use_mla = False
                self.gpu_buffer = None
                self.store_s = self.load_s = 0.0

            def initialize_kvcaches_ptr(self, **kwargs):
                if "kvcaches" in kwargs and kwargs["kvcaches"] is not self.kvcaches:
                    self.kvcaches = kwargs["kvcaches"]
                    self._phys = None

            def _physical(self):
                if self._phys is None:
                    H, D, bs = self.H, self.D, self.bs
                    out = []
                    for t in self.kvcaches:
                        per_block = H * 2 * bs * D
                        nb = (t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()) // per_block
                        out.append(torch.as_strided(t, (nb, H, 2 * bs, D), (per_block, 2 * bs * D, D, 1),
                                                    t.storage_offset()))
                    self._phys = out
                return self._phys

            def _index(self, slots: torch.Tensor):
                slots = slots.to(dtype=torch.long, device="cpu")
                return slots // self.bs, slots % self.bs

            def from_gpu(self, memory_obj, start: int, end: int, **kwargs):  # vLLM KV -> LMCache object
                self.initialize_kvcaches_ptr(**kwargs)
                blk, off = self._index(kwargs["slot_mapping"][start:end])
                n = end - start
                dst = memory_obj.tensor
                for layer, phys in enumerate(self._physical()):
                    dst[0, layer, :n] = phys[blk, :, off, :].reshape(n, -1)
                    dst[1, layer, :n] = phys[blk, :, off + self.bs, :].reshape(n, -1)
                memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

            def to_gpu(self, memory_obj, start: int, end: int, **kwargs):  # LMCache object -> vLLM KV
                self.initialize_kvcaches_ptr(**kwargs)
                vllm_cached = kwargs.get("vllm_cached_tokens", 0)
                skip = min(end - start, max(0, vllm_cached - start))
                blk, off = self._index(kwargs["slot_mapping"][start + skip:end])
                n = end - start - skip
                if n <= 0:
                    return
                src = memory_obj.tensor
                for layer, phys in enumerate(self._physical()):
                    phys[blk, :, off, :] = src[0, layer, skip:skip + n].reshape(n, self.H, self.D)
                    phys[blk, :, off + self.bs, :] = src[1, layer, skip:skip + n].reshape(n, self.H, self.D)

            def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
                for m, s, e in zip(memory_objs, starts, ends):
                    self.to_gpu(m, s, e, **kwargs)

            def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
                for m, s, e in zip(memory_objs, starts, ends):
                    self.from_gpu(m, s, e, **kwargs)

            def get_shape(self, num_tokens: int) -> torch.Size:
                return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

        _orig = _gc.CreateGPUConnector

        def CreateGPUConnector(config, metadata, engine, **kwargs):  # noqa: N802
            if engine == EngineType.VLLM and _gc.torch_device_type == "cpu":
                bs = int(os.environ.get("PEERS_BLOCK_SIZE", "128"))  # vLLM's block size (the benchmark sets it)
                return VLLMPagedMemCPUConnector(metadata.kv_shape[0], metadata.kv_shape[3], metadata.kv_shape[4], bs)
            return _orig(config, metadata, engine, **kwargs)

        _gc.CreateGPUConnector = CreateGPUConnector


class _Hook:
    """Meta-path finder: patch lmcache.v1.gpu_connector right after it is executed."""

    def find_spec(self, name, path, target=None):
        if name != "lmcache.v1.gpu_connector":
            return None
        import importlib.machinery

        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        orig_exec = spec.loader.exec_module

        def exec_module(module):
            orig_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("PEERS_LMCACHE_CPU") == "1":
    sys.meta_path.insert(0, _Hook())
