"""Which pools the daemon may hold: sizing a new pool, reclaiming idle ones.

Contract:

- ``sizing_for(name, reusable_bytes=0)`` is what ``PoolRegistry`` calls
  before it creates pool ``name``: the configured sizing, once the new pool
  fits. ``reusable_bytes`` is memory the pool's own files hold already (a
  persistent CPU tier left by the previous daemon: reused, not taken anew);
  it counts as available, for the fit and for an "auto" or N% ``cpu_bytes``
  (which then comes to what it came to before the restart). To make it fit,
  idle pools (no session), longest idle first, are closed while the new one
  would pass ``max_pools``, the CPU budget (``cpu_budget_bytes``) or the host
  memory available; a pool with a session is never touched. If it still
  does not fit, it raises ``ProtocolError``: TOO_MANY_POOLS, or NO_SPACE with
  the numbers, and nothing was created.
- ``close_expired(now_s)`` closes the pools idle for ``pool_idle_ttl_s``;
  the loop calls it on its sweep.
- ``allocation_progress`` reports a CPU tier being pinned (systemd STATUS=)
  and feeds the watchdog, since pinning a large tier blocks the loop.
- A pool closed here is freed at once, by reference count (a pool's object
  graph has no cycle: ``tiers.pool``), so its tier memory is back before the
  new pool allocates. Nothing here may keep a reference to a closed pool.
- Single-threaded: only the event loop calls this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.client.protocol import ErrorCode, ProtocolError
from kvtier.daemon.pooling.memory import check_new_pool, gib
from kvtier.daemon.pooling.pools import PoolRegistry
from kvtier.daemon.process.sd_notify import Notifier
from kvtier.daemon.telemetry.metrics import Counters
from kvtier.tiers.host_memory import HostMemoryError

if TYPE_CHECKING:
    from kvtier.daemon.config import PoolSettings

__all__ = ["PoolAdmission"]

log = logging.getLogger(__name__)


class PoolAdmission:
    """See the module docstring."""

    def __init__(self, *, configured_sizing: Callable[[str, int], PoolSettings], max_pools: int,
                 cpu_budget_bytes: int | None, pool_idle_ttl_s: float, close_timeout_s: float,
                 metrics: Counters, notifier: Notifier) -> None:
        self.configured_sizing = configured_sizing
        self.max_pools = max_pools
        self.cpu_budget_bytes = cpu_budget_bytes
        self.pool_idle_ttl_s = pool_idle_ttl_s
        self.close_timeout_s = close_timeout_s
        self.metrics = metrics
        self.notifier = notifier
        self.pools: PoolRegistry | None = None  # attach(): the registry calls sizing_for, so it comes after

    def attach(self, pools: PoolRegistry) -> None:
        self.pools = pools

    def sizing_for(self, name: str, reusable_bytes: int = 0) -> PoolSettings:
        """The configured settings of a new pool, sized, once it fits (see the module docstring)."""
        pools = self._registry()
        sizing = self.configured_sizing(name, reusable_bytes)
        cpu_bytes = sizing.resolve_cpu_bytes()  # sized: what the pool will take
        # By name: a reference held here (a loop variable, the list) would keep a closed pool, and its
        # tier memory, alive until this call returns.
        for key, since_s, idle_bytes in [(e.name, e.idle_since_s, e.cpu_bytes) for e in pools.idle()]:
            if not self._would_not_fit(cpu_bytes, reusable_bytes):  # the new pool's size, not the idle one's
                break
            log.info("pool %r reclaimed for pool %r: idle %.0f s, %s of CPU tier freed", key, name,
                     time.monotonic() - (since_s or 0.0), gib(idle_bytes))
            self.metrics.inc("pools_reclaimed_total", reason="memory")
            pools.close(key, self.close_timeout_s)
        if len(pools) >= self.max_pools:
            # Pools outlive their sessions (the cache is the point), so without
            # a bound every new pool name a client sends costs tiers and threads.
            self.metrics.inc("pools_refused_total")
            raise ProtocolError(ErrorCode.TOO_MANY_POOLS,
                                f"this daemon holds as many pools as it may (max_pools {self.max_pools}), "
                                "all with sessions; join an existing pool or ask the operator")
        existing = {e.name: e.cpu_bytes for e in pools}
        try:  # the host first: a pool the machine cannot hold is refused for that, whatever the budget
            check_new_pool(name, cpu_bytes, existing, reusable_bytes=reusable_bytes)
        except HostMemoryError as exc:
            raise ProtocolError(ErrorCode.NO_SPACE, str(exc)) from None
        budget = self.cpu_budget_bytes
        if budget is not None and sum(existing.values()) + cpu_bytes > budget:
            raise ProtocolError(ErrorCode.NO_SPACE,
                                f"pool {name!r} needs a {gib(cpu_bytes)} ({cpu_bytes} bytes) CPU tier; "
                                f"the daemon's CPU tiers hold {gib(sum(existing.values()))} of its {gib(budget)} "
                                "budget (cpu_budget_bytes), all in pools with sessions; end one, or ask the operator")
        self.notifier.status(f"allocating the CPU tier of pool {name!r}: {gib(cpu_bytes)}")
        return sizing

    def close_expired(self, now_s: float) -> None:
        """Pools idle for pool_idle_ttl_s go, with their blocks."""
        pools = self._registry()
        # By name, as in sizing_for: no reference here keeps a closed pool alive.
        expired = [(e.name, now_s - e.idle_since_s, e.cpu_bytes) for e in pools.idle()
                   if e.idle_since_s is not None and now_s - e.idle_since_s >= self.pool_idle_ttl_s]
        for key, idle_s, cpu_bytes in expired:
            log.info("pool %r closed: no session for %.0f s (pool_idle_ttl_s), %s of CPU tier freed",
                     key, idle_s, gib(cpu_bytes))
            self.metrics.inc("pools_reclaimed_total", reason="idle")
            pools.close(key, self.close_timeout_s)

    def allocation_progress(self, name: str, done_bytes: int, total_bytes: int) -> None:
        """After each pinned chunk of a new CPU tier (``PoolRegistry``'s ``progress``)."""
        self.notifier.status(f"allocating the CPU tier of pool {name!r}: {gib(done_bytes)} of {gib(total_bytes)}")
        if self.notifier.watchdog_due():
            self.notifier.watchdog()

    def _would_not_fit(self, cpu_bytes: int, reusable_bytes: int = 0) -> bool:
        """A new pool with this CPU tier would pass max_pools, the CPU budget or the memory available."""
        pools = self._registry()
        if len(pools) >= self.max_pools:
            return True
        existing = {e.name: e.cpu_bytes for e in pools}
        if self.cpu_budget_bytes is not None and sum(existing.values()) + cpu_bytes > self.cpu_budget_bytes:
            return True
        try:
            check_new_pool("", cpu_bytes, existing, reusable_bytes=reusable_bytes)
        except HostMemoryError:
            return True
        return False

    def _registry(self) -> PoolRegistry:
        if self.pools is None:
            raise RuntimeError("PoolAdmission.attach(pools) must come before the first pool")
        return self.pools
