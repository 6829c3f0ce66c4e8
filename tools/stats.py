"""``kvtier stats``: one look at a running kvtierd's counters, as a table or as JSON.

Contract
========

- ``kvtier stats [--socket URL] [--json] [--pool NAME] [--timeout S]`` sends
  one session-less ``stats`` request (``kvtier.client.admin.request``: no
  session, no pool created) to ``--socket`` (default: ``$KVTIER_SOCKET``,
  else the daemon's default socket) and prints it.
- ``--json`` prints the reply as one JSON object: ``endpoint`` plus the
  ``stats`` verb's fields unchanged (``pools``, ``daemon``, ``sessions``);
  every counter is defined in docs/metrics.md. Without it, aligned tables:
  hits by tier (each looked-up block is counted once: gpu, cpu, disk (when
  some pool has a disk tier), remote or miss), occupancy, copies per
  direction, events, the blocks a restarted daemon adopted from its
  predecessor's CPU tier (and dropped), the disk tiers (hits, bytes, dropped
  write-backs, errors, blocks adopted at start), daemon counters (lent
  restores among them: lends granted, released, expired, dropped, and held
  now with their bytes).
- ``--pool NAME`` keeps one pool (an unknown name is an error naming the
  pools there are).
- Exit status 0; 1 with ``kvtier stats: no kvtierd at URL ...`` when no
  daemon answers (or on an error reply).

The derived numbers (``hit_rates``, ``occupancy``, ``fmt_bytes``) and
``render_table`` are shared with ``kvtier top``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

TIERS = ("gpu", "cpu", "remote")  # the tiers every daemon reports
ALL_TIERS = ("gpu", "cpu", "disk", "remote")  # ... and a pool with a disk tier (disk_dir)
# A restarted daemon's adoption of its predecessor's CPU tier (docs/metrics.md 3.2a).
ADOPTION_KEYS = ("cpu_adopted_blocks", "cpu_adoption_dropped_blocks", "cpu_adoption_pending_blocks")
DIRECTIONS = ("demote", "restore", "store", "load")
DEFAULT_TIMEOUT_S = 2.0


# ---- fetching ---------------------------------------------------------------------------------


def fetch_stats(endpoint: str, *, timeout_s: float, prog: str, curve: Any = None) -> dict[str, Any]:
    """The ``stats`` reply, or ``SystemExit("<prog>: <why>")`` when no daemon answers."""
    from kvtier.client.admin import request
    from kvtier.client.protocol import KvtierError

    try:
        return request(endpoint, "stats", timeout_s=timeout_s, curve=curve)
    except KvtierError as exc:
        raise SystemExit(f"{prog}: {exc}") from None


def curve_keys(args: argparse.Namespace, prog: str) -> Any:
    """``--curve-server-key`` + ``--curve-secret-key-file`` as the client's keys, or None; SystemExit if one is missing."""
    if (args.curve_server_key is None) != (args.curve_secret_key_file is None):
        raise SystemExit(f"{prog}: CURVE needs both --curve-server-key and --curve-secret-key-file")
    if args.curve_server_key is None:
        return None
    from kvtier.client.curve import CurveKeys

    try:
        return CurveKeys.load(args.curve_server_key, args.curve_secret_key_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{prog}: cannot load the CURVE keys: {exc}") from None


def select_pool(stats: dict[str, Any], pool: str | None, *, endpoint: str, prog: str) -> dict[str, Any]:
    """``stats`` with only pool ``pool`` (all pools when None); SystemExit for an unknown pool."""
    if pool is None:
        return stats
    pools = stats.get("pools") or {}
    if pool not in pools:
        known = ", ".join(repr(p) for p in sorted(pools)) or "none yet"
        raise SystemExit(f"{prog}: no pool {pool!r} in kvtierd at {endpoint} (pools: {known})")
    return {**stats, "pools": {pool: pools[pool]}}


# ---- derived numbers ----------------------------------------------------------------------------


def _num(p: Mapping[str, Any], key: str) -> float:
    value = p.get(key, 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def hit_counts(p: Mapping[str, Any]) -> dict[str, float]:
    """Looked-up blocks and their split: ``{"looked_up", "lookups", "gpu", "cpu", "disk", "remote", "miss"}``."""
    out = {"lookups": _num(p, "lookups"), "looked_up": _num(p, "looked_up_blocks"), "miss": _num(p, "miss_blocks")}
    for tier in ALL_TIERS:
        out[tier] = _num(p, f"hit_blocks_{tier}")
    return out


def hit_rates(counts: Mapping[str, float]) -> dict[str, float | None]:
    """Share of looked-up blocks per tier and miss (they sum to 1); None when nothing was looked up."""
    total = counts["looked_up"]
    return {k: (counts[k] / total if total else None) for k in (*ALL_TIERS, "miss")}


def shown_tiers(pools: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...]:
    """The tiers a table shows: the disk tier's column only where some pool has one."""
    return ALL_TIERS if any(isinstance(p.get("disk"), Mapping) for p in pools.values()) else TIERS


def disk_rows(pools: Mapping[str, Mapping[str, Any]], names: Sequence[str],
              delta: Mapping[str, Mapping[str, float]] | None = None) -> list[list[str]]:
    """One row per pool with a disk tier: state, used/capacity, hits, bytes read and written, dropped, errors,
    adopted; with ``delta`` (per pool, the disk counters' change over an interval) the interval's too."""
    rows = []
    for name in names:
        d = pools[name].get("disk")
        if not isinstance(d, Mapping):
            continue
        state = "up" if d.get("available") else f"DOWN ({d.get('last_error') or 'opening'})"
        dropped = sum(_num(d, k) for k in ("writes_dropped_full", "writes_dropped_unavailable"))
        errors = sum(_num(d, k) for k in ("read_errors", "write_errors", "disk_corrupt"))
        cells = [fmt_int(_num(d, "disk_hits")), fmt_bytes(_num(d, "bytes_read")), fmt_bytes(_num(d, "bytes_written")),
                 fmt_int(dropped), fmt_int(_num(d, "writes_not_admitted")), fmt_int(errors)]
        if delta is not None:
            dd = delta.get(name, {})
            d_dropped = sum(dd.get(k, 0.0) for k in ("writes_dropped_full", "writes_dropped_unavailable"))
            d_errors = sum(dd.get(k, 0.0) for k in ("read_errors", "write_errors", "disk_corrupt"))
            new = [dd.get("disk_hits", 0.0), dd.get("bytes_read", 0.0), dd.get("bytes_written", 0.0), d_dropped,
                   dd.get("writes_not_admitted", 0.0), d_errors]
            cells = [f"{c} +{fmt_bytes(x) if i in (1, 2) else fmt_int(x)}" for i, (c, x) in enumerate(zip(cells, new))]
        rows.append([name, state, f"{fmt_int(_num(d, 'used_blocks'))}/{fmt_int(_num(d, 'capacity_blocks'))}", *cells,
                     f"{fmt_int(_num(d, 'adopted_blocks'))} ({fmt_int(_num(d, 'torn_records'))} torn)"])
    return rows


DISK_HEADER = ["pool", "state", "blocks", "hits", "read", "written", "dropped", "not admitted", "errors", "adopted"]


def occupancy(p: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Per tier: ``capacity``, ``used``, ``free`` (used + free = capacity) and ``cached`` blocks.

    GPU ``used`` = referenced (requests, pins, copies); GPU ``free`` includes
    cached blocks that are evictable. CPU ``used`` = occupied slots; so is
    ``disk``'s, present for a pool with a disk tier.
    """
    gpu_cap, gpu_free = int(_num(p, "gpu_blocks")), int(_num(p, "gpu_free_blocks"))
    cpu_cap, cpu_used = int(_num(p, "cpu_blocks")), int(_num(p, "cpu_used_blocks"))
    out = {
        "gpu": {"capacity": gpu_cap, "used": gpu_cap - gpu_free, "free": gpu_free,
                "cached": int(_num(p, "gpu_cached_blocks"))},
        "cpu": {"capacity": cpu_cap, "used": cpu_used, "free": cpu_cap - cpu_used, "cached": cpu_used},
    }
    disk = p.get("disk")
    if isinstance(disk, Mapping):
        cap, used = int(_num(disk, "capacity_blocks")), int(_num(disk, "used_blocks"))
        out["disk"] = {"capacity": cap, "used": used, "free": cap - used, "cached": used}
    return out


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_bytes(n: float) -> str:
    """Bytes in binary units: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_int(x: float) -> str:
    return f"{int(x):,}"


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, indent: int = 0) -> list[str]:
    """Columns padded to their widest cell; the first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (" " * indent + "  ".join(parts)).rstrip()

    return [line(header), *(line(r) for r in rows)]


# ---- the table -------------------------------------------------------------------------------------


def _labelled(daemon: Mapping[str, Any], name: str) -> str:
    """A labelled daemon counter as ``a 3, b 1`` (label values only), or ``0``."""
    value = daemon.get(name)
    if not isinstance(value, Mapping) or not value:
        return fmt_int(value) if isinstance(value, (int, float)) else "0"
    parts = []
    for key, n in sorted(value.items(), key=lambda kv: (-kv[1], kv[0])):
        label = ",".join(part.partition("=")[2] for part in str(key).split(","))
        parts.append(f"{label} {n:,.0f}" if float(n).is_integer() else f"{label} {n:.3f}")
    return ", ".join(parts)


def format_stats(stats: Mapping[str, Any], endpoint: str) -> str:
    """The human view of one ``stats`` reply (see the module docstring)."""
    pools: Mapping[str, Mapping[str, Any]] = stats.get("pools") or {}
    daemon: Mapping[str, Any] = stats.get("daemon") or {}
    names = sorted(pools)
    n_sessions = int(stats.get("sessions", 0))
    out = [f"kvtierd at {endpoint}: {n_sessions} session{'s' * (n_sessions != 1)}, "
           f"{len(names)} pool{'s' * (len(names) != 1)}"]
    if names:
        tiers = shown_tiers(pools)
        out += ["", f"HITS (looked-up blocks; each is counted once: {', '.join(tiers)} or miss)"]
        rows = []
        for name in names:
            c = hit_counts(pools[name])
            r = hit_rates(c)
            rows.append([name, fmt_int(c["lookups"]), fmt_int(c["looked_up"]),
                         *(f"{fmt_int(c[k])} {fmt_pct(r[k])}" for k in (*tiers, "miss"))])
        out += render_table(["pool", "lookups", "blocks", *tiers, "miss"], rows, indent=2)

        out += ["", "OCCUPANCY (blocks; used + free = capacity; pins count both tiers; held: distinct keys either tier holds)"]
        rows = []
        for name in names:
            p = pools[name]
            occ = occupancy(p)
            for tier in ("gpu", "cpu", "disk"):
                if tier not in occ:
                    continue
                o = occ[tier]
                rows.append([name if tier == "gpu" else "", tier, fmt_int(o["capacity"]), fmt_int(o["used"]),
                             fmt_int(o["free"]), fmt_int(o["cached"]),
                             fmt_int(_num(p, "pinned_blocks")) if tier == "gpu" else "",
                             fmt_int(_num(p, "held_blocks")) if tier == "gpu" else ""])
        out += render_table(["pool", "tier", "capacity", "used", "free", "cached", "pinned", "held"], rows, indent=2)

        out += ["", "COPIES (bytes, and seconds from submission to completion summed over copies)"]
        rows = []
        for name in names:
            p = pools[name]
            for i, d in enumerate(DIRECTIONS):
                b, s = _num(p, f"bytes_{d}"), _num(p, f"seconds_{d}")
                rate = f"{fmt_bytes(b / s)}/s" if s > 0 else "-"
                rows.append([name if i == 0 else "", d, fmt_bytes(b), f"{s:.3f}", rate])
        out += render_table(["pool", "direction", "bytes", "seconds", "bytes/seconds"], rows, indent=2)

        out += ["", "EVENTS (blocks unless noted)"]
        rows = []
        for name in names:
            p = pools[name]
            skipped = sum(_num(p, k) for k in ("demotions_skipped_clean", "demotions_not_admitted",
                                                "demotions_dropped_full"))
            rows.append([name, str(p.get("mode", "?")), fmt_int(_num(p, "sessions")), fmt_int(_num(p, "demotions")),
                         fmt_int(skipped), fmt_int(_num(p, "restores")), fmt_int(_num(p, "cpu_evictions")),
                         fmt_int(_num(p, "stores")), fmt_int(_num(p, "stores_failed")), fmt_int(_num(p, "loads")),
                         fmt_int(_num(p, "copy_failures")), fmt_int(_num(p, "copies_in_flight"))])
        out += render_table(["pool", "mode", "sessions", "demoted", "demote skipped", "restored", "cpu evicted",
                             "stored", "store fails", "loaded", "copy fails", "in flight"], rows, indent=2)
        adopted = [name for name in names if any(_num(pools[name], k) for k in ADOPTION_KEYS)]
        if adopted:
            out += ["", "ADOPTED AT START (blocks of the CPU tier the previous kvtierd left; verified before served)"]
            rows = [[name, *(fmt_int(_num(pools[name], k)) for k in ADOPTION_KEYS)] for name in adopted]
            out += render_table(["pool", "adopted", "dropped", "verifying"], rows, indent=2)
        rows = disk_rows(pools, names)
        if rows:
            out += ["", "DISK TIER (blocks read and verified, bytes, write-backs dropped (queue full, disk resting "
                        "after an error) and not admitted, errors (read, write, checksum), blocks adopted at start)"]
            out += render_table(DISK_HEADER, rows, indent=2)
        for name in names:
            remote = pools[name].get("remote")
            if isinstance(remote, Mapping):
                state = "up" if remote.get("available") else f"DOWN ({remote.get('last_error') or 'unreachable'})"
                out.append(f"  {name}: remote tier {remote.get('url', '')} {state}")
    else:
        out += ["", "no pools yet (a pool is created by the first client's hello)"]

    out += ["", "DAEMON"]
    rows = [
        ["sessions", fmt_int(_num(daemon, "sessions") or n_sessions)],
        ["lease expiries", fmt_int(_num(daemon, "lease_expiries_total"))],
        ["requests in flight", fmt_int(_num(daemon, "requests_in_flight"))],
        ["requests", _labelled(daemon, "requests_total")],
        ["errors", _labelled(daemon, "errors_total")],
        ["protocol errors", _labelled(daemon, "protocol_errors_total")],
        ["replies dropped", _labelled(daemon, "replies_dropped_total")],
        ["lends", lends_text(daemon)],
    ]
    out += ["  " + line for line in _two_columns(rows)]
    return "\n".join(out) + "\n"


def lends_text(daemon: Mapping[str, Any]) -> str:
    """Lent restores (kvtier.daemon.clients.lends): held now (bytes), and since start: granted, released, expired, dropped."""
    return (f"{fmt_int(_num(daemon, 'lends_held'))} held ({fmt_bytes(_num(daemon, 'lends_held_bytes'))}); "
            f"granted {fmt_int(_num(daemon, 'lends_granted_total'))}, "
            f"released {fmt_int(_num(daemon, 'lends_released_total'))}, "
            f"expired {fmt_int(_num(daemon, 'lends_expired_total'))}, "
            f"dropped {fmt_int(_num(daemon, 'lends_dropped_total'))}")


def _two_columns(rows: Sequence[Sequence[str]]) -> list[str]:
    width = max(len(r[0]) for r in rows)
    return [f"{r[0].ljust(width)}  {r[1]}" for r in rows]


# ---- the command ------------------------------------------------------------------------------------


def add_socket_arguments(p: argparse.ArgumentParser) -> None:
    """``--socket`` and ``--timeout``, shared with ``kvtier top``."""
    p.add_argument("--socket", metavar="URL", default=None,
                   help="kvtierd endpoint (default: $KVTIER_SOCKET, else kvtierd's default socket: "
                        "ipc://$XDG_RUNTIME_DIR/kvtier/kvtierd.sock, else /run/user/<uid>/kvtier/kvtierd.sock, "
                        "else ${TMPDIR:-/tmp}/kvtier-<uid>/kvtierd.sock)")
    p.add_argument("--timeout", metavar="S", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for the daemon's answer (default: {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--curve-server-key", metavar="KEY", default=None,
                   help="a tcp:// daemon's CURVE public key (Z85 text, or its key file)")
    p.add_argument("--curve-secret-key-file", metavar="PATH", default=None,
                   help="this client's CURVE secret key file (`kvtier keygen`; its public key must be authorised "
                        "by the daemon: an operator key, or a tenant's to see that tenant only)")


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "stats",
        help="print a running kvtierd's counters (table or JSON)",
        description="Print a running kvtierd's counters once: hits by tier, occupancy, copies per direction, "
                    "events and daemon counters. Asks the session-less `stats` verb: opens no session. "
                    "Counters are defined in docs/metrics.md.",
    )
    add_socket_arguments(p)
    p.add_argument("--json", action="store_true", help="print the stats reply as JSON instead of tables")
    p.add_argument("--pool", metavar="NAME", default=None, help="only this pool (default: all)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from kvtier.client.admin import resolve_endpoint

    endpoint = resolve_endpoint(args.socket)
    stats = fetch_stats(endpoint, timeout_s=args.timeout, prog="kvtier stats", curve=curve_keys(args, "kvtier stats"))
    stats = select_pool(stats, args.pool, endpoint=endpoint, prog="kvtier stats")
    if args.json:
        json.dump({"endpoint": endpoint, **stats}, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_stats(stats, endpoint))
    return 0
