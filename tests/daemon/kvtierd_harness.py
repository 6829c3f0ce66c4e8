"""Test harness: a real kvtierd process on a real ipc socket (tests/daemon, tests/client).

Loaded by ``tests/daemon/conftest.py`` and ``tests/client/conftest.py``.

``kvtierd_factory(**flags)`` starts ``python -m kvtier.daemon`` with
``--socket ipc://<tmp>/kvtier.sock`` plus the given flags (``gpu_bytes=4096``
becomes ``--gpu-bytes 4096``), waits until it answers ``health``, and kills
whatever is left at teardown. ``kvtierd_module_factory`` is the same with
module scope; ``kvtierd`` is one daemon with small tiers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.client.client import KvtierTimeout, probe_health

START_TIMEOUT_S = 30.0


@dataclass
class Daemon:
    endpoint: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str]
    env: dict[str, str]

    def restart(self) -> None:
        """Kill (SIGKILL) and start the same daemon again on the same socket."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = _spawn(self.argv, self.env, self.log_path)
        _wait_ready(self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send_signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        return self.proc.wait(timeout_s)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def _start(tmp_path: Path, name: str, flags: dict[str, object]) -> Daemon:
    sock_dir = tmp_path / name
    sock_dir.mkdir(parents=True, exist_ok=True)
    endpoint = f"ipc://{sock_dir}/kvtier.sock"
    argv = [sys.executable, "-m", "kvtier.daemon", "--socket", endpoint]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") and k != "NOTIFY_SOCKET"}
    log_path = sock_dir / "kvtierd.log"
    daemon = Daemon(endpoint, _spawn(argv, env, log_path), log_path, argv, env)
    _wait_ready(daemon)
    return daemon


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env)


def _wait_ready(daemon: Daemon) -> None:
    proc, endpoint = daemon.proc, daemon.endpoint
    deadline_s = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"kvtierd exited with {proc.returncode} at start-up:\n{daemon.log()}")
        try:
            probe_health(endpoint, timeout_s=0.2)
            return
        except KvtierTimeout:
            if time.monotonic() > deadline_s:
                proc.kill()
                raise RuntimeError(f"kvtierd did not answer health in {START_TIMEOUT_S}s:\n{daemon.log()}") from None


DEFAULT_FLAGS: dict[str, object] = {"log_level": "debug", "cpu_bytes": 64 * 1024, "gpu_bytes": 16 * 1024}


class _Starter:
    """Starts daemons under one folder and kills the ones still running at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[Daemon] = []

    def __call__(self, **flags: object) -> Daemon:
        daemon = _start(self.root, f"d{len(self.started)}", {**DEFAULT_FLAGS, **flags})
        self.started.append(daemon)
        return daemon

    def cleanup(self) -> None:
        for daemon in self.started:
            if daemon.proc.poll() is None:
                daemon.proc.kill()
                daemon.proc.wait(10)


@pytest.fixture
def kvtierd_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """A fresh daemon per call, for tests that stop, kill or restart it."""
    starter = _Starter(tmp_path)
    yield starter
    starter.cleanup()


@pytest.fixture(scope="module")
def kvtierd_module_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Daemon]]:
    """Daemons shared by the tests of one module (torch makes each start cost seconds)."""
    starter = _Starter(tmp_path_factory.mktemp("kvtierd"))
    yield starter
    starter.cleanup()


@pytest.fixture
def kvtierd(kvtierd_factory: Callable[..., Daemon]) -> Daemon:
    return kvtierd_factory()
