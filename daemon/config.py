"""kvtierd configuration: one frozen tree, four sources, every mistake named by its key.

Contract
========

``load_config(argv, environ)`` returns a validated, frozen ``DaemonConfig``
or raises ``ConfigError(key, message)``. Nothing else in kvtier reads the
environment or config files: the daemon's ``main()`` calls this once and hands
the result down.

Sources, lowest precedence first (a later source overrides single keys of an
earlier one, it does not replace whole tables):

1. embedded defaults (the dataclass defaults below): enough to run with no
   file, no environment and no flags;
2. a TOML file: ``--config PATH``, else ``$KVTIER_CONFIG``; none by default.
   See ``systemd/kvtierd.toml`` for every key;
3. ``KVTIER_*`` environment variables: ``KVTIER_<KEY>`` for top-level keys
   (``KVTIER_SOCKET``, ``KVTIER_LEASE_S``, ...), ``KVTIER_GPU_BYTES``,
   ``KVTIER_CPU_BYTES``, ``KVTIER_POLICY``, ``KVTIER_CLEAN_AHEAD_BLOCKS`` for
   the ``[default_pool]`` table, and ``KVTIER_POOLS__<POOL>__<KEY>`` for one
   pool, where ``<POOL>`` is the pool name with every character other than
   ``A-Z a-z 0-9`` written as ``_``, compared case-insensitively
   (``llama-8b/tp0`` -> ``KVTIER_POOLS__LLAMA_8B_TP0__CPU_BYTES``). An empty
   variable counts as unset; an unknown ``KVTIER_*`` variable is an error;
4. command-line flags (``build_arg_parser()``; ``kvtierd --help``).

Values:

- Byte sizes are ints or strings: ``"8GiB"``, ``"512 MiB"``, ``"0.5TiB"``,
  ``"1.5GB"`` (KB/MB/GB/TB are powers of 1000; K/M/G/T and KiB/MiB/GiB/TiB
  powers of 1024; fractions of a byte round down). ``cpu_bytes`` also takes
  ``"30%"``: that share of the host's *available* memory, measured when the
  pool is created. ``"auto"`` (or leaving the key out) means auto-size:
  CPU tier = 25 % of available memory, at most 64 GiB; GPU tier (store mode) =
  1 GiB of device memory on CUDA, 256 MiB of host memory standing in for it
  without CUDA. ``PoolSettings.resolve_cpu_bytes`` / ``resolve_gpu_bytes``
  turn these into bytes.
- Durations are seconds (``*_s`` keys), floats or ints.
- In text sources (environment, flags) optional values take ``auto``/``off``/
  ``none``; booleans take ``1/0``, ``true/false``, ``yes/no``, ``on/off``.

Adding a top-level key: a field of ``DaemonConfig`` (with its check in
``__post_init__``) and one ``_Key`` line in ``_TOP_KEYS`` (parser and help);
its environment variable, its flag and its ``--print-config`` line follow
from those. Put it in ``systemd/kvtierd.toml`` too (a test loads that file
and compares it with the defaults), in a ``build_arg_parser`` group, and in
``docs/operating.md``.

Default socket (``ipc://`` only; ``tcp://`` is used only when configured), the
first that applies:

1. ``ipc://$XDG_RUNTIME_DIR/kvtier/kvtierd.sock`` when ``XDG_RUNTIME_DIR`` is
   set to an absolute path;
2. ``ipc:///run/user/<uid>/kvtier/kvtierd.sock`` when ``/run/user/<uid>`` is a
   directory;
3. ``ipc://${TMPDIR:-/tmp}/kvtier-<uid>/kvtierd.sock``.

The daemon creates the socket's directory (mode 0700, 0710 when the socket's
group may connect) and the socket file (``socket_mode``: 0600, or 0660 for
the group; never anything for others); this module only names them. CURVE
keys apply to ``tcp://`` sockets only.

Tenants (``[tenants.<name>]`` tables, in the file only: secrets and key maps
stay out of the environment and the command line) are ``TenantConfig``:
``public_key`` (CURVE, Z85) and/or ``token`` (hashed to ``token_sha256`` on
loading; ``--print-config`` prints the hash), and ``cpu_quota_bytes``. With
two or more tenants ``hash_algo`` defaults to ``sha256`` unless a source sets
it (tenants who do not trust each other must not share a non-cryptographic
hash); ``kvtier.daemon.tenants`` says what the daemon does with them.

Validation (all raise ``ConfigError`` naming the dotted key, e.g. ``lease_s``,
``default_pool.cpu_bytes``, ``pools."llama-8b/tp0".policy``): unknown keys
(with a did-you-mean), wrong types, negative sizes, non-positive durations,
sockets other than ``ipc://<absolute path or @abstract>`` and
``tcp://<host>:<port>``, ``tcp://`` without ``insecure_tcp = true`` and
without both CURVE key settings, CURVE key files that do not exist, unknown
eviction policies (asked of ``kvtier.tiers.eviction.make_policy``), unknown
hash algorithms, log levels and devices, socket modes with bits for others,
tenants without an identity, with malformed keys or short tokens, and keys,
tokens or namespace tags shared by two tenants.

For ``main()``: ``load_config_or_exit(argv)`` does the CLI policy: on a
``ConfigError`` it prints ``kvtierd: config error: <key>: <message>`` to
stderr and exits 2 (``exit_on_config_error``); with ``--print-config`` it
prints the effective configuration as TOML (loadable as a config file) and
exits 0. Bad flags themselves are argparse's: usage on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn, TextIO

import psutil

from kvtier.client.admin import default_socket  # one rule for the daemon and the tools
from kvtier.tiers import units
from kvtier.tiers.eviction import DEFAULT_POLICY  # no torch: config stays fast to load
from kvtier.tiers.units import GiB, KiB, MiB, format_byte_size, format_gib

__all__ = [
    "ConfigError",
    "DaemonConfig",
    "MemoryFraction",
    "PoolDefaults",
    "PoolOverrides",
    "PoolSettings",
    "TenantConfig",
    "build_arg_parser",
    "default_socket",
    "exit_on_config_error",
    "format_config",
    "load_config",
    "load_config_or_exit",
    "parse_byte_size",
]

CPU_AUTO_FRACTION = 0.25
CPU_AUTO_CAP_BYTES = 64 * GiB
# The daemon's CPU budget ("auto"): half of what is available at start leaves
# the other half to the engines (their processes, vLLM's own CPU KV cache).
CPU_BUDGET_AUTO_FRACTION = 0.5
GPU_AUTO_BYTES_CUDA = 1 * GiB
GPU_AUTO_BYTES_HOST = 256 * MiB

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MIN_MESSAGE_BYTES = 4 * KiB
# sun_path is 108 bytes on Linux, one of them the terminating NUL.
MAX_IPC_PATH_BYTES = 107
ENV_PREFIX = "KVTIER_"
CONFIG_EXIT_CODE = 2


class ConfigError(Exception):
    """A configuration value that cannot be used. ``key`` is the dotted config key (or the source)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


