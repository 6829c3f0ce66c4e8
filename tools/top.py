"""``kvtier top``: a refreshing terminal view of a running kvtierd.

Contract
========

- ``kvtier top [--socket URL] [--interval S] [--once | --count N]`` asks the
  session-less ``stats`` verb every ``--interval`` seconds (default 1.0) and
  shows, per pool: hit rate by tier (gpu, cpu, disk where a pool has a disk
  tier, remote, miss) over the last interval and since the daemon started,
  bytes/s per copy direction over the last interval, occupancy of the tiers,
  pins, copies in flight, sessions, and the interval's demotions, restores,
  CPU evictions and failures; the blocks a restarted daemon adopted from its
  predecessor's CPU tier, dropped and still verifying (when any); the disk
  tiers' hits, bytes read and written, dropped write-backs and errors (total,
  +interval); and for the daemon: sessions, lease expiries, requests/s,
  errors, and lent restores (held now with their bytes, granted/s, expired).
- Rates come from counter deltas between two samples divided by the time
  between them. A counter that went down (the daemon restarted) or a pool
  that is new counts from zero.
- On a terminal it draws in the alternate screen with ANSI codes (no
  curses), and Ctrl-C restores the screen and exits 0. Elsewhere (a pipe, a
  file) frames are printed one after another, separated by a blank line.
- ``--once``: take two samples ``--interval`` apart, print one frame with
  no escape codes, exit 0 (for scripts and tests). ``--count N``: N such
  frames.
- Exit 1 with ``kvtier top: no kvtierd at URL ...`` when no daemon answers
  the first sample; later, a daemon that stops answering is shown as such
  and asked again each interval.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TextIO

from kvtier.tools.stats import (
    ADOPTION_KEYS,
    DIRECTIONS,
    DISK_HEADER,
    disk_rows,
    shown_tiers,
    add_socket_arguments,
    curve_keys,
    fetch_stats,
    fmt_bytes,
    fmt_int,
    fmt_pct,
    hit_counts,
    hit_rates,
    occupancy,
    render_table,
    select_pool,
)

PROG = "kvtier top"
DEFAULT_INTERVAL_S = 1.0

# Alternate screen + hidden cursor on entry; both undone on exit.
_ENTER = "\x1b[?1049h\x1b[?25l"
_LEAVE = "\x1b[?25h\x1b[?1049l"
_HOME_CLEAR = "\x1b[H\x1b[2J"

_EVENT_KEYS = (("demotions", "demoted"), ("restores", "restored"), ("cpu_evictions", "cpu evicted"),
               ("stores_failed", "store fails"), ("copy_failures", "copy fails"))


def _num(m: Mapping[str, Any], key: str) -> float:
    value = m.get(key, 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _total(value: Any) -> float:
    """A daemon counter's value summed over its labels."""
    if isinstance(value, Mapping):
        return float(sum(v for v in value.values() if isinstance(v, (int, float))))
    return float(value) if isinstance(value, (int, float)) else 0.0


def _delta(cur: float, prev: float) -> float:
    # A counter that went down was reset (daemon restart): count from zero.
    return cur - prev if cur >= prev else cur


