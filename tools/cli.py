"""The ``kvtier`` command: a table of subcommands, each registered by its own module.

To add a subcommand, write a module in ``kvtier.tools`` with

    def register(subparsers) -> argparse.ArgumentParser:
        p = subparsers.add_parser("name", help="...")
        ...                                  # its arguments
        p.set_defaults(func=main)            # main(args: argparse.Namespace) -> int
        return p

and add one line to ``SUBCOMMANDS`` below. A module should import what is
heavy (torch, matplotlib, the tiers) inside ``main``, not at import time, so
``kvtier --help`` stays fast. A subcommand reports user errors by raising
``SystemExit("kvtier NAME: message")``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvtier.tiers.version import kvtier_version

# (subcommand, module that registers it). The order is the order of `kvtier --help`.
SUBCOMMANDS: list[tuple[str, str]] = [
    ("replay", "kvtier.tools.replay"),
    ("stats", "kvtier.tools.stats"),
    ("top", "kvtier.tools.top"),
    ("keygen", "kvtier.tools.keygen"),
    ("arenas", "kvtier.tools.arenas"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="kvtier command-line tools")
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvtier_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS:
        sub = importlib.import_module(module).register(subparsers)
        if sub is not None and sub.prog.split()[-1] != name:
            raise RuntimeError(f"{module}.register added {sub.prog!r}, expected subcommand {name!r}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `kvtier replay ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
