"""bench/gpu_qos.py's CPU fallback, run as a script: it must not rot between GPU sessions.

The GPU machine is lent by chance and for 15 minutes; a bench script that
fails there wastes the lease. On a CPU the script runs the same sections on
the thread engine (a check of the script, not a measurement).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_script_runs_and_reads_the_target_on_the_median_of_its_runs(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_qos.py"), "--out", str(tmp_path), "--reps", "2",
                          "--repeat", "3", "--requests", "10", "--sections", "restore,clean-ahead"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "gpu-qos-cpu.json").read_text())
    runs = result["restore_under_load_runs"]
    assert len(runs) == 3
    (row,) = result["restore_under_load"]
    assert row["engine"] == "default" and row["runs"] == 3
    assert row["ratios"] == [run[0]["ratio"] for run in runs]
    assert row["ratio"] == statistics.median(row["ratios"])
    assert row["met"] == (row["ratio"] <= 1.5) and row["runs_met"] == sum(r <= 1.5 for r in row["ratios"])
    assert row["demote_gbps_alone"] > 0
    assert [r["clean_ahead_blocks"] for r in result["clean_ahead"]] == [0, 64]
    assert "interference_default" not in result  # not asked for (and CUDA only)
    assert "Restore of one batch" in out.stdout and "each run" in out.stdout


def test_a_bad_section_is_a_clear_error() -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_qos.py"), "--sections", "restore,bogus"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and "--sections takes" in out.stderr