# --------------------------------------------------------------------------------------------
# The tree


@dataclass(frozen=True)
class MemoryFraction:
    """A share of the host's available memory, e.g. ``"30%"`` -> ``MemoryFraction(0.3)``."""

    fraction: float

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, float) and 0.0 < self.fraction <= 1.0):
            raise ConfigError("fraction", f"must be a float in (0, 1], got {self.fraction!r}")

    def of(self, total_bytes: int) -> int:
        return int(total_bytes * self.fraction)

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%"


CpuBytes = int | MemoryFraction


@dataclass(frozen=True)
class PoolDefaults:
    """Settings of every pool that has no override (``[default_pool]``). ``None`` sizes auto-size."""

    gpu_bytes: int | None = None
    cpu_bytes: CpuBytes | None = None
    policy: str = DEFAULT_POLICY
    clean_ahead_blocks: int = 64
    remote_url: str | None = None  # Redis/Valkey remote tier below the CPU tier; None: none

    def __post_init__(self) -> None:
        _check_gpu_bytes("gpu_bytes", self.gpu_bytes)
        _check_cpu_bytes("cpu_bytes", self.cpu_bytes)
        _check_policy("policy", self.policy)
        _check_int("clean_ahead_blocks", self.clean_ahead_blocks, minimum=0)
        _check_remote_url("remote_url", self.remote_url)


@dataclass(frozen=True)
class PoolOverrides:
    """Per-pool settings (``[pools."<name>"]``); ``None`` keeps the ``default_pool`` value."""

    gpu_bytes: int | None = None
    cpu_bytes: CpuBytes | None = None
    policy: str | None = None
    clean_ahead_blocks: int | None = None
    remote_url: str | None = None

    def __post_init__(self) -> None:
        _check_gpu_bytes("gpu_bytes", self.gpu_bytes)
        _check_cpu_bytes("cpu_bytes", self.cpu_bytes)
        if self.policy is not None:
            _check_policy("policy", self.policy)
        if self.clean_ahead_blocks is not None:
            _check_int("clean_ahead_blocks", self.clean_ahead_blocks, minimum=0)
        _check_remote_url("remote_url", self.remote_url)


@dataclass(frozen=True)
class PoolSettings:
    """The effective settings of one pool: ``default_pool`` with that pool's overrides applied."""

    name: str
    gpu_bytes: int | None
    cpu_bytes: CpuBytes | None
    policy: str
    clean_ahead_blocks: int
    remote_url: str | None = None

    def resolve_cpu_bytes(self, available_bytes: int | None = None) -> int:
        """CPU-tier bytes for this pool; ``available_bytes`` defaults to psutil's available memory now."""
        if isinstance(self.cpu_bytes, int):
            return self.cpu_bytes
        if available_bytes is None:
            available_bytes = int(psutil.virtual_memory().available)
        if isinstance(self.cpu_bytes, MemoryFraction):
            return self.cpu_bytes.of(available_bytes)
        return min(int(available_bytes * CPU_AUTO_FRACTION), CPU_AUTO_CAP_BYTES)

    def resolve_gpu_bytes(self, *, on_cuda: bool) -> int:
        """GPU-tier bytes for a store-mode pool (engine mode uses the engine's tensors instead)."""
        if self.gpu_bytes is not None:
            return self.gpu_bytes
        return GPU_AUTO_BYTES_CUDA if on_cuda else GPU_AUTO_BYTES_HOST


@dataclass(frozen=True)
class TenantConfig:
    """One tenant (``[tenants.<name>]``, TOML only): how its sessions are recognised, and its quota.

    A session belongs to the tenant whose ``public_key`` (CURVE, Z85, 40
    characters) its connection authenticated with, or whose token it sent in
    ``hello``. Tokens are kept as ``token_sha256`` (hex SHA-256 of the token):
    a file may give ``token = "..."`` in clear, which is hashed on loading, so
    the loaded configuration neither holds nor prints it. ``cpu_quota_bytes``
    (None = no quota) caps the tenant's resident CPU-tier bytes over all pools.
    """

    public_key: str | None = None
    token_sha256: str | None = None
    cpu_quota_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.public_key is not None:
            _check_z85_key("public_key", self.public_key)
        if self.token_sha256 is not None and not (
            isinstance(self.token_sha256, str) and re.fullmatch(r"[0-9a-f]{64}", self.token_sha256)
        ):
            raise ConfigError("token_sha256", "must be 64 lower-case hex digits (sha256 of the token)")
        if self.public_key is None and self.token_sha256 is None:
            raise ConfigError("public_key", "a tenant needs a public_key (CURVE) or a token (or both)")
        if self.cpu_quota_bytes is not None:
            _check_int("cpu_quota_bytes", self.cpu_quota_bytes, minimum=0)


