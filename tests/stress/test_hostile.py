"""Hostile and careless clients together, the CI version (``hostile_full.py`` is the long run; issue 32).

Issue 32's items 1 to 5 at once against one kvtierd for ``KVTIER_HOSTILE_SECONDS`` (default 60):
lookups of never-stored hashes under ``chain`` and ``chain+session`` (a new session each), careless
pinned batches with 256-character sessions, connection floods beside a busy loop, clients that never
read their replies, a flood of sessions, and an attacker writing to the remote tier's Redis. Beside
them a well-behaved engine (``hostilelib.GoodEngine``). Its requests must all be answered without an
error, its blocks byte-exact, its pins gone once its requests end; the careless client's pins too; the
daemon must stay up, log no traceback, answer no INTERNAL, keep each pool's policy within its key
bound and its RSS within ``memory_bound.rss_bound`` of the configuration. Every attack must have reached
the daemon (``coverage``), or the run shows nothing.

Asserts correctness and bounds, not speeds: on a loaded 2-core machine the engine does ~20 steps.
"""

from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

import pytest

from kvtier.testing import redis_servers as rs
from tests.stress.hostilelib import HostileConfig, print_summary, run_hostile

SECONDS = float(os.environ.get("KVTIER_HOSTILE_SECONDS", "60"))


@pytest.mark.skipif(not rs.have_redis(), reason=rs.MISSING_REASON)
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="prlimit(1) is not available")
def test_items_1_to_5_together_leave_a_well_behaved_engine_served_byte_exact_within_the_memory_bound(
        tmp_path: Path) -> None:
    cfg = HostileConfig(duration_s=SECONDS, root=str(tmp_path / "hostile"))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < max(cfg.nofile, cfg.flood_connections + 64):
        pytest.skip(f"the daemon and the flooding processes need {cfg.nofile} descriptors")
    result = run_hostile(cfg)
    print_summary(result)  # shown with -s, and on failure
    assert result["failures"] == [], result["failures"]
    assert all(result["coverage"].values()), result["coverage"]
    engine = result["engine"]
    counts = engine["counts"]
    assert engine["steps"] >= 5 and counts["verified_blocks"] > 0, engine
    assert not [k for k in counts if k.startswith("errors_")], counts  # none of any kind
    assert set(engine["pinned_blocks_at_end"].values()) == {0}, engine["pinned_blocks_at_end"]
    assert result["rss"]["within_bound"], {k: v for k, v in result["rss"].items() if k != "curve_s_bytes"}
    assert result["daemon"]["alive_at_end"] and result["daemon"]["exit_code"] == 0
