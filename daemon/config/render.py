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

from kvtier.daemon.config.schema import POOL_KEYS, TOP_KEYS, DaemonConfig, Key, PoolDefaults, PoolOverrides
from kvtier.daemon.config.units import MemoryFraction
from kvtier.tiers.units import format_byte_size


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def _size_line(key: str, value: int | MemoryFraction) -> str:
    if isinstance(value, MemoryFraction):
        return f"{key} = {_toml_value(value)}  # of available memory when the pool is created"
    spelled = format_byte_size(value)
    return f"{key} = {json.dumps(spelled) if spelled != str(value) else value}"


def _key_line(name: str, spec: Key, value: object, cfg: DaemonConfig, available_bytes: int) -> str | None:
    """``name = value`` as the key's declaration spells it; None for an unset key spelled "none"."""
    if value is None:
        if spec.unset == "none":
            return None
        note = spec.auto_note(cfg, available_bytes) if spec.auto_note is not None else ""
        return f'{name} = "{spec.unset}"' + (f"  # {note}" if note else "")
    if spec.is_size:
        return _size_line(name, value)  # type: ignore[arg-type]
    if spec.is_mode:
        return f'{name} = "{value:04o}"'
    return f"{name} = {_toml_value(value)}"


def format_config(cfg: DaemonConfig, available_bytes: int | None = None) -> str:
    """The configuration as TOML that ``--config`` reads back to an equal ``DaemonConfig``."""
    if available_bytes is None:
        available_bytes = int(psutil.virtual_memory().available)
    lines = ["# kvtierd effective configuration (kvtierd --print-config)"]
    for name, spec in TOP_KEYS.items():
        line = _key_line(name, spec, getattr(cfg, name), cfg, available_bytes)
        lines.append(line if line is not None else f"# {name} is not set")

    def pool_lines(table: PoolDefaults | PoolOverrides) -> list[str]:
        out = []
        for name, spec in POOL_KEYS.items():
            value = getattr(table, name)
            if value is None and isinstance(table, PoolOverrides):
                continue  # not overridden: the [default_pool] value applies
            line = _key_line(name, spec, value, cfg, available_bytes)
            if line is not None:
                out.append(line)
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
            lines.append(_size_line(f.name, value) if f.name == "cpu_quota_bytes" else f"{f.name} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"
