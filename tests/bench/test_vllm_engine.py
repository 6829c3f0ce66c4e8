"""bench/vllm_engine.py without vLLM: the model families' configs and KV layouts, and the child's command loop.

bench/vllm.py, bench/peers.py and bench/vllm_busy.py take their model and
their engine child from this one module; the families' numbers decide the
bytes the benches report (restored per hit, held per cached token), so they
are checked here against the checkpoint's own tensors and by hand, and the
command loop (``serve``) against a real child driven by ``EngineProc``.
"""

from __future__ import annotations

import os
import sys
from math import prod
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))  # at the end: first, bench/vllm.py would shadow vLLM

import vllm_engine  # noqa: E402

from kvtier.testing.vllm_weights import tensor_specs  # noqa: E402


@pytest.mark.parametrize("family", vllm_engine.FAMILIES)
def test_parameters_are_the_checkpoints_tensors(family: str) -> None:
    cfg = vllm_engine.model_config(family=family, hidden=256, heads=4, kv_heads=2,
                                   layers=6 if family == "gemma3" else 2, vocab=1000)
    assert vllm_engine.parameters(cfg) == sum(prod(t.shape) for t in tensor_specs(cfg))
    assert vllm_engine.parameters(cfg) > 0


def test_llama_kv_layout_is_the_default_models() -> None:
    cfg = vllm_engine.model_config()  # 4 layers, 2 KV heads of 128, float32: 8 KiB a token
    layout = vllm_engine.kv_layout("llama", cfg)
    assert layout == {"block_size": 128, "kv_bytes_per_token": 4 * 2 * 2 * 128 * 4,
                      "groups": [{"kind": "full", "layers": 4}]}
    assert vllm_engine.kv_bytes_per_token(cfg) == 8192
    assert cfg["max_position_embeddings"] == 8192
    assert vllm_engine.model_config(max_positions=20000)["max_position_embeddings"] == 20000


def test_gemma3_has_five_sliding_groups_to_one_full() -> None:
    cfg = vllm_engine.model_config(family="gemma3", hidden=512, heads=4, kv_heads=2, layers=12, window=256,
                                   dtype="bfloat16")
    layout = vllm_engine.kv_layout("gemma3", cfg)
    per_layer = 2 * 2 * 128 * 2  # K and V, 2 KV heads of 128, bfloat16
    assert layout["kv_bytes_per_token"] == 12 * per_layer
    assert [g["kind"] for g in layout["groups"]] == ["sliding_window"] * 5 + ["full"]
    assert all(g["layers"] == 2 for g in layout["groups"])
    assert all(g["window"] == 256 for g in layout["groups"][:5])
    assert layout["group_block_bytes"] == 2 * per_layer * 128


def test_mla_holds_one_latent_a_layer_in_blocks_of_16() -> None:
    cfg = vllm_engine.model_config(family="mla", hidden=256, heads=4, layers=3)
    layout = vllm_engine.kv_layout("mla", cfg)
    assert layout["block_size"] == vllm_engine.MLA_BLOCK_SIZE == vllm_engine.block_size("mla") == 16
    assert layout["kv_bytes_per_token"] == 3 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    assert vllm_engine.block_size("llama") == vllm_engine.block_size("gemma3") == vllm_engine.BLOCK_SIZE


def test_an_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="known: llama, gemma3, mla"):
        vllm_engine.model_config(family="gpt2")


def test_engine_env_gives_each_rank_its_cores() -> None:
    env = vllm_engine.engine_env(1, ["/front"], {"X": "1"}, tp=2)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == "/front" and env["X"] == "1"
    ranks = env["VLLM_CPU_OMP_THREADS_BIND"].split("|")
    assert len(ranks) == 2
    cores = [set(r.split(",")) for r in ranks]
    assert not cores[0] & cores[1]  # no core shared by two ranks
    # TP=1 leaves the binding as it is.
    assert vllm_engine.engine_env(1, tp=1).get("VLLM_CPU_OMP_THREADS_BIND") == os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


CHILD = """
import sys
sys.path.append(sys.argv[1])
import vllm_engine
vllm_engine.reply({"ready": True})
vllm_engine.serve({"add": lambda c: {"sum": c["a"] + c["b"]}, "echo": lambda c: {"got": c}})
vllm_engine.reply({"bye": True})
"""


def test_serve_answers_each_command_until_exit(tmp_path: Path) -> None:
    proc = vllm_engine.EngineProc("t", [sys.executable, "-c", CHILD, str(BENCH)], vllm_engine.engine_env(1),
                                  tmp_path / "log")
    try:
        assert proc.recv(30) == {"ready": True}
        assert proc.call(30, op="add", a=2, b=3) == {"sum": 5}
        assert proc.call(30, op="echo", x=[1, "y"]) == {"got": {"op": "echo", "x": [1, "y"]}}
        proc.send(op="exit")
        assert proc.recv(30) == {"bye": True}
    finally:
        assert proc.close() == 0


def test_serve_ends_the_child_on_an_unknown_command(tmp_path: Path) -> None:
    proc = vllm_engine.EngineProc("t", [sys.executable, "-c", CHILD, str(BENCH)], vllm_engine.engine_env(1),
                                  tmp_path / "log")
    try:
        assert proc.recv(30) == {"ready": True}
        proc.send(op="gen")
        with pytest.raises(RuntimeError, match="exited with 1"):
            proc.recv(30)
        assert "unknown command 'gen'; known: exit, add, echo" in (tmp_path / "log").read_text()
    finally:
        proc.close()
