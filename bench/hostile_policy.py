"""What hostile traffic costs the CPU-tier policy and the retain_s ledger, bounded against unbounded.

Two measurements (issue 32, items 1 and 8), in one process, side by side:

1. Policy memory under a flood of never-seen keys: ``--requests`` requests of
   ``--keys`` fresh keys each (with ``+session``, each a new session), through
   ``chain`` and ``chain+session`` at ``--cpu-blocks``, with the default
   bounds and with the bounds lifted (what the policy did before them).
   Memory held after the flood (tracemalloc, after a collection), keys
   remembered, and the time per request.
2. The ``retain_s`` ledger of one session holding n one-block reservations,
   each deadline earlier than the one before (as differing ``retain_s``
   give): the time of one more reservation through ``Retention`` and through
   the list rule it replaced (sum the live reservations, append, re-sort when
   out of order), interleaved.

    python bench/hostile_policy.py

prints two tables and writes bench/results/hostile-policy.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from collections import deque
from pathlib import Path
from typing import Any

import report

from kvtier.daemon.clients.retention import Retention
from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies import EvictionPolicy, make_policy
from kvtier.tiers.policies.chain import ChainPolicy
from kvtier.tiers.policies.session import SessionWrapper

RESULTS = Path(__file__).resolve().parent / "results"
UNBOUNDED = 1 << 62


def fresh_keys(n: int) -> list[bytes]:
    data = os.urandom(16 * n)
    return [data[i:i + 16] for i in range(0, len(data), 16)]


def build(spec: str, cpu_blocks: int, bounded: bool) -> EvictionPolicy:
    policy = make_policy(spec, cpu_blocks)
    if not bounded:
        chain = policy.inner if isinstance(policy, SessionWrapper) else policy
        assert isinstance(chain, ChainPolicy)
        chain.history_keys = UNBOUNDED
        if isinstance(policy, SessionWrapper):
            policy.chain_keys = UNBOUNDED
    return policy


def flood(spec: str, cpu_blocks: int, bounded: bool, requests: int, keys: int) -> dict[str, Any]:
    """The flood twice: timed (CPU time of the process: this machine is shared), then under tracemalloc."""
    out: dict[str, Any] = dict(policy=spec, bounded=bounded, cpu_blocks=cpu_blocks, requests=requests, keys=keys)
    for traced in (False, True):
        gc.collect()
        if traced:
            tracemalloc.start()
        policy = build(spec, cpu_blocks, bounded)
        seconds = 0.0
        for r in range(requests):
            batch = fresh_keys(keys)
            t0 = time.process_time()
            session = isinstance(policy, SessionWrapper)
            hints = RequestHints(session=f"s{r}".encode(), at_s=float(r)) if session else None
            policy.record(batch, hints)
            seconds += time.process_time() - t0
            del batch
        if traced:
            gc.collect()
            out["held_bytes"], out["peak_bytes"] = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            out["remembered_keys"] = policy.stats().remembered_keys
        else:
            out["ms_per_request"] = 1e3 * seconds / requests
        del policy
    return out


def list_rule(retained: deque[tuple[float, int]], now_s: float, until_s: float, blocks: int, share: int) -> bool:
    """The ledger before issue 32: sum the live reservations, append, re-sort when out of order."""
    while retained and retained[0][0] <= now_s:
        retained.popleft()
    if sum(n for _, n in retained) + blocks > share:
        return False
    retained.append((until_s, blocks))
    if len(retained) > 1 and retained[-2][0] > retained[-1][0]:
        items = sorted(retained)
        retained.clear()
        retained.extend(items)
    return True


def retention(held: int, probes: int) -> dict[str, Any]:
    ledger, old = Retention(), deque()  # type: ignore[var-annotated]
    share = 2 * (held + probes)
    for i in range(held):
        until_s = 3600.0 - 0.01 * i
        ledger.reserve(0.0, until_s, 1, share)
        list_rule(old, 0.0, until_s, 1, share)
    new_s = old_s = 0.0
    rounds = 4  # alternated: load on the machine falls on both alike; each timed as one block of calls
    per_round = max(1, probes // rounds)
    j = 0
    for _ in range(rounds):
        untils = [1000.0 - 0.01 * (j + k) for k in range(per_round)]
        j += per_round
        t0 = time.process_time()
        for until_s in untils:
            ledger.reserve(0.0, until_s, 1, share)
        t1 = time.process_time()
        for until_s in untils:
            list_rule(old, 0.0, until_s, 1, share)
        t2 = time.process_time()
        new_s += t1 - t0
        old_s += t2 - t1
    probes = rounds * per_round
    return dict(held=held, ledger_us=1e6 * new_s / probes, list_rule_us=1e6 * old_s / probes,
                ratio=old_s / new_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-blocks", type=int, default=256, help="CPU-tier blocks of the policy (default 256)")
    ap.add_argument("--requests", type=int, default=12, help="flood requests (default 12)")
    ap.add_argument("--keys", type=int, default=65536, help="fresh keys per request (default 65,536)")
    ap.add_argument("--held", default="1000,10000,30000",
                    help="reservations held before timing the ledger, comma-separated (default 1000,10000,30000)")
    ap.add_argument("--probes", type=int, default=400, help="timed reservations per size (default 400)")
    ap.add_argument("--json", type=Path, default=RESULTS / "hostile-policy.json", help="where to write the JSON")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    info = report.machine_info()
    floods = []
    for spec in ("chain", "chain+session"):
        for bounded in (True, False):
            report.progress(f"flood {spec} bounded={bounded}")
            floods.append(flood(spec, args.cpu_blocks, bounded, args.requests, args.keys))
    print(report.table(
        ["policy", "bounds", "keys remembered", "MiB held", "CPU ms/request"],
        [[f["policy"], "yes" if f["bounded"] else "lifted", f"{f['remembered_keys']:,}",
          f"{f['held_bytes'] / 2**20:.1f}", f"{f['ms_per_request']:.0f}"] for f in floods],
        f"Policy memory after {args.requests} requests of {args.keys:,} never-seen keys "
        f"(CPU tier {args.cpu_blocks} blocks)"))
    ledgers = []
    for held in (int(x) for x in args.held.split(",")):
        report.progress(f"retention held={held}")
        ledgers.append(retention(held, args.probes))
    print()
    print(report.table(
        ["reservations held", "ledger CPU us", "list rule CPU us", "list / ledger"],
        [[f"{r['held']:,}", f"{r['ledger_us']:.1f}", f"{r['list_rule_us']:.0f}", f"{r['ratio']:.0f}x"]
         for r in ledgers],
        "One more retain_s reservation (deadlines out of order)"))
    print(f"\nload average at start: {report.loadavg_text(info['loadavg_at_start'])}")
    report.write_json(dict(machine=info | report.memory_facts(), floods=floods, retention=ledgers), args.json,
                      wall_s=time.monotonic() - t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
