"""The daemon's policy bookkeeping runs between requests and always catches up."""

from __future__ import annotations

import random
import time

from kvtier.client.client import Client, PoolLayout

BLOCK_BYTES = 1024


def test_learning_backlog_drains_once_clients_go_quiet(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=64 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)
    layout = PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                        kv_heads=1, head_dim=8, mode="store")
    rng = random.Random(5)
    with Client(daemon.endpoint, "learn", layout) as c:
        hashes = [rng.randbytes(16) for _ in range(256)]
        c.store(hashes[:32], bytes(32 * BLOCK_BYTES))
        # Back to back, so the loop is seldom idle: each lookup leaves up to
        # 256 keys of bookkeeping behind it.
        for i in range(200):
            assert c.lookup(hashes[: 64 + i % 192])[:32] == ["gpu"] * 32
        deadline = time.monotonic() + 5
        while c.stats()["daemon"]["learn_backlog_keys"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = c.stats()
        assert stats["daemon"]["learn_backlog_keys"] == 0
        assert stats["pools"]["learn"]["lookups"] == 200
