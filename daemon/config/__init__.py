"""kvtierd configuration: one frozen tree, four sources, every mistake named by its key.

Contract
========

``load_config(argv, environ)`` returns a validated, frozen ``DaemonConfig``
or raises ``ConfigError(key, message)``. Nothing else in kvtier reads the
environment or config files: the daemon's ``main()`` calls this once and hands
the result down.

Sources, lowest precedence first (a later source overrides single keys of an
earlier one, it does not replace whole tables):

1. embedded defaults (the dataclass defaults in ``schema``): enough to run with no
   file, no environment and no flags;
2. a TOML file: ``--config PATH``, else ``$KVTIER_CONFIG``; none by default.
   See ``systemd/kvtierd.toml`` for every key;
3. ``KVTIER_*`` environment variables: ``KVTIER_<KEY>`` for top-level keys
   (``KVTIER_SOCKET``, ``KVTIER_LEASE_S``, ...) and for the keys of the
   ``[default_pool]`` table (``KVTIER_GPU_BYTES``, ``KVTIER_CPU_BYTES``,
   ...), and ``KVTIER_POOLS__<POOL>__<KEY>`` for one
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

Adding a top-level key: one field of ``DaemonConfig``,
``name: type = field(default=..., metadata=key(reader, help, metavar,
group=..., rank=..., check=...))`` (``schema.key``): the reader of its raw
value (``units._as_*``), its check, its ``--help`` text, section and place
there, and how an unset value is spelled. Its environment variable, its flag,
its ``--help`` default, its ``--print-config`` line and its did-you-mean
follow from that field. A key of the pool tables is a field of
``PoolDefaults`` declared the same way, with its name and type repeated in
``PoolOverrides`` and ``PoolSettings`` (the module does not import when they
differ). A setting of the remote tier (``kvtier.tiers.remote.settings.
RemoteTierSettings``, which holds its default) is a top-level key named
``remote_<field>`` whose default is the field's (checked the same way).
Put the key in ``systemd/kvtierd.toml`` too (a test loads that file and
compares it with the defaults), and in ``docs/operating.md``.

Pools: ``DaemonConfig.pool_settings(name)`` is a ``PoolSettings``, the one
shape of a pool's settings: the daemon sizes it (``PoolSettings.sized``) and
builds the pool from it (``kvtier.daemon.pooling.pools``). Its defaults, and
``TieredPool``'s, are ``kvtier.tiers.pool_defaults``'s (``DEFAULT_POLICY``,
``DEFAULT_CLEAN_AHEAD_BLOCKS``).

Modules: ``units`` (value grammar: byte sizes, shares, seconds; the ``_as_*``
readers), ``schema`` (the dataclasses, their checks, the key declarations),
``sources`` (file, environment and flags layered into a ``DaemonConfig``),
``cli`` (flags, ``load_config``, the exit policy), ``render``
(``--print-config``), ``host`` (the device and GPU-tier sizes against this
host), ``cautions`` (allowed values that get a warning line), ``errors``
(``ConfigError``). Import from this package. Inside it dependencies point
one way: ``errors`` <- ``units`` <- ``schema`` <- ``sources``, ``render``,
``host``, ``cautions`` <- ``cli``.

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
hash); ``kvtier.daemon.tenancy.tenants`` says what the daemon does with them.

Validation (all raise ``ConfigError`` naming the dotted key, e.g. ``lease_s``,
``default_pool.cpu_bytes``, ``pools."llama-8b/tp0".policy``): every key is
checked at load time against the range the code can use (each key's check
in ``schema`` says it; docs/operating.md lists the ranges): unknown keys
(with a did-you-mean), wrong types, negative sizes, durations outside their
range (``lease_s`` 0.1..3600, ``poll_interval_s`` 0.001..1,
``drain_timeout_s`` 0..3600, ``heartbeat_s`` >= 0.01 and below the lease),
byte limits larger than the host's memory, counts past what a process can
hold, ``clean_ahead_blocks`` past a GPU tier's most blocks, sockets other
than ``ipc://<absolute path or @abstract>`` and ``tcp://<host>:<port>``,
``tcp://`` without ``insecure_tcp = true`` and without both CURVE key
settings, CURVE key files that do not exist, remote URLs the remote tier
could not use (``kvtier.tiers.remote.url``: scheme, IPv6 brackets, port
1..65535, database number) and a remote tier without
``remote_secret_key_file``, remote tier settings outside their ranges
(``remote_retry_max_s`` below ``remote_retry_initial_s``), eviction policies
the registry does not build
(``kvtier.tiers.policies.check_policy_name``: unknown names, a wrapper
named twice), unknown hash algorithms, log levels and devices, socket
modes with bits for others, pool names no ``hello`` can send,
``max_connections_per_peer`` above ``max_connections``, a
``cpu_budget_bytes`` below a pool's ``cpu_bytes`` (when both are bytes),
``metrics_port`` equal to a ``tcp://`` socket's port, TOML nested too deeply
to parse, tenants without an identity, with malformed keys or short
tokens, and keys, tokens or namespace tags shared by two tenants.

For ``main()``: ``load_config_or_exit(argv)`` does the CLI policy: on a
``ConfigError`` it prints ``kvtierd: config error: <key>: <message>`` to
stderr and exits 2 (``exit_on_config_error``); with ``--print-config`` it
prints the effective configuration as TOML (loadable as a config file) and
exits 0. Bad flags themselves are argparse's: usage on stderr, exit 2.
"""

from __future__ import annotations

from kvtier.client.admin import default_socket
from kvtier.daemon.config.cli import build_arg_parser, exit_on_config_error, load_config, load_config_or_exit
from kvtier.daemon.config.errors import ConfigError
from kvtier.daemon.config.render import format_config
from kvtier.daemon.config.schema import (
    DaemonConfig,
    PoolDefaults,
    PoolOverrides,
    PoolSettings,
    TenantConfig,
    pool_key,
    resolve_cpu_budget_bytes,
)
from kvtier.daemon.config.units import MemoryFraction, parse_byte_size

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
    "pool_key",
    "resolve_cpu_budget_bytes",
]
