"""bench/hostile_policy.py, run as a script with small sizes: it must not rot (a check of the script, not a
measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_script_runs_and_the_bounds_hold_where_they_are_lifted_they_do_not(tmp_path: Path) -> None:
    out_json = tmp_path / "hostile.json"
    out = subprocess.run([sys.executable, str(REPO / "bench" / "hostile_policy.py"), "--cpu-blocks", "16",
                          "--requests", "3", "--keys", "6000", "--held", "100,1000", "--probes", "8",
                          "--json", str(out_json)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_json.read_text())
    floods = {(f["policy"], f["bounded"]): f for f in result["floods"]}
    assert floods["chain", True]["remembered_keys"] == 4096  # MIN_HISTORY_KEYS: 16 blocks are few
    assert floods["chain", False]["remembered_keys"] == 3 * 6000
    # Three sessions of 6,000 keys hold 18,000 > MIN_CHAIN_KEYS (16,384): the oldest stream is forgotten.
    assert floods["chain+session", True]["remembered_keys"] == 4096 + 2 * 6000
    assert floods["chain+session", False]["remembered_keys"] == 2 * 3 * 6000
    assert [r["held"] for r in result["retention"]] == [100, 1000]
    assert all(r["ledger_us"] > 0 and r["list_rule_us"] > 0 for r in result["retention"])
    assert "Policy memory after 3 requests" in out.stdout and "retain_s reservation" in out.stdout
