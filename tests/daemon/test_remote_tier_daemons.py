"""Two kvtierd processes sharing one Redis as their remote tier (issue 9, end to end)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client.client import Client, PoolLayout
from kvtier.testing import redis_servers as rs

pytestmark = pytest.mark.skipif(not rs.have_redis(), reason=rs.MISSING_REASON)

BLOCK_BYTES = 4096
LAYOUT = PoolLayout(model="shared-model", block_size=16, block_bytes=BLOCK_BYTES, dtype="float16",
                    num_layers=2, kv_heads=2, head_dim=64)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[object]:
    srv = rs.RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """The remote tier secret the daemons of a test share."""
    return rs.secret_file(tmp_path / "remote.secret")


def wait_for(cond, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def store_until_in_redis(client: Client, hashes: list[bytes], data: list[bytes], head: int) -> None:
    """Store in fours; wait until the first ``head`` blocks, pushed out of the daemon, are in Redis."""
    for i in range(0, len(hashes), 4):
        assert client.store(hashes[i : i + 4], data[i : i + 4]) == (4, 0)
    wait_for(lambda: client.lookup(hashes[:head]) == ["remote"] * head, 10.0, "the evicted blocks to reach Redis")


def test_block_stored_through_daemon_a_restores_byte_exact_through_daemon_b(kvtierd_factory, redis_server, secret) -> None:  # type: ignore[no-untyped-def]
    # Four GPU blocks and four CPU blocks per daemon: 12 stored blocks push the
    # first four out of A's CPU tier, which writes them back to Redis.
    flags = dict(gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=4 * BLOCK_BYTES, remote_url=redis_server.url,
                 remote_secret_key_file=secret)
    a, b = kvtierd_factory(**flags), kvtierd_factory(**flags)
    data = [os.urandom(BLOCK_BYTES) for _ in range(12)]
    hashes = [bytes([7, i]) * 8 for i in range(12)]
    with Client(a.endpoint, "m/tp0", LAYOUT) as ca, Client(b.endpoint, "m/tp0", LAYOUT) as cb:
        store_until_in_redis(ca, hashes, data, 4)
        assert cb.lookup(hashes[:4]) == ["remote"] * 4
        got = cb.restore(hashes[:4])
        assert got.tiers == ["remote"] * 4
        assert bytes(got.data) == b"".join(data[:4])
        # Now in B's CPU tier: no second fetch.
        assert cb.lookup(hashes[:4]) == ["cpu"] * 4
        pool_b = cb.stats()["pools"]["m/tp0"]
        assert pool_b["hit_blocks_remote"] >= 4 and pool_b["remote"]["available"]
        assert cb.health()["remote"] == {"m/tp0": True}


def test_remote_down_daemon_keeps_serving_and_recovers(kvtierd_factory, redis_server, secret) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=4 * BLOCK_BYTES, remote_url=redis_server.url,
                             remote_secret_key_file=secret)
    data = [os.urandom(BLOCK_BYTES) for _ in range(4)]
    hashes = [bytes([9, i]) * 8 for i in range(4)]
    with Client(daemon.endpoint, "m/tp0", LAYOUT) as c:
        wait_for(lambda: c.health()["remote"] == {"m/tp0": True}, 10.0, "the remote tier to connect")
        port = redis_server.port
        redis_server.kill()
        assert c.store(hashes, data) == (4, 0)  # GPU and CPU tiers serve on
        got = c.restore(hashes)
        assert got.tiers == ["gpu"] * 4 and bytes(got.data) == b"".join(data)
        wait_for(lambda: c.health()["remote"] == {"m/tp0": False}, 10.0, "the outage to show in health")
        restarted = rs.RedisServer(redis_server.workdir, port=port).start()
        try:
            wait_for(lambda: c.health()["remote"] == {"m/tp0": True}, 20.0, "the remote tier to reconnect by itself")
        finally:
            restarted.stop()


def test_a_pinning_lookup_on_daemon_b_holds_what_only_redis_has(kvtierd_factory, redis_server, secret) -> None:  # type: ignore[no-untyped-def]
    # What the vLLM connector does: lookup(pin=True) at a request's arrival, restore later.
    flags = dict(gpu_bytes=8 * BLOCK_BYTES, cpu_bytes=16 * BLOCK_BYTES, remote_url=redis_server.url,
                 remote_secret_key_file=secret)
    a, b = kvtierd_factory(**flags), kvtierd_factory(**flags)
    data = [os.urandom(BLOCK_BYTES) for _ in range(40)]
    hashes = [bytes([11, i]) * 8 for i in range(40)]
    with Client(a.endpoint, "m/tp0", LAYOUT) as ca, Client(b.endpoint, "m/tp0", LAYOUT) as cb:
        store_until_in_redis(ca, hashes, data, 6)
        (found,) = cb.lookup_many([hashes[:6]], pin=True)
        assert list(found) == ["remote"] * 6
        assert cb.stats()["pools"]["m/tp0"]["pinned_blocks"] == 6
        got = cb.restore(hashes[:6])
        assert got.tiers == ["cpu"] * 6  # fetched when pinned: the restore reads B's CPU tier
        assert bytes(got.data) == b"".join(data[:6])
        assert cb.unpin(hashes[:6]) == 6
        assert cb.stats()["pools"]["m/tp0"]["pinned_blocks"] == 0
