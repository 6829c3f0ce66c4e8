"""The loop's gauges (sessions, requests_in_flight, learn_backlog_keys, connections) are set lazily, at each sweep and
just before a ``stats`` request reads them: never stale to the one who asks."""

from __future__ import annotations

import contextlib

import pytest

from kvtier.client.client import Client, PoolLayout

LAYOUT = PoolLayout(model="m", block_size=4, block_bytes=1024, dtype="bfloat16", num_layers=1, kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    # A long lease: its sweeps come every lease / 10 at most, so only the stats request can have set the gauges.
    return kvtierd_module_factory(gpu_bytes=8 * 1024, cpu_bytes=16 * 1024, lease_s=3600)


def test_stats_sees_the_gauges_of_this_instant(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "gauges", LAYOUT) as a, contextlib.ExitStack() as others:
        for n in range(2, 5):
            others.enter_context(Client(daemon.endpoint, "gauges", LAYOUT, heartbeat=False))
            d = a.stats()["daemon"]
            assert d["sessions"] == n and d["requests_in_flight"] == 0 and d["connections"] >= n, d
        others.close()
        assert a.stats()["daemon"]["sessions"] == 1
