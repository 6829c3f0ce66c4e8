"""The example engine (examples/engine): prefix reuse through kvtier gives the outputs of a full recompute.

A tiny random-init Llama (2 layers, hidden 128; random weights are fine: reuse
must be exact for any weights) serves prompts that share long prefixes. Each
prompt is served three ways: with its prefix hit in the GPU tier, with its
prefix demoted to the CPU tier and restored, and with caching disabled. The
last prompt token's logits must agree to 1e-4 and the greedy continuations
must be identical. A cache salt must prevent reuse.

The in-process backend (kvtier.tiers.TieredPool over the engine's KV tensor)
always runs; the daemon backend runs when kvtierd and kvtier.client.kv_share
are importable.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.testing.daemon import KvtierDaemon, daemon_available

pytest.importorskip("transformers", reason="the example engine needs the 'engine' extra (transformers)")

# examples/engine's modules (a folder of scripts): pyproject's pytest pythonpath has their folder.
from block_backends import InProcessBackend  # noqa: E402
from engine import Engine, RequestResult  # noqa: E402
from paged_llama import KVGeometry, PagedKVPool, build_model  # noqa: E402

LOGIT_TOL = 1e-4
NEW_TOKENS = 12
VOCAB = 1024


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return build_model("tiny", seed=0)


def make_engine(model: torch.nn.Module, *, gpu_blocks: int, cpu_blocks: int = 256,
                enable_caching: bool = True) -> Engine:
    kv = PagedKVPool.allocate(KVGeometry.of(model.config), gpu_blocks)
    return Engine(model, InProcessBackend(kv, cpu_blocks=cpu_blocks, enable_caching=enable_caching))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts sharing a 320-token prefix (20 blocks); suffixes of odd and block-aligned lengths."""
    rng = random.Random(1234)
    prefix = tokens(rng, 320)
    return [
        prefix + tokens(rng, 7),
        prefix + tokens(rng, 45),
        prefix + tokens(rng, 32),  # block-aligned: every full block can be a hit
        prefix[:250] + tokens(rng, 19),  # shares a prefix that ends mid-block
    ]


@pytest.fixture(scope="module")
def recomputed(model: torch.nn.Module, prompts: list[list[int]]) -> list[RequestResult]:
    """The reference: caching disabled, every token computed."""
    eng = make_engine(model, gpu_blocks=64, cpu_blocks=0, enable_caching=False)
    results = [eng.generate(p, NEW_TOKENS) for p in prompts]
    for r in results:
        assert r.num_cached_tokens == 0 and r.hit_tier == "miss"
    return results


def assert_same_outputs(got: RequestResult, ref: RequestResult) -> None:
    diff = (got.last_prompt_logits - ref.last_prompt_logits).abs().max().item()
    assert diff <= LOGIT_TOL, f"max abs logit difference {diff:.3g} > {LOGIT_TOL}"
    assert got.output_ids == ref.output_ids


def test_gpu_tier_hits_match_recompute(model: torch.nn.Module, prompts: list[list[int]],
                                       recomputed: list[RequestResult]) -> None:
    eng = make_engine(model, gpu_blocks=128)
    first = eng.generate(prompts[0], NEW_TOKENS)  # computes the shared prefix
    assert first.hit_tier == "miss"
    assert_same_outputs(first, recomputed[0])
    for prompt, ref in zip(prompts[1:], recomputed[1:]):
        got = eng.generate(prompt, NEW_TOKENS)
        assert got.hit_tier == "gpu"
        assert got.num_cached_tokens >= 240  # at least the 15 full blocks every prompt shares
        assert got.num_computed_tokens < len(prompt) - 200
        assert_same_outputs(got, ref)


def test_cpu_tier_hits_after_demotion_match_recompute(model: torch.nn.Module, prompts: list[list[int]],
                                                      recomputed: list[RequestResult]) -> None:
    # A GPU tier of 26 blocks holds one request: every request evicts the
    # previous one's blocks, which the pool demotes into the CPU tier.
    eng = make_engine(model, gpu_blocks=26, cpu_blocks=512)
    rng = random.Random(99)
    eng.generate(prompts[0], NEW_TOKENS)
    for prompt, ref in zip(prompts[1:], recomputed[1:]):
        for _ in range(2):  # unrelated traffic pushes the shared prefix out of the GPU tier
            eng.generate(tokens(rng, 380), 2)
        got = eng.generate(prompt, NEW_TOKENS)
        assert got.hit_tier == "cpu", got.hit_tiers
        assert got.num_cached_tokens >= 240
        assert_same_outputs(got, ref)
    stats = eng.backend.stats()
    assert stats["restores"] > 0 and stats["demotions"] > 0 and stats["hit_blocks_cpu"] > 0


