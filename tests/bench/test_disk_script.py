"""bench/disk.py run as a script (a check of the script, not a measurement): it must not rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_script_measures_dd_and_the_tier_alternately(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "disk.py"), "--quick", "--block-mib", "0.25",
                          "--blocks", "24", "--fetch-blocks", "8", "--dir", str(tmp_path / "disk"),
                          "--json", str(tmp_path / "disk.json")],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "disk.json").read_text())
    assert len(result["rounds"]) == 2
    assert set(result["reads"]) == {"dd", "tier shuffled", "tier sequential", "tier unaligned"}
    for run in result["rounds"]:
        assert all(rate > 0 for rate in run.values())
    assert result["reads"]["tier shuffled"]["ratio_median"] > 0
    assert "vs dd" in out.stdout and "target: tier shuffled >= 70% of dd" in out.stdout