@dataclass(frozen=True)
class DaemonConfig:
    """Everything kvtierd is configured with. Constructing one validates it."""

    socket: str = field(default_factory=lambda: default_socket(os.environ))
    lease_s: float = 10.0
    heartbeat_s: float | None = None
    poll_interval_s: float = 0.05
    drain_timeout_s: float = 10.0
    max_message_bytes: int = 256 * MiB
    # Shared-memory files a session may map (arena and KV registrations: one
    # descriptor each) and KV registrations it may hold; the daemon-wide total
    # of mapped files is capped below RLIMIT_NOFILE as well (daemon.handlers).
    max_shm_files_per_session: int = 1024
    max_registrations_per_session: int = 64
    max_pools: int = 128  # pools the daemon holds at once (each: a CPU tier, a GPU tier in store mode, 2 threads)
    # Pins one session, and one tenant's sessions together, may hold on a pool, as a share of its blocks.
    max_pinned_share: float = 0.5
    # Bytes of replies (block payloads) one connection has not read yet; past it its requests are refused.
    max_unread_reply_bytes: int = 512 * MiB
    # All pools' CPU tiers together; None ("auto"): CPU_BUDGET_AUTO_FRACTION of available memory at start.
    cpu_budget_bytes: CpuBytes | None = None
    # A pool without sessions keeps its blocks this long (or until a new pool needs its memory).
    pool_idle_ttl_s: float = 3600.0
    log_level: str = "info"
    device: str = "auto"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    insecure_tcp: bool = False
    curve_secret_key_file: Path | None = None
    curve_public_keys_dir: Path | None = None
    socket_mode: int = 0o600
    hash_algo: str = "xxh3_128"
    default_pool: PoolDefaults = field(default_factory=PoolDefaults)
    pools: Mapping[str, PoolOverrides] = field(default_factory=dict, hash=False)
    tenants: Mapping[str, TenantConfig] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check_duration("lease_s", self.lease_s)
        if self.heartbeat_s is not None:
            _check_duration("heartbeat_s", self.heartbeat_s)
            if self.heartbeat_s >= self.lease_s:
                raise ConfigError(
                    "heartbeat_s",
                    f"must be shorter than lease_s ({self.lease_s:g} s), got {self.heartbeat_s:g} s; "
                    "a client heartbeating slower than the lease loses its pins",
                )
        _check_duration("poll_interval_s", self.poll_interval_s)
        _check_duration("drain_timeout_s", self.drain_timeout_s, allow_zero=True)
        _check_int("max_message_bytes", self.max_message_bytes, minimum=MIN_MESSAGE_BYTES)
        _check_int("max_shm_files_per_session", self.max_shm_files_per_session, minimum=1)
        _check_int("max_registrations_per_session", self.max_registrations_per_session, minimum=1)
        _check_int("max_pools", self.max_pools, minimum=1)
        _check_cpu_bytes("cpu_budget_bytes", self.cpu_budget_bytes)
        _check_int("max_unread_reply_bytes", self.max_unread_reply_bytes, minimum=MIN_MESSAGE_BYTES)
        _check_duration("pool_idle_ttl_s", self.pool_idle_ttl_s)
        if not 0.0 < self.max_pinned_share <= 1.0:
            raise ConfigError("max_pinned_share", f"must be a share in (0, 1], got {self.max_pinned_share!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        _check_device("device", self.device)
        if self.metrics_port is not None:
            _check_int("metrics_port", self.metrics_port, minimum=1, maximum=65535)
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ConfigError("metrics_host", f"must be a host name or address, got {self.metrics_host!r}")
        if not isinstance(self.insecure_tcp, bool):
            raise ConfigError("insecure_tcp", f"must be true or false, got {self.insecure_tcp!r}")
        _check_hash_algo("hash_algo", self.hash_algo)
        _check_socket_mode("socket_mode", self.socket_mode)
        _check_socket(self)
        if not isinstance(self.default_pool, PoolDefaults):
            raise ConfigError("default_pool", "must be a PoolDefaults")
        pools = dict(self.pools)
        env_keys: dict[str, str] = {}
        for name, overrides in pools.items():
            key = pool_key(name)
            if not isinstance(name, str) or not name:
                raise ConfigError(key, "pool names must be non-empty strings")
            if not isinstance(overrides, PoolOverrides):
                raise ConfigError(key, "must be a PoolOverrides")
            other = env_keys.setdefault(env_pool_name(name), name)
            if other != name:
                raise ConfigError(
                    key,
                    f"pool names {other!r} and {name!r} are the same pool in the environment "
                    f"(KVTIER_POOLS__{env_pool_name(name)}__...); rename one",
                )
        # Frozen all the way down: nobody edits the pools table after loading.
        object.__setattr__(self, "pools", MappingProxyType(pools))
        object.__setattr__(self, "tenants", MappingProxyType(_check_tenants(self.tenants)))

    @property
    def is_tcp(self) -> bool:
        return self.socket.startswith("tcp://")

    @property
    def ipc_path(self) -> Path | None:
        """The socket file for an ``ipc://`` endpoint; None for tcp and abstract sockets."""
        if self.socket.startswith("ipc://") and not self.socket.startswith("ipc://@"):
            return Path(self.socket[len("ipc://") :])
        return None

    @property
    def recommended_heartbeat_s(self) -> float:
        """What hello tells clients: ``heartbeat_s`` if set, else a third of the lease."""
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / 3.0

    def pool_settings(self, name: str) -> PoolSettings:
        """Effective settings for pool ``name``: exact name first, then its environment spelling."""
        overrides = self.pools.get(name)
        if overrides is None:
            wanted = env_pool_name(name)
            overrides = next((o for n, o in self.pools.items() if env_pool_name(n) == wanted), PoolOverrides())
        d = self.default_pool
        return PoolSettings(
            name=name,
            gpu_bytes=overrides.gpu_bytes if overrides.gpu_bytes is not None else d.gpu_bytes,
            cpu_bytes=overrides.cpu_bytes if overrides.cpu_bytes is not None else d.cpu_bytes,
            policy=overrides.policy if overrides.policy is not None else d.policy,
            clean_ahead_blocks=(
                overrides.clean_ahead_blocks if overrides.clean_ahead_blocks is not None else d.clean_ahead_blocks
            ),
            remote_url=overrides.remote_url if overrides.remote_url is not None else d.remote_url,
        )


def env_pool_name(name: str) -> str:
    """How pool ``name`` is spelled inside ``KVTIER_POOLS__<NAME>__<KEY>``."""
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def pool_key(name: object) -> str:
    """The dotted key of a pool's table, TOML-quoted when needed: ``pools."llama-8b/tp0"``."""
    if isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_-]+", name):
        return f"pools.{name}"
    return f"pools.{json.dumps(name) if isinstance(name, str) else repr(name)}"


