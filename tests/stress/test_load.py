"""Sustained load, the CI version (``load_full.py`` is the full run: 16 processes, 60 s).

Six client processes (four store-mode, two engines) for ten seconds against
one daemon whose tiers are small enough that demotion and CPU-tier eviction
run all the time. Every restore and every engine hit is checked byte for
byte (or reported missing after eviction, never shorter than a pinned
prefix); every worker must finish (no deadlock, no call without a reply);
the daemon's RSS stays within its start-up RSS plus the configured capacity
plus a stated overhead (``LoadConfig.rss_overhead_bytes``). Hostile frames
from a fuzzing thread hit the same daemon all along; each gets its one
well-formed reply.

``KVTIER_LOAD_WORKERS`` / ``KVTIER_LOAD_SECONDS`` change the size.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

from tests.stress.loadlib import LoadConfig, print_summary, run_load

NUM_WORKERS = int(os.environ.get("KVTIER_LOAD_WORKERS", "6"))
DURATION_S = float(os.environ.get("KVTIER_LOAD_SECONDS", "10"))
# A loop stall (e.g. a full garbage collection over every object the daemon
# ever imported) delays every client at once; p99 stays low, the max shows it.
MAX_STALL_S = 1.0


def test_mixed_load_every_byte_checked_no_deadlock_bounded_rss(tmp_path: Path) -> None:
    cfg = LoadConfig(num_workers=NUM_WORKERS, duration_s=DURATION_S, root=str(tmp_path / "load"))
    result = run_load(cfg)
    print_summary(result)  # shown with -s, and on failure
    assert result["failures"] == [], result["failures"]
    assert result["daemon_alive"]
    assert result["rss"]["within_limit"], result["rss"]
    verbs = result["verbs"]
    for verb in ("lookup", "pin", "unpin", "store", "restore", "allocate", "append", "free"):
        assert verbs.get(verb, {}).get("count", 0) > 0, verb
    for verb, v in verbs.items():
        assert v["max_ms"] < MAX_STALL_S * 1e3, (verb, v)
    totals = result["daemon_pool_totals"]
    # The tiers were under pressure the whole time, and bytes really moved.
    assert totals["demotions"] > 1000 and totals["cpu_evictions"] > 1000, totals
    assert totals["hit_blocks_cpu"] > 0 and totals["restores"] > 0 and totals["copy_failures"] == 0
    assert result["outcomes"]["restored_blocks"] > 1000 and result["verified_bytes"] > 10 << 20
    assert result["fuzz"]["cases"] > 500 and result["fuzz"]["failures"] == []


def test_the_loop_freezes_its_startup_objects_out_of_the_cyclic_gc(tmp_path: Path) -> None:
    """Regression: a full collection walked torch's ~170k objects on the loop thread (0.2-0.3 s stalls)."""
    from kvtier.daemon.process.lifecycle import StopFlag
    from kvtier.daemon.server import ServeOptions, Server

    stop = StopFlag()
    stop.request("test")  # bind, then drain at once
    gc.unfreeze()
    try:
        server = Server(ServeOptions(endpoint=f"ipc://{tmp_path}/gc.sock"), stop, kv_import=lambda desc: (None, None))
        assert server.run() == 0
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
