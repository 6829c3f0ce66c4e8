"""Fixtures for tests against a live kvtierd: see tests/daemon/kvtierd_harness.py."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

# The harness is shared by tests/daemon and tests/client; with
# --import-mode=importlib its folder has to be on the path explicitly.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from kvtierd_harness import Daemon, kvtierd, kvtierd_factory, kvtierd_module_factory  # noqa: E402,F401


@pytest.fixture
def raw(daemon) -> Iterator[zmq.Socket]:  # type: ignore[no-untyped-def]
    """A bare DEALER on the test module's ``daemon``, for hand-made messages."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    yield sock
    sock.close()
    ctx.term()
