"""``kvtier.testing.vllm_weights`` writes the checkpoints it promises (no vLLM needed).

Whether those weights make vLLM's answers depend on the prefix is
``test_vllm_weights.py``'s question, against real vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from kvtier.testing import vllm_weights as vw  # noqa: E402

CONFIGS = {"llama": vw.llama_config(), "deepseek_v2": vw.deepseek_v2_config(), "gemma3": vw.gemma3_config()}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_checkpoint_is_the_same_for_the_same_seed_and_differs_for_another(model_type: str) -> None:
    cfg = CONFIGS[model_type]
    a, again, other = vw.checkpoint(cfg, 0), vw.checkpoint(cfg, 0), vw.checkpoint(cfg, 1)
    assert list(a) == [s.name for s in vw.tensor_specs(cfg)]
    for name, t in a.items():
        assert torch.equal(t, again[name]), name
        if t.std() > 0:  # norms are constants
            assert not torch.equal(t, other[name]), name


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_write_model_writes_the_config_and_every_tensor(tmp_path: Path, model_type: str) -> None:
    cfg = CONFIGS[model_type]
    vw.write_model(tmp_path, cfg, 3)
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    loaded = safetensors_torch.load_file(str(tmp_path / vw.SAFETENSORS_NAME))
    specs = vw.tensor_specs(cfg)
    assert sorted(loaded) == sorted(s.name for s in specs)
    drawn = vw.checkpoint(cfg, 3)
    for s in specs:
        assert tuple(loaded[s.name].shape) == s.shape and loaded[s.name].dtype == torch.bfloat16, s
        assert torch.equal(loaded[s.name], drawn[s.name].to(torch.bfloat16)), s.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", vw.SAFETENSORS_NAME]  # no temp files left


def test_the_recipe_gains_reach_queries_keys_and_values() -> None:
    recipe = vw.Recipe()
    t = vw.checkpoint(vw.llama_config(), 0, recipe)
    fan_in = 256
    for name, gain in (("self_attn.q_proj", recipe.qk_gain), ("self_attn.k_proj", recipe.qk_gain),
                       ("self_attn.v_proj", recipe.value_gain ** 0.5), ("self_attn.o_proj", recipe.value_gain ** 0.5),
                       ("mlp.up_proj", 1.0)):
        got = t[f"model.layers.1.{name}.weight"].std().item()
        assert got == pytest.approx(gain / fan_in ** 0.5, rel=0.05), name
    # MLA: per head, the key rows of kv_b_proj at the key's scale, the value rows at the value's.
    cfg = vw.deepseek_v2_config()
    kv_b = vw.checkpoint(cfg, 0, recipe)["model.layers.0.self_attn.kv_b_proj.weight"].view(4, 128, 512)
    assert kv_b[:, :64].std().item() == pytest.approx(recipe.qk_gain / 512 ** 0.5, rel=0.05)
    assert kv_b[:, 64:].std().item() == pytest.approx(recipe.value_gain ** 0.5 / 512 ** 0.5, rel=0.05)


def test_write_update_changes_every_drawn_tensor_and_leaves_the_model(tmp_path: Path) -> None:
    cfg = vw.llama_config()
    vw.write_model(tmp_path, cfg, 0)
    before = (tmp_path / vw.SAFETENSORS_NAME).read_bytes()
    update = vw.write_update(tmp_path, 5, base_seed=0)
    assert update == tmp_path / "update-5" and (tmp_path / vw.SAFETENSORS_NAME).read_bytes() == before
    base, new = vw.checkpoint(cfg, 0), safetensors_torch.load_file(str(update / vw.SAFETENSORS_NAME))
    for name, t in base.items():
        assert torch.equal(new[name], t.to(torch.bfloat16)) == (t.std() == 0), name


def test_gemma3_norms_carry_the_gains_as_gemma_stores_them() -> None:
    recipe = vw.Recipe()
    cfg = vw.gemma3_config()
    assert cfg["layer_types"].count("sliding_attention") == 5 and cfg["layer_types"][5] == "full_attention"
    t = vw.checkpoint(cfg, 0, recipe)
    # Gemma's RMSNorm multiplies by 1 + weight.
    assert torch.all(t["model.layers.0.self_attn.q_norm.weight"] == recipe.qk_gain - 1)
    assert torch.all(t["model.layers.0.post_attention_layernorm.weight"] == recipe.value_gain - 1)
    assert torch.all(t["model.layers.0.input_layernorm.weight"] == 0)
    # The model scales the embedding by sqrt(hidden): stored 1/sqrt(hidden) of the recipe's.
    assert t["model.embed_tokens.weight"].std().item() == pytest.approx(recipe.embed_std / 256 ** 0.5, rel=0.05)


def test_configs_it_cannot_write_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot write a 'mistral'"):
        vw.tensor_specs({"model_type": "mistral"})
    with pytest.raises(ValueError, match="dense MLPs"):
        vw.tensor_specs(vw.deepseek_v2_config(first_k_dense_replace=1))
    with pytest.raises(ValueError, match="q_lora_rank"):
        vw.tensor_specs(vw.deepseek_v2_config(q_lora_rank=128))
