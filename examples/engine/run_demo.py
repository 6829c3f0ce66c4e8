#!/usr/bin/env python3
"""The main job: kvtierd in its own process, a real transformers engine on it, a multi-turn chat.

1. starts ``kvtierd`` (``python -m kvtier.daemon``) on a private ipc socket;
2. builds the example engine (a random-init Llama, see ``paged_llama``) whose
   paged KV pool is shared with the daemon (/dev/shm here, CUDA IPC on a GPU)
   and registered as the daemon's GPU tier (engine-managed mode);
3. replays the chat workload (``chat_workload.py``): conversations sharing a
   system prompt, turns served round-robin, a GPU tier small enough that
   earlier turns are evicted and demoted to the daemon's CPU tier, then every
   prompt again with caching defeated, for recompute TTFT and an exactness
   check;
4. prints the per-turn hit/TTFT table and totals, writes the JSON report;
5. stops the daemon with SIGTERM and checks that it exits 0.

Exit status: 0 when everything above holds (outputs identical with and
without reuse, daemon exit 0), 1 otherwise.

``--model-size small`` (default, ~56M parameters) takes a minute or two on a
2-core CPU; ``--model-size 200m`` is the benchmark model (slower);
``--model-size tiny`` finishes in seconds (smoke test). When other
processes keep the CPU busy and ``--threads`` is not given, the engine uses
one torch thread (said on the console): timings stay steady.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from kvtier.testing.daemon import KvtierDaemon, daemon_available

# This folder's modules: run as a script, its folder is first on the path.
from chat_workload import build_parser, run
from paged_llama import KVGeometry, model_config


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.epilog = "\n\n".join(__doc__.split("\n\n")[1:])
    parser.set_defaults(backend="daemon")
    # The demo starts its own daemon: no backend or endpoint to choose.
    for flag in ("--backend", "--endpoint"):
        parser._option_string_actions[flag].help = argparse.SUPPRESS
    parser._option_string_actions["--cpu-blocks"].help = "the daemon's CPU tier size in blocks (default: 4096)"
    args = parser.parse_args(argv)
    if args.backend != "daemon" or args.endpoint:
        parser.error("run_demo.py starts and uses its own kvtierd; run chat_workload.py for other set-ups")
    if not daemon_available():
        print("kvtierd or kvtier.client is not importable here; cannot run the demo", file=sys.stderr)
        return 1

    cores = os.cpu_count() or 1
    if args.threads is None and os.getloadavg()[0] > 0.5 * cores:
        # On a busy machine torch's parallel regions stall on descheduled
        # threads (seconds per forward on 2 cores); one thread stays steady.
        args.threads = 1
        print(f"the machine is busy (load average {os.getloadavg()[0]:.1f} on {cores} cores): running the engine with "
              f"1 torch thread for steadier timings (override with --threads)")
    block_bytes = KVGeometry.of(model_config(args.model_size)).block_bytes
    # One OpenMP thread for the daemon: its copies are memory-bound and would
    # otherwise fight the engine's compute threads. KVTIER_* settings of the
    # user's environment reach it, as they would a kvtierd started by hand.
    flags = {"cpu_bytes": args.cpu_blocks * block_bytes, "device": args.device, "log_level": "info"}
    daemon = KvtierDaemon(flags=flags, omp_threads=1, keep_kvtier_env=True)
    t0 = time.perf_counter()
    daemon.spawn()
    args.endpoint = daemon.endpoint
    print(f"kvtierd started (pid {daemon.pid}) on {args.endpoint} in {time.perf_counter() - t0:.1f} s; "
          f"CPU tier {args.cpu_blocks} blocks ({args.cpu_blocks * block_bytes / 2**20:.0f} MiB)")
    ok = False
    try:
        report = run(args)
        ex = report.get("exactness")
        ok = ex is None or (ex["max_abs_logit_diff"] <= 1e-4 and ex["same_greedy_outputs"] == ex["requests"])
        if not ok:
            print("FAILED: reuse changed the outputs", file=sys.stderr)
    finally:
        rc = daemon.stop()
        print(f"kvtierd stopped with SIGTERM: exit code {rc}")
        if rc != 0:
            print(daemon.log_tail(), file=sys.stderr)
        daemon.cleanup()
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
