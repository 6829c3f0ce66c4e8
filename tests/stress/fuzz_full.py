"""The full protocol-fuzzing run: >= 100k frames against one live kvtierd; a table and bench/results JSON.

Usage::

    python -m tests.stress.fuzz_full [--cases 100000] [--examples 5000] [--seed 1] \
        [--out bench/results/stress-fuzz.json]

Same checks as ``test_fuzz.py`` at a larger scale: Hypothesis-generated
structured requests (``--examples``), then ``--cases`` seeded frames spread
over every category of ``fuzzlib.CATEGORIES``. Every frame must get exactly
one well-formed reply (none only above the hard size limit), never
INTERNAL; afterwards the daemon answers health, its counters account for
every rejection, and every block a victim client stored beforehand restores
byte-exact. Exit status 0 when everything held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from tests.stress.fuzzlib import (
    CATEGORIES,
    CountingClient,
    FuzzCase,
    FuzzWorld,
    Judge,
    Victim,
    after_checks,
    hypothesis_requests,
    run_campaign,
    victim_snapshot,
)
from tests.stress.stresslib import (
    RESULTS_DIR,
    machine_description,
    print_table,
    start_stress_daemon,
    store_layout,
    write_result,
)

BLOCK_BYTES = 1024
GPU_BLOCKS = 16
CPU_BLOCKS = 64
MAX_PAYLOAD_BYTES = 8 * BLOCK_BYTES


def run_hypothesis(world: FuzzWorld, judge: Judge, examples: int, seed: int) -> list[str]:
    """Hypothesis over structured requests; returns the failure (shrunk) if one was found."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hyp_seed

    @hyp_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(hypothesis_requests(world))
    def one(frames: list[bytes]) -> None:
        before = judge.num_failures
        judge.send(FuzzCase("hypothesis", frames))
        assert judge.num_failures == before, judge.failures[-1]

    try:
        one()
    except Exception as exc:  # Hypothesis re-raises the shrunk failing example
        return [f"hypothesis: {exc}"]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100_000, help="seeded generated frames (default 100000)")
    ap.add_argument("--examples", type=int, default=5000, help="Hypothesis examples first (default 5000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "stress-fuzz.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the fuzz sessions' reconnect chatter

    root = Path(tempfile.mkdtemp(prefix="kvtier-fuzz-"))
    daemon = start_stress_daemon(root, flags={"gpu_bytes": GPU_BLOCKS * BLOCK_BYTES,
                                              "cpu_bytes": CPU_BLOCKS * BLOCK_BYTES,
                                              "max_message_bytes": MAX_PAYLOAD_BYTES, "lease_s": 5.0,
                                              "log_level": "warning"})
    try:
        layout = store_layout(BLOCK_BYTES)
        client = CountingClient(daemon.endpoint, "victim", layout)
        victim = Victim(client, BLOCK_BYTES)
        victim.store(num_chains=6, chain_blocks=8)
        errors_before, pool_before = victim_snapshot(victim)
        rss_before = daemon.rss_bytes()
        world = FuzzWorld.open(daemon.endpoint, BLOCK_BYTES, "victim", layout.to_wire(), MAX_PAYLOAD_BYTES)
        judge = Judge(daemon.endpoint, world.hard_limit_bytes)
        t0 = time.monotonic()
        print(f"kvtierd pid {daemon.pid}: {args.examples} Hypothesis examples, then {args.cases} generated frames",
              flush=True)
        problems = run_hypothesis(world, judge, args.examples, args.seed)
        hyp_s = time.monotonic() - t0
        gen_s = run_campaign(world, judge, args.cases, seed=args.seed, progress_every=20_000)
        problems += [f"frame: {f}" for f in judge.failures]
        problems += after_checks(victim, judge, errors_before, pool_before, daemon.log_path.read_text(errors="replace"))
        rss_after = daemon.rss_bytes()
        threads = daemon.num_threads()
        stats = client.stats()
        world.close()
        judge.close()
        client.close()
    finally:
        exit_code = daemon.stop()

    categories = ["hypothesis", *CATEGORIES]
    rows = []
    for cat in categories:
        outcomes = judge.by_category.get(cat, {})
        top = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])[:4])
        rows.append([cat, judge.cases[cat], outcomes.get("ok", 0), sum(outcomes.values()) - outcomes.get("ok", 0), top])
    print()
    print_table(["category", "cases", "ok", "rejected", "most common replies"], rows)
    total = sum(judge.cases.values())
    print(f"\n{total} cases ({judge.frames_sent} frames) in {hyp_s + gen_s:.1f} s "
          f"({total / (hyp_s + gen_s):.0f}/s); slowest reply {judge.slowest_s * 1e3:.1f} ms; "
          f"connections dropped at the hard limit {judge.dropped_connections}")
    print(f"daemon RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB, {threads} threads, "
          f"{len(stats['pools'])} pools, exit code after SIGTERM {exit_code}")
    print(f"failures: {judge.num_failures} frames; problems: {len(problems)}")
    for p in problems[:30]:
        print("  " + p)
    passed = not problems and judge.num_failures == 0 and exit_code == 0
    result = {
        "what": "protocol fuzzing against a live kvtierd (tests/stress/fuzz_full.py)",
        "machine": machine_description(),
        "args": {"cases": args.cases, "examples": args.examples, "seed": args.seed},
        "cases_total": total,
        "frames_total": judge.frames_sent,
        "seconds": round(hyp_s + gen_s, 2),
        "cases_per_s": round(total / (hyp_s + gen_s), 1),
        "slowest_reply_ms": round(judge.slowest_s * 1e3, 2),
        "cases_by_category": dict(judge.cases),
        "replies_by_category": {k: dict(v) for k, v in judge.by_category.items()},
        "replies": dict(judge.replies),
        "connections_dropped_at_hard_limit": judge.dropped_connections,
        "daemon_errors_total": stats["daemon"].get("errors_total", {}),
        "daemon_protocol_errors_total": stats["daemon"].get("protocol_errors_total", {}),
        "daemon_rss_bytes": {"before": rss_before, "after": rss_after},
        "daemon_threads_after": threads,
        "pools_after": len(stats["pools"]),
        "daemon_exit_code": exit_code,
        "victim": {"chains": len(victim.chains), "blocks": sum(len(c) for c in victim.chains), "byte_exact": not any(
            "victim" in p or "chain" in p for p in problems)},
        "problems": problems,
        "passed": passed,
    }
    print(f"wrote {write_result(args.out.stem, result) if args.out.parent == RESULTS_DIR else _write(args.out, result)}")
    return 0 if passed else 1


def _write(path: Path, result: dict[str, object]) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
