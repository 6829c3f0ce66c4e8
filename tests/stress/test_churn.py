"""Engines churning pools and arenas under the CPU budget, the CI size (``churn_full.py``: the full run).

Four processes for eight seconds over 24 pool names, a budget of six pools:
pools are created, used and reclaimed all the time. Every restore is
checked byte for byte, no worker hangs, the daemon's RSS stays within its
start-up RSS plus the tiers the budget lets live plus a stated overhead,
and no arena file is left behind. ``KVTIER_CHURN_WORKERS`` /
``KVTIER_CHURN_SECONDS`` change the size.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.stress.churnlib import ChurnConfig, run_churn


def test_pools_and_arenas_churn_under_the_budget_every_byte_checked(tmp_path: Path) -> None:
    cfg = ChurnConfig(workers=int(os.environ.get("KVTIER_CHURN_WORKERS", "4")),
                      duration_s=float(os.environ.get("KVTIER_CHURN_SECONDS", "8")), root=str(tmp_path / "churn"))
    result = run_churn(cfg)
    assert result["failures"] == [], result["failures"][:10]
    assert result["daemon_alive_at_end"]
    t = result["totals"]
    assert t["hellos"] > 50 and t["restored_blocks"] > 50 * cfg.chain_blocks, t
    assert t["verified_bytes"] == t["restored_blocks"] * cfg.block_bytes
    assert result["pools_reclaimed"].get("reason=memory", 0) > 10, result["pools_reclaimed"]
    assert result["pools_at_end"] <= cfg.max_live_pools()
    assert result["rss"]["within_bound"], {k: v for k, v in result["rss"].items() if k != "curve_s_bytes"}
    assert result["shm_files_left"] == []
