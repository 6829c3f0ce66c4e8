#!/usr/bin/env python3
"""The same benchmarks on two checkouts of kvtier, side by side in one run: is a change slower?

Usage:
    git worktree add /tmp/kvtier-old main      # the old code, any checkout
    python bench/side_by_side.py --old /tmp/kvtier-old [--new .] [--rounds 4] [--benches replay,replay:chain,...]

A structural change (issue 36: "the benchmarks are no slower, compared side
by side with the old code in one run") is checked by running each benchmark
once per checkout per round, alternating which goes first, so load drift on
a shared machine falls on both alike. Each run is a child process that
imports ``kvtier`` from its own checkout (a throw-away import shim, as
``pip install -e`` would map it) and runs that checkout's own scripts.

Benchmarks (``--benches``, comma-separated):

- ``replay`` / ``replay:<policy>``: ``kvtier replay`` of a trace through
  each checkout's in-process pool (``--no-belady``), with the checkout's
  default policy or the named one. Measured: the child's CPU time (user +
  system); the hit rate is reported so that a decision change shows.
- ``tiers``: ``bench/tiers.py --sections ops`` (GPU-tier block manager).
  Measured: the median CPU seconds of its timed repetitions.
- ``protocol``: ``bench/protocol.py --sections lookup`` (a live daemon).
  Measured: ``Client.lookup`` of 256 hashes, p50, as a ratio to the raw ZMQ
  echo of the same run (the ratio cancels most of the load).
- ``restore`` (not in the default set): ``bench/protocol.py --sections
  restore --quick``, each data plane from each tier. Measured: the geometric
  mean of the kvtier variants' median restore times; each variant's median
  is kept beside it in the JSON (``variants_ms``) for per-plane ratios.

Reported per benchmark: the median over rounds of new / old (below 1:
the new code is faster). Prints a table; writes
``bench/results/side-by-side.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from report import REPO, loadavg, loadavg_text, machine_info, progress, table, write_json

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
# kvtier's subpackages and the checkout folders they live in (pyproject's package-dir).
SUBPACKAGES = ("tiers", "client", "daemon", "tools", "integrations", "testing", "blocks")
BENCHES = ("replay", "replay:chain", "tiers", "protocol")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, required=True, help="checkout of the old code (e.g. a `git worktree add` of main)")
    p.add_argument("--new", type=Path, default=REPO, help="checkout of the new code (default: this one)")
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs every benchmark on both (default 4)")
    p.add_argument("--benches", default=",".join(BENCHES),
                   help="comma-separated: replay, replay:<policy>, tiers, protocol, restore (default: %(default)s)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace for replay (default: %(default)s)")
    p.add_argument("--lookups", type=int, default=2000, help="timed lookups per protocol run (default 2000)")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "side-by-side.json")
    args = p.parse_args(argv)
    for tree in (args.old, args.new):
        if not all((tree / sub).is_dir() for sub in SUBPACKAGES):
            p.error(f"{tree} is not a kvtier checkout (it lacks one of {', '.join(SUBPACKAGES)})")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    for bench in args.benches.split(","):
        if bench not in ("tiers", "protocol", "restore", "replay") and not bench.startswith("replay:"):
            p.error(f"unknown benchmark {bench!r}: use replay, replay:<policy>, tiers, protocol or restore")
    if any(b.startswith("replay") for b in args.benches.split(",")) and not args.trace.is_file():
        p.error(f"no trace at {args.trace}: pass --trace")
    return args


def make_shim(tree: Path, root: Path) -> Path:
    """A folder whose ``kvtier`` maps each subpackage to ``tree``'s folder (what ``pip install -e`` does)."""
    shim = root / "kvtier"
    shim.mkdir(parents=True)
    for sub in SUBPACKAGES:
        if (tree / sub).is_dir():  # an older checkout may predate a subpackage (blocks)
            (shim / sub).symlink_to(tree.resolve() / sub)
    return root