def test_repeated_prompt_reuses_every_full_block(model: torch.nn.Module, prompts: list[list[int]],
                                                 recomputed: list[RequestResult]) -> None:
    eng = make_engine(model, gpu_blocks=64)
    prompt = prompts[2]  # 352 tokens = 22 full blocks
    eng.generate(prompt, NEW_TOKENS)
    again = eng.generate(prompt, NEW_TOKENS)
    assert again.num_hit_blocks == len(prompt) // 16
    # The last prompt token is run again to get its logits; its slot (a shared hit) is not rewritten.
    assert again.num_computed_tokens == 1
    assert_same_outputs(again, recomputed[2])


def test_multi_turn_reuses_previous_turn_and_its_answer(model: torch.nn.Module) -> None:
    rng = random.Random(7)
    eng = make_engine(model, gpu_blocks=96)
    ref = make_engine(model, gpu_blocks=96, cpu_blocks=0, enable_caching=False)
    history = tokens(rng, 100)
    for turn in range(3):
        history = history + tokens(rng, 21)
        got = eng.generate(history, 20)
        want = ref.generate(history, 20)
        assert_same_outputs(got, want)
        if turn:
            # Everything up to the previous turn's last fed-back answer token is cached.
            assert got.num_cached_tokens >= (prev_len // 16) * 16
        history = history + got.output_ids
        prev_len = len(history) - 1


def test_salt_prevents_reuse(model: torch.nn.Module, prompts: list[list[int]],
                             recomputed: list[RequestResult]) -> None:
    eng = make_engine(model, gpu_blocks=128)
    eng.generate(prompts[0], NEW_TOKENS)
    salted = eng.generate(prompts[1], NEW_TOKENS, cache_salt="tenant-a")
    assert salted.num_hit_blocks == 0 and salted.num_computed_tokens == len(prompts[1])
    assert_same_outputs(salted, recomputed[1])
    same_salt = eng.generate(prompts[1], NEW_TOKENS, cache_salt="tenant-a")
    assert same_salt.hit_tier == "gpu"
    other_salt = eng.generate(prompts[1], NEW_TOKENS, cache_salt="tenant-b")
    assert other_salt.num_hit_blocks == 0
    unsalted = eng.generate(prompts[1], NEW_TOKENS)
    assert unsalted.hit_tier == "gpu"  # the unsalted prefix from prompts[0]
    assert unsalted.num_hit_blocks == 320 // 16


class _FailingModel(torch.nn.Module):
    """Raises on the call that would compute the prompt (after allocate committed its blocks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("injected failure")


def test_failed_request_leaves_no_stale_blocks(model: torch.nn.Module, prompts: list[list[int]],
                                               recomputed: list[RequestResult]) -> None:
    eng = make_engine(model, gpu_blocks=64)
    eng.generate(prompts[0], NEW_TOKENS)  # the shared 320-token prefix is cached and valid
    eng.model = _FailingModel(model)
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate(prompts[1], NEW_TOKENS)  # allocate committed its new blocks, then the model failed
    eng.model = model
    again = eng.generate(prompts[1], NEW_TOKENS)
    # Only the prefix computed by the first request is reused; nothing the failed one never wrote.
    assert again.num_hit_blocks == 320 // 16
    assert_same_outputs(again, recomputed[1])


def test_pool_slots_hold_the_model_kv(model: torch.nn.Module, prompts: list[list[int]]) -> None:
    """The K/V the engine wrote into its slots are the model's own post-RoPE K/V."""
    eng = make_engine(model, gpu_blocks=64)
    prompt = prompts[1][:100]
    rid = "probe"
    alloc = eng.backend.allocate(rid, eng.hasher.hash_blocks(prompt), len(prompt))
    cache = eng.kv.make_cache(alloc.block_ids, 0, capacity_tokens=len(prompt))
    with torch.inference_mode():
        eng.model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        full = eng.model(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values
    stored = eng.kv.read_tokens(alloc.block_ids, len(prompt))  # [L, 2, H, T, D]
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(stored[layer, 0], full.layers[layer].keys[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(stored[layer, 1], full.layers[layer].values[0], rtol=0, atol=1e-5)
    eng.backend.free(rid)


# ---- the same through kvtierd, a separate process ---------------------------------------------------------


@pytest.fixture(scope="module")
def kvtierd(model: torch.nn.Module) -> Iterator[str]:
    if not daemon_available():
        pytest.skip("kvtierd / kvtier.client not importable")
    # As the example starts it (run_demo.py): one OpenMP thread, the user's KVTIER_* settings kept.
    daemon = KvtierDaemon.start(flags={"cpu_bytes": 512 * KVGeometry.of(model.config).block_bytes, "device": "cpu",
                                       "log_level": "warning"}, omp_threads=1, keep_kvtier_env=True)
    endpoint = daemon.endpoint
    try:
        yield endpoint
    finally:
        rc = daemon.stop()
        log = daemon.log_tail()
        daemon.cleanup()
        assert rc == 0, f"kvtierd exited with {rc}:\n{log}"


def make_daemon_engine(model: torch.nn.Module, endpoint: str, *, gpu_blocks: int, name: str) -> Engine:
    from block_backends import DaemonBackend

    # A pool per test (the model name is part of the pool identity): tests do not share cached blocks.
    return Engine(model, DaemonBackend(KVGeometry.of(model.config), gpu_blocks, endpoint=endpoint, model_name=name))


def test_daemon_gpu_and_cpu_hits_match_recompute(model: torch.nn.Module, kvtierd: str, prompts: list[list[int]],
                                                 recomputed: list[RequestResult]) -> None:
    eng = make_daemon_engine(model, kvtierd, gpu_blocks=26, name="test-daemon-tiers")
    try:
        rng = random.Random(5)
        assert_same_outputs(eng.generate(prompts[0], NEW_TOKENS), recomputed[0])
        gpu_hit = eng.generate(prompts[1], NEW_TOKENS)
        assert gpu_hit.hit_tier == "gpu" and gpu_hit.num_cached_tokens >= 240
        assert_same_outputs(gpu_hit, recomputed[1])
        for prompt, ref in zip(prompts[2:], recomputed[2:]):
            for _ in range(2):
                eng.generate(tokens(rng, 380), 2)
            got = eng.generate(prompt, NEW_TOKENS)
            assert got.hit_tier == "cpu", got.hit_tiers
            assert_same_outputs(got, ref)
        stats = eng.backend.stats()
        assert stats["restores"] > 0 and stats["demotions"] > 0 and stats["hit_blocks_cpu"] > 0
    finally:
        eng.backend.close()


def test_daemon_salt_prevents_reuse(model: torch.nn.Module, kvtierd: str, prompts: list[list[int]],
                                    recomputed: list[RequestResult]) -> None:
    eng = make_daemon_engine(model, kvtierd, gpu_blocks=64, name="test-daemon-salt")
    try:
        eng.generate(prompts[0], NEW_TOKENS, cache_salt="tenant-a")
        other = eng.generate(prompts[0], NEW_TOKENS, cache_salt="tenant-b")
        assert other.num_hit_blocks == 0
        assert_same_outputs(other, recomputed[0])
        unsalted = eng.generate(prompts[0], NEW_TOKENS)
        assert unsalted.num_hit_blocks == 0
        same = eng.generate(prompts[0], NEW_TOKENS, cache_salt="tenant-a")
        assert same.hit_tier == "gpu" and same.num_hit_blocks == len(prompts[0]) // 16
        assert_same_outputs(same, recomputed[0])
    finally:
        eng.backend.close()


def test_chat_workload_script_runs(tmp_path: Path) -> None:
    """The workload script end to end (tiny model, in-process tiers): JSON written, outputs exact."""
    import json

    from chat_workload import main

    out = tmp_path / "chat.json"
    rc = main(["--model-size", "tiny", "--conversations", "2", "--turns", "3", "--system-tokens", "128",
               "--user-tokens", "40", "--answer-tokens", "6", "--json-out", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["exactness"]["same_greedy_outputs"] == report["exactness"]["requests"] == 6
    assert report["totals"]["hit_blocks_cpu"] > 0  # earlier turns came back from the CPU tier
    assert {t["hit_tier"] for t in report["turns"][2:]} <= {"gpu", "cpu", "gpu+cpu"}


def test_daemon_failed_request_leaves_no_stale_blocks(model: torch.nn.Module, kvtierd: str,
                                                      prompts: list[list[int]],
                                                      recomputed: list[RequestResult]) -> None:
    eng = make_daemon_engine(model, kvtierd, gpu_blocks=64, name="test-daemon-abort")
    try:
        eng.model = _FailingModel(model)
        with pytest.raises(RuntimeError, match="injected"):
            eng.generate(prompts[1], NEW_TOKENS)
        eng.model = model
        again = eng.generate(prompts[1], NEW_TOKENS)
        assert again.num_hit_blocks == 0, (again.hit_tiers, eng.backend.stats())
        assert_same_outputs(again, recomputed[1])
    finally:
        eng.backend.close()


def test_run_demo_main_job(tmp_path: Path) -> None:
    """The README's main job, small: kvtierd started and stopped (exit 0) around the chat workload."""
    if not daemon_available():
        pytest.skip("kvtierd / kvtier.client not importable")
    import json

    from run_demo import main

    out = tmp_path / "demo.json"
    rc = main(["--model-size", "tiny", "--conversations", "2", "--turns", "2", "--system-tokens", "96",
               "--user-tokens", "24", "--answer-tokens", "4", "--json-out", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "daemon"
    assert report["exactness"]["same_greedy_outputs"] == report["exactness"]["requests"] == 4
