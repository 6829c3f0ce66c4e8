"""The example engine: one request at a time, prefix reuse through kvtier, greedy decoding.

Contract
========

``Engine(model, backend).generate(prompt_ids, max_new_tokens, cache_salt=None)``
runs one request end to end and returns a ``RequestResult``:

1. hash the prompt's full blocks (``kvtier.client.hashing``, chained, the
   salt entering block 0);
2. ``backend.allocate``: the longest cached prefix comes back as slots that
   hold its K/V (GPU-tier hits as they are, CPU-tier hits restored into
   their slots before the call returns), plus fresh slots for the rest;
3. build the model's cache input from those slots and run the model ONLY on
   the tokens not covered by hits. When every prompt token is covered, the
   last prompt token is run again (the model needs one input to produce
   logits); its K/V is not written back, as its slot is a shared hit;
4. the first token is the argmax of the last prompt token's logits: the
   time to here is the TTFT;
5. decode greedily, ``backend.append`` one token at a time (committing each
   block as it fills), then ``backend.free``. If anything fails part-way,
   ``backend.abort`` withdraws the blocks whose K/V were never written.

Exactness: a hit block holds the post-RoPE K/V that an earlier request
computed at the same positions for the same tokens (the hash chains over
the whole prefix and the salt), so the logits equal a full recompute up to
float rounding (the kernels see different shapes).

Timings (seconds, wall clock, the device synchronised before each stamp):
``hash_s``, ``allocate_s`` (block manager + restore copies, and the ZMQ
round trip with the daemon backend), ``cache_build_s`` (gathering the hit
slots into the working cache), ``prefill_model_s`` (the model on the
uncovered tokens, including writing their K/V into the pool), ``ttft_s`` (all
of it plus sampling), ``decode_s``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaForCausalLM

from kvtier.client.hashing import BlockHasher

from block_backends import BlockBackend, DaemonBackend, InProcessBackend, new_request_id
from paged_llama import KVGeometry, KVWorkspace, PagedKVPool, build_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RequestResult:
    request_id: str
    prompt_len: int
    output_ids: list[int]
    last_prompt_logits: torch.Tensor  # [vocab], float32, on the CPU
    hit_tiers: list[str]  # one per leading hit block: "gpu" | "cpu"
    num_cached_tokens: int  # prompt tokens whose K/V came from the pool
    num_computed_tokens: int  # prompt tokens run through the model
    hash_s: float
    allocate_s: float
    cache_build_s: float
    prefill_model_s: float
    ttft_s: float
    decode_s: float

    @property
    def hit_tier(self) -> str:
        """Where the reused prefix came from: "gpu", "cpu", "gpu+cpu" or "miss"."""
        kinds = [t for t in ("gpu", "cpu") if t in self.hit_tiers]
        return "+".join(kinds) if kinds else "miss"

    @property
    def num_hit_blocks(self) -> int:
        return len(self.hit_tiers)

    @property
    def restore_share_s(self) -> float:
        """TTFT minus the model time on the new tokens: what reuse itself cost."""
        return self.ttft_s - self.prefill_model_s

    def summary(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_tokens": self.prompt_len,
            "cached_tokens": self.num_cached_tokens,
            "computed_tokens": self.num_computed_tokens,
            "hit_tier": self.hit_tier,
            "hit_blocks_gpu": self.hit_tiers.count("gpu"),
            "hit_blocks_cpu": self.hit_tiers.count("cpu"),
            "ttft_s": round(self.ttft_s, 6),
            "hash_s": round(self.hash_s, 6),
            "allocate_s": round(self.allocate_s, 6),
            "cache_build_s": round(self.cache_build_s, 6),
            "prefill_model_s": round(self.prefill_model_s, 6),
            "decode_s": round(self.decode_s, 6),
            "output_tokens": len(self.output_ids),
        }


class Engine:
    """Serves requests one at a time over a paged KV pool managed by a ``BlockBackend``."""

    def __init__(self, model: LlamaForCausalLM, backend: BlockBackend) -> None:
        self.model = model
        self.backend = backend
        self.kv = backend.kv
        self.block_size = self.kv.geometry.block_size
        self.hasher = BlockHasher(self.block_size, backend.hash_algo)
        self.device = self.kv.device
        self.workspace = KVWorkspace(self.kv.geometry, self.device)

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 1, *, cache_salt: str | None = None,
                 request_id: str | None = None) -> RequestResult:
        """Serve one request (see the module docstring). ``max_new_tokens`` >= 1."""
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1 (the first token is what TTFT measures)")
        rid = request_id or new_request_id()
        bs = self.block_size
        prompt = [int(t) for t in prompt_ids]
        n = len(prompt)

        _sync(self.device)
        t0 = time.perf_counter()
        hashes = self.hasher.hash_blocks(prompt, cache_salt=cache_salt)
        t_hash = time.perf_counter()
        alloc = self.backend.allocate(rid, hashes, n)
        t_alloc = time.perf_counter()
        # Tokens whose K/V are in the pool (hits, then what the model wrote).
        valid_tokens = 0
        try:
            num_hit_tokens = alloc.num_hit_blocks * bs
            num_cached = min(num_hit_tokens, n - 1)
            cache = self.kv.make_cache(alloc.block_ids, num_cached, write_from_token=num_hit_tokens,
                                       capacity_tokens=n + max_new_tokens, workspace=self.workspace)
            _sync(self.device)
            t_cache = time.perf_counter()
            input_ids = torch.tensor([prompt[num_cached:]], dtype=torch.int64, device=self.device)
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float()
            valid_tokens = n
            _sync(self.device)
            t_model = time.perf_counter()
            next_id = int(torch.argmax(logits))
            t_first = time.perf_counter()

            output = [next_id]
            seq = list(prompt)
            for _ in range(max_new_tokens - 1):
                # The token just sampled is fed back: it takes position len(seq).
                seq.append(next_id)
                new_hashes: list[bytes] = []
                if len(seq) % bs == 0:
                    k = len(seq) // bs - 1
                    new_hashes = self.hasher.hash_blocks(seq[k * bs :], parent=hashes[-1] if k else None,
                                                         start_block=k, cache_salt=cache_salt)
                    hashes.extend(new_hashes)
                cache.set_block_table(self.backend.append(rid, 1, new_hashes))
                step = self.model(input_ids=torch.tensor([[next_id]], device=self.device), past_key_values=cache,
                                  use_cache=True)
                valid_tokens = len(seq)
                next_id = int(torch.argmax(step.logits[0, -1]))
                output.append(next_id)
            _sync(self.device)
            t_end = time.perf_counter()
        except BaseException:
            # Blocks committed ahead of their K/V must not stay cached.
            self.backend.abort(rid, max(valid_tokens, alloc.num_hit_blocks * bs) // bs)
            raise
        self.backend.free(rid)
        return RequestResult(
            request_id=rid,
            prompt_len=n,
            output_ids=output,
            last_prompt_logits=logits.detach().to("cpu").clone(),
            hit_tiers=list(alloc.tiers),
            num_cached_tokens=num_cached,
            num_computed_tokens=n - num_cached,
            hash_s=t_hash - t0,
            allocate_s=t_alloc - t_hash,
            cache_build_s=t_cache - t_alloc,
            prefill_model_s=t_model - t_cache,
            ttft_s=t_first - t0,
            decode_s=t_end - t_first,
        )


def build_engine(preset: str, *, gpu_blocks: int, cpu_blocks: int = 4096, backend: str = "inproc",
                 endpoint: str | None = None, device: str = "cpu", seed: int = 0,
                 enable_caching: bool = True) -> Engine:
    """A random-init ``preset`` model on ``device`` with a KV pool of ``gpu_blocks`` blocks.

    ``backend="inproc"``: a ``TieredPool`` in this process with ``cpu_blocks``
    CPU-tier blocks. ``backend="daemon"``: kvtierd at ``endpoint`` manages the
    blocks (its CPU tier is sized by the daemon's own configuration).
    """
    model = build_model(preset, seed=seed, device=device)
    geometry = KVGeometry.of(model.config)
    model_name = f"kvtier-example-{preset}-seed{seed}"
    if backend == "inproc":
        kv = PagedKVPool.allocate(geometry, gpu_blocks, device=device)
        return Engine(model, InProcessBackend(kv, cpu_blocks=cpu_blocks, model_name=model_name,
                                              enable_caching=enable_caching))
    if backend == "daemon":
        if endpoint is None:
            raise ValueError("the daemon backend needs an endpoint (e.g. ipc:///run/user/1000/kvtier.sock)")
        if not enable_caching:
            raise ValueError("caching cannot be disabled in the daemon; use a cache_salt per request instead")
        return Engine(model, DaemonBackend(geometry, gpu_blocks, endpoint=endpoint, model_name=model_name,
                                           device=device))
    raise ValueError(f"unknown backend {backend!r}: inproc or daemon")
