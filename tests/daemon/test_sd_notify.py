"""sd_notify datagrams arrive on a real unix socket, in order; the unit file verifies."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from kvtier.daemon.sd_notify import Notifier

REPO = Path(__file__).resolve().parents[2]


def _recv_all(sock: socket.socket) -> list[dict[str, str]]:
    messages = []
    sock.settimeout(0.2)
    while True:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            return messages
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
        messages.append(fields)


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    else:
        name = f"kvtier-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        address = "@" + name
    yield sock, address
    sock.close()


def test_ready_status_watchdog_stopping_arrive_in_order(notify_socket: tuple[socket.socket, str]) -> None:
    sock, address = notify_socket
    n = Notifier.from_environ({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000"})
    assert n.enabled and n.watchdog_interval_s == pytest.approx(1.0)
    assert n.status("allocating CPU tier: 1/4 chunks")
    assert n.ready("serving ipc:///run/kvtier-0/kvtierd.sock")
    assert n.watchdog_due(now_s=0.0)
    assert n.watchdog(now_s=100.0)
    assert not n.watchdog_due(now_s=100.9) and n.watchdog_due(now_s=101.0)
    assert n.stopping("draining 3 requests")
    got = _recv_all(sock)
    assert got == [
        {"STATUS": "allocating CPU tier: 1/4 chunks"},
        {"READY": "1", "STATUS": "serving ipc:///run/kvtier-0/kvtierd.sock", "MAINPID": str(os.getpid())},
        {"WATCHDOG": "1"},
        {"STOPPING": "1", "STATUS": "draining 3 requests"},
    ]


def test_without_notify_socket_everything_is_a_no_op() -> None:
    n = Notifier.from_environ({})
    assert not n.enabled
    assert not n.ready("x") and not n.watchdog_due(0.0)


def test_watchdog_for_another_pid_is_ignored() -> None:
    n = Notifier.from_environ({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval_s is None or os.getpid() == 1


def test_unreachable_socket_does_not_raise(tmp_path: Path) -> None:
    n = Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert n.ready("x") is False


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", ["kvtierd@.service", "kvtierd@0.service"])
def test_unit_file_verifies(tmp_path: Path, name: str) -> None:
    shutil.copy(REPO / "systemd" / "kvtierd@.service", tmp_path / name)
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / name)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kvtierd" not in proc.stderr, proc.stderr
