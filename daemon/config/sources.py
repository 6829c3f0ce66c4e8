"""Layering the sources: TOML file, ``KVTIER_*`` environment, flags; then building the tree.

Contract
========

``_Layers`` collects coerced values by dotted key, and the source each came
from. ``_apply_file``, ``_apply_environ`` and ``_apply_flags`` add one
source each, in precedence order (a later source overrides single keys of an
earlier one); ``_build`` constructs the ``DaemonConfig``. Every error is a
``ConfigError`` naming the dotted key (or the environment variable) and the
source, with a did-you-mean for unknown keys.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.client.admin import default_socket
from kvtier.daemon.config.errors import ConfigError
from kvtier.daemon.config.schema import (
    ENV_PREFIX,
    MIN_TOKEN_CHARS,
    POOL_KEYS,
    TABLES,
    TENANT_KEYS,
    TOP_KEYS,
    DaemonConfig,
    PoolDefaults,
    PoolOverrides,
    TenantConfig,
    env_name,
    env_pool_name,
    flag_name,
    pool_key,
    tenant_key,
)
from kvtier.daemon.config.units import _as_optional_size


@dataclass
class _Layers:
    """Coerced values by dotted key, and where each came from (for messages)."""

    top: dict[str, Any] = field(default_factory=dict)
    default_pool: dict[str, Any] = field(default_factory=dict)
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)

    def pool_targets(self, name: str) -> list[str]:
        """The pool entries a setting for ``name`` applies to.

        The exact name if present; else every entry with the same environment
        spelling (an environment variable cannot spell ``llama-8b/tp0``, so
        it is matched that way); else a new entry ``name``. An entry that
        only the environment named takes the more precise ``name``.
        """
        if name in self.pools:
            return [name]
        wanted = env_pool_name(name)
        matches = [n for n in self.pools if env_pool_name(n) == wanted]
        if matches == [wanted] and name != wanted:
            self.pools[name] = self.pools.pop(wanted)
            old_prefix, new_prefix = f"{pool_key(wanted)}.", f"{pool_key(name)}."
            for dotted in [d for d in self.source if d.startswith(old_prefix)]:
                self.source[new_prefix + dotted[len(old_prefix) :]] = self.source.pop(dotted)
            return [name]
        return matches or [name]

    def set(self, key: str, value: object, text: bool, source: str, pool: str | None = None, table: str | None = None) -> None:
        if pool is not None:
            spec, dotted = POOL_KEYS.get(key), f"{pool_key(pool)}.{key}"
        elif table == "default_pool":
            spec, dotted = POOL_KEYS.get(key), f"default_pool.{key}"
        else:
            spec, dotted = TOP_KEYS.get(key), key
        if spec is None:
            raise ConfigError(dotted, f"unknown key (from {source})")
        try:
            coerced = spec.coerce(value, text)
        except (ValueError, ConfigError) as exc:
            message = exc.message if isinstance(exc, ConfigError) else str(exc)
            raise ConfigError(dotted, f"{message} (from {source})") from None
        if pool is not None:
            self.pools.setdefault(pool, {})[key] = coerced
        elif table == "default_pool":
            self.default_pool[key] = coerced
        else:
            self.top[key] = coerced
        self.source[dotted] = source


def _unknown(key: str, known: Sequence[str], source: str) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
    return ConfigError(key, f"unknown key (in {source}){hint}")


def _apply_file(layers: _Layers, path: Path) -> None:
    source = f"config file {path}"
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("config", f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError("config", f"{path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively: a few hundred
        # levels exhaust Python's stack. No key of this file nests at all.
        raise ConfigError("config", f"{path}: arrays or inline tables nested too deeply to read "
                                    "(no kvtierd key takes a nested value)") from None
    for key, value in data.items():
        if key == "default_pool":
            if not isinstance(value, dict):
                raise ConfigError(key, f"must be a table ([default_pool]) (in {source})")
            for sub, sub_value in value.items():
                if sub not in POOL_KEYS:
                    raise _unknown(f"default_pool.{sub}", list(POOL_KEYS), source)
                layers.set(sub, sub_value, False, source, table="default_pool")
        elif key == "pools":
            if not isinstance(value, dict):
                raise ConfigError(key, f'must be a table of tables ([pools."NAME"]) (in {source})')
            for name, table in value.items():
                if not isinstance(table, dict):
                    raise ConfigError(pool_key(name), f'must be a table ([pools."{name}"]) (in {source})')
                layers.pools.setdefault(name, {})
                for sub, sub_value in table.items():
                    if sub not in POOL_KEYS:
                        raise _unknown(f"{pool_key(name)}.{sub}", list(POOL_KEYS), source)
                    layers.set(sub, sub_value, False, source, pool=name)
        elif key == "tenants":
            if not isinstance(value, dict):
                raise ConfigError(key, f"must be a table of tables ([tenants.NAME]) (in {source})")
            for name, table in value.items():
                layers.tenants[name] = _tenant_values(name, table, source)
        elif key in TOP_KEYS:
            layers.set(key, value, False, source)
        else:
            raise _unknown(key, [*TOP_KEYS, *TABLES], source)


def _tenant_values(name: str, table: object, source: str) -> dict[str, Any]:
    """One ``[tenants.<name>]`` table as TenantConfig arguments (a clear-text token hashed here)."""
    key = tenant_key(name)
    if not isinstance(table, dict):
        raise ConfigError(key, f"must be a table ([tenants.{name}]) (in {source})")
    out: dict[str, Any] = {}
    for sub, value in table.items():
        dotted = f"{key}.{sub}"
        if sub not in TENANT_KEYS:
            raise _unknown(dotted, list(TENANT_KEYS), source)
        if sub == "cpu_quota_bytes":
            try:
                out[sub] = _as_optional_size(value, False)
            except ValueError as exc:
                raise ConfigError(dotted, f"{exc} (in {source})") from None
        elif not isinstance(value, str):
            raise ConfigError(dotted, f"must be a string, got {type(value).__name__} (in {source})")
        elif sub == "token":
            if len(value) < MIN_TOKEN_CHARS:
                raise ConfigError(dotted, f"must be at least {MIN_TOKEN_CHARS} characters (in {source}); "
                                          "use a random one, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
            if "token_sha256" in table:
                raise ConfigError(dotted, f"give token or token_sha256, not both (in {source})")
            out["token_sha256"] = hashlib.sha256(value.encode()).hexdigest()
        else:
            out[sub] = value.strip().lower() if sub == "token_sha256" else value.strip()
    return out


# Environment spellings that map into the [default_pool] table.
_ENV_DEFAULT_POOL = {env_name(k): k for k in POOL_KEYS}
_ENV_TOP = {env_name(k): k for k in TOP_KEYS}
ENV_CONFIG = env_name("config")


def _known_env_names() -> list[str]:
    return sorted([*_ENV_TOP, *_ENV_DEFAULT_POOL, ENV_CONFIG]) + [f"{ENV_PREFIX}POOLS__<POOL>__<KEY>"]


def _apply_environ(layers: _Layers, environ: Mapping[str, str]) -> None:
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG:
            continue
        value = environ[var]
        if value == "":
            continue
        source = f"environment {var}"
        if var in _ENV_TOP:
            layers.set(_ENV_TOP[var], value, True, source)
        elif var in _ENV_DEFAULT_POOL:
            layers.set(_ENV_DEFAULT_POOL[var], value, True, source, table="default_pool")
        elif var.startswith(f"{ENV_PREFIX}POOLS__"):
            parts = var[len(f"{ENV_PREFIX}POOLS__") :].rsplit("__", 1)
            if len(parts) != 2 or not parts[0] or parts[1].lower() not in POOL_KEYS:
                raise ConfigError(
                    var,
                    f"expected {ENV_PREFIX}POOLS__<POOL>__<KEY> with KEY one of "
                    f"{', '.join(k.upper() for k in POOL_KEYS)}",
                )
            key = parts[1].lower()
            for name in layers.pool_targets(parts[0].upper()):
                layers.set(key, value, True, source, pool=name)
        else:
            close = difflib.get_close_matches(var, _known_env_names(), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(var, f"unknown kvtier environment variable{hint} (known: {', '.join(_known_env_names())})")


def _apply_flags(layers: _Layers, ns: argparse.Namespace) -> None:
    values = vars(ns)
    for key in TOP_KEYS:
        if key in values:
            layers.set(key, values[key], True, f"flag {flag_name(key)}")
    for key in POOL_KEYS:
        dest = f"default_pool.{key}"
        if dest in values:
            layers.set(key, values[dest], True, f"flag {flag_name(key)}", table="default_pool")
    for name, assignment in values.get("pool_settings", []):
        key, sep, value = assignment.partition("=")
        source = f"flag --pool {name} {assignment}"
        if not sep or not key.strip():
            raise ConfigError(pool_key(name), f"expected KEY=VALUE, got {assignment!r} (from {source})")
        key = key.strip().replace("-", "_")
        if key not in POOL_KEYS:
            raise _unknown(f"{pool_key(name)}.{key}", list(POOL_KEYS), source)
        for target in layers.pool_targets(name):
            layers.set(key, value, True, source, pool=target)


def _build(layers: _Layers, environ: Mapping[str, str]) -> DaemonConfig:
    def with_source(err: ConfigError) -> ConfigError:
        source = layers.source.get(err.key)
        if source and "(from " not in err.message and "(in " not in err.message:
            return ConfigError(err.key, f"{err.message} (from {source})")
        return err

    try:
        default_pool = PoolDefaults(**layers.default_pool)
    except ConfigError as err:
        raise with_source(ConfigError(f"default_pool.{err.key}", err.message)) from None
    pools: dict[str, PoolOverrides] = {}
    for name, values in layers.pools.items():
        try:
            pools[name] = PoolOverrides(**values)
        except ConfigError as err:
            raise with_source(ConfigError(f"{pool_key(name)}.{err.key}", err.message)) from None
    tenants: dict[str, TenantConfig] = {}
    for name, values in layers.tenants.items():
        try:
            tenants[name] = TenantConfig(**values)
        except ConfigError as err:
            raise ConfigError(f"{tenant_key(name)}.{err.key}", err.message) from None
    top = dict(layers.top)
    top.setdefault("socket", default_socket(environ))
    if len(tenants) > 1:
        # Tenants who do not trust each other share the cache: xxh3 is not
        # collision resistant, so a tenant could craft colliding block hashes.
        top.setdefault("hash_algo", "sha256")
    try:
        return DaemonConfig(**top, default_pool=default_pool, pools=pools, tenants=tenants)
    except ConfigError as err:
        raise with_source(err) from None
