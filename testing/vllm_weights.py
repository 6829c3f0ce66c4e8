"""Weights for vLLM's random-weight test models, set in each worker through ``LLM.collective_rpc``.

vLLM's ``load_format="dummy"`` draws weights uniform in +-1e-3. Under them
attention is uniform, the residual stream is the last token's embedding, and
the outputs depend on the last token only: a test that compares outputs
could not tell right KV from wrong. ``context_sensitive_weights`` makes the
prefix decide the outputs; ``perturb_weights`` plays a weight update. Both
run in the worker process (``collective_rpc`` passes the worker first, and
needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send a function).

Under tensor parallelism each rank draws its own shard (the seed plus the
rank): with one seed for all, every rank's heads would be equal and a rank
restoring another rank's half of the KV would go unnoticed.
"""

from __future__ import annotations

from typing import Any


def context_sensitive_weights(worker: Any, seed: int) -> int:
    """Seeded weights scaled like a trained model's (1/sqrt(fan_in)), attention sharpened (QKV x2).

    Returns the number of tensors set. Every engine given the same seed gets the same weights.
    """
    import torch

    gen = torch.Generator().manual_seed(_shard_seed(seed))
    n = 0
    with torch.no_grad():
        for name, p in worker.model_runner.model.named_parameters():
            if p.dim() == 1:  # norms
                p.fill_(1.0)
            else:
                std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std * (2.0 if "qkv_proj" in name else 1.0))
            n += 1
    return n


def perturb_weights(worker: Any, seed: int) -> int:
    """Seeded noise on every weight, as a weight update (an RL step) changes them; returns the tensors changed."""
    import torch

    gen = torch.Generator().manual_seed(_shard_seed(seed))
    n = 0
    with torch.no_grad():
        for p in worker.model_runner.model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.add_((noise * p.float().std().clamp(min=1e-3)).to(p.dtype))
            n += 1
    return n


def _shard_seed(seed: int) -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return seed + 1_000_003 * get_tensor_model_parallel_rank()
