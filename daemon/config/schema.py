"""The configuration tree: frozen dataclasses that check themselves, each key declared once.

Contract
========

- ``DaemonConfig`` (top-level keys and the ``default_pool``, ``pools`` and
  ``tenants`` tables), ``PoolDefaults``, ``PoolOverrides``, ``PoolSettings``
  (one pool's effective settings) and ``TenantConfig``. Constructing one
  validates it (a ``DaemonConfig`` built by hand is checked as a loaded one
  is) and raises ``ConfigError`` naming the key relative to its table.
- A key is a dataclass field whose metadata is ``key(...)``: a ``Key`` with
  the reader of its raw value (``units._as_*``), its check, its ``--help``
  text, metavar and group, and how "unset" is spelled. ``DaemonConfig``'s
  fields declare the top-level keys, ``PoolDefaults``' the keys of a pool
  table; ``TOP_KEYS`` and ``POOL_KEYS`` collect them in field order, and
  ``sources``, ``cli`` and ``render`` derive environment names, flags and
  ``--print-config`` lines from them. ``PoolOverrides`` and ``PoolSettings``
  repeat the pool keys' names and types only (importing this module fails
  when they drift apart).
- ``pool_key``/``tenant_key`` spell a table's dotted key for messages;
  ``env_pool_name`` spells a pool name inside ``KVTIER_POOLS__<POOL>__<KEY>``;
  ``env_name``/``flag_name`` spell a key's environment variable and flag.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import psutil

from kvtier.client.admin import default_socket  # one rule for the daemon and the tools
from kvtier.client.endpoint import EndpointError, check_endpoint, ipc_socket_file  # the one endpoint parser
from kvtier.client.protocol import HASH_ALGOS, MAX_POOL_NAME, ProtocolError, check_text  # what a hello may send: pool names
from kvtier.client.protocol import MAX_LEASE_S as HELLO_MAX_LEASE_S  # ... and leases
from kvtier.daemon.access.descriptors import MAX_AUTO_CONNECTIONS_PER_PEER, FdBudget, auto_per_peer, descriptor_limit
from kvtier.daemon.config.errors import ConfigError
from kvtier.daemon.config.units import (
    Coerce,
    CpuBytes,
    MemoryFraction,
    _as_bool,
    _as_device,
    _as_float,
    _as_fraction,
    _as_int,
    _as_log_level,
    _as_lower_str,
    _as_mode,
    _as_optional_cpu_size,
    _as_optional_dir,
    _as_optional_float,
    _as_optional_path,
    _as_path,
    _as_optional_int,
    _as_optional_size,
    _as_optional_url,
    _as_share,
    _as_size,
    _as_str,
    _is_int,
)
from kvtier.daemon.tenancy.tenant_ids import tenant_tag
from kvtier.tiers.pool_defaults import DEFAULT_CLEAN_AHEAD_BLOCKS, DEFAULT_POLICY  # stdlib only: config stays fast
from kvtier.tiers.remote.settings import RemoteTierError, RemoteTierSettings  # stdlib only
from kvtier.tiers.units import GiB, KiB, MiB, format_byte_size, format_gib

CPU_AUTO_FRACTION = 0.25
CPU_AUTO_CAP_BYTES = 64 * GiB
# The daemon's CPU budget ("auto"): half of what is available at start leaves
# the other half to the engines (their processes, vLLM's own CPU KV cache).
CPU_BUDGET_AUTO_FRACTION = 0.5
GPU_AUTO_BYTES_CUDA = 1 * GiB
GPU_AUTO_BYTES_HOST = 256 * MiB

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MIN_MESSAGE_BYTES = 4 * KiB

# The ranges the code can use (issue 32: values that passed validation and then failed).
# A lease is a client's to hold: no longer than a hello may ask for (the protocol's
# bound), and long enough for a round trip and a heartbeat or two.
MIN_LEASE_S = 0.1
MAX_LEASE_S = HELLO_MAX_LEASE_S  # 3600
MIN_HEARTBEAT_S = 0.01
# The loop polls in whole milliseconds (below 1 ms: a busy loop), sweeps expired leases
# and feeds systemd's watchdog when it wakes: at least once a second.
MIN_POLL_INTERVAL_S = 0.001
MAX_POLL_INTERVAL_S = 1.0
# Past threading.TIMEOUT_MAX a join raises; systemd kills a stop far sooner anyway.
MAX_DRAIN_TIMEOUT_S = 3600.0
# A process holds at most fs.nr_open descriptors (2**20 by default): no session maps more
# files, or holds more registrations (each one maps its tensors: a file or a CUDA IPC handle).
MAX_PER_SESSION = 1 << 20
# Each pool runs 2 threads; Linux runs at most pid_max (<= 2**22) of them.
MAX_POOLS = 1 << 21
# A GPU tier has at most this many blocks (daemon.pooling.pools.MAX_BLOCKS_PER_TIER, which a test
# compares): clean-ahead past it demotes nothing more.
MAX_CLEAN_AHEAD_BLOCKS = 1 << 23
# A disk tier holds at least one block of a few MiB, and its slot index records 2**23 blocks
# at most (daemon.pooling.pools.MAX_BLOCKS_PER_TIER): 1 PiB is that many blocks of 128 MiB.
MIN_DISK_BYTES = 1 * MiB
MAX_DISK_BYTES = 1 << 50
DEFAULT_DISK_BYTES = 64 * GiB
# The remote tier's settings (the remote_* keys) default to RemoteTierSettings' own defaults.
_REMOTE = RemoteTierSettings()
# Threads and sockets are per pool (each pool has its own remote tier): bounds a daemon can hold.
MAX_REMOTE_THREADS = 64
MAX_REMOTE_CONNECTIONS = 4096
# A read or a connect that may wait this long on a hung server stalls what waits for it.
MAX_REMOTE_TIMEOUT_S = 60.0
MAX_REMOTE_BACKOFF_S = 3600.0
# SET ... EX takes whole seconds; ten years is past any cache's use for a block.
MAX_REMOTE_TTL_S = 10 * 365 * 24 * 3600
# The name a hello sends for a pool: a pool table no hello can name would never apply.
ENV_PREFIX = "KVTIER_"


# --------------------------------------------------------------------------------------------
# Declaring a key


Check = Callable[[str, Any], None]
# What an "auto" value comes to on this host now, for --print-config's comment.
AutoNote = Callable[["DaemonConfig", int], str]

# --help sections, in the order of their first key.
SERVER = "server"
RUNTIME = "runtime"
TCP_SECURITY = "tcp security"
REMOTE_TIER = "remote tier"
POOLS = "pools"

_SIZE_READERS: frozenset[Coerce] = frozenset({_as_size, _as_optional_size, _as_optional_cpu_size})
_KEY_METADATA = "kvtier.config.key"


@dataclass(frozen=True)
class Key:
    """Everything about one key besides its field's name, type and default.

    ``coerce`` reads a raw value (``text``: a string from the environment or a
    flag; else a TOML value); ``check`` (None: any value of the right type)
    validates the field's value and names the key it is given; ``help`` is
    argparse text (``%`` written ``%%``); ``rank`` orders the flags of one
    ``group`` in ``--help`` (ties: field order); ``unset`` is how ``--help``
    and ``--print-config`` spell None ("none": ``--print-config`` leaves
    the key out); ``shown_default`` replaces ``--help``'s default when the
    field's default says nothing (computed at run time); ``auto_note`` is
    ``--print-config``'s comment on an unset value.
    """

    coerce: Coerce
    help: str
    metavar: str
    group: str
    check: Check | None = None
    rank: int = 0
    unset: str = "none"
    shown_default: str | None = None
    auto_note: AutoNote | None = None

    @property
    def is_size(self) -> bool:
        return self.coerce in _SIZE_READERS

    @property
    def is_mode(self) -> bool:
        return self.coerce is _as_mode

    @property
    def is_switch(self) -> bool:
        return self.coerce is _as_bool


def key(
    coerce: Coerce,
    help: str,  # noqa: A002 - argparse's word for it
    metavar: str,
    *,
    group: str,
    check: Check | None = None,
    rank: int = 0,
    unset: str = "none",
    shown_default: str | None = None,
    auto_note: AutoNote | None = None,
) -> Mapping[str, Key]:
    """A field's ``metadata`` declaring it a key: ``field(default=..., metadata=key(...))``."""
    spec = Key(coerce=coerce, help=help, metavar=metavar, group=group, check=check, rank=rank, unset=unset,
               shown_default=shown_default, auto_note=auto_note)
    return MappingProxyType({_KEY_METADATA: spec})


