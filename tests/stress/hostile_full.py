"""The long hostile run: issue 32's items 1 to 5 together against one kvtierd; a table and bench/results JSON.

Usage::

    python -m tests.stress.hostile_full [--seconds 300] [--out bench/results/stress-hostile.json]

The same attackers, engine and checks as ``test_hostile.py`` (see
``hostilelib``), longer. Prints the engine's counts, each attacker's, the
daemon's RSS against its bound (with the bound's terms), the policies' key
counts against theirs, what reached the daemon, and every failure; writes
the JSON (with the RSS curve); exit status 0 when everything held, 1
otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.stress.hostilelib import HostileConfig, run_hostile
from tests.stress.stresslib import RESULTS_DIR, machine_description, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300.0, help="how long the attack runs (default 300)")
    ap.add_argument("--seed", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "stress-hostile.json",
                    help="where the JSON goes (default bench/results/stress-hostile.json)")
    args = ap.parse_args(argv)
    cfg = HostileConfig(duration_s=args.seconds, seed=args.seed)
    print(f"issue 32 items 1-5 against one kvtierd for {cfg.duration_s:.0f} s, a well-behaved engine beside them; "
          f"descriptor limit {cfg.nofile}, max_sessions {cfg.max_sessions}, max_connections {cfg.max_connections}",
          flush=True)
    result = run_hostile(cfg, progress=True)
    result["what"] = "hostile and careless clients (issue 32 items 1-5) beside a well-behaved engine (tests/stress/hostile_full.py)"
    result["machine"] = machine_description()
    passed = bool(result["passed"])
    if args.out.parent.resolve() == RESULTS_DIR.resolve():
        path = write_result(args.out.stem, result)
    else:
        import json

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
        path = args.out
    print(f"wrote {path}; {'passed' if passed else 'FAILED'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
