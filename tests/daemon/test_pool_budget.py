"""One CPU budget for all pools; idle pools keep their blocks until their memory is needed or their TTL passes.

Real daemons. Each pool's CPU tier is 16 blocks of 1 KiB here; the budget
holds two of them.
"""

from __future__ import annotations

import time

import pytest

from kvtier.client.client import Client, DaemonError, PoolLayout, probe_health
from kvtier.client.protocol import ErrorCode

BLOCK = 1024
CPU_BYTES = 16 * BLOCK


def layout(model: str) -> PoolLayout:
    return PoolLayout(model=model, block_size=4, block_bytes=BLOCK, dtype="bfloat16", num_layers=1, kv_heads=1,
                      head_dim=8, mode="store")


def pools_of(endpoint: str) -> set[str]:
    with Client(endpoint, "probe", layout("probe")) as c:
        return set(c.stats()["pools"]) - {"probe"}


def test_an_idle_pool_keeps_its_blocks_then_gives_its_memory_to_a_new_pool(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    # Room for three CPU tiers: the probe's, a live pool's and one more.
    d = kvtierd_factory(cpu_bytes=CPU_BYTES, gpu_bytes=4 * BLOCK, cpu_budget_bytes=3 * CPU_BYTES)
    keys = [bytes([7, i]) * 8 for i in range(3)]
    with Client(d.endpoint, "live", layout("live")):
        with Client(d.endpoint, "idle", layout("idle")) as c:
            c.store(keys, bytes(range(3)) * BLOCK)
        # No session on "idle" now, but its blocks wait for the engine's return (no memory is needed).
        with Client(d.endpoint, "idle", layout("idle")) as c:
            assert list(c.lookup(keys)) == ["gpu"] * 3
        with Client(d.endpoint, "probe", layout("probe")) as p:
            reclaimed0 = p.stats()["daemon"].get("pools_reclaimed_total", {})
            # A new pool: the budget holds probe + live + idle; "idle" (no session) goes for it.
            with Client(d.endpoint, "new", layout("new")):
                st = p.stats()
                assert "idle" not in st["pools"] and {"live", "new"} <= set(st["pools"])
                assert st["daemon"]["pools_reclaimed_total"]["reason=memory"] == reclaimed0.get("reason=memory", 0) + 1
                # Every pool has a session now: the next new pool is refused with the numbers, nothing closed.
                with pytest.raises(DaemonError) as err:
                    Client(d.endpoint, "more", layout("more"))
                assert err.value.code == ErrorCode.NO_SPACE and "cpu_budget_bytes" in str(err.value)
                assert {"live", "new"} <= set(p.stats()["pools"])
    assert "pool 'idle' reclaimed for pool 'new'" in d.log()


def test_a_pool_without_sessions_closes_after_pool_idle_ttl_s(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    d = kvtierd_factory(cpu_bytes=CPU_BYTES, gpu_bytes=4 * BLOCK, pool_idle_ttl_s=0.5)
    with Client(d.endpoint, "short", layout("short")) as c:
        c.store([b"s" * 16], bytes(BLOCK))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and probe_health(d.endpoint)["pools"] > 0:
        time.sleep(0.1)
    assert probe_health(d.endpoint)["pools"] == 0
    assert "pool 'short' closed: no session" in d.log()


def test_max_pools_reclaims_an_idle_pool_before_refusing(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    d = kvtierd_factory(cpu_bytes=CPU_BYTES, gpu_bytes=4 * BLOCK, max_pools=2)
    with Client(d.endpoint, "a", layout("a")):
        Client(d.endpoint, "b", layout("b")).close()  # "b" is idle
        with Client(d.endpoint, "c", layout("c")) as c:  # takes b's place
            assert set(c.stats()["pools"]) == {"a", "c"}
            with pytest.raises(DaemonError) as err:  # a and c are live: nothing to reclaim
                Client(d.endpoint, "d", layout("d"))
            assert err.value.code == ErrorCode.TOO_MANY_POOLS


def test_a_thousand_hellos_with_distinct_layouts_stay_within_the_budget(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    """Every new pool name costs a pool; without a session it is reclaimed when the next one needs room."""
    import psutil

    mib = 1 << 20
    # On the CPU everywhere: the bounds below are of host memory and copy threads
    # (a CUDA pool's GPU tier is device memory, and its engine has five threads).
    d = kvtierd_factory(cpu_bytes=mib, gpu_bytes=mib, cpu_budget_bytes=16 * mib, device="cpu")
    proc = psutil.Process(d.proc.pid)
    with Client(d.endpoint, "steady", layout("steady")) as steady:
        steady.store([b"k" * 16], bytes(BLOCK))
        rss_before = proc.memory_info().rss
        threads_before = proc.num_threads()
        for i in range(1000):
            lay = PoolLayout(model=f"m{i}", block_size=4, block_bytes=BLOCK * (1 + i % 4), dtype="bfloat16",
                             num_layers=1, kv_heads=1, head_dim=8, mode="store")
            Client(d.endpoint, f"pool-{i}", lay).close()
            if i % 100 == 0:
                assert list(steady.lookup([b"k" * 16])) == ["gpu"]  # the others keep being served
        st = steady.stats()
        assert len(st["pools"]) <= 16  # the budget's worth of 1 MiB CPU tiers
        assert st["daemon"]["pools_reclaimed_total"]["reason=memory"] >= 1000 - 16
        # 16 MiB of CPU tiers and 16 MiB of store-mode GPU tiers (host memory here), plus a stated overhead.
        assert proc.memory_info().rss - rss_before < 32 * mib + 64 * mib
        assert proc.num_threads() <= threads_before + 2 * 16  # two copy threads a pool