def keys_of(cls: type) -> dict[str, Key]:
    """The keys a dataclass declares, by field name, in field order."""
    return {f.name: f.metadata[_KEY_METADATA] for f in dataclasses.fields(cls) if _KEY_METADATA in f.metadata}


def _check_keys(obj: object, keys: Mapping[str, Key], *, skip_none: bool = False) -> None:
    for name, spec in keys.items():
        value = getattr(obj, name)
        if spec.check is not None and not (skip_none and value is None):
            spec.check(name, value)


def env_name(name: str) -> str:
    """A top-level or ``[default_pool]`` key's environment variable: ``lease_s`` -> ``KVTIER_LEASE_S``."""
    return f"{ENV_PREFIX}{name.upper()}"


def flag_name(name: str) -> str:
    """A key's flag: ``lease_s`` -> ``--lease-s``."""
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------------------------
# Checks (used by the dataclasses, so a DaemonConfig built by hand is checked too)


def _optional(check: Check) -> Check:
    """``check`` for a key whose None means unset ("auto", "off")."""

    def check_unless_none(key: str, value: object) -> None:
        if value is not None:
            check(key, value)

    return check_unless_none


def _check_int(key: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if not _is_int(value):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    assert isinstance(value, int)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ConfigError(key, f"must be {bound}, got {value}")


def _check_duration(key: str, value: object, *, allow_zero: bool = False, minimum: float | None = None,
                    maximum: float | None = None, why: str = "") -> None:
    """A finite number of seconds, > 0 (>= 0 with ``allow_zero``), and within [minimum, maximum] when given."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)) or not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'} seconds, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        lo = f"{minimum:g}" if minimum is not None else "0"
        hi = f"{maximum:g}" if maximum is not None else "inf"
        raise ConfigError(key, f"must be in {lo}..{hi} seconds, got {value!r}" + (f" ({why})" if why else ""))


def _check_bytes_of_memory(key: str, value: object, *, minimum: int, what: str) -> None:
    """A byte count >= ``minimum`` that this host's memory could hold at all."""
    _check_int(key, value, minimum=minimum)
    assert isinstance(value, int)
    total = int(psutil.virtual_memory().total)
    if value > total:
        raise ConfigError(key, f"is {format_byte_size(value)} ({value} bytes), more than this host's memory "
                               f"({format_gib(total, decimals=1)}): {what}")


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
        from kvtier.tiers.policies import check_policy_name
    except ImportError:
        # Without the tiers package nothing can build a pool anyway; the pool
        # constructor would report the name then.
        return
    try:
        check_policy_name(value)  # the registry's rules, without building a policy
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def _check_hash_algo(key: str, value: object) -> None:
    if value not in HASH_ALGOS:
        raise ConfigError(key, f"must be one of {', '.join(HASH_ALGOS)}, got {value!r}")


def _check_socket_mode(key: str, value: object) -> None:
    # Read and write for the owner (connecting needs write permission), at
    # most the same for the group, never anything for others.
    if not _is_int(value) or value & ~0o660 or value & 0o600 != 0o600:  # type: ignore[operator]
        shown = f"{value:04o}" if _is_int(value) else repr(value)
        raise ConfigError(key, f"must be 0600, 0620, 0640 or 0660 (owner rw, optionally the group), got {shown}")


def _check_share(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ConfigError(key, f"must be a share in (0, 1], got {value!r}")


def _check_log_level(key: str, value: object) -> None:
    if value not in LOG_LEVELS:
        raise ConfigError(key, f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")


# RFC 1123 labels, with "_" too (found in /etc/hosts names); no spaces, ports or schemes.
_HOST_NAME_RE = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*")


def _check_host(key: str, value: object) -> None:
    if isinstance(value, str):
        try:
            ipaddress.ip_address(value)
            return
        except ValueError:
            if _HOST_NAME_RE.fullmatch(value):
                return
    raise ConfigError(key, f"must be an IP address (127.0.0.1, ::1, 0.0.0.0) or a host name, got {value!r}")


def _check_bool(key: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")


def _check_arena_dir(key: str, value: object) -> None:
    # Existence is checked when the daemon starts (and only if persist_cpu_tier is on).
    if not isinstance(value, Path) or not value.is_absolute():
        raise ConfigError(key, f"must be an absolute directory path, got {str(value)!r}")


def _check_device(key: str, value: object) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda:(0|[1-9][0-9]*)", value):
        raise ConfigError(key, f"must be 'auto', 'cpu' or 'cuda:N', got {value!r}")


def _check_disk_dir(key: str, value: object) -> None:
    # Whether kvtierd can make and write it is checked with disk_bytes (_check_disk_tiers).
    if not isinstance(value, Path) or not value.is_absolute():
        raise ConfigError(key, f"must be an absolute directory path, got {str(value)!r}")


def _check_disk_bytes(key: str, value: object) -> None:
    if not _is_int(value) or not MIN_DISK_BYTES <= value <= MAX_DISK_BYTES:  # type: ignore[operator]
        shown = format_byte_size(value) if _is_int(value) else repr(value)  # type: ignore[arg-type]
        raise ConfigError(key, f"must be a size in {format_byte_size(MIN_DISK_BYTES)}..{format_byte_size(MAX_DISK_BYTES)}, "
                               f"got {shown}")


def _check_remote_url(key: str, value: object) -> None:
    if value is None:
        return
    # The remote tier's own parser (stdlib only), the one it connects with: a URL it
    # refuses would otherwise be retried forever in the background.
    from kvtier.tiers.remote.settings import RemoteTierError
    from kvtier.tiers.remote.url import parse_url

    try:
        parse_url(value)  # type: ignore[arg-type]
    except RemoteTierError as exc:
        raise ConfigError(key, str(exc)) from None


TENANT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MIN_TOKEN_CHARS = 16
_Z85_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def _check_z85_key(key: str, value: object) -> None:
    if not (isinstance(value, str) and len(value) == 40 and set(value) <= _Z85_CHARS):
        raise ConfigError(key, f"must be a CURVE public key: 40 Z85 characters (kvtier keygen writes them), got {value!r:.60}")


def _check_tenants(tenants: Mapping[str, TenantConfig]) -> dict[str, TenantConfig]:
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


def _check_socket(cfg: DaemonConfig) -> None:
    url = cfg.socket
    if not isinstance(url, str):
        raise ConfigError("socket", f"must be an ipc:// or tcp:// URL, got {url!r}")
    try:
        check_endpoint(url)
    except EndpointError as exc:
        raise ConfigError("socket", str(exc)) from None
    if url.startswith("tcp://"):
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


def _check_metrics_port(cfg: DaemonConfig) -> None:
    match = re.fullmatch(r"tcp://.*:([0-9]+)", cfg.socket)
    if cfg.metrics_port is not None and match and int(match.group(1)) == cfg.metrics_port:
        raise ConfigError("metrics_port", f"{cfg.metrics_port} is the socket's port too ({cfg.socket}); "
                                          "the second bind would fail: choose another")


def _check_per_peer(cfg: DaemonConfig) -> None:
    per_peer = cfg.max_connections_per_peer
    if per_peer is None:
        return  # auto: a quarter of max_connections
    total = cfg.max_connections if cfg.max_connections is not None else FdBudget.of(descriptor_limit()).connections
    if per_peer > total:
        source = "" if cfg.max_connections is not None else " ('auto' here: a quarter of the file descriptors)"
        raise ConfigError("max_connections_per_peer", f"is {per_peer}, more than max_connections ({total}{source}): "
                                                      "one peer can never hold more than all of them")


def _check_cpu_budget(cfg: DaemonConfig) -> None:
    # Only what is spelled in bytes on both sides can be compared before start; the
    # daemon checks shares of memory against the host when it starts (daemon.pooling.memory).
    budget = cfg.cpu_budget_bytes
    if not isinstance(budget, int):
        return
    if budget == 0:
        raise ConfigError("cpu_budget_bytes", "is 0: no pool's CPU tier would fit, so every hello would get "
                                              "NO_SPACE; give bytes, N%, or 'auto'")
    tables = [("default_pool.cpu_bytes", cfg.default_pool.cpu_bytes)]
    tables += [(f"{pool_key(n)}.cpu_bytes", o.cpu_bytes) for n, o in cfg.pools.items()]
    for dotted, cpu_bytes in tables:
        if isinstance(cpu_bytes, int) and cpu_bytes > budget:
            raise ConfigError("cpu_budget_bytes", f"is {format_byte_size(budget)}, less than {dotted} "
                                                  f"({format_byte_size(cpu_bytes)}): that pool could never be created")


def _check_disk_tiers(cfg: DaemonConfig) -> None:
    # Like the remote secret's file: what can be known before start is checked here, so a
    # disk tier that could never work stops kvtierd (exit 2) instead of logging misses forever.
    d = cfg.default_pool
    tables = [("default_pool.disk_dir", "default_pool.disk_bytes", d.disk_dir, d.disk_bytes)]
    for name, o in cfg.pools.items():
        s = cfg.pool_settings(name)
        dir_key = f"{pool_key(name)}.disk_dir" if o.disk_dir is not None else "default_pool.disk_dir"
        bytes_key = f"{pool_key(name)}.disk_bytes" if o.disk_bytes is not None else "default_pool.disk_bytes"
        tables.append((dir_key, bytes_key, s.disk_dir, s.disk_bytes))
    for dir_key, bytes_key, disk_dir, disk_bytes in tables:
        if disk_dir is None:
            continue
        existing = disk_dir
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(dir_key, f"{existing} is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(dir_key, f"kvtierd cannot {'write' if existing == disk_dir else 'create'} {disk_dir} "
                                       f"({existing} is not writable by uid {os.geteuid()})")
        fs = os.statvfs(existing)
        total = fs.f_blocks * fs.f_frsize
        if disk_bytes > total:
            raise ConfigError(bytes_key, f"is {format_byte_size(disk_bytes)}, more than the whole filesystem of "
                                         f"{disk_dir} ({format_gib(total, decimals=1)}): no pool could keep that much")


def _check_remote_settings(cfg: DaemonConfig) -> None:
    if cfg.remote_retry_max_s < cfg.remote_retry_initial_s:
        raise ConfigError("remote_retry_max_s", f"is {cfg.remote_retry_max_s:g} s, less than remote_retry_initial_s "
                                                f"({cfg.remote_retry_initial_s:g} s): the backoff starts there")
    try:
        cfg.remote_settings  # noqa: B018 - the remote tier's own checks, on what every pool will get
    except RemoteTierError as exc:
        raise ConfigError("remote_settings", str(exc)) from None


def _check_fraction(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(key, f"must be a share in [0, 1), got {value!r}")


def _check_remote_secret(cfg: DaemonConfig) -> None:
    # Presence here, like the CURVE keys; the daemon reads the file (and refuses
    # a bad one, exit 2) when it starts.
    remote = cfg.remote_url_keys
    secret = cfg.remote_secret_key_file
    if not remote:
        return
    if secret is None:
        raise ConfigError(
            "remote_secret_key_file",
            f"is required with a remote tier ({remote[0]} is set): every value in the server is authenticated "
            "with this secret, so nobody else who can write there can make this daemon serve a block. Create "
            "one with `kvtier keygen /etc/kvtier --remote-secret` and give every daemon that shares the "
            "server the same file",
        )
    if not Path(secret).is_file():
        raise ConfigError("remote_secret_key_file", f"{secret} does not exist or is not a file")


# --------------------------------------------------------------------------------------------
# What "auto" comes to (--print-config's comments)


def _heartbeat_note(cfg: DaemonConfig, available_bytes: int) -> str:
    return f"lease_s / 3 = {cfg.recommended_heartbeat_s:g} s"


def _cpu_budget_note(cfg: DaemonConfig, available_bytes: int) -> str:
    budget_bytes = resolve_cpu_budget_bytes(cfg, available_bytes)
    return f"{CPU_BUDGET_AUTO_FRACTION:.0%} of available memory at start (now {format_gib(budget_bytes, decimals=1)})"


def _max_connections_note(cfg: DaemonConfig, available_bytes: int) -> str:
    budget = FdBudget.of(descriptor_limit())
    return f"a quarter of the file descriptors (now {budget.connections} of {budget.limit_fds})"


def _check_max_connections(key: str, value: object) -> None:
    _check_int(key, value, minimum=1)
    assert isinstance(value, int)
    try:
        # What the daemon's descriptor limit allows: libzmq aborts the daemon when an accept finds none.
        FdBudget.of(descriptor_limit(), value)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def _per_peer_note(cfg: DaemonConfig, available_bytes: int) -> str:
    budget = FdBudget.of(descriptor_limit())
    total = cfg.max_connections if cfg.max_connections is not None else budget.connections
    return f"a quarter of max_connections, at most {MAX_AUTO_CONNECTIONS_PER_PEER} (now {auto_per_peer(total)})"


def _gpu_bytes_note(cfg: DaemonConfig, available_bytes: int) -> str:
    return f"{format_byte_size(GPU_AUTO_BYTES_CUDA)} on CUDA, {format_byte_size(GPU_AUTO_BYTES_HOST)} without"


def _cpu_bytes_note(cfg: DaemonConfig, available_bytes: int) -> str:
    auto_cpu_bytes = min(int(available_bytes * CPU_AUTO_FRACTION), CPU_AUTO_CAP_BYTES)
    return (
        f"{CPU_AUTO_FRACTION:.0%} of available memory, at most {format_byte_size(CPU_AUTO_CAP_BYTES)} "
        f"(now {format_gib(auto_cpu_bytes, decimals=1)})"
    )


# --------------------------------------------------------------------------------------------
# The tree


@dataclass(frozen=True)
class PoolDefaults:
    """Settings of every pool that has no override (``[default_pool]``); its fields declare the pool keys."""

    gpu_bytes: int | None = field(default=None, metadata=key(
        _as_optional_size, "GPU tier size of a store-mode pool ('auto' = 1GiB on CUDA, 256MiB without)", "SIZE",
        group=POOLS, check=_check_gpu_bytes, unset="auto", auto_note=_gpu_bytes_note))
    cpu_bytes: CpuBytes | None = field(default=None, metadata=key(
        _as_optional_cpu_size, "CPU tier size: bytes, or N%% of available memory ('auto' = 25%%, at most 64GiB)", "SIZE",
        group=POOLS, check=_check_cpu_bytes, unset="auto", auto_note=_cpu_bytes_note))
    policy: str = field(default=DEFAULT_POLICY, metadata=key(
        _as_lower_str, "CPU-tier eviction policy (e.g. lru)", "NAME", group=POOLS, check=_check_policy))
    clean_ahead_blocks: int = field(default=DEFAULT_CLEAN_AHEAD_BLOCKS, metadata=key(
        _as_int, "free GPU blocks kept already demoted ahead of allocation", "N",
        group=POOLS, check=partial(_check_int, minimum=0, maximum=MAX_CLEAN_AHEAD_BLOCKS)))
    remote_url: str | None = field(default=None, metadata=key(
        _as_optional_url,
        "remote tier below the CPU tier: redis://HOST:PORT/DB or redis+cluster://HOST:PORT[,...] ('off' = none)", "URL",
        group=POOLS, check=_check_remote_url))
    disk_dir: Path | None = field(default=None, metadata=key(
        _as_optional_dir, "directory of the disk tier below the CPU tier (e.g. on local NVMe): each pool keeps "
        "up to disk_bytes of blocks in a subdirectory, kept across restarts and reboots ('none' = no disk tier)",
        "DIR", group=POOLS, check=_optional(_check_disk_dir)))
    disk_bytes: int = field(default=DEFAULT_DISK_BYTES, metadata=key(
        _as_size, "disk-tier size of each pool with a disk_dir, preallocated when the pool is created "
        "(e.g. 500GiB)", "SIZE", group=POOLS, check=_check_disk_bytes))

    def __post_init__(self) -> None:
        _check_keys(self, POOL_KEYS)


@dataclass(frozen=True)
class PoolOverrides:
    """Per-pool settings (``[pools."<name>"]``), ``PoolDefaults``' keys; ``None`` keeps the ``default_pool`` value."""

    gpu_bytes: int | None = None
    cpu_bytes: CpuBytes | None = None
    policy: str | None = None
    clean_ahead_blocks: int | None = None
    remote_url: str | None = None
    disk_dir: Path | None = None
    disk_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_keys(self, POOL_KEYS, skip_none=True)


@dataclass(frozen=True)
class PoolSettings:
    """The settings of one pool, in the one shape both sides use.

    The configuration produces it (``DaemonConfig.pool_settings(name)``:
    ``default_pool`` with the pool's overrides applied, and the remote
    tier's settings), and the daemon builds the pool from it
    (``daemon.pooling.pools.PoolRegistry``), once ``sized``: its ``gpu_bytes`` and
    ``cpu_bytes`` in bytes, "auto" and N% resolved on this host. Its
    defaults are the configuration's, which are ``TieredPool``'s
    (``kvtier.tiers.pool_defaults``). Checked when built, as the tables are.
    """

    name: str
    gpu_bytes: int | None = None
    cpu_bytes: CpuBytes | None = None
    policy: str = DEFAULT_POLICY
    clean_ahead_blocks: int = DEFAULT_CLEAN_AHEAD_BLOCKS
    remote_url: str | None = None
    disk_dir: Path | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES
    remote: RemoteTierSettings = field(default_factory=RemoteTierSettings)  # the top-level remote_* keys

    def __post_init__(self) -> None:
        _check_keys(self, POOL_KEYS)
        if not isinstance(self.remote, RemoteTierSettings):
            raise ConfigError("remote", "must be a RemoteTierSettings")

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

    def sized(self, *, on_cuda: bool, available_bytes: int | None = None) -> PoolSettings:
        """These settings with both tiers' sizes in bytes, as a new pool gets them on this host now."""
        return dataclasses.replace(self, gpu_bytes=self.resolve_gpu_bytes(on_cuda=on_cuda),
                                   cpu_bytes=self.resolve_cpu_bytes(available_bytes))


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
    """Everything kvtierd is configured with. Constructing one validates it.

    The fields with ``key(...)`` metadata are the top-level keys, in
    ``--print-config`` order; ``default_pool``, ``pools`` and ``tenants`` are
    the tables.
    """

    socket: str = field(default_factory=lambda: default_socket(os.environ), metadata=key(
        _as_str, "ZMQ endpoint to bind: ipc:///path or ipc://@abstract; tcp://HOST:PORT only with CURVE keys or --insecure-tcp",
        "URL", group=SERVER, rank=1, shown_default="see below"))  # checked with the CURVE keys in _check_socket
    lease_s: float = field(default=10.0, metadata=key(
        _as_float, f"seconds a session's pins and registrations survive without a heartbeat "
        f"({MIN_LEASE_S:g}..{MAX_LEASE_S:g})", "SECONDS",
        group=SERVER, rank=3, check=partial(_check_duration, minimum=MIN_LEASE_S, maximum=MAX_LEASE_S,
                                            why="a lease a client can hold: time for a round trip, at most what a "
                                                "hello may ask for")))
    heartbeat_s: float | None = field(default=None, metadata=key(
        _as_optional_float, "heartbeat interval recommended to clients in hello ('auto' = lease_s / 3)", "SECONDS",
        group=SERVER, rank=4, check=_optional(partial(_check_duration, minimum=MIN_HEARTBEAT_S,
                                                      why="every client sends one heartbeat per interval")),
        unset="auto", auto_note=_heartbeat_note))
    poll_interval_s: float = field(default=0.05, metadata=key(
        _as_float, f"longest the event loop sleeps before polling copies in flight "
        f"({MIN_POLL_INTERVAL_S:g}..{MAX_POLL_INTERVAL_S:g})", "SECONDS",
        group=SERVER, rank=5, check=partial(_check_duration, minimum=MIN_POLL_INTERVAL_S, maximum=MAX_POLL_INTERVAL_S,
                                            why="the loop polls in whole milliseconds, and must wake at least once "
                                                "a second to expire leases and feed the watchdog")))
    drain_timeout_s: float = field(default=10.0, metadata=key(
        _as_float, f"on SIGTERM/SIGINT, how long to finish copies and pending replies before exiting "
        f"(0..{MAX_DRAIN_TIMEOUT_S:g})", "SECONDS",
        group=SERVER, rank=6, check=partial(_check_duration, allow_zero=True, maximum=MAX_DRAIN_TIMEOUT_S,
                                            why="an hour; systemd's stop timeout is far shorter")))
    upgrade_timeout_s: float = field(default=300.0, metadata=key(
        _as_float, f"on SIGUSR2 (an upgrade), how long the successor may take to get ready, and to serve once the "
        f"CPU tiers are released, before it is stopped and this daemon keeps serving (1..{MAX_DRAIN_TIMEOUT_S:g})",
        "SECONDS", group=SERVER, rank=6, check=partial(_check_duration, minimum=1.0, maximum=MAX_DRAIN_TIMEOUT_S,
                                                         why="a start-up: importing torch and CUDA take seconds")))
    max_message_bytes: int = field(default=256 * MiB, metadata=key(
        _as_size,
        "largest payload (block bytes: a request's frames, an inline restore's reply) accepted; "
        "the header has its own 4 MiB limit (e.g. 256MiB)", "SIZE",
        group=SERVER, rank=7, check=partial(_check_bytes_of_memory, minimum=MIN_MESSAGE_BYTES,
                                            what="a message is staged in memory whole")))
    # The daemon-wide total of mapped files is capped below RLIMIT_NOFILE as well (daemon.handling.session_memory).
    max_shm_files_per_session: int = field(default=1024, metadata=key(
        _as_int, "shared-memory files (arena, KV tensors) one session may map: one descriptor each", "N",
        group=SERVER, rank=8, check=partial(_check_int, minimum=1, maximum=MAX_PER_SESSION)))
    max_registrations_per_session: int = field(default=64, metadata=key(
        _as_int, "KV registrations (register_kv) one session may hold", "N",
        group=SERVER, rank=9, check=partial(_check_int, minimum=1, maximum=MAX_PER_SESSION)))
    lend_lease_s: float = field(default=2.0, metadata=key(
        _as_float, "how long a restore may lend CPU-tier slots to a client of this daemon's user, which copies "
        "them itself from the tier's file (faster than kvtierd copying into it); 0 turns lending off",
        "SECONDS", group=SERVER, rank=9, check=partial(_check_duration, allow_zero=True, maximum=60.0)))
    # Each pool holds a CPU tier, a GPU tier in store mode, and 2 threads.
    max_pools: int = field(default=128, metadata=key(
        _as_int, "pools the daemon holds at once; a hello that would create one more gets TOO_MANY_POOLS", "N",
        group=SERVER, rank=10, check=partial(_check_int, minimum=1, maximum=MAX_POOLS)))
    max_auth_failures_per_minute: int = field(default=10, metadata=key(
        _as_int, "wrong tenant tokens one peer (a uid on ipc://, an IP address on tcp://) may send in hello per "
        "minute; past it its hellos with a token get TOO_MANY_AUTH_FAILURES, the token unchecked", "N",
        group=SERVER, rank=10, check=partial(_check_int, minimum=1, maximum=100_000)))
    # Each live session costs ~3.7 KB and a place in every lease sweep.
    max_sessions: int = field(default=4096, metadata=key(
        _as_int, "live sessions the daemon holds at once; a hello past it gets TOO_MANY_SESSIONS", "N",
        group=SERVER, rank=10, check=partial(_check_int, minimum=1, maximum=1 << 20)))
    max_pinned_share: float = field(default=0.5, metadata=key(
        _as_share,
        "pinned blocks one session (and one tenant's sessions together) may hold, as a share of the pool's blocks",
        "SHARE", group=SERVER, rank=11, check=_check_share))
    max_unread_reply_bytes: int = field(default=512 * MiB, metadata=key(
        _as_size,
        "bytes of block payload in replies one connection has not read yet; past it its requests get "
        "UNREAD_REPLIES (e.g. 512MiB)", "SIZE",
        group=SERVER, rank=14, check=partial(_check_bytes_of_memory, minimum=MIN_MESSAGE_BYTES,
                                             what="unread replies are held in memory")))
    max_unread_reply_bytes_total: int = field(default=1 * GiB, metadata=key(
        _as_size,
        "bytes of copied block payload (not lent tier memory) in replies all connections have not read yet; past "
        "it a connection with replies unread gets UNREAD_REPLIES (e.g. 1GiB)", "SIZE",
        group=SERVER, rank=14, check=partial(_check_bytes_of_memory, minimum=MIN_MESSAGE_BYTES,
                                             what="unread replies are held in memory")))
    # Both caps shed connections as libzmq accepts them (daemon.access.connection_limits).
    max_connections: int | None = field(default=None, metadata=key(
        _as_optional_int, "client connections held at once; past it new ones get TOO_MANY_CONNECTIONS and are "
        "closed ('auto' = a quarter of the file descriptors; at most half of them)", "N",
        group=SERVER, rank=15, check=_optional(_check_max_connections), unset="auto",
        auto_note=_max_connections_note))
    max_connections_per_peer: int | None = field(default=None, metadata=key(
        _as_optional_int, "client connections one peer (a uid on ipc://, an IP address on tcp://) may hold at "
        "once ('auto' = a quarter of max_connections, at most 1024)", "N",
        group=SERVER, rank=16, check=_optional(partial(_check_int, minimum=1)), unset="auto",
        auto_note=_per_peer_note))
    cpu_budget_bytes: CpuBytes | None = field(default=None, metadata=key(
        _as_optional_cpu_size,
        "all pools' CPU tiers together: bytes, or N%% of available memory ('auto' = 50%% at start); "
        "a new pool that does not fit reclaims idle pools, else NO_SPACE", "SIZE",
        group=SERVER, rank=12, check=_check_cpu_bytes, unset="auto", auto_note=_cpu_budget_note))
    pool_idle_ttl_s: float = field(default=3600.0, metadata=key(
        _as_float, "how long a pool without sessions keeps its blocks (sooner when a new pool needs its memory)",
        "SECONDS", group=SERVER, rank=13, check=_check_duration))
    log_level: str = field(default="info", metadata=key(
        _as_log_level, "one of debug, info, warning, error, critical", "LEVEL",
        group=RUNTIME, rank=3, check=_check_log_level))
    device: str = field(default="auto", metadata=key(
        _as_device, "'auto' (CUDA if available), 'cpu', or 'cuda:N'", "DEVICE",
        group=RUNTIME, rank=1, check=_check_device))
    metrics_port: int | None = field(default=None, metadata=key(
        _as_optional_int, "Prometheus endpoint port ('off' = no endpoint)", "PORT",
        group=RUNTIME, rank=4, check=_optional(partial(_check_int, minimum=1, maximum=65535)), unset="off"))
    metrics_host: str = field(default="127.0.0.1", metadata=key(
        _as_str, "address the Prometheus endpoint binds", "HOST", group=RUNTIME, rank=5, check=_check_host))
    insecure_tcp: bool = field(default=False, metadata=key(
        _as_bool, "allow a tcp:// socket without CURVE authentication", "BOOL",
        group=TCP_SECURITY, rank=1, check=_check_bool))
    # Presence and existence are checked with the socket (they matter for tcp:// only).
    curve_secret_key_file: Path | None = field(default=None, metadata=key(
        _as_optional_path, "the daemon's CURVE secret key file (tcp://)", "FILE", group=TCP_SECURITY, rank=2))
    curve_public_keys_dir: Path | None = field(default=None, metadata=key(
        _as_optional_path, "directory of authorised client CURVE public keys (tcp://)", "DIR",
        group=TCP_SECURITY, rank=3))
    # Presence and existence are checked with the remote URLs; the daemon reads it at start.
    remote_secret_key_file: Path | None = field(default=None, metadata=key(
        _as_optional_path, "the remote tier's secret (kvtier keygen DIR --remote-secret): every value in Redis is "
        "authenticated with it; required with remote_url, the same file on every daemon sharing the server",
        "FILE", group=REMOTE_TIER, rank=1))
    remote_write_queue_blocks: int = field(default=_REMOTE.write_queue_blocks, metadata=key(
        _as_int, "blocks each pool's remote tier may hold queued for write-back (each block_bytes + 32 bytes of "
        "memory); a full queue drops the block (counted), never waits", "N",
        group=REMOTE_TIER, rank=2, check=partial(_check_int, minimum=1, maximum=1 << 20)))
    remote_writer_threads: int = field(default=_REMOTE.writer_threads, metadata=key(
        _as_int, f"threads per pool sending queued blocks (1..{MAX_REMOTE_THREADS})", "N",
        group=REMOTE_TIER, rank=3, check=partial(_check_int, minimum=1, maximum=MAX_REMOTE_THREADS)))
    remote_write_batch_blocks: int = field(default=_REMOTE.write_batch_blocks, metadata=key(
        _as_int, "SETs per pipelined round trip of a writer (1..4096)", "N",
        group=REMOTE_TIER, rank=4, check=partial(_check_int, minimum=1, maximum=4096)))
    remote_ttl_s: int | None = field(default=_REMOTE.ttl_s, metadata=key(
        _as_optional_int, "expiry of each block written, in whole seconds (SET ... EX); 'off' = none, the "
        "server's maxmemory alone bounds what it keeps", "SECONDS",
        group=REMOTE_TIER, rank=5, check=_optional(partial(_check_int, minimum=1, maximum=MAX_REMOTE_TTL_S)),
        unset="off"))
    remote_reader_threads: int = field(default=_REMOTE.reader_threads, metadata=key(
        _as_int, f"threads per pool fetching blocks in the background (1..{MAX_REMOTE_THREADS})", "N",
        group=REMOTE_TIER, rank=6, check=partial(_check_int, minimum=1, maximum=MAX_REMOTE_THREADS)))
    remote_fetch_round_trip_bytes: int = field(default=_REMOTE.fetch_round_trip_bytes, metadata=key(
        _as_size, "most value bytes one fetch round trip asks for (held in memory at once; at least one block "
        "is asked for) (e.g. 64MiB)", "SIZE",
        group=REMOTE_TIER, rank=7, check=partial(_check_bytes_of_memory, minimum=1,
                                                 what="a round trip's values are held in memory")))
    remote_timeout_s: float = field(default=_REMOTE.timeout_s, metadata=key(
        _as_float, f"socket timeout of every command: the longest a hung server delays a lookup or read before "
        f"it is a miss and the tier is marked unavailable (0.001..{MAX_REMOTE_TIMEOUT_S:g})", "SECONDS",
        group=REMOTE_TIER, rank=8, check=partial(_check_duration, minimum=0.001, maximum=MAX_REMOTE_TIMEOUT_S,
                                                 why="a lookup waits for it")))
    remote_connect_timeout_s: float = field(default=_REMOTE.connect_timeout_s, metadata=key(
        _as_float, f"timeout of each connection attempt (0.001..{MAX_REMOTE_TIMEOUT_S:g})", "SECONDS",
        group=REMOTE_TIER, rank=9, check=partial(_check_duration, minimum=0.001, maximum=MAX_REMOTE_TIMEOUT_S,
                                                 why="a lookup may wait for it")))
    remote_max_connections: int = field(default=_REMOTE.max_connections, metadata=key(
        _as_int, f"connections per pool's remote tier (per node of a Cluster), one descriptor each "
        f"(1..{MAX_REMOTE_CONNECTIONS})", "N",
        group=REMOTE_TIER, rank=10, check=partial(_check_int, minimum=1, maximum=MAX_REMOTE_CONNECTIONS)))
    remote_retry_initial_s: float = field(default=_REMOTE.retry_initial_s, metadata=key(
        _as_float, "while the server is unreachable: the first wait before reconnecting, doubling up to "
        f"remote_retry_max_s (0.001..{MAX_REMOTE_BACKOFF_S:g})", "SECONDS",
        group=REMOTE_TIER, rank=11, check=partial(_check_duration, minimum=0.001, maximum=MAX_REMOTE_BACKOFF_S)))
    remote_retry_max_s: float = field(default=_REMOTE.retry_max_s, metadata=key(
        _as_float, f"the longest wait between reconnection attempts (remote_retry_initial_s..{MAX_REMOTE_BACKOFF_S:g})",
        "SECONDS", group=REMOTE_TIER, rank=12,
        check=partial(_check_duration, minimum=0.001, maximum=MAX_REMOTE_BACKOFF_S)))
    remote_retry_jitter_fraction: float = field(default=_REMOTE.retry_jitter_fraction, metadata=key(
        _as_fraction, "each reconnection wait varies by up to this share, + or - ([0, 1): 1 could make a wait 0, a "
        "busy loop against a dead server)", "SHARE",
        group=REMOTE_TIER, rank=13, check=_check_fraction))
    remote_health_interval_s: float = field(default=_REMOTE.health_interval_s, metadata=key(
        _as_float, f"ping period while the server is reachable and idle, so a dead server is noticed without "
        f"traffic (0.01..{MAX_REMOTE_BACKOFF_S:g})", "SECONDS",
        group=REMOTE_TIER, rank=14, check=partial(_check_duration, minimum=0.01, maximum=MAX_REMOTE_BACKOFF_S)))
    socket_mode: int = field(default=0o600, metadata=key(
        _as_mode, "file mode of the ipc socket: 0600, or 0660 to let the socket's group connect", "MODE",
        group=SERVER, rank=2, check=_check_socket_mode))
    persist_cpu_tier: bool = field(default=True, metadata=key(
        _as_bool, "keep CPU tiers in files under arena_dir, so a restarted kvtierd (crash, stop, upgrade) adopts "
        "their blocks; false: private memory, emptied by every restart", "BOOL",
        group=RUNTIME, rank=6, check=_check_bool))
    arena_dir: Path = field(default=Path("/dev/shm"), metadata=key(
        _as_path, "directory (tmpfs) of the persistent CPU tiers' files; 'kvtier arenas' lists and removes them",
        "DIR", group=RUNTIME, rank=7, check=_check_arena_dir))
    standby: bool = field(default=False, metadata=key(
        _as_bool, "keep a second, fully started kvtierd waiting beside the serving one: if the serving one dies "
        "(SIGKILL, a crash) it adopts the CPU tiers and serves at once, instead of after a whole start; it holds "
        "one more process's memory (~0.3-0.5 GiB, no CPU tier)", "BOOL",
        group=RUNTIME, rank=8, check=_check_bool))
    hash_algo: str = field(default="xxh3_128", metadata=key(
        _as_lower_str, "block hash algorithm pools must use: xxh3_128 or sha256 (default sha256 with 2+ tenants)",
        "ALGO", group=RUNTIME, rank=2, check=_check_hash_algo))
    default_pool: PoolDefaults = field(default_factory=PoolDefaults)
    pools: Mapping[str, PoolOverrides] = field(default_factory=dict, hash=False)
    tenants: Mapping[str, TenantConfig] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check_keys(self, TOP_KEYS)
        if self.heartbeat_s is not None and self.heartbeat_s >= self.lease_s:
            raise ConfigError(
                "heartbeat_s",
                f"must be shorter than lease_s ({self.lease_s:g} s), got {self.heartbeat_s:g} s; "
                "a client heartbeating slower than the lease loses its pins",
            )
        _check_socket(self)
        _check_metrics_port(self)
        _check_per_peer(self)
        if not isinstance(self.default_pool, PoolDefaults):
            raise ConfigError("default_pool", "must be a PoolDefaults")
        pools = dict(self.pools)
        env_keys: dict[str, str] = {}
        for name, overrides in pools.items():
            key = pool_key(name)
            if not isinstance(name, str) or not name:
                raise ConfigError(key, "pool names must be non-empty strings")
            try:
                check_text("pool", name, MAX_POOL_NAME)
            except ProtocolError as exc:
                raise ConfigError(key, f"no hello can name this pool ({exc.message}), so its settings would "
                                       "never apply") from None
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
        _check_remote_secret(self)
        _check_remote_settings(self)
        _check_cpu_budget(self)
        _check_disk_tiers(self)

    @property
    def remote_url_keys(self) -> list[str]:
        """The dotted keys that configure a remote tier (``default_pool.remote_url``, ``pools."x".remote_url``)."""
        found = ["default_pool.remote_url"] if self.default_pool.remote_url else []
        return found + [f"{pool_key(n)}.remote_url" for n, o in self.pools.items() if o.remote_url]

    @property
    def is_tcp(self) -> bool:
        return self.socket.startswith("tcp://")

    @property
    def ipc_path(self) -> Path | None:
        """The socket file for an ``ipc://`` endpoint; None for tcp and abstract sockets."""
        path = ipc_socket_file(self.socket)
        return Path(path) if path is not None else None

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
        settings: dict[str, Any] = {}
        for key_name in POOL_KEYS:
            value = getattr(overrides, key_name)
            settings[key_name] = value if value is not None else getattr(self.default_pool, key_name)
        return PoolSettings(name=name, remote=self.remote_settings, **settings)

    @property
    def remote_settings(self) -> RemoteTierSettings:
        """How every pool's remote tier runs: the ``remote_*`` keys (``REMOTE_KEYS``)."""
        return RemoteTierSettings(**{name: getattr(self, key_name) for key_name, name in REMOTE_KEYS.items()})


TOP_KEYS: dict[str, Key] = keys_of(DaemonConfig)
POOL_KEYS: dict[str, Key] = keys_of(PoolDefaults)
TABLES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DaemonConfig) if f.name not in TOP_KEYS)
# [tenants.<name>]: file only. Tokens and key-to-tenant maps are not for the
# environment or the command line, where other users' `ps` can read them. A
# file may give a tenant's token in clear ("token"); only its hash is kept.
TENANT_KEYS: tuple[str, ...] = ("token", *(f.name for f in dataclasses.fields(TenantConfig)))


# remote_<setting> key -> the RemoteTierSettings field it sets.
REMOTE_KEYS: dict[str, str] = {name: name[len("remote_"):] for name in TOP_KEYS
                               if name.startswith("remote_") and name != "remote_secret_key_file"}


def _check_pool_mirrors() -> None:
    # PoolOverrides and PoolSettings repeat PoolDefaults' keys for their types;
    # a key missing from one of them would be dropped without a word.
    for cls, own in ((PoolOverrides, ()), (PoolSettings, ("name", "remote"))):
        names = [f.name for f in dataclasses.fields(cls) if f.name not in own]
        if names != list(POOL_KEYS):
            raise TypeError(f"{cls.__name__}'s fields {names} must be PoolDefaults' keys {list(POOL_KEYS)}")
    # Every RemoteTierSettings field is a remote_* key, and each key's default is the field's.
    fields = [f.name for f in dataclasses.fields(RemoteTierSettings)]
    if sorted(REMOTE_KEYS.values()) != sorted(fields):
        raise TypeError(f"the remote_* keys {sorted(REMOTE_KEYS)} must be RemoteTierSettings' fields {fields}")
    defaults = RemoteTierSettings()
    for key_name, name in REMOTE_KEYS.items():
        default = next(f.default for f in dataclasses.fields(DaemonConfig) if f.name == key_name)
        if default != getattr(defaults, name):
            raise TypeError(f"{key_name} defaults to {default!r}, RemoteTierSettings.{name} to "
                            f"{getattr(defaults, name)!r}")


_check_pool_mirrors()


# --------------------------------------------------------------------------------------------
# Names and resolved values


def env_pool_name(name: str) -> str:
    """How pool ``name`` is spelled inside ``KVTIER_POOLS__<NAME>__<KEY>``."""
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def pool_key(name: object) -> str:
    """The dotted key of a pool's table, TOML-quoted when needed: ``pools."llama-8b/tp0"``."""
    if isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_-]+", name):
        return f"pools.{name}"
    return f"pools.{json.dumps(name) if isinstance(name, str) else repr(name)}"


def tenant_key(name: object) -> str:
    return pool_key(name).replace("pools.", "tenants.", 1)


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
