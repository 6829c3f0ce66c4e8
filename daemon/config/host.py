"""The configuration against this host: values that are valid in general but not here.

Contract
========

- ``check_device(device)``: ``cuda:N`` must name a device this process can
  use: torch (imported only for ``cuda:N``) must see CUDA, and N must be
  below ``torch.cuda.device_count()`` (which honours
  ``CUDA_VISIBLE_DEVICES``). Raises ``ConfigError("device", ...)`` saying
  what there is and what to set instead. ``auto`` and ``cpu`` need nothing.
  ``load_config_or_exit`` calls it (so ``--print-config`` checks it too).
- ``check_gpu_bytes(cfg, device)``: every ``gpu_bytes`` given in bytes must
  fit the device that holds the GPU tier: the CUDA device's total memory,
  or without CUDA (the GPU tier stands in host memory) the host's. Raises
  ``ConfigError`` naming the dotted key. kvtierd calls it at start, once the
  device is resolved (``auto`` needs torch to resolve).

``load_config`` stays host-independent: a configuration for another host
loads and prints there.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import psutil

from kvtier.daemon.config.errors import ConfigError
from kvtier.tiers.units import format_byte_size, format_gib

if TYPE_CHECKING:
    from kvtier.daemon.config.schema import DaemonConfig

__all__ = ["check_device", "check_gpu_bytes"]


def _cuda_index(device: str) -> int | None:
    match = re.fullmatch(r"cuda:([0-9]+)", device)
    return int(match.group(1)) if match else None


def check_device(device: str) -> None:
    """See the module docstring."""
    index = _cuda_index(device)
    if index is None:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("device", f"{device}, but CUDA is not available here (no GPU or driver, a CPU-only "
                                    "torch, or CUDA_VISIBLE_DEVICES hides them); use device = \"auto\" or \"cpu\"")
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError("device", f"{device}, but this process sees {count} CUDA device{'s' if count != 1 else ''} "
                                    f"(cuda:0..cuda:{count - 1}; CUDA_VISIBLE_DEVICES renumbers them)")


def check_gpu_bytes(cfg: DaemonConfig, device: str) -> None:
    """See the module docstring."""
    from kvtier.daemon.config.schema import pool_key

    tables = [("default_pool.gpu_bytes", cfg.default_pool.gpu_bytes)]
    tables += [(f"{pool_key(name)}.gpu_bytes", o.gpu_bytes) for name, o in cfg.pools.items()]
    given = [(key, n) for key, n in tables if isinstance(n, int)]
    if not given:
        return
    index = _cuda_index(device)
    if index is not None:
        import torch

        total = int(torch.cuda.get_device_properties(index).total_memory)
        where = f"{device}'s memory"
    else:
        total = int(psutil.virtual_memory().total)
        where = "this host's memory (without CUDA the GPU tier is host memory)"
    for key, n in given:
        if n > total:
            raise ConfigError(key, f"is {format_byte_size(n)}, more than {where} ({format_gib(total, decimals=1)})")
