"""An inline restore sizes its reply by a lookup, then restores: the remote tier may hold more in between.

Found by the hostile stress scenario (tests/stress/test_hostile.py): the well-behaved engine's inline
restore on a pool with a Redis tier got TRANSFER_FAILED, "duplicate destination slots: the copy would
write one block twice". The handler probes the held prefix (k blocks) to size its staging buffer and
gives the restore slots 0..k-1, then slot 0 for every hash past k; the restore asks the remote tier
again, and a write-back that landed between the two probes made the held prefix longer than k.

The daemon runs in this process (a thread), so that the test can make the remote tier's first answer
the stale one: the write-back lands right after the handler's probe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvtier.client.client import Client, PoolLayout
from kvtier.testing import redis_servers as rs

pytestmark = pytest.mark.skipif(not rs.have_redis(), reason=rs.MISSING_REASON)

BLOCK_BYTES = 4096
LAYOUT = PoolLayout(model="m", block_size=16, block_bytes=BLOCK_BYTES, dtype="float16", num_layers=2, kv_heads=2,
                    head_dim=64)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[object, str]]:
    from kvtier.daemon.process.lifecycle import StopFlag
    from kvtier.daemon.config.schema import PoolSettings
    from kvtier.daemon.server import ServeOptions, Server

    redis = rs.RedisServer(tmp_path / "redis").start()
    endpoint = f"ipc://{tmp_path}/d.sock"
    sizing = PoolSettings("p", gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=8 * BLOCK_BYTES, remote_url=redis.url)
    stop = StopFlag()
    srv = Server(ServeOptions(endpoint=endpoint, sizing_for=lambda _name, _reusable_bytes=0: sizing,
                                    poll_interval_s=0.01, remote_secret=rs.SECRET), stop,
                 kv_import=lambda desc: (None, None))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        yield srv, endpoint
    finally:
        stop.request("test")
        thread.join(30)
        redis.stop()


def test_an_inline_restore_is_not_failed_by_a_write_back_landing_after_its_probe(server) -> None:  # type: ignore[no-untyped-def]
    srv, endpoint = server
    data = [bytes([i]) * BLOCK_BYTES for i in range(16)]
    hashes = [bytes([40, i]) * 8 for i in range(16)]
    with Client(endpoint, "p", LAYOUT, timeout_s=30.0) as c:
        for i in range(0, 16, 4):  # 12 tier slots: the first 4 blocks go on to Redis
            assert c.store(hashes[i:i + 4], b"".join(data[i:i + 4])) == (4, 0)
        deadline_s = time.monotonic() + 10
        while c.lookup(hashes[:4]) != ["remote"] * 4:
            assert time.monotonic() < deadline_s, "the evicted blocks never reached Redis"
            time.sleep(0.05)
        remote = srv.pools.get("p").pool.remote
        real = remote.exists_prefix
        calls: list[int] = []

        def not_there_yet(keys: Sequence[bytes]) -> int:
            calls.append(len(keys))
            return 0 if len(calls) == 1 else real(keys)  # the handler's probe, before the write-back

        # A block the GPU tier holds, then the four in Redis: the probe sees one block, the restore five.
        asked = hashes[15:] + hashes[:4]
        remote.exists_prefix = not_there_yet
        try:
            got = c.restore(asked)
        finally:
            remote.exists_prefix = real
        assert len(calls) >= 2  # probed, then restored: the race this test stages
        assert got.tiers == ["gpu"] and bytes(got.data) == data[15]  # what the probe promised, not an error
        got = c.restore(asked)  # asked again, all of it comes back (the four from where the first fetched them)
        assert len(got.tiers) == 5 and bytes(got.data) == data[15] + b"".join(data[:4])