# --------------------------------------------------------------------------------------------
# Checks (used by the dataclasses, so a DaemonConfig built by hand is checked too)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(key: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if not _is_int(value):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    assert isinstance(value, int)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ConfigError(key, f"must be {bound}, got {value}")


def _check_duration(key: str, value: object, *, allow_zero: bool = False) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)) or not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'} seconds, got {value!r}")


def _check_gpu_bytes(key: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, MemoryFraction):
        raise ConfigError(key, "a percentage is only accepted for cpu_bytes; give gpu_bytes in bytes")
    if not _is_int(value):
        raise ConfigError(key, f"must be a byte size, got {value!r}")
    assert isinstance(value, int)
    if value < 0:
        raise ConfigError(key, f"must not be negative, got {value}")


def _check_cpu_bytes(key: str, value: object) -> None:
    if isinstance(value, MemoryFraction):
        return
    _check_gpu_bytes(key, value)


def _check_policy(key: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"must be a policy name such as 'lru', got {value!r}")
    try:
        from kvtier.tiers.eviction import make_policy
    except ImportError:
        # Without the tiers package nothing can build a pool anyway; the pool
        # constructor would report the name then.
        return
    try:
        make_policy(value, 1)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def _check_hash_algo(key: str, value: object) -> None:
    try:
        from kvtier.client.hashing import HASH_ALGOS
    except ImportError:
        HASH_ALGOS = ("xxh3_128", "sha256")  # noqa: N806 - mirrors the constant it stands in for
    if value not in HASH_ALGOS:
        raise ConfigError(key, f"must be one of {', '.join(HASH_ALGOS)}, got {value!r}")


def _check_socket_mode(key: str, value: object) -> None:
    # Read and write for the owner (connecting needs write permission), at
    # most the same for the group, never anything for others.
    if not _is_int(value) or value & ~0o660 or value & 0o600 != 0o600:  # type: ignore[operator]
        shown = f"{value:04o}" if _is_int(value) else repr(value)
        raise ConfigError(key, f"must be 0600, 0620, 0640 or 0660 (owner rw, optionally the group), got {shown}")


TENANT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MIN_TOKEN_CHARS = 16
_Z85_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def _check_z85_key(key: str, value: object) -> None:
    if not (isinstance(value, str) and len(value) == 40 and set(value) <= _Z85_CHARS):
        raise ConfigError(key, f"must be a CURVE public key: 40 Z85 characters (kvtier keygen writes them), got {value!r:.60}")


def tenant_key(name: object) -> str:
    return pool_key(name).replace("pools.", "tenants.", 1)


def _check_tenants(tenants: Mapping[str, TenantConfig]) -> dict[str, TenantConfig]:
    from kvtier.daemon.tenants import tenant_tag  # light: hashlib only

    out = dict(tenants)
    keys: dict[str, str] = {}
    tokens: dict[str, str] = {}
    tags: dict[bytes, str] = {}
    for name, tenant in out.items():
        key = tenant_key(name)
        if not isinstance(name, str) or not TENANT_NAME_RE.fullmatch(name):
            raise ConfigError(key, "tenant names are 1-64 of A-Z a-z 0-9 _ . - (starting with a letter or digit)")
        if not isinstance(tenant, TenantConfig):
            raise ConfigError(key, "must be a TenantConfig")
        if tenant.public_key is not None:
            other = keys.setdefault(tenant.public_key, name)
            if other != name:
                raise ConfigError(f"{key}.public_key", f"is also tenant {other!r}'s key; one key, one tenant")
        if tenant.token_sha256 is not None:
            other = tokens.setdefault(tenant.token_sha256, name)
            if other != name:
                raise ConfigError(f"{key}.token", f"is also tenant {other!r}'s token; one token, one tenant")
        other = tags.setdefault(tenant_tag(name), name)
        if other != name:
            raise ConfigError(key, f"tenants {other!r} and {name!r} hash to the same block namespace tag; rename one")
    return out


def _check_device(key: str, value: object) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda:(0|[1-9][0-9]*)", value):
        raise ConfigError(key, f"must be 'auto', 'cpu' or 'cuda:N', got {value!r}")


