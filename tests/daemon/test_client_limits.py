"""What one client can do to the daemon is bounded (issue 15): absurd layouts, other sessions'
sids, arenas and registrations, and file descriptors. Each refusal has its own code, and
the daemon goes on serving everyone else."""

from __future__ import annotations

import random

import pytest

from kvtier.client.client import Client, DaemonError, PoolLayout
from kvtier.client.protocol import ErrorCode

BLOCK_BYTES = 4096


def layout(**kw: object) -> PoolLayout:
    base = dict(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=2,
                kv_heads=2, head_dim=64, mode="store")
    base.update(kw)
    return PoolLayout(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    return kvtierd_module_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)


def still_serving(daemon, pool: str) -> None:  # type: ignore[no-untyped-def]
    assert daemon.alive, daemon.log()[-3000:]
    rng = random.Random(pool)
    with Client(daemon.endpoint, pool, layout()) as other:
        hs, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
        assert other.store(hs, data) == (2, 0)
        assert bytes(other.restore(hs).data) == data


@pytest.mark.parametrize("mode", ["store", "engine"])
def test_a_layout_that_gives_the_pool_no_block_is_refused(daemon, mode: str) -> None:  # type: ignore[no-untyped-def]
    from kvtier.client.client import probe_health

    pools_before = probe_health(daemon.endpoint)["pools"]
    for block_bytes in (1 << 40, 64 * BLOCK_BYTES + 1):
        with pytest.raises(DaemonError) as err:
            Client(daemon.endpoint, f"huge-{mode}-{block_bytes}", layout(block_bytes=block_bytes, mode=mode)).close()
        assert err.value.code == ErrorCode.INVALID_FIELD
        assert "no block" in str(err.value) and str(block_bytes) in str(err.value)
    assert probe_health(daemon.endpoint)["pools"] == pools_before  # nothing was created
    still_serving(daemon, f"after-huge-{mode}")

