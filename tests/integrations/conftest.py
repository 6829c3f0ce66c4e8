"""Fixtures for the engine integration tests: real kvtierd processes (tests/daemon/kvtierd_harness.py)."""

from __future__ import annotations

import sys
from pathlib import Path

# The harness lives with the daemon tests; with --import-mode=importlib its
# folder has to be on the path explicitly.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from kvtierd_harness import Daemon, kvtierd_factory, kvtierd_module_factory  # noqa: E402,F401