def _check_socket(cfg: DaemonConfig) -> None:
    url = cfg.socket
    if not isinstance(url, str):
        raise ConfigError("socket", f"must be an ipc:// or tcp:// URL, got {url!r}")
    if url.startswith("ipc://"):
        path = url[len("ipc://") :]
        if path.startswith("@"):
            if len(path) < 2:
                raise ConfigError("socket", "an abstract ipc socket needs a name after '@'")
        elif not os.path.isabs(path):
            raise ConfigError("socket", f"ipc socket path must be absolute, got {path!r}")
        elif path.endswith("/"):
            raise ConfigError("socket", f"ipc socket path names a directory: {path!r}")
        if len(path.encode()) > MAX_IPC_PATH_BYTES:
            raise ConfigError(
                "socket",
                f"ipc socket path is {len(path.encode())} bytes, the limit is {MAX_IPC_PATH_BYTES}; choose a shorter path",
            )
        return
    if url.startswith("tcp://"):
        match = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9*._-]+):([0-9]{1,5})", url)
        if not match or not 1 <= int(match.group(2)) <= 65535:
            raise ConfigError("socket", f"must look like tcp://HOST:PORT with PORT in 1..65535, got {url!r}")
        has_curve = cfg.curve_secret_key_file is not None or cfg.curve_public_keys_dir is not None
        if has_curve:
            _check_curve(cfg)
        elif not cfg.insecure_tcp:
            raise ConfigError(
                "socket",
                f"{url} is reachable from the network and would be unauthenticated; configure "
                "curve_secret_key_file and curve_public_keys_dir, or set insecure_tcp = true "
                "(only on a network you trust)",
            )
        return
    raise ConfigError("socket", f"must start with ipc:// or tcp://, got {url!r}")


def _check_curve(cfg: DaemonConfig) -> None:
    # Presence here; the daemon reads the key file (and refuses a bad one,
    # exit 2) and the directory of client keys when it starts.
    secret, public_dir = cfg.curve_secret_key_file, cfg.curve_public_keys_dir
    if secret is None:
        raise ConfigError("curve_secret_key_file", "is required together with curve_public_keys_dir")
    if public_dir is None:
        raise ConfigError("curve_public_keys_dir", "is required together with curve_secret_key_file")
    if not Path(secret).is_file():
        raise ConfigError("curve_secret_key_file", f"{secret} does not exist or is not a file")
    if not Path(public_dir).is_dir():
        raise ConfigError("curve_public_keys_dir", f"{public_dir} does not exist or is not a directory")


# --------------------------------------------------------------------------------------------
# Parsing values


_PERCENT_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*")


def parse_byte_size(value: object, *, allow_percent: bool = False) -> int | MemoryFraction:
    """``8GiB`` -> 8589934592; ints pass through; ``"30%"`` -> MemoryFraction when allowed.

    The grammar is ``kvtier.tiers.units.parse_byte_size``'s (the one every
    kvtier command line uses); this adds the percentage ``cpu_bytes`` takes.
    Raises ``ValueError`` with a message fit for a ``ConfigError``.
    """
    if isinstance(value, str) and not value.strip().startswith("-"):
        percent = _PERCENT_RE.fullmatch(value)
        if percent:
            if not allow_percent:
                raise ValueError(f"a percentage is only accepted for cpu_bytes, got {value!r}")
            pct = float(percent.group(1))
            if not 0.0 < pct <= 100.0:
                raise ValueError(f"percentage must be in (0, 100], got {value!r}")
            return MemoryFraction(pct / 100.0)
    return units.parse_byte_size(value)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_UNSET = {"auto", "off", "none", ""}

# How each key's value is read. ``text`` is True for environment variables and
# flags (everything is a string there) and False for TOML (values are typed).
Coerce = Callable[[object, bool], object]


def _as_number(value: object, text: bool, what: str) -> float:
    if text and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"must be {what}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be {what}, got {type(value).__name__} {value!r}")
    return float(value)


def _as_float(value: object, text: bool) -> float:
    return _as_number(value, text, "a number of seconds")


def _as_share(value: object, text: bool) -> float:
    return _as_number(value, text, "a number in (0, 1]")


def _as_optional_float(value: object, text: bool) -> float | None:
    if isinstance(value, str) and value.strip().lower() in _UNSET:
        return None
    return _as_float(value, text)


def _as_int(value: object, text: bool) -> int:
    if text and isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ValueError(f"must be an integer, got {value!r}") from None
    if not _is_int(value):
        raise ValueError(f"must be an integer, got {type(value).__name__} {value!r}")
    assert isinstance(value, int)
    return value


def _as_optional_port(value: object, text: bool) -> int | None:
    if isinstance(value, str) and value.strip().lower() in _UNSET:
        return None
    return _as_int(value, text)


def _as_bool(value: object, text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"must be true or false, got {value!r}")


def _as_str(value: object, text: bool) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__} {value!r}")
    return value.strip() if text else value


REMOTE_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys", "redis+cluster", "rediss+cluster",
                  "valkey+cluster", "valkeys+cluster")


def _as_optional_url(value: object, text: bool) -> str | None:
    url = _as_str(value, text)
    return None if url.lower() in ("", "off", "none") else url


def _check_remote_url(key: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str) or value.split("://", 1)[0].lower() not in REMOTE_SCHEMES or "://" not in value:
        raise ConfigError(key, f"must be a URL with one of the schemes {', '.join(REMOTE_SCHEMES)}, got {value!r}")


def _as_lower_str(value: object, text: bool) -> str:
    return _as_str(value, text).strip().lower()


def _as_log_level(value: object, text: bool) -> str:
    level = _as_lower_str(value, text)
    return "warning" if level == "warn" else level


def _as_device(value: object, text: bool) -> str:
    device = _as_lower_str(value, text)
    return "cuda:0" if device == "cuda" else device


def _as_optional_path(value: object, text: bool) -> Path | None:
    if text and isinstance(value, str) and value.strip().lower() in {"none", ""}:
        return None
    return Path(_as_str(value, text))


def _as_mode(value: object, text: bool) -> int:
    # TOML can write 0o660 (an int); text and TOML strings spell it "0660".
    if _is_int(value):
        return value  # type: ignore[return-value]
    if isinstance(value, str):
        digits = value.strip().lower().removeprefix("0o")
        if re.fullmatch(r"[0-7]{3,4}", digits):
            return int(digits, 8)
    raise ValueError(f'must be an octal file mode such as "0600" or "0660" (TOML: 0o660 or "0660"), got {value!r}')


