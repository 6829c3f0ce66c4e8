"""The daemon's host-memory budget: every pool's CPU tier, checked before it is allocated.

Contract:

- A CPU tier is sized per pool of *this daemon* (``cpu_bytes``); a machine
  with one daemon per GPU runs several, each with its own pools. Nothing is
  multiplied behind the operator's back: what the configuration says is what
  each pool of each daemon takes.
- ``planned_cpu_bytes(cfg)``: what the configuration will allocate, as
  ``[(config key, bytes)]``: every ``[pools."name"]`` table, or
  ``default_pool`` when no pool is named (the first hello will use it).
- ``check_startup(cfg, pin)`` raises ``HostMemoryError`` naming the keys and
  the numbers when the planned total exceeds available memory (less the
  reserve) or, for pinned memory, ``RLIMIT_MEMLOCK``. kvtierd exits 2 with
  that message rather than starting a daemon the kernel would kill later.
- ``check_new_pool(name, cpu_bytes, existing)`` at ``hello``, before a pool
  is created: the new tier must fit in the memory available now (existing
  tiers are already allocated), and all tiers together (existing + new) must
  fit in ``RLIMIT_MEMLOCK`` when they are pinned. Raises ``HostMemoryError``.
- ``reusable_bytes`` (both checks): memory the daemon's persistent CPU tiers
  left by the previous daemon hold (``tiers.persistent_arena``). It is not
  "available", yet a restarted daemon takes it over rather than allocating
  anew, so it counts as available here.
- Whether tiers are pinned follows ``tiers.host_memory``: pinned when CUDA
  is available.
"""

from __future__ import annotations

import resource
from collections.abc import Mapping
from typing import TYPE_CHECKING

import psutil

from kvtier.tiers.host_memory import RESERVE_BYTES, HostMemoryError
from kvtier.tiers.units import format_gib as gib

if TYPE_CHECKING:
    from kvtier.daemon.config import DaemonConfig


def pins_cpu_tiers() -> bool:
    import torch

    return torch.cuda.is_available()


def planned_cpu_bytes(cfg: DaemonConfig, available_bytes: int | None = None) -> list[tuple[str, int]]:
    """See the module docstring."""
    from kvtier.daemon.config import pool_key

    if cfg.pools:
        return [(f"{pool_key(n)}.cpu_bytes", cfg.pool_settings(n).resolve_cpu_bytes(available_bytes)) for n in cfg.pools]
    # No pool named: a pool with any name gets the default_pool sizes.
    return [("default_pool.cpu_bytes", cfg.pool_settings("").resolve_cpu_bytes(available_bytes))]


def _memlock_soft_bytes() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def check_startup(cfg: DaemonConfig, *, pin: bool, reusable_bytes: int = 0) -> list[tuple[str, int]]:
    """Refuse a configuration whose CPU tiers cannot be had; returns the plan. See the module docstring."""
    available = int(psutil.virtual_memory().available) + reusable_bytes
    plan = planned_cpu_bytes(cfg, available)
    total = sum(n for _, n in plan)
    detail = ", ".join(f"{key} = {gib(n)}" for key, n in plan)
    usable = max(0, available - RESERVE_BYTES)
    if total > usable:
        raise HostMemoryError(
            f"the CPU tiers of this daemon need {gib(total)} ({total} bytes: {detail}) but the host has only "
            f"{gib(available)} available ({gib(usable)} after a {gib(RESERVE_BYTES)} reserve); lower cpu_bytes "
            "(each daemon on this host takes its own)"
        )
    limit = _memlock_soft_bytes() if pin else None
    if limit is not None and total > limit:
        raise HostMemoryError(
            f"the CPU tiers of this daemon need {gib(total)} ({total} bytes: {detail}) of pinned memory but "
            f"RLIMIT_MEMLOCK is {gib(limit)} ({limit} bytes); raise it (systemd: LimitMEMLOCK=infinity; "
            "shell: ulimit -l unlimited) or lower cpu_bytes"
        )
    return plan


def check_new_pool(name: str, cpu_bytes: int, existing: Mapping[str, int], *, pin: bool | None = None,
                   reusable_bytes: int = 0) -> None:
    """See the module docstring."""
    available = int(psutil.virtual_memory().available) + reusable_bytes
    usable = max(0, available - RESERVE_BYTES)
    held = sum(existing.values())
    if cpu_bytes > usable:
        raise HostMemoryError(
            f"pool {name!r}: its CPU tier needs {gib(cpu_bytes)} ({cpu_bytes} bytes) but only {gib(available)} is "
            f"available ({gib(usable)} after a {gib(RESERVE_BYTES)} reserve; this daemon's {len(existing)} other "
            f"pools hold {gib(held)}); lower cpu_bytes for it"
        )
    if pin is None:
        pin = pins_cpu_tiers()
    limit = _memlock_soft_bytes() if pin else None
    if limit is not None and held + cpu_bytes > limit:
        raise HostMemoryError(
            f"pool {name!r}: its CPU tier ({gib(cpu_bytes)}) would bring this daemon's pinned memory to "
            f"{gib(held + cpu_bytes)} ({held + cpu_bytes} bytes; {len(existing)} other pools hold {gib(held)}), "
            f"over RLIMIT_MEMLOCK {gib(limit)} ({limit} bytes); raise it (LimitMEMLOCK=infinity) or lower cpu_bytes"
        )
