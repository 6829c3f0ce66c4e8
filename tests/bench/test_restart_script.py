"""bench/restart.py, run small as a script: the restart benchmark must not rot between runs.

A check of the script (a 64 MiB tier in the test's folder), not a measurement:
the numbers of record are bench/results/restart-cpu.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_script_kills_restarts_and_counts_every_block(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "restart.py"), "--quick", "--arena-dir", str(tmp_path),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "restart-cpu.json").read_text())
    adopt = result["adopt"]
    assert adopt["served"] == adopt["adopted"] == result["blocks"] == 32 and adopt["wrong"] == 0
    assert adopt["first_request_hit"] and adopt["first_hit_exact"]
    assert not result["baseline_no_persistence"]["first_request_hit"]  # a private tier starts empty
    standby = result["standby"]  # SIGKILL with a standby waiting: it serves every block, each round
    assert len(standby["rounds"]) == 3 and standby["served"] == 32 and standby["wrong"] == 0
    assert all(r["first_request_hit"] and r["first_hit_exact"] and r["standby_rss_bytes"] > 0 for r in standby["rounds"])
    assert "with a standby: first hit" in out.stdout
    assert result["targets"]["served_share_met"] and "first hit" in out.stdout
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("kvtier-restart-bench")] == []  # cleaned up
