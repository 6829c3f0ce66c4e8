"""The full churn run: engines creating, using and leaving pools and arenas under the CPU budget.

Usage::

    python -m tests.stress.churn_full [--workers 8] [--seconds 60] [--pool-names 48]

The same loop and checks as ``test_churn.py`` (see ``churnlib``), longer and
wider. Prints the counts and the RSS against its bound, writes
``bench/results/stress-churn.json`` with the RSS curve (seconds, bytes);
exit status 0 when everything held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

from tests.stress.churnlib import MIB, ChurnConfig, run_churn
from tests.stress.stresslib import machine_description, print_table, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8, help="engine processes (default 8)")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long they churn (default 60)")
    ap.add_argument("--pool-names", type=int, default=48, help="distinct pool names they pick from (default 48)")
    ap.add_argument("--budget-pools", type=int, default=8, help="CPU budget, in pools' worth of CPU tier (default 8)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    cfg = ChurnConfig(workers=args.workers, duration_s=args.seconds, pool_names=args.pool_names,
                      budget_bytes=args.budget_pools * MIB, seed=args.seed)
    print(f"{cfg.workers} engines for {cfg.duration_s:.0f} s over {cfg.pool_names} pool names; budget "
          f"{cfg.max_live_pools()} pools ({cfg.budget_bytes // MIB} MiB of CPU tiers)", flush=True)
    result = run_churn(cfg, progress=True)
    t, rss = result["totals"], result["rss"]
    print_table(["hellos", "refused", "stores", "restored blocks", "short restores", "verified MiB",
                 "pools reclaimed", "failures"],
                [[t["hellos"], t["refused_hellos"], t["stores"], t["restored_blocks"], t["short_restores"],
                  t["verified_bytes"] / MIB, result["pools_reclaimed"].get("reason=memory", 0),
                  len(result["failures"])]])
    print(f"RSS: start {rss['start_bytes'] / MIB:.0f} MiB, max {rss['max_bytes'] / MIB:.0f} MiB, bound "
          f"{rss['bound_bytes'] / MIB:.0f} MiB ({'within' if rss['within_bound'] else 'OVER'}); shm files left: "
          f"{len(result['shm_files_left'])}")
    result["what"] = "engines churning pools and arenas under the CPU budget (tests/stress/churn_full.py)"
    result["machine"] = machine_description()
    passed = (not result["failures"] and rss["within_bound"] and not result["shm_files_left"]
              and result["daemon_alive_at_end"])
    result["passed"] = passed
    print(f"wrote {write_result('stress-churn', result)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