def _pool_delta(cur: Mapping[str, Any], prev: Mapping[str, Any] | None) -> dict[str, float]:
    prev = prev or {}
    keys = {k for k, v in cur.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    # A pool whose lookups went down is a new pool of the same name: all from zero.
    reset = _num(cur, "looked_up_blocks") < _num(prev, "looked_up_blocks")
    return {k: _num(cur, k) if reset else _delta(_num(cur, k), _num(prev, k)) for k in keys}


def render_frame(prev: Mapping[str, Any] | None, cur: Mapping[str, Any], elapsed_s: float, *,
                 endpoint: str, interval_s: float, clock: str) -> str:
    """One frame from two ``stats`` replies ``elapsed_s`` apart (``prev`` None: no interval columns)."""
    pools: Mapping[str, Mapping[str, Any]] = cur.get("pools") or {}
    prev_pools: Mapping[str, Mapping[str, Any]] = (prev or {}).get("pools") or {}
    daemon: Mapping[str, Any] = cur.get("daemon") or {}
    prev_daemon: Mapping[str, Any] = (prev or {}).get("daemon") or {}
    window = prev is not None and elapsed_s > 0
    win = f"last {elapsed_s:.1f} s" if window else "last -"

    def per_s(d: float) -> str:
        return f"{d / elapsed_s:,.1f}/s" if window else "-"

    requests = _total(daemon.get("requests_total"))
    d_requests = _delta(requests, _total(prev_daemon.get("requests_total")))
    errors = _total(daemon.get("errors_total"))
    expiries = _num(daemon, "lease_expiries_total")
    lines = [
        f"kvtier top  {endpoint}  {clock}  every {interval_s:g} s  (Ctrl-C quits)",
        f"sessions {int(cur.get('sessions', 0))}   lease expiries {fmt_int(expiries)}"
        + (f" (+{fmt_int(_delta(expiries, _num(prev_daemon, 'lease_expiries_total')))})" if window else "")
        + f"   requests {per_s(d_requests)}   errors {fmt_int(errors)}"
        + (f" (+{fmt_int(_delta(errors, _total(prev_daemon.get('errors_total'))))})" if window else "")
        + f"   in flight {fmt_int(_num(daemon, 'requests_in_flight'))}",
    ]
    if "standby_pid" in daemon:  # a daemon run with a standby: is a crash covered now?
        pid = int(_num(daemon, "standby_pid"))
        lines.append(f"standby {'pid ' + str(pid) if pid else 'none'}   "
                     + ("ready: serves at once if this daemon dies" if _num(daemon, "standby_ready")
                        else "starting: a crash now is a plain restart"))
    granted = _num(daemon, "lends_granted_total")
    if granted:  # a daemon that lent something: what it holds lent now, how fast it lends, what expired
        lent_expired = _num(daemon, "lends_expired_total")
        lines.append(f"lends {fmt_int(_num(daemon, 'lends_held'))} held ({fmt_bytes(_num(daemon, 'lends_held_bytes'))})   "
                     f"granted {per_s(_delta(granted, _num(prev_daemon, 'lends_granted_total')))}   "
                     f"expired {fmt_int(lent_expired)}"
                     + (f" (+{fmt_int(_delta(lent_expired, _num(prev_daemon, 'lends_expired_total')))})"
                        if window else ""))
    if not pools:
        lines += ["", "no pools yet (a pool is created by the first client's hello)"]
        return "\n".join(lines) + "\n"
    names = sorted(pools)
    deltas = {name: _pool_delta(pools[name], prev_pools.get(name)) for name in names}
    tiers = shown_tiers(pools)

    rows = []
    for name in names:
        for label, counts in ((win, hit_counts(deltas[name]) if window else None),
                              ("since start", hit_counts(pools[name]))):
            if counts is None:
                rows.append([name, label, "-", "-", *("-" for _ in (*tiers, "miss"))])
                continue
            rates = hit_rates(counts)
            rate = per_s(counts["looked_up"]) if label == win else ""
            rows.append([name if label == win else "", label, fmt_int(counts["looked_up"]), rate,
                         *(fmt_pct(rates[k]) for k in (*tiers, "miss"))])
    lines += ["", "HIT RATE (share of looked-up blocks)"]
    lines += render_table(["pool", "window", "blocks", "blocks/s", *tiers, "miss"], rows, indent=2)

    rows = []
    for name in names:
        d = deltas[name]
        rows.append([name, *((f"{fmt_bytes(d.get(f'bytes_{k}', 0.0) / elapsed_s)}/s" if window else "-")
                             for k in DIRECTIONS)])
    lines += ["", f"BYTES/S ({win})"]
    lines += render_table(["pool", *DIRECTIONS], rows, indent=2)

    rows = []
    for name in names:
        p = pools[name]
        occ = occupancy(p)

        def used(tier: str) -> str:
            o = occ[tier]
            share = fmt_pct(o["used"] / o["capacity"]) if o["capacity"] else "-"
            return f"{fmt_int(o['used'])}/{fmt_int(o['capacity'])} {share}"

        rows.append([name, used("gpu"), fmt_int(occ["gpu"]["cached"]), used("cpu"), fmt_int(_num(p, "pinned_blocks")),
                     fmt_int(_num(p, "held_blocks")) if "held_blocks" in p else "-",
                     fmt_int(_num(p, "copies_in_flight")), fmt_int(_num(p, "sessions"))])
    lines += ["", "OCCUPANCY (blocks; gpu used = referenced, cpu used = occupied, held = distinct keys either tier holds)"]
    lines += render_table(["pool", "gpu used", "gpu cached", "cpu used", "pinned", "held", "copies", "sessions"], rows,
                          indent=2)

    rows = []
    for name in names:
        p, d = pools[name], deltas[name]
        rows.append([name, *(fmt_int(_num(p, k)) + (f" +{fmt_int(d.get(k, 0.0))}" if window else "")
                             for k, _ in _EVENT_KEYS)])
    lines += ["", f"EVENTS (total, +{win})"]
    lines += render_table(["pool", *(label for _, label in _EVENT_KEYS)], rows, indent=2)

    adopted = [name for name in names if any(_num(pools[name], k) for k in ADOPTION_KEYS)]
    if adopted:
        rows = [[name, *(fmt_int(_num(pools[name], k)) for k in ADOPTION_KEYS)] for name in adopted]
        lines += ["", "ADOPTED AT START (the previous kvtierd's CPU tier; verified before served)"]
        lines += render_table(["pool", "adopted", "dropped", "verifying"], rows, indent=2)
    disk_deltas = {name: _pool_delta(pools[name]["disk"], (prev_pools.get(name) or {}).get("disk"))
                   for name in names if isinstance(pools[name].get("disk"), Mapping)}
    rows = disk_rows(pools, names, disk_deltas if window else None)
    if rows:
        lines += ["", f"DISK TIER (total{', +' + win if window else ''}; dropped: write-backs the queue or a resting "
                      "disk refused; errors: read, write, checksum)"]
        lines += render_table(DISK_HEADER, rows, indent=2)
    return "\n".join(lines) + "\n"


class _Screen:
    """Where frames go: the alternate screen of a terminal, or plain lines."""

    def __init__(self, out: TextIO, interactive: bool) -> None:
        self.out = out
        self.interactive = interactive
        self._frames = 0

    def __enter__(self) -> _Screen:
        if self.interactive:
            self.out.write(_ENTER)
            self.out.flush()
        return self

    def show(self, frame: str) -> None:
        if self.interactive:
            self.out.write(_HOME_CLEAR + frame)
        else:
            self.out.write(("\n" if self._frames else "") + frame)
        self._frames += 1
        self.out.flush()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.interactive:
            self.out.write(_LEAVE)
            self.out.flush()


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "top",
        help="refreshing view of a running kvtierd (hit rate by tier, bytes/s, occupancy)",
        description="A refreshing view of a running kvtierd: hit rate by tier over the last interval and "
                    "since start, bytes/s per copy direction, occupancy, pins, sessions, lease expiries. "
                    "Asks the session-less `stats` verb: opens no session. Ctrl-C quits.",
    )
    add_socket_arguments(p)
    p.add_argument("--interval", metavar="S", type=float, default=DEFAULT_INTERVAL_S,
                   help=f"seconds between refreshes (default: {DEFAULT_INTERVAL_S:g})")
    p.add_argument("--pool", metavar="NAME", default=None, help="only this pool (default: all)")
    once = p.add_mutually_exclusive_group()
    once.add_argument("--once", action="store_true",
                      help="print one frame (two samples --interval apart) without escape codes, and exit")
    once.add_argument("--count", metavar="N", type=int, default=None, help="print N frames, then exit")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from kvtier.client.admin import request, resolve_endpoint
    from kvtier.client.protocol import KvtierError

    if args.interval <= 0:
        raise SystemExit(f"{PROG}: --interval must be positive, got {args.interval:g}")
    frames = 1 if args.once else args.count
    if frames is not None and frames < 1:
        raise SystemExit(f"{PROG}: --count must be at least 1, got {frames}")
    endpoint = resolve_endpoint(args.socket)
    curve = curve_keys(args, PROG)

    def sample() -> dict[str, Any]:
        stats = request(endpoint, "stats", timeout_s=args.timeout, curve=curve)
        if args.pool is not None:  # a pool gone with a daemon restart shows as "no pools yet"
            pools = stats.get("pools") or {}
            stats["pools"] = {args.pool: pools[args.pool]} if args.pool in pools else {}
        return stats

    # The first sample decides "no daemon" (exit 1) before the screen changes.
    prev = select_pool(fetch_stats(endpoint, timeout_s=args.timeout, prog=PROG, curve=curve), args.pool,
                       endpoint=endpoint, prog=PROG)
    prev_s = time.monotonic()
    interactive = frames is None and sys.stdout.isatty()
    shown = 0
    try:
        with _Screen(sys.stdout, interactive) as screen:
            if interactive:  # something to look at before the first interval ends
                screen.show(render_frame(None, prev, 0.0, endpoint=endpoint, interval_s=args.interval,
                                         clock=time.strftime("%H:%M:%S")))
            next_s = prev_s + args.interval
            while frames is None or shown < frames:
                time.sleep(max(0.0, next_s - time.monotonic()))
                # A slow answer delays the next refresh instead of bunching them up.
                next_s = max(next_s + args.interval, time.monotonic())
                clock = time.strftime("%H:%M:%S")
                try:
                    cur = sample()
                except KvtierError as exc:
                    # Keep the last good sample and its time: the next answer's
                    # rates then cover the whole gap.
                    screen.show(f"kvtier top  {endpoint}  {clock}\n\n{exc}\nasking again every "
                                f"{args.interval:g} s (Ctrl-C quits)\n")
                    shown += 1
                    continue
                now_s = time.monotonic()
                screen.show(render_frame(prev, cur, now_s - prev_s, endpoint=endpoint, interval_s=args.interval,
                                         clock=clock))
                shown += 1
                prev, prev_s = cur, now_s
    except KeyboardInterrupt:
        pass  # Ctrl-C is how one leaves top: the screen is restored above
    return 0
