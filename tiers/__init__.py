"""kvtier.tiers: the block store as a library (GPU tier, CPU tier, policies, disk and remote tiers).

Public API: what the daemon, engine adapters (``kvtier.integrations``) and
tools may import from tiers. Each name below can be imported from
``kvtier.tiers`` itself or from the module named beside it (the same
object); every other name in ``tiers/`` is internal and may change without
notice. ``tests/test_architecture.py`` checks that daemon/, integrations/ and
tools/ import nothing else. The module docstrings hold each contract;
docs/tiers-api.md is the walk-through.

- The pool (``kvtier.tiers.pool``): ``TieredPool`` and ``PoolSpec``; ``Op``
  (a two-phase operation) and ``Tier`` (where a block is); its errors
  ``PoolError``, ``NoSpace``, ``NotFound``; ``WrapPolicy`` (the
  ``policy_wrapper`` argument's type). Its journal's event kinds
  ``STORED``, ``REMOVED`` (``kvtier.tiers.pool.journal``). Defaults the
  daemon's configuration shares: ``DEFAULT_POLICY``,
  ``DEFAULT_CLEAN_AHEAD_BLOCKS`` (``kvtier.tiers.pool_defaults``; stdlib only).
- Memory: ``allocate_host_slab``, ``HostMemoryError``, ``RESERVE_BYTES``
  (``host_memory``); ``PersistentArena``, ``ArenaDirectory``
  (``persistent_arena``) and ``list_arenas``, ``remove_arena``,
  ``instance_id`` (``arena_files``); ``SlotIndexBusy`` (``slot_index``).
- Copies: ``make_transfer_engine``, ``TransferEngine``,
  ``ThreadTransferEngine``, ``TransferError``, ``warm_up``
  (``transfer``); ``DeadlinePassed`` and ``CopyJob`` (``copy_types``: what
  ``ThreadTransferEngine._copy`` is handed, for the test-only fault seam).
- Policies: ``make_policy``, ``check_policy_name`` (``policies``: names
  through the registry); ``EvictionPolicy``, ``PolicyWrapper``
  (``policies.base``: for a wrapper such as the daemon's tenant quotas) and
  ``CpuTier`` (``cpu_tier``: what a wrapper is given); ``RequestHints``
  (``hints``).
- Lower tiers: ``DiskTier`` (``disk_tier``), ``slot_bytes_for``
  (``disk_files``); ``RemoteStore`` (``remote``: the contract),
  ``RemoteTier``, ``make_pool_key`` (``remote.tier``),
  ``RemoteTierSettings``, ``RemoteTierError`` (``remote.settings``),
  ``parse_url`` (``remote.url``), ``load_secret``, ``write_secret``
  (``remote.secret``).
- ``kvtier_version`` (``version``): the kvtier package's version.
- Block layouts and host copies (``BlockLayout``, ``copy_host_blocks``) are
  ``kvtier.blocks``'s, below tiers: import them from there.
- ``kvtier.tiers.units`` is public as a whole (its ``__all__``: byte sizes
  and their formats).

Importing ``kvtier.tiers`` loads nothing: a name is imported on first use
(``__getattr__``), so ``import kvtier.tiers.units`` stays stdlib-only and
bookkeeping stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it (kvtier.tiers.<module>).
_PUBLIC: dict[str, str] = {
    **dict.fromkeys(("TieredPool", "PoolSpec", "Op", "Tier", "PoolError", "NoSpace", "NotFound", "WrapPolicy"),
                    "pool"),
    **dict.fromkeys(("STORED", "REMOVED"), "pool.journal"),
    **dict.fromkeys(("DEFAULT_POLICY", "DEFAULT_CLEAN_AHEAD_BLOCKS"), "pool_defaults"),
    **dict.fromkeys(("allocate_host_slab", "HostMemoryError", "RESERVE_BYTES"), "host_memory"),
    **dict.fromkeys(("PersistentArena", "ArenaDirectory"), "persistent_arena"),
    **dict.fromkeys(("list_arenas", "remove_arena", "instance_id"), "arena_files"),
    "SlotIndexBusy": "slot_index",
    **dict.fromkeys(("make_transfer_engine", "TransferEngine", "ThreadTransferEngine", "TransferError",
                     "warm_up"), "transfer"),
    **dict.fromkeys(("DeadlinePassed", "CopyJob"), "copy_types"),
    **dict.fromkeys(("make_policy", "check_policy_name"), "policies"),
    **dict.fromkeys(("EvictionPolicy", "PolicyWrapper"), "policies.base"),
    "CpuTier": "cpu_tier",
    "RequestHints": "hints",
    "DiskTier": "disk_tier",
    "slot_bytes_for": "disk_files",
    "RemoteStore": "remote",
    **dict.fromkeys(("RemoteTier", "make_pool_key"), "remote.tier"),
    **dict.fromkeys(("RemoteTierSettings", "RemoteTierError"), "remote.settings"),
    "parse_url": "remote.url",
    **dict.fromkeys(("load_secret", "write_secret"), "remote.secret"),
    "kvtier_version": "version",
}
# Modules public as a whole: their own __all__ is part of the API.
PUBLIC_MODULES: tuple[str, ...] = ("units",)

__all__ = sorted(_PUBLIC)


def public_module_of(name: str) -> str:
    """The full name of the module that defines public ``name``; KeyError if ``name`` is not public."""
    return f"{__name__}.{_PUBLIC[name]}"


def __getattr__(name: str) -> Any:
    # PEP 562: import on first use, so that importing one submodule never loads the rest (or torch).
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (its public API: kvtier.tiers.__all__)")
    value = getattr(importlib.import_module(public_module_of(name)), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
