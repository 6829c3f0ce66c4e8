"""A pool the daemon closes is freed at once, by reference count (issue 36, item 1; no daemon process).

The registry closes an idle pool when a new one needs its memory or its idle
time is up (``pool_admission``), and the new pool is sized right after: the
closed pool's tier memory must be back by then. It used to sit in reference
cycles (the pool's parts held the pool; a tenant quota policy held the CPU
tier that holds it) until a ``gc.collect()`` on the loop freed it. Here the
cyclic collector is off: the pool, its CPU tier and its memory must go with
the registry's last reference.
"""

from __future__ import annotations

import gc
import weakref

from kvtier.daemon.config import PoolSettings, TenantConfig
from kvtier.daemon.pooling.pools import PoolRegistry
from kvtier.daemon.tenancy.tenants import TenantRegistry
from kvtier.blocks.layout import BlockLayout

BLOCK = 1024
LAYOUT = {"model": "m", "block_size": 4, "block_bytes": BLOCK, "dtype": "bfloat16", "num_layers": 1, "kv_heads": 1,
          "head_dim": 8, "mode": "store"}


def test_a_closed_tenant_pool_is_freed_without_the_cyclic_collector() -> None:
    tenants = TenantRegistry({"alice": TenantConfig(token_sha256="0" * 64, cpu_quota_bytes=64 * BLOCK)})
    registry = PoolRegistry(device="cpu", policy_wrapper=tenants.policy_wrapper,
                            sizing_for=lambda name, reusable_bytes=0: PoolSettings(
                                name, gpu_bytes=8 * BLOCK, cpu_bytes=32 * BLOCK, policy="chain"))
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        entry = registry.get_or_create("p", LAYOUT, tenant="alice")
        pool = entry.pool
        keys = tenants.namespace("alice", [bytes([i]) * 16 for i in range(24)])
        src = BlockLayout.contiguous(24, BLOCK)
        for start in (0, 8, 16):  # the GPU tier holds 8: the rest is demoted through the quota policy
            pool.store(keys[start:start + 8], src, range(start, start + 8)).wait(10)
        assert pool.lookup(keys) and tenants.resident_bytes["alice"] > 0
        assert type(pool.policy).__name__ == "TenantQuotaPolicy"
        refs = {"pool": weakref.ref(pool), "cpu tier": weakref.ref(pool.cpu), "CPU tier memory":
                weakref.ref(pool.cpu.storage), "GPU tier memory": weakref.ref(pool.gpu)}
        del pool, entry, src
        registry.close("alice/p", 5.0)
        survivors = [name for name, ref in refs.items() if ref() is not None]
        assert survivors == [], [type(r).__name__ for name in survivors for r in gc.get_referrers(refs[name]())]
    finally:
        if was:
            gc.enable()
        registry.close_all(5.0)
