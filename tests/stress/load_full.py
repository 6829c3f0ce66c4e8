"""The full sustained-load run: 16 client processes for 60 s; a table and bench/results JSON.

Usage::

    python -m tests.stress.load_full [--workers 16] [--seconds 60] [--out bench/results/stress-load.json]

The same load and checks as ``test_load.py`` (see ``loadlib``): store-mode
workers (inline and shared-memory planes) on one shared pool and engine
workers on pools of their own, overlapping prefix families, tiers small
enough that demotion and CPU-tier eviction never stop; every restored byte
checked; every worker must finish; daemon RSS within start-up RSS +
configured capacity + the stated overhead. Prints operations/s and
p50/p99/max latency per verb, the counts, and the RSS; exit status 0 when
everything held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.stress.loadlib import LoadConfig, print_summary, run_load
from tests.stress.stresslib import RESULTS_DIR, machine_description, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=16, help="client processes (default 16)")
    ap.add_argument("--seconds", type=float, default=60.0, help="load duration (default 60)")
    ap.add_argument("--engine-every", type=int, default=4, help="every N-th worker is an engine (default 4)")
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "stress-load.json")
    args = ap.parse_args(argv)
    cfg = LoadConfig(num_workers=args.workers, duration_s=args.seconds, engine_every=args.engine_every,
                     seed=args.seed)
    print(f"{args.workers} workers ({', '.join(f'{n} {r}' for r, n in sorted(_count(cfg.roles()).items()))}) "
          f"for {args.seconds:.0f} s; blocks {cfg.block_bytes} B, store pool GPU {cfg.gpu_blocks} / CPU "
          f"{cfg.cpu_blocks} blocks, engine KV {cfg.engine_blocks} blocks", flush=True)
    result = run_load(cfg, progress=True)
    print()
    print_summary(result)
    result["what"] = "sustained mixed load against one kvtierd (tests/stress/load_full.py)"
    result["machine"] = machine_description()
    result["latency_note"] = ("client-side wall time per call (ZMQ round trip + daemon work), all client processes "
                              "and the daemon sharing the machine's cores")
    out = args.out
    path = write_result(out.stem, result) if out.parent == RESULTS_DIR else _write(out, result)
    print(f"wrote {path}")
    return 0 if result["passed"] else 1


def _count(roles: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in roles:
        counts[r] = counts.get(r, 0) + 1
    return counts


def _write(path: Path, result: dict[str, object]) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