def _as_size(value: object, text: bool) -> int:
    result = parse_byte_size(_as_text_int(value, text))
    assert isinstance(result, int)
    return result


def _as_optional_size(value: object, text: bool) -> int | None:
    if isinstance(value, str) and value.strip().lower() in _UNSET - {"off"}:
        return None
    return _as_size(value, text)


def _as_optional_cpu_size(value: object, text: bool) -> CpuBytes | None:
    if isinstance(value, str) and value.strip().lower() in _UNSET - {"off"}:
        return None
    return parse_byte_size(_as_text_int(value, text), allow_percent=True)


def _as_text_int(value: object, text: bool) -> object:
    # "4096" from the environment is a byte count, as 4096 in TOML is.
    if text and isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return value


@dataclass(frozen=True)
class _Key:
    coerce: Coerce
    help: str
    metavar: str


_TOP_KEYS: dict[str, _Key] = {
    "socket": _Key(_as_str, "ZMQ endpoint to bind: ipc:///path or ipc://@abstract; tcp://HOST:PORT only with CURVE keys or --insecure-tcp", "URL"),
    "lease_s": _Key(_as_float, "seconds a session's pins and registrations survive without a heartbeat", "SECONDS"),
    "heartbeat_s": _Key(_as_optional_float, "heartbeat interval recommended to clients in hello ('auto' = lease_s / 3)", "SECONDS"),
    "poll_interval_s": _Key(_as_float, "longest the event loop sleeps before polling copies in flight", "SECONDS"),
    "drain_timeout_s": _Key(_as_float, "on SIGTERM/SIGINT, how long to finish copies and pending replies before exiting", "SECONDS"),
    "max_shm_files_per_session": _Key(_as_int, "shared-memory files (arena, KV tensors) one session may map: one descriptor each", "N"),
    "max_registrations_per_session": _Key(_as_int, "KV registrations (register_kv) one session may hold", "N"),
    "max_unread_reply_bytes": _Key(_as_size, "bytes of block payload in replies one connection has not read yet; past it its requests get UNREAD_REPLIES (e.g. 512MiB)", "SIZE"),
    "cpu_budget_bytes": _Key(_as_optional_cpu_size, "all pools' CPU tiers together: bytes, or N%% of available memory ('auto' = 50%% at start); a new pool that does not fit reclaims idle pools, else NO_SPACE", "SIZE"),
    "pool_idle_ttl_s": _Key(_as_float, "how long a pool without sessions keeps its blocks (sooner when a new pool needs its memory)", "SECONDS"),
    "max_pinned_share": _Key(_as_share, "pinned blocks one session (and one tenant's sessions together) may hold, as a share of the pool's blocks", "SHARE"),
    "max_pools": _Key(_as_int, "pools the daemon holds at once; a hello that would create one more gets TOO_MANY_POOLS", "N"),
    "max_message_bytes": _Key(_as_size, "largest payload (block bytes: a request's frames, an inline restore's reply) accepted; the header has its own 4 MiB limit (e.g. 256MiB)", "SIZE"),
    "log_level": _Key(_as_log_level, "one of debug, info, warning, error, critical", "LEVEL"),
    "device": _Key(_as_device, "'auto' (CUDA if available), 'cpu', or 'cuda:N'", "DEVICE"),
    "metrics_port": _Key(_as_optional_port, "Prometheus endpoint port ('off' = no endpoint)", "PORT"),
    "metrics_host": _Key(_as_str, "address the Prometheus endpoint binds", "HOST"),
    "insecure_tcp": _Key(_as_bool, "allow a tcp:// socket without CURVE authentication", "BOOL"),
    "curve_secret_key_file": _Key(_as_optional_path, "the daemon's CURVE secret key file (tcp://)", "FILE"),
    "curve_public_keys_dir": _Key(_as_optional_path, "directory of authorised client CURVE public keys (tcp://)", "DIR"),
    "socket_mode": _Key(_as_mode, "file mode of the ipc socket: 0600, or 0660 to let the socket's group connect", "MODE"),
    "hash_algo": _Key(
        _as_lower_str, "block hash algorithm pools must use: xxh3_128 or sha256 (default sha256 with 2+ tenants)", "ALGO"
    ),
}
_POOL_KEYS: dict[str, _Key] = {
    "gpu_bytes": _Key(_as_optional_size, "GPU tier size of a store-mode pool ('auto' = 1GiB on CUDA, 256MiB without)", "SIZE"),
    "cpu_bytes": _Key(_as_optional_cpu_size, "CPU tier size: bytes, or N%% of available memory ('auto' = 25%%, at most 64GiB)", "SIZE"),
    "policy": _Key(_as_lower_str, "CPU-tier eviction policy (e.g. lru)", "NAME"),
    "clean_ahead_blocks": _Key(_as_int, "free GPU blocks kept already demoted ahead of allocation", "N"),
    "remote_url": _Key(
        _as_optional_url,
        "remote tier below the CPU tier: redis://HOST:PORT/DB or redis+cluster://HOST:PORT[,...] ('off' = none)",
        "URL",
    ),
}
# [tenants.<name>]: file only. Tokens and key-to-tenant maps are not for the
# environment or the command line, where other users' `ps` can read them.
_TENANT_KEYS = ("public_key", "token", "token_sha256", "cpu_quota_bytes")
_TABLES = ("default_pool", "pools", "tenants")