def run_child(argv: list[str], tree: Path, shim: Path) -> tuple[float, float]:
    """Run ``argv`` in ``tree`` importing kvtier from it; its wall and CPU seconds (user + system)."""
    env = dict(os.environ, PYTHONPATH=str(shim))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{' '.join(argv[:3])} failed in {tree} (exit {done.returncode}); its output is above")
    return wall_s, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_bench(bench: str, tree: Path, shim: Path, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``bench`` on one checkout: its measure (lower is better) and what else it says."""
    out_json = scratch / "out.json"
    if bench.startswith("replay"):
        argv = [sys.executable, "-c", "import sys; from kvtier.tools.cli import main; sys.exit(main(sys.argv[1:]))",
                "replay", str(args.trace), "--no-belady", "-q", "--json", str(out_json)]
        if ":" in bench:
            argv += ["--policy", bench.split(":", 1)[1]]
        wall_s, cpu_s = run_child(argv, tree, shim)
        r = json.loads(out_json.read_text())
        return {"measure": cpu_s, "unit": "cpu s", "wall_s": wall_s, "policy": r["config"]["policy"],
                "block_hit_rate": r["block_hit_rate"]["total"], "replay_s": r["seconds"]}
    if bench == "tiers":
        argv = [sys.executable, "bench/tiers.py", "--sections", "ops", "--reps", "3", "--json", str(out_json)]
        wall_s, _ = run_child(argv, tree, shim)
        kv = json.loads(out_json.read_text())["ops"]["results"]["kvtier"]
        return {"measure": statistics.median(kv["cpu_seconds"]), "unit": "cpu s", "wall_s": wall_s,
                "us_per_request": kv["us_per_request"]}
    if bench == "restore":
        argv = [sys.executable, "bench/protocol.py", "--sections", "restore", "--quick", "--profile", "never",
                "--json", str(out_json)]
        wall_s, _ = run_child(argv, tree, shim)
        variants_ms = {f"{size} {name}": v["median_ms"]
                       for size, r in json.loads(out_json.read_text())["restore"].items()
                       for name, v in r["variants"].items() if name.startswith("kvtier ")}
        return {"measure": statistics.geometric_mean(variants_ms.values()), "unit": "restore ms (geomean)",
                "wall_s": wall_s, "variants_ms": variants_ms}
    argv = [sys.executable, "bench/protocol.py", "--sections", "lookup", "--lookups", str(args.lookups),
            "--profile", "never", "--json", str(out_json)]
    wall_s, _ = run_child(argv, tree, shim)
    variants = json.loads(out_json.read_text())["lookup"]["variants"]
    lookup_us, echo_us = variants["kvtier Client.lookup"]["p50_us"], variants["zmq echo (raw)"]["p50_us"]
    return {"measure": lookup_us / echo_us, "unit": "lookup/echo p50", "wall_s": wall_s,
            "lookup_p50_us": lookup_us, "echo_p50_us": echo_us}


def run(args: argparse.Namespace) -> dict[str, Any]:
    benches = args.benches.split(",")
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    out: dict[str, Any] = {
        "machine": machine_info(),
        "trees": {k: {"path": str(v), "commit": _commit(v)} for k, v in trees.items()},
        "benches": benches, "trace": args.trace.name, "lookups": args.lookups, "rounds": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-side-by-side-") as tmp:
        shims = {k: make_shim(v, Path(tmp) / f"shim-{k}") for k, v in trees.items()}
        scratch = Path(tmp)
        for rnd in range(args.rounds):
            order = ["old", "new"] if rnd % 2 == 0 else ["new", "old"]
            row: dict[str, Any] = {"round": rnd, "order": order, "loadavg": loadavg(), "runs": {}}
            for bench in benches:
                row["runs"][bench] = {}
                for which in order:
                    r = run_bench(bench, trees[which], shims[which], scratch, args)
                    row["runs"][bench][which] = r
                    progress(f"round {rnd + 1}/{args.rounds} {bench} {which}: {r['measure']:.4g} {r['unit']} "
                             f"(load {loadavg_text(loadavg())})")
            out["rounds"].append(row)
    out["summary"] = {}
    for bench in benches:
        ratios = [r["runs"][bench]["new"]["measure"] / r["runs"][bench]["old"]["measure"] for r in out["rounds"]]
        out["summary"][bench] = {
            "old_median": statistics.median(r["runs"][bench]["old"]["measure"] for r in out["rounds"]),
            "new_median": statistics.median(r["runs"][bench]["new"]["measure"] for r in out["rounds"]),
            "unit": out["rounds"][0]["runs"][bench]["old"]["unit"],
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        }
    out["loadavg_at_end"] = loadavg()
    return out


def _commit(tree: Path) -> str | None:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def report(out: dict[str, Any]) -> None:
    rows = []
    for bench, s in out["summary"].items():
        extra = ""
        if bench.startswith("replay"):
            first = out["rounds"][0]["runs"][bench]
            extra = (f"policy {first['old']['policy']} -> {first['new']['policy']}, hit rate "
                     f"{first['old']['block_hit_rate']:.4f} -> {first['new']['block_hit_rate']:.4f}")
        rows.append([bench, s["unit"], f"{s['old_median']:.4g}", f"{s['new_median']:.4g}", f"{s['ratio_median']:.3f}",
                     f"{s['ratio_min']:.3f}-{s['ratio_max']:.3f}", extra])
    trees = out["trees"]
    print(table(["bench", "measure", "old", "new", "new/old median", "range", "note"], rows,
                f"Old ({trees['old']['commit']}) beside new ({trees['new']['commit']}), "
                f"{len(out['rounds'])} rounds, alternating"))
    print(f"\nload at end {loadavg_text(out['loadavg_at_end'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = run(args)
    report(out)
    write_json(out, args.json, wall_s=time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
