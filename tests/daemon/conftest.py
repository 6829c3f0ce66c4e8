"""Fixtures for tests against a live kvtierd: see tests/daemon/kvtierd_harness.py."""

from __future__ import annotations

import sys
from pathlib import Path

# The harness is shared by tests/daemon and tests/client; with
# --import-mode=importlib its folder has to be on the path explicitly.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from kvtierd_harness import Daemon, kvtierd, kvtierd_factory, kvtierd_module_factory  # noqa: E402,F401