# --------------------------------------------------------------------------------------------
# Layered raw values


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
            spec, dotted = _POOL_KEYS.get(key), f"{pool_key(pool)}.{key}"
        elif table == "default_pool":
            spec, dotted = _POOL_KEYS.get(key), f"default_pool.{key}"
        else:
            spec, dotted = _TOP_KEYS.get(key), key
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
    for key, value in data.items():
        if key == "default_pool":
            if not isinstance(value, dict):
                raise ConfigError(key, f"must be a table ([default_pool]) (in {source})")
            for sub, sub_value in value.items():
                if sub not in _POOL_KEYS:
                    raise _unknown(f"default_pool.{sub}", list(_POOL_KEYS), source)
                layers.set(sub, sub_value, False, source, table="default_pool")
        elif key == "pools":
            if not isinstance(value, dict):
                raise ConfigError(key, f'must be a table of tables ([pools."NAME"]) (in {source})')
            for name, table in value.items():
                if not isinstance(table, dict):
                    raise ConfigError(pool_key(name), f'must be a table ([pools."{name}"]) (in {source})')
                layers.pools.setdefault(name, {})
                for sub, sub_value in table.items():
                    if sub not in _POOL_KEYS:
                        raise _unknown(f"{pool_key(name)}.{sub}", list(_POOL_KEYS), source)
                    layers.set(sub, sub_value, False, source, pool=name)
        elif key == "tenants":
            if not isinstance(value, dict):
                raise ConfigError(key, f"must be a table of tables ([tenants.NAME]) (in {source})")
            for name, table in value.items():
                layers.tenants[name] = _tenant_values(name, table, source)
        elif key in _TOP_KEYS:
            layers.set(key, value, False, source)
        else:
            raise _unknown(key, [*_TOP_KEYS, *_TABLES], source)


def _tenant_values(name: str, table: object, source: str) -> dict[str, Any]:
    """One ``[tenants.<name>]`` table as TenantConfig arguments (a clear-text token hashed here)."""
    key = tenant_key(name)
    if not isinstance(table, dict):
        raise ConfigError(key, f"must be a table ([tenants.{name}]) (in {source})")
    out: dict[str, Any] = {}
    for sub, value in table.items():
        dotted = f"{key}.{sub}"
        if sub not in _TENANT_KEYS:
            raise _unknown(dotted, list(_TENANT_KEYS), source)
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
_ENV_DEFAULT_POOL = {f"{ENV_PREFIX}{k.upper()}": k for k in _POOL_KEYS}
_ENV_TOP = {f"{ENV_PREFIX}{k.upper()}": k for k in _TOP_KEYS}
_ENV_CONFIG = f"{ENV_PREFIX}CONFIG"


def _known_env_names() -> list[str]:
    return sorted([*_ENV_TOP, *_ENV_DEFAULT_POOL, _ENV_CONFIG]) + [f"{ENV_PREFIX}POOLS__<POOL>__<KEY>"]


