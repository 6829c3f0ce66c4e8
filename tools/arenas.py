"""``kvtier arenas``: the persistent CPU tiers kvtierd leaves in shared memory, listed and removed.

Contract
========

- A kvtierd with ``persist_cpu_tier`` (the default) keeps each pool's CPU
  tier in two files in ``arena_dir`` (default /dev/shm), and leaves them
  there when it stops or dies, for the next kvtierd on the same socket to
  adopt. They hold memory until then, or until removed here (or a reboot).
- ``kvtier arenas [list] [--arena-dir DIR] [--json]`` lists this user's
  arenas in DIR (``--arena-dir``, else ``$KVTIER_ARENA_DIR``, else
  /dev/shm): pool, the socket of the daemon that owns it, size, block size,
  the kvtier version that wrote it, and its state: ``in use`` (a running
  kvtierd holds it), ``waiting`` (for the next kvtierd on its socket), or
  why it is unusable. ``--json``: one object, ``{"arena_dir", "arenas":
  [...]}``.
- ``kvtier arenas remove [--socket URL | --all] [--pool KEY] [--dry-run]``
  removes this user's arenas that no running kvtierd holds: those of the
  daemon at ``--socket`` (default ``$KVTIER_SOCKET``, else the daemon's
  default socket: what a unit's ``ExecStopPost`` wants), or all of them
  (``--all``: uninstalling), optionally only pool KEY. An arena a running
  daemon holds is never removed: it is reported and the exit status is 1.
  Exit status 0 otherwise, also when there was nothing to remove.
- Stdlib and ``kvtier.tiers.arena_files`` only: no torch, no daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_DIR = "/dev/shm"
DIR_ENV = "KVTIER_ARENA_DIR"


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "arenas", help="list or remove the persistent CPU tiers kvtierd keeps in shared memory",
        description="kvtierd keeps each pool's CPU tier in files under arena_dir (default /dev/shm) so that a "
                    "restarted daemon adopts its blocks; they hold memory until the next kvtierd on the same "
                    "socket adopts them, or until removed here.")
    p.add_argument("action", nargs="?", choices=("list", "remove"), default="list",
                   help="list (default) or remove arenas no running kvtierd holds")
    p.add_argument("--arena-dir", default=None,
                   help=f"where the arenas are (default: ${DIR_ENV}, else {DEFAULT_DIR})")
    p.add_argument("--socket", default=None,
                   help="remove: the arenas of the kvtierd at this endpoint (default: $KVTIER_SOCKET, else the "
                        "daemon's default socket)")
    p.add_argument("--all", action="store_true", help="remove: every arena of this user, whatever its daemon")
    p.add_argument("--pool", default=None, help="remove: only this pool's (its key: NAME, or TENANT/NAME)")
    p.add_argument("--dry-run", action="store_true", help="remove: say what would go, remove nothing")
    p.add_argument("--json", action="store_true", help="list: print JSON")
    p.set_defaults(func=main)
    return p


def _state(info: Any) -> str:
    if info.held:
        return "in use" if not info.problem else f"unknown ({info.problem})"
    if info.problem:
        return f"unusable: {info.problem}"
    return "waiting"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _row(info: Any) -> dict[str, Any]:
    ident = info.identity or {}
    return {"name": info.stem, "pool": ident.get("pool"), "socket": ident.get("endpoint"),
            "memory_bytes": info.memory_bytes, "blocks": info.slots, "block_bytes": info.block_bytes,
            "kvtier": ident.get("kvtier"), "state": _state(info), "held": info.held,
            "files": [str(info.index_path), str(info.data_path)]}


def main(args: argparse.Namespace) -> int:
    from kvtier.tiers.arena_files import list_arenas, remove_arena

    where = Path(args.arena_dir or os.environ.get(DIR_ENV) or DEFAULT_DIR)
    if not where.is_dir():
        raise SystemExit(f"kvtier arenas: {where} is not a directory (--arena-dir)")
    arenas = list_arenas(where, uid=os.getuid())
    if args.action == "list":
        if args.all or args.pool or args.socket or args.dry_run:
            raise SystemExit("kvtier arenas: --all, --pool, --socket and --dry-run go with 'remove'")
        rows = [_row(a) for a in arenas]
        if args.json:
            print(json.dumps({"arena_dir": str(where), "arenas": rows}, indent=2))
            return 0
        if not rows:
            print(f"no kvtierd arenas of this user in {where}")
            return 0
        from kvtier.tools.stats import render_table

        table = [[r["pool"] or r["name"], r["socket"] or "?", _fmt_bytes(r["memory_bytes"]),
                  f"{r['blocks']:,}", _fmt_bytes(r["block_bytes"]), r["kvtier"] or "?", r["state"]] for r in rows]
        for line in render_table(["pool", "socket", "memory", "blocks", "block", "kvtier", "state"], table):
            print(line)
        print(f"{len(rows)} arenas, {_fmt_bytes(sum(r['memory_bytes'] for r in rows))} in {where}; "
              "'kvtier arenas remove' frees those no kvtierd holds")
        return 0
    if args.json:
        raise SystemExit("kvtier arenas: --json goes with 'list'")
    if args.all and args.socket:
        raise SystemExit("kvtier arenas: --all removes every daemon's arenas; give it or --socket, not both")
    if not args.all:
        from kvtier.client.admin import resolve_endpoint

        endpoint = resolve_endpoint(args.socket)
        arenas = [a for a in arenas if (a.identity or {}).get("endpoint") == endpoint
                  or (a.identity is None and _stem_instance_matches(a.stem, endpoint))]
    if args.pool is not None:
        arenas = [a for a in arenas if (a.identity or {}).get("pool") == args.pool]
    status = 0
    freed = 0
    for info in arenas:
        what = f"{(info.identity or {}).get('pool', info.stem)!r} ({_fmt_bytes(info.memory_bytes)}, {info.stem})"
        if info.held:
            print(f"kvtier arenas: {what} is held by a running kvtierd: stop it first", file=sys.stderr)
            status = 1
            continue
        if args.dry_run:
            print(f"would remove {what}")
            continue
        try:
            remove_arena(info)
        except (RuntimeError, OSError) as exc:
            print(f"kvtier arenas: {what}: {exc}", file=sys.stderr)
            status = 1
            continue
        freed += info.memory_bytes
        print(f"removed {what}")
    if not arenas:
        print(f"no arenas to remove in {where}")
    elif not args.dry_run:
        print(f"{_fmt_bytes(freed)} freed")
    return status


def _stem_instance_matches(stem: str, endpoint: str) -> bool:
    """An unreadable arena still names its daemon's instance in its file name."""
    from kvtier.tiers.arena_files import instance_id

    return f"-{instance_id(endpoint)}-" in stem
