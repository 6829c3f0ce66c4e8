"""Fixtures for the stress suite: kvtierd processes (``stresslib.start_stress_daemon``) killed at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.daemon import KvtierDaemon
from tests.stress.stresslib import start_stress_daemon


class _Daemons:
    """Starts daemons under one folder; kills (SIGKILL, by pid) those still running at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[KvtierDaemon] = []

    def __call__(self, *, env: dict[str, str] | None = None, **flags: Any) -> KvtierDaemon:
        flags = {"log_level": "info", **flags}
        daemon = start_stress_daemon(self.root / f"d{len(self.started)}", flags=flags, env=env)
        self.started.append(daemon)
        return daemon

    def cleanup(self) -> None:
        for daemon in self.started:
            daemon.kill()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., KvtierDaemon]]:
    """``start_daemon(env=..., **flags)``: a fresh kvtierd per call, killed at teardown."""
    daemons = _Daemons(tmp_path)
    yield daemons
    daemons.cleanup()


@pytest.fixture(scope="module")
def start_module_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., KvtierDaemon]]:
    """The same with module scope (a daemon start costs seconds of torch import)."""
    daemons = _Daemons(tmp_path_factory.mktemp("kvtierd"))
    yield daemons
    daemons.cleanup()
