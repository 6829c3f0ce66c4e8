"""Which markers a test gets from where it lives, so that ``pytest -m "not slow"`` is a fast inner loop.

Contract: ``markers_for(rel_path, module_globals)`` returns the marker names
(``slow``, ``vllm``, ``stress``, ``redis``; registered in pyproject.toml) that ``tests/conftest.py`` adds
to a test, from its file's path relative to the repository root (posix
form) and its module's globals. Markers a test declares itself
(``@pytest.mark.slow``, ``install``) are kept; these are added on top:

- ``stress``: everything under ``tests/stress/`` (the reliability suite).
- ``vllm``: files named ``test_vllm*`` in ``tests/integrations`` and
  ``tests/examples``: they start vLLM (or import it, which alone takes
  seconds).
- ``redis``: modules that use ``kvtier.testing.redis_servers`` (they start
  their own redis-server processes).
- ``slow``: every ``stress`` and ``vllm`` test, and the files in
  ``SLOW_FILES``: those that took more than about 15 s on the 2-core
  development VM. A new slow file belongs there.

``never_selected(rel_path, markexpr)``: whether ``-m markexpr`` would
deselect every test of a file from its path's markers alone, whatever
other markers its tests carry; ``tests/conftest.py`` then does not even
import the file (importing vLLM alone costs seconds).

The full suite (``bash scripts/test.sh``, ``.ci/run``) selects nothing and
runs every test whatever its markers.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from _pytest.mark.expression import Expression

import kvtier.testing.redis_servers as redis_servers

STRESS_DIRS = ("tests/stress/",)
VLLM_PREFIXES = ("tests/integrations/test_vllm", "tests/examples/test_vllm")
# Files past about 15 s (idle) on the 2-core development VM, from `pytest -p fileclock` per-file wall and CPU
# (pytest plus the daemons it reaped) at load averages of 15-30 in November 2026, where CPU seconds (a
# floor for an idle machine's wall time) or wall time stood out; the remaining files were judged from
# what they start (a daemon per test, restarts, Redis clusters, large Hypothesis runs).
SLOW_FILES: frozenset[str] = frozenset({
    "tests/test_plain_install.py",  # builds a venv and pip-installs kvtier
    "tests/bench/test_gpu_qos_script.py",  # 133 s wall, 14 s CPU
    "tests/bench/test_restart_script.py",  # 162 s wall, 15 s CPU
    "tests/client/test_client.py",  # 218 s wall, 25 s CPU: reconnects, deadlines
    "tests/client/test_kv_share.py",  # 96 s wall, 10 s CPU
    "tests/daemon/test_client_limits.py",  # 289 s wall, 28 s CPU
    "tests/daemon/test_config_ranges.py",  # 153 s wall at load 15: a daemon per range
    "tests/daemon/test_connection_limits.py",  # 101 s wall, 26 s CPU
    "tests/daemon/test_disk_tier_daemon.py",  # 135 s wall, 16 s CPU
    "tests/daemon/test_engine_mode.py",  # 71 s wall, 7 s CPU
    "tests/daemon/test_events.py",  # 125 s wall, 11 s CPU
    "tests/daemon/test_hints_policy.py",  # 64 s wall, 6 s CPU
    "tests/daemon/test_hints_retention.py",  # 46 s wall, 9 s CPU
    "tests/daemon/test_lifecycle.py",  # 165 s wall, 17 s CPU: daemon stops and restarts
    "tests/daemon/test_policy_memory.py",  # 219 s wall, 22 s CPU: floods
    # judged, not measured in isolation: daemons per test, restarts, timeouts, Redis servers
    "tests/daemon/test_pool_budget.py",
    "tests/daemon/test_pool_names.py",
    "tests/daemon/test_prometheus.py",
    "tests/daemon/test_remote_tier_attacks.py",
    "tests/daemon/test_remote_tier_daemons.py",
    "tests/daemon/test_restart.py",
    "tests/daemon/test_sd_notify.py",
    "tests/daemon/test_security.py",
    "tests/daemon/test_standby.py",  # 136 s wall at load 8: primaries, standbys and successors importing torch
    "tests/daemon/test_unread_replies.py",
    "tests/examples/test_engine.py",
    "tests/tiers/test_remote_tier.py",  # Redis standalone and a 3-node cluster
    "tests/tiers/test_pool_remote.py",
    "tests/tiers/test_pool_state_machine.py",  # 400 Hypothesis programs
    "tests/tools/test_stats_top.py",
})


def markers_for(rel_path: str, module_globals: Mapping[str, Any]) -> set[str]:
    """The markers a test in ``rel_path`` (posix, from the repository root) gets from where it lives."""
    found: set[str] = set()
    if rel_path.startswith(STRESS_DIRS):
        found |= {"stress", "slow"}
    if rel_path.startswith(VLLM_PREFIXES):
        found |= {"vllm", "slow"}
    if any(_from_redis_servers(value) for value in module_globals.values()):
        found.add("redis")
    if rel_path in SLOW_FILES:
        found.add("slow")
    return found


def _from_redis_servers(value: object) -> bool:
    """``value`` is kvtier.testing.redis_servers or one of its functions or classes (``import ... as rs`` or
    ``from ... import``)."""
    if isinstance(value, ModuleType):
        return value is redis_servers
    return callable(value) and getattr(value, "__module__", None) == redis_servers.__name__


def never_selected(rel_path: str, markexpr: str) -> bool:
    """``-m markexpr`` deselects every test in ``rel_path`` from the markers its path gives (see the module
    docstring): false for each choice of the expression's other markers. False when unsure."""
    known = markers_for(rel_path, {})
    if not known or "=" in markexpr or "(" in markexpr.replace("not (", "").replace("and (", "").replace("or (", ""):
        return False  # nothing known from the path, or marker keyword arguments: let pytest decide
    try:
        expr = Expression.compile(markexpr)
    except Exception:  # pytest reports a bad expression itself
        return False
    others = sorted(set(re.findall(r"[A-Za-z_][\w.-]*", markexpr)) - {"and", "or", "not"} - known)
    if len(others) > 8:
        return False
    for values in itertools.product((False, True), repeat=len(others)):
        chosen = known | {name for name, on in zip(others, values) if on}
        if expr.evaluate(lambda name, chosen=chosen: name in chosen):
            return False
    return True