def _apply_environ(layers: _Layers, environ: Mapping[str, str]) -> None:
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var == _ENV_CONFIG:
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
            if len(parts) != 2 or not parts[0] or parts[1].lower() not in _POOL_KEYS:
                raise ConfigError(
                    var,
                    f"expected {ENV_PREFIX}POOLS__<POOL>__<KEY> with KEY one of "
                    f"{', '.join(k.upper() for k in _POOL_KEYS)}",
                )
            key = parts[1].lower()
            for name in layers.pool_targets(parts[0].upper()):
                layers.set(key, value, True, source, pool=name)
        else:
            close = difflib.get_close_matches(var, _known_env_names(), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(var, f"unknown kvtier environment variable{hint} (known: {', '.join(_known_env_names())})")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _apply_flags(layers: _Layers, ns: argparse.Namespace) -> None:
    values = vars(ns)
    for key in _TOP_KEYS:
        if key in values:
            layers.set(key, values[key], True, f"flag {_flag(key)}")
    for key in _POOL_KEYS:
        dest = f"default_pool.{key}"
        if dest in values:
            layers.set(key, values[dest], True, f"flag {_flag(key)}", table="default_pool")
    for name, assignment in values.get("pool_settings", []):
        key, sep, value = assignment.partition("=")
        source = f"flag --pool {name} {assignment}"
        if not sep or not key.strip():
            raise ConfigError(pool_key(name), f"expected KEY=VALUE, got {assignment!r} (from {source})")
        key = key.strip().replace("-", "_")
        if key not in _POOL_KEYS:
            raise _unknown(f"{pool_key(name)}.{key}", list(_POOL_KEYS), source)
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


# --------------------------------------------------------------------------------------------
# Command line


_EPILOG = f"""\
configuration sources, later ones override single keys of earlier ones:
  built-in defaults < TOML file (--config, or $KVTIER_CONFIG) < KVTIER_* environment < flags

environment variables:
  KVTIER_<KEY>                  a top-level key, e.g. KVTIER_SOCKET, KVTIER_LEASE_S
  KVTIER_GPU_BYTES, KVTIER_CPU_BYTES, KVTIER_POLICY, KVTIER_CLEAN_AHEAD_BLOCKS
                                the [default_pool] table
  KVTIER_POOLS__<POOL>__<KEY>   one pool; POOL is the pool name with every
                                non-alphanumeric character written as '_'
                                (llama-8b/tp0 -> KVTIER_POOLS__LLAMA_8B_TP0__CPU_BYTES)
  empty variables count as unset; unknown KVTIER_* variables are an error.

sizes: 4096, 512MiB, 8GiB, 0.5TiB, 1.5GB (KB/MB/GB = 1000^n, K/KiB.. = 1024^n);
cpu sizes also N% of available memory. 'auto' picks: CPU tier
{CPU_AUTO_FRACTION:.0%} of available memory (at most {format_byte_size(CPU_AUTO_CAP_BYTES)}), GPU tier
{format_byte_size(GPU_AUTO_BYTES_CUDA)} on CUDA ({format_byte_size(GPU_AUTO_BYTES_HOST)} of host memory without CUDA).

default socket: ipc://$XDG_RUNTIME_DIR/kvtier/kvtierd.sock, else
/run/user/<uid>/kvtier/kvtierd.sock, else ${{TMPDIR:-/tmp}}/kvtier-<uid>/kvtierd.sock.

exit status: 0 ok, 2 bad configuration or flags.
"""


def build_arg_parser() -> argparse.ArgumentParser:
    """kvtierd's flags. Unset flags are absent from the namespace (they override nothing)."""
    parser = argparse.ArgumentParser(
        prog="kvtierd",
        description="kvtier daemon: a two-tier (GPU + pinned CPU) KV-cache block store for LLM\n"
        "inference engines, served over ZMQ. Runs in the foreground and logs to stderr.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    defaults = DaemonConfig(socket="ipc:///default")
    general = parser.add_argument_group("configuration")
    general.add_argument("--config", metavar="PATH", help="TOML config file (default: $KVTIER_CONFIG, else none)")
    general.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration as TOML (usable as a --config file) and exit",
    )
    try:
        from importlib.metadata import version

        kvtier_version = version("kvtier")
    except Exception:  # noqa: BLE001 - a source checkout without metadata still has --help
        kvtier_version = "unknown"
    general.add_argument("--version", action="version", version=f"kvtierd (kvtier) {kvtier_version}")

    groups = {
        "server": ("server", ["socket", "socket_mode", "lease_s", "heartbeat_s", "poll_interval_s", "drain_timeout_s",
                              "max_message_bytes", "max_shm_files_per_session", "max_registrations_per_session", "max_pools", "max_pinned_share",
                              "cpu_budget_bytes", "pool_idle_ttl_s", "max_unread_reply_bytes"]),
        "runtime": ("runtime", ["device", "hash_algo", "log_level", "metrics_port", "metrics_host"]),
        "security": ("tcp security", ["insecure_tcp", "curve_secret_key_file", "curve_public_keys_dir"]),
    }
    for title, keys in groups.values():
        group = parser.add_argument_group(title)
        for key in keys:
            spec = _TOP_KEYS[key]
            default = getattr(defaults, key)
            shown = default
            if key == "socket":
                shown = "see below"
            elif key == "max_message_bytes":
                shown = format_byte_size(default)
            elif key == "socket_mode":
                shown = f"{default:04o}"
            elif default is None:
                shown = {"heartbeat_s": "auto", "metrics_port": "off"}.get(key, "none")
            if key == "insecure_tcp":
                group.add_argument(
                    _flag(key), dest=key, action=argparse.BooleanOptionalAction, help=f"{spec.help} (default: no)"
                )
                continue
            group.add_argument(_flag(key), dest=key, metavar=spec.metavar, help=f"{spec.help} (default: {shown})")

    pools = parser.add_argument_group(
        "pools",
        "sizes and policy for every pool ([default_pool]); --pool overrides one pool by name",
    )
    for key, spec in _POOL_KEYS.items():
        default = getattr(defaults.default_pool, key)
        shown = "auto" if default is None else default
        pools.add_argument(
            _flag(key), dest=f"default_pool.{key}", metavar=spec.metavar, help=f"{spec.help} (default: {shown})"
        )
    pools.add_argument(
        "--pool",
        dest="pool_settings",
        nargs=2,
        action="append",
        metavar=("NAME", "KEY=VALUE"),
        help=f"set one key of pool NAME, e.g. --pool llama-8b/tp0 cpu_bytes=32GiB (keys: {', '.join(_POOL_KEYS)}); repeatable",
    )
    return parser


def _load(argv: Sequence[str] | None, environ: Mapping[str, str] | None) -> tuple[DaemonConfig, argparse.Namespace]:
    environ = os.environ if environ is None else environ
    ns = build_arg_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    layers = _Layers()
    config_path = getattr(ns, "config", None) or environ.get(_ENV_CONFIG) or None
    if config_path:
        _apply_file(layers, Path(config_path))
    _apply_environ(layers, environ)
    _apply_flags(layers, ns)
    return _build(layers, environ), ns


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """The effective configuration from defaults, file, environment and flags.

    ``argv`` excludes the program name (``None`` = ``sys.argv[1:]``);
    ``environ`` defaults to ``os.environ``. Raises ``ConfigError``; bad flags
    exit 2 through argparse. ``--print-config`` is accepted and ignored here
    (``load_config_or_exit`` acts on it).
    """
    return _load(argv, environ)[0]


def exit_on_config_error(err: ConfigError, stderr: TextIO | None = None) -> NoReturn:
    """Print ``kvtierd: config error: <key>: <message>`` and exit with status 2."""
    print(f"kvtierd: config error: {err.key}: {err.message}", file=stderr or sys.stderr, flush=True)
    raise SystemExit(CONFIG_EXIT_CODE)


def load_config_or_exit(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> DaemonConfig:
    """``main()``'s entry: load, or exit 2 on a config error, or print and exit 0 for --print-config."""
    try:
        cfg, ns = _load(argv, environ)
    except ConfigError as err:
        exit_on_config_error(err, stderr)
    if getattr(ns, "print_config", False):
        print(format_config(cfg), end="", file=stdout or sys.stdout, flush=True)
        raise SystemExit(0)
    return cfg


# --------------------------------------------------------------------------------------------
# Printing


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


def resolve_cpu_budget_bytes(cfg: DaemonConfig, available_bytes: int | None = None) -> int:
    """All pools' CPU tiers together, in bytes (``cpu_budget_bytes``; auto and N% of available memory now)."""
    value = cfg.cpu_budget_bytes
    if isinstance(value, int):
        return value
    if available_bytes is None:
        available_bytes = int(psutil.virtual_memory().available)
    if isinstance(value, MemoryFraction):
        return value.of(available_bytes)
    return int(available_bytes * CPU_BUDGET_AUTO_FRACTION)


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
