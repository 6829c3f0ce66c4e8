"""PoolAdmission.sizing_for (no daemon process): idle pools are reclaimed until the *new* pool fits.

Found while taking the ``gc.collect()`` out of it (issue 36, item 1): the
reclaim loop's variable shadowed the new pool's size, so with pools of
different sizes the fit was checked for an idle pool's size, and the new
pool could pass the CPU budget.
"""

from __future__ import annotations

from kvtier.daemon.config import PoolSettings
from kvtier.daemon.pooling.pool_admission import PoolAdmission
from kvtier.daemon.pooling.pools import PoolRegistry
from kvtier.daemon.process.sd_notify import Notifier
from kvtier.daemon.telemetry.metrics import Counters

MIB = 1 << 20
BLOCK = 64 * 1024


def layout(model: str) -> dict[str, object]:
    return {"model": model, "block_size": 4, "block_bytes": BLOCK, "dtype": "bfloat16", "num_layers": 1,
            "kv_heads": 1, "head_dim": 8, "mode": "engine"}


def test_idle_pools_are_reclaimed_until_a_larger_new_pool_fits_the_budget() -> None:
    sizes = {"big": 3 * MIB}  # the others: 1 MiB

    def configured(name: str, reusable_bytes: int = 0) -> PoolSettings:
        return PoolSettings(name, cpu_bytes=sizes.get(name, MIB), gpu_bytes=0)

    admission = PoolAdmission(configured_sizing=configured, max_pools=100, cpu_budget_bytes=4 * MIB,
                              pool_idle_ttl_s=1e9, close_timeout_s=5.0, metrics=Counters(), notifier=Notifier(None))
    registry = PoolRegistry(device="cpu", sizing_for=admission.sizing_for)
    admission.attach(registry)
    try:
        for i in range(4):  # the budget, full of idle pools
            registry.get_or_create(f"small{i}", layout(f"m{i}")).idle_since_s = float(i)
        registry.get_or_create("big", layout("big"))
        held = {e.name: e.cpu_bytes for e in registry}
        assert held["big"] == 3 * MIB
        assert sum(held.values()) <= 4 * MIB, held  # three idle pools went, oldest first
        assert set(held) == {"small3", "big"}
    finally:
        registry.close_all(5.0)
