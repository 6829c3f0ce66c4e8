"""kvtierd's command line: flags, ``--help``, and loading the configuration for ``main()``.

Contract
========

- ``build_arg_parser()``: every key's flag (``--lease-s``, ``--cpu-bytes``,
  ``--pool NAME KEY=VALUE``), grouped for ``--help``; unset flags are absent
  from the namespace.
- ``load_config(argv, environ)``: defaults < file < environment < flags, a
  validated ``DaemonConfig`` or ``ConfigError``.
- ``load_config_or_exit(argv)``: ``main()``'s policy: a ``ConfigError`` is
  printed (``exit_on_config_error``) and exits 2, and so is a ``device``
  this host does not have (``host.check_device``); each caution
  (``cautions``) is printed as a warning line; ``--print-config`` prints
  the configuration and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn, TextIO

from kvtier.tiers.version import kvtier_version
from kvtier.daemon.config.cautions import cautions
from kvtier.daemon.config.errors import ConfigError
from kvtier.daemon.config.host import check_device
from kvtier.daemon.config.render import format_config
from kvtier.daemon.config.schema import (
    CPU_AUTO_CAP_BYTES,
    CPU_AUTO_FRACTION,
    GPU_AUTO_BYTES_CUDA,
    GPU_AUTO_BYTES_HOST,
    POOL_KEYS,
    POOLS,
    TOP_KEYS,
    DaemonConfig,
    Key,
    env_name,
    flag_name,
)
from kvtier.daemon.config.sources import ENV_CONFIG, _apply_environ, _apply_file, _apply_flags, _build, _Layers
from kvtier.tiers.units import format_byte_size

CONFIG_EXIT_CODE = 2
_DESCRIPTION_COLUMN = 32  # where the epilog's explanations start

_GROUP_DESCRIPTIONS = {POOLS: "sizes and policy for every pool ([default_pool]); --pool overrides one pool by name"}


def _env_lines(names: list[str], description: str) -> str:
    """``names`` wrapped at 80 columns, ``description`` in the epilog's column after them (below if no room)."""
    lines = textwrap.wrap(", ".join(names), width=80, initial_indent="  ", subsequent_indent="  ")
    if len(lines[-1]) < _DESCRIPTION_COLUMN:
        lines[-1] = lines[-1].ljust(_DESCRIPTION_COLUMN) + description
    else:
        lines.append(" " * _DESCRIPTION_COLUMN + description)
    return "\n".join(lines)


_EPILOG = f"""\
configuration sources, later ones override single keys of earlier ones:
  built-in defaults < TOML file (--config, or $KVTIER_CONFIG) < KVTIER_* environment < flags

environment variables:
  KVTIER_<KEY>                  a top-level key, e.g. KVTIER_SOCKET, KVTIER_LEASE_S
{_env_lines([env_name(k) for k in POOL_KEYS], "the [default_pool] table")}
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


def _shown_default(spec: Key, default: object) -> str:
    """``--help``'s "(default: ...)", spelled as the key's values are written."""
    if spec.shown_default is not None:
        return spec.shown_default
    if default is None:
        return spec.unset
    if spec.is_switch:
        return "yes" if default else "no"
    if spec.is_size:
        return format_byte_size(default)  # type: ignore[arg-type]
    if spec.is_mode:
        return f"{default:04o}"
    return str(default)


def build_arg_parser() -> argparse.ArgumentParser:
    """kvtierd's flags. Unset flags are absent from the namespace (they override nothing).

    One flag per key of ``TOP_KEYS`` (dest: the key) and of ``POOL_KEYS``
    (dest: ``default_pool.<key>``, setting the ``[default_pool]`` table), in
    ``--help`` sections by the key's group and rank; ``--pool NAME KEY=VALUE``
    sets one pool's key.
    """
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
    general.add_argument("--version", action="version", version=f"kvtierd (kvtier) {kvtier_version()}")

    # Sections in the order of their first key; in a section, flags by rank (ties: field order).
    declared = [(name, name, spec, getattr(defaults, name)) for name, spec in TOP_KEYS.items()]
    declared += [
        (name, f"default_pool.{name}", spec, getattr(defaults.default_pool, name)) for name, spec in POOL_KEYS.items()
    ]
    titles = list(dict.fromkeys(spec.group for _, _, spec, _ in declared))
    sections = {title: parser.add_argument_group(title, _GROUP_DESCRIPTIONS.get(title)) for title in titles}
    for name, dest, spec, default in sorted(declared, key=lambda d: (titles.index(d[2].group), d[2].rank)):
        section, help_text = sections[spec.group], f"{spec.help} (default: {_shown_default(spec, default)})"
        if spec.is_switch:
            section.add_argument(flag_name(name), dest=dest, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            section.add_argument(flag_name(name), dest=dest, metavar=spec.metavar, help=help_text)
    sections[POOLS].add_argument(
        "--pool",
        dest="pool_settings",
        nargs=2,
        action="append",
        metavar=("NAME", "KEY=VALUE"),
        help=f"set one key of pool NAME, e.g. --pool llama-8b/tp0 cpu_bytes=32GiB (keys: {', '.join(POOL_KEYS)}); repeatable",
    )
    return parser


def _load(argv: Sequence[str] | None, environ: Mapping[str, str] | None) -> tuple[DaemonConfig, argparse.Namespace]:
    environ = os.environ if environ is None else environ
    ns = build_arg_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    layers = _Layers()
    config_path = getattr(ns, "config", None) or environ.get(ENV_CONFIG) or None
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


MAX_MESSAGE_CHARS = 2000  # a message quotes the bad value: a huge one is cut, the line stays readable


def _cut(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else f"{text[:MAX_MESSAGE_CHARS]}... ({len(text)} characters)"


def exit_on_config_error(err: ConfigError, stderr: TextIO | None = None) -> NoReturn:
    """Print ``kvtierd: config error: <key>: <message>`` and exit with status 2."""
    print(f"kvtierd: config error: {_cut(err.key)}: {_cut(err.message)}", file=stderr or sys.stderr, flush=True)
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
        check_device(cfg.device)
    except ConfigError as err:
        exit_on_config_error(err, stderr)
    for key, message in cautions(cfg):
        print(f"kvtierd: config warning: {key}: {_cut(message)}", file=stderr or sys.stderr, flush=True)
    if getattr(ns, "print_config", False):
        print(format_config(cfg), end="", file=stdout or sys.stdout, flush=True)
        raise SystemExit(0)
    return cfg
