"""``--print-config``: the effective configuration as TOML that ``--config`` reads back.

Contract: ``format_config(cfg, available_bytes=None)`` returns TOML that
loads to a ``DaemonConfig`` equal to ``cfg``. Sizes are spelled as
``"8GiB"`` where exact; ``auto`` values carry a comment saying what they
resolve to now (``available_bytes`` defaults to psutil's available memory);
tenants' tokens appear only as their hashes.
"""

from __future__ import annotations

import dataclasses
import json

import psutil

from kvtier.daemon.config.schema import (
    _TABLES,
    CPU_AUTO_CAP_BYTES,
    CPU_AUTO_FRACTION,
    CPU_BUDGET_AUTO_FRACTION,
    GPU_AUTO_BYTES_CUDA,
    GPU_AUTO_BYTES_HOST,
    DaemonConfig,
    PoolDefaults,
    PoolOverrides,
    resolve_cpu_budget_bytes,
)
from kvtier.daemon.config.units import MemoryFraction
from kvtier.tiers.units import format_byte_size, format_gib


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, MemoryFraction):
        return json.dumps(str(value))
    return json.dumps(str(value))


def _size_line(key: str, value: int | MemoryFraction | None, auto_comment: str) -> str:
    if value is None:
        return f'{key} = "auto"  # {auto_comment}'
    if isinstance(value, MemoryFraction):
        return f"{key} = {_toml_value(value)}  # of available memory when the pool is created"
    spelled = format_byte_size(value)
    return f"{key} = {json.dumps(spelled) if spelled != str(value) else value}"


def format_config(cfg: DaemonConfig, available_bytes: int | None = None) -> str:
    """The configuration as TOML that ``--config`` reads back to an equal ``DaemonConfig``."""
    if available_bytes is None:
        available_bytes = int(psutil.virtual_memory().available)
    auto_cpu_bytes = min(int(available_bytes * CPU_AUTO_FRACTION), CPU_AUTO_CAP_BYTES)
    auto_cpu = (
        f"{CPU_AUTO_FRACTION:.0%} of available memory, at most {format_byte_size(CPU_AUTO_CAP_BYTES)} "
        f"(now {format_gib(auto_cpu_bytes, decimals=1)})"
    )
    auto_gpu = f"{format_byte_size(GPU_AUTO_BYTES_CUDA)} on CUDA, {format_byte_size(GPU_AUTO_BYTES_HOST)} without"
    lines = ["# kvtierd effective configuration (kvtierd --print-config)"]
    for f in dataclasses.fields(cfg):
        key, value = f.name, getattr(cfg, f.name)
        if key in _TABLES:
            continue
        if key == "heartbeat_s" and value is None:
            lines.append(f'heartbeat_s = "auto"  # lease_s / 3 = {cfg.recommended_heartbeat_s:g} s')
        elif key == "metrics_port" and value is None:
            lines.append('metrics_port = "off"')
        elif key == "max_message_bytes":
            lines.append(_size_line(key, value, ""))
        elif key == "max_unread_reply_bytes":
            lines.append(_size_line(key, value, ""))
        elif key == "cpu_budget_bytes":
            lines.append(_size_line(key, value, f"{CPU_BUDGET_AUTO_FRACTION:.0%} of available memory at start "
                                                f"(now {format_gib(resolve_cpu_budget_bytes(cfg, available_bytes), decimals=1)})"))
        elif key == "socket_mode":
            lines.append(f'{key} = "{value:04o}"')
        elif value is None:
            lines.append(f"# {key} is not set")
        else:
            lines.append(f"{key} = {_toml_value(value)}")

    def pool_lines(table: PoolDefaults | PoolOverrides) -> list[str]:
        out = []
        for f in dataclasses.fields(table):
            value = getattr(table, f.name)
            if f.name in ("gpu_bytes", "cpu_bytes"):
                if value is None and isinstance(table, PoolOverrides):
                    continue
                out.append(_size_line(f.name, value, auto_gpu if f.name == "gpu_bytes" else auto_cpu))
            elif value is not None:
                out.append(f"{f.name} = {_toml_value(value)}")
        return out

    lines += ["", "[default_pool]", *pool_lines(cfg.default_pool)]
    for name in sorted(cfg.pools):
        lines += ["", f"[pools.{json.dumps(name)}]", *pool_lines(cfg.pools[name])]
    for name in sorted(cfg.tenants):
        tenant = cfg.tenants[name]
        lines += ["", f"[tenants.{json.dumps(name)}]"]
        for f in dataclasses.fields(tenant):
            value = getattr(tenant, f.name)
            if value is None:
                continue
            lines.append(_size_line(f.name, value, "") if f.name == "cpu_quota_bytes" else f"{f.name} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"
