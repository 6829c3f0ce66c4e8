#!/usr/bin/env python3
"""What a CPU-tier policy costs per request in a live kvtierd: ``chain+session`` against ``chain``.

Usage:
    python bench/policy_cost.py [--requests 1500] [--rounds 3] [--trace PATH] [--json PATH]

Issue 36 item 4 makes ``chain+session`` the default policy only if its cost
per request in the daemon is within 1.2x of ``chain``'s. Without hints the
two decide alike (the session wrapper forwards every decision), so what is
measured is the wrapper's bookkeeping on the request path and in the
daemon's deferred learning.

Set-up, all on this machine in one run: one kvtierd per policy (same
sizes, ``--device cpu``, store-mode pools of small blocks so that copies
cost little next to the policy), started side by side. The requests are
the first ``--requests`` of a trace (default: the Mooncake conversation
trace, 512-token blocks), without hints, as an engine would send them:
``lookup`` of the request's blocks, then ``store`` of those not held.
Each request goes to every daemon, in a fresh random order per request, so
load drift on a shared machine hits both alike. Each round uses a new pool
in each daemon (cold caches); ``--rounds`` rounds.

Measured per round and daemon:

- the daemon's CPU time (user + system, from ``/proc`` via psutil) over the
  round, less its idle rate (measured before the rounds) times the round's
  length, divided by the requests: what a request costs the daemon, the
  deferred learning included (the round ends once both daemons have had
  ``--settle-s`` to learn what they owe);
- the round trip of lookup + store, p50 and mean, as the client sees it;
- how many lookups the two daemons answered differently. Without hints the
  policies decide alike (in-process, with learning at fixed points, every
  answer is the same), but in a daemon when learning runs and when copies
  land depend on timing, so some answers differ between any two daemons:
  ``--policies chain,chain`` runs that control (two daemons of one policy).
  Reported, not asserted.

The verdict: the median over rounds of the CPU-per-request ratio, against
1.2. Prints tables; writes ``bench/results/policy-cost-cpu.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from report import REPO, loadavg, loadavg_text, machine_info, memory_facts, percentile, progress, table, write_json

TARGET_RATIO = 1.2
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK_BYTES = 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file (default: %(default)s)")
    p.add_argument("--requests", type=int, default=1500, help="requests of the trace per round (default 1500)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each on new pools (default 3)")
    p.add_argument("--gpu-blocks", type=int, default=64, help="GPU tier blocks per pool (default 64)")
    p.add_argument("--cpu-blocks", type=int, default=2048, help="CPU tier blocks per pool (default 2048)")
    p.add_argument("--policies", default="chain,chain+session",
                   help="the baseline, then the candidate (default chain,chain+session)")
    p.add_argument("--settle-s", type=float, default=1.0, help="idle time after each round (default 1.0)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "policy-cost-cpu.json")
    args = p.parse_args(argv)
    if args.requests < 1 or args.rounds < 1:
        p.error("--requests and --rounds must be >= 1")
    if len(args.policies.split(",")) != 2:
        p.error("--policies takes two names: the baseline, then the candidate")
    return args


def cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.client.client import Client, PoolLayout
    from kvtier.testing.daemon import KvtierDaemon
    from kvtier.tools.traces import load_trace

    names = args.policies.split(",")
    # Labels: the policy names, numbered when they are the same (a control run: two daemons of one policy).
    policies = names if names[0] != names[1] else [f"{n} #{i + 1}" for i, n in enumerate(names)]
    baseline, candidate = policies
    requests = [r.keys for r in load_trace(args.trace, 512, limit=args.requests)]
    progress(f"{len(requests)} requests of {args.trace.name}, {statistics.fmean(map(len, requests)):.1f} blocks each")
    layout = PoolLayout(model="policy-cost", block_size=512, block_bytes=BLOCK_BYTES, dtype="bfloat16",
                        num_layers=1, kv_heads=1, head_dim=8, mode="store")
    rng = random.Random(args.seed)
    out: dict[str, Any] = {"machine": machine_info(), "trace": str(args.trace.name), "requests": len(requests),
                           "gpu_blocks": args.gpu_blocks, "cpu_blocks": args.cpu_blocks, "block_bytes": BLOCK_BYTES,
                           "policies": policies, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-policy-cost-") as tmp:
        daemons = {}
        try:
            for i, (policy, name) in enumerate(zip(policies, names)):
                flags = {"device": "cpu", "policy": name, "gpu_bytes": args.gpu_blocks * BLOCK_BYTES,
                         "cpu_bytes": args.cpu_blocks * BLOCK_BYTES, "log_level": "warning"}
                daemons[policy] = KvtierDaemon(Path(tmp) / f"d{i}", flags=flags, cwd=REPO)
                daemons[policy].spawn()
            time.sleep(1.0)
            t0 = {p: cpu_s(d.pid) for p, d in daemons.items()}
            w0 = time.perf_counter()
            time.sleep(3.0)
            idle_s = time.perf_counter() - w0
            idle_rate = {p: (cpu_s(d.pid) - t0[p]) / idle_s for p, d in daemons.items()}
            out["idle_cpu_share"] = idle_rate
            for rnd in range(args.rounds):
                clients = {p: Client(d.endpoint, f"round{rnd}", layout) for p, d in daemons.items()}
                payload = bytes(max(map(len, requests)) * BLOCK_BYTES)
                lat: dict[str, list[float]] = {p: [] for p in policies}
                differ = 0
                c0 = {p: cpu_s(d.pid) for p, d in daemons.items()}
                w0 = time.perf_counter()
                load0 = loadavg()
                for n, keys in enumerate(requests):
                    answers = {}
                    for p in rng.sample(policies, len(policies)):
                        c = clients[p]
                        s = time.perf_counter()
                        held = len(c.lookup(keys))
                        if held < len(keys):
                            c.store(keys[held:], memoryview(payload)[:(len(keys) - held) * BLOCK_BYTES])
                        lat[p].append(time.perf_counter() - s)
                        answers[p] = held
                    differ += answers[baseline] != answers[candidate]
                    if n % 250 == 0:
                        progress(f"round {rnd + 1}/{args.rounds}: {n}/{len(requests)}", end="")
                time.sleep(args.settle_s)  # both daemons learn what they owe
                wall_s = time.perf_counter() - w0
                used = {p: cpu_s(d.pid) - c0[p] - idle_rate[p] * wall_s for p, d in daemons.items()}
                stats = {p: clients[p].stats() for p in policies}
                for c in clients.values():
                    c.close()
                per_req = {p: used[p] / len(requests) for p in policies}
                row = {"round": rnd, "wall_s": wall_s, "loadavg": [load0, loadavg()],
                       "cpu_us_per_request": {p: 1e6 * per_req[p] for p in policies},
                       "cpu_ratio": per_req[candidate] / per_req[baseline],
                       "p50_us": {p: 1e6 * percentile(lat[p], 0.5) for p in policies},
                       "mean_us": {p: 1e6 * statistics.fmean(lat[p]) for p in policies},
                       "p50_ratio": percentile(lat[candidate], 0.5) / percentile(lat[baseline], 0.5),
                       "lookups_answered_differently": differ,
                       "policy_keys": {p: _pool_stat(stats[p], "policy_keys") for p in policies}}
                out["rounds"].append(row)
                progress(f"round {rnd + 1}: cpu/request {row['cpu_us_per_request'][baseline]:.0f} vs "
                         f"{row['cpu_us_per_request'][candidate]:.0f} us ({row['cpu_ratio']:.3f}x), "
                         f"p50 {row['p50_ratio']:.3f}x, differing answers {differ}")
        finally:
            for d in daemons.values():
                rc = d.stop()
                if rc not in (0, None):
                    progress(f"kvtierd exited {rc}:\n{d.log_tail()}")
    ratios = [r["cpu_ratio"] for r in out["rounds"]]
    out["cpu_ratio_median"] = statistics.median(ratios)
    out["p50_ratio_median"] = statistics.median(r["p50_ratio"] for r in out["rounds"])
    out["target_ratio"] = TARGET_RATIO
    out["within_target"] = out["cpu_ratio_median"] <= TARGET_RATIO
    out["loadavg_at_end"] = loadavg()
    out.update(memory_facts())
    return out


def _pool_stat(stats: dict[str, Any], key: str) -> Any:
    pools = stats.get("pools") or {}
    for pool in (pools.values() if isinstance(pools, dict) else pools):
        if isinstance(pool, dict) and key in pool:
            return pool[key]
    return stats.get(key)


def report(out: dict[str, Any]) -> None:
    baseline, candidate = out["policies"]
    rows = []
    for r in out["rounds"]:
        cpu = r["cpu_us_per_request"]
        rows.append([str(r["round"] + 1), f"{cpu[baseline]:.0f}", f"{cpu[candidate]:.0f}", f"{r['cpu_ratio']:.3f}",
                     f"{r['p50_us'][baseline]:.0f}", f"{r['p50_us'][candidate]:.0f}", f"{r['p50_ratio']:.3f}",
                     str(r["lookups_answered_differently"]), loadavg_text(r["loadavg"][0])])
    print(table(["round", f"{baseline} cpu us/req", f"{candidate} cpu us/req", "ratio",
                 f"{baseline} p50 us", f"{candidate} p50 us", "p50 ratio", "differing", "load at start"], rows,
                f"Daemon cost per request ({out['requests']} requests of {out['trace']}, no hints; lookup + store)"))
    verdict = "within" if out["within_target"] else "NOT within"
    print(f"\nmedian cpu ratio {out['cpu_ratio_median']:.3f} ({verdict} {out['target_ratio']}x); "
          f"median p50 ratio {out['p50_ratio_median']:.3f}; idle cpu share "
          + ", ".join(f"{p} {v:.4f}" for p, v in out["idle_cpu_share"].items())
          + f"; load at end {loadavg_text(out['loadavg_at_end'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = run(args)
    report(out)
    write_json(out, args.json, wall_s=time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
