"""sd_notify datagrams arrive on a real unix socket, in order (from the Notifier and from a real kvtierd);
the unit file verifies; host memory a daemon cannot have is refused with the numbers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.daemon.process.sd_notify import Notifier

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
    assert n.last_status == "draining 3 requests"  # the loop's summary goes out only when it differs
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
@pytest.mark.parametrize("name", ["kvtierd@.service", "kvtierd@0.service", "kvtierd@.socket", "kvtierd@0.socket"])
def test_unit_file_verifies(tmp_path: Path, name: str) -> None:
    # A socket unit is verified with the service it activates beside it.
    instance = name.rsplit(".", 1)[0]
    for suffix in ("service", "socket"):
        shutil.copy(REPO / "systemd" / f"kvtierd@.{suffix}", tmp_path / f"{instance}.{suffix}")
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / name)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kvtierd" not in proc.stderr, proc.stderr


def test_socket_unit_listens_where_the_service_points_its_daemon() -> None:
    """kvtierd refuses an inherited socket that is not its configured one: the two units must agree."""
    service = (REPO / "systemd" / "kvtierd@.service").read_text()
    socket_unit = (REPO / "systemd" / "kvtierd@.socket").read_text()
    listen = next(line.split("=", 1)[1] for line in socket_unit.splitlines() if line.startswith("ListenStream="))
    assert f"Environment=KVTIER_SOCKET=ipc://{listen}" in service
    assert "FileDescriptorName=kvtierd" in socket_unit
    assert "ExecReload=/bin/kill -USR2 $MAINPID" in service and "RuntimeDirectoryPreserve=yes" in service


# ---- a real kvtierd -------------------------------------------------------------------------


def _daemon_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVTIER_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    env.update(extra)
    return env


def _collect(sock: socket.socket, until: Callable[[list[dict[str, str]]], bool], timeout_s: float,
             into: list[dict[str, str]]) -> list[dict[str, str]]:
    deadline = time.monotonic() + timeout_s
    while not until(into):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out; notifications so far: {into}")
        sock.settimeout(left)
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        into.append(dict(line.split("=", 1) for line in data.decode().splitlines() if line))
    return into


def test_real_daemon_sends_ready_after_bind_status_watchdog_and_stopping(tmp_path: Path) -> None:
    from kvtier.client.client import Client, PoolLayout, probe_health

    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    endpoint = f"ipc://{tmp_path}/d/kvtier.sock"
    env = _daemon_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC="400000")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.daemon", "--socket", endpoint, "--cpu-bytes", "65536", "--gpu-bytes", "16384",
         "--arena-dir", str(tmp_path)],  # its persistent CPU tier goes with the test's folder
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    got: list[dict[str, str]] = []
    try:
        _collect(notify, lambda m: any("READY" in x for x in m), 60.0, got)
        # READY means the socket is bound: the daemon answers at once.
        assert probe_health(endpoint, timeout_s=2.0)["status"] == "ok"
        ready = next(x for x in got if "READY" in x)
        assert ready["READY"] == "1" and ready["MAINPID"] == str(proc.pid) and endpoint in ready["STATUS"]
        assert "STATUS" in got[0] and "READY" not in got[0], "a STATUS line comes before READY (start-up)"
        layout = PoolLayout(model="m", block_size=4, block_bytes=1024, dtype="bfloat16", num_layers=1,
                            kv_heads=1, head_dim=8)
        with Client(endpoint, "p", layout) as c:
            c.store([b"\1" * 16], bytes(1024))
            # A new pool: a STATUS line about its CPU tier, then the summary with it.
            _collect(notify, lambda m: any("1 pools" in x.get("STATUS", "") for x in m), 10.0, got)
        assert any("allocating the CPU tier of pool 'p'" in x.get("STATUS", "") for x in got)
        # Watchdog pings at half of WATCHDOG_USEC (0.2 s): several within a second.
        n = sum("WATCHDOG" in x for x in got)
        _collect(notify, lambda m: sum("WATCHDOG" in x for x in m) >= n + 3, 3.0, got)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        _collect(notify, lambda m: any("STOPPING" in x for x in m), 5.0, got)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
    kinds = [next(k for k in ("READY", "STOPPING", "WATCHDOG", "STATUS") if k in x) for x in got]
    first_ready, stopping = kinds.index("READY"), kinds.index("STOPPING")
    assert kinds.count("READY") == 1 and first_ready < stopping
    assert "WATCHDOG" in kinds[first_ready:stopping]
    assert "READY" not in kinds[stopping:] and "WATCHDOG" not in kinds[stopping + 1:]
    assert got[stopping]["STOPPING"] == "1"


def test_oversize_cpu_tier_is_refused_at_start_with_the_numbers(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--socket", f"ipc://{tmp_path}/k.sock", "--cpu-bytes", "4096TiB"],
        env=_daemon_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("kvtierd: config error: cpu_bytes: the CPU tiers of this daemon need 4194304.00 GiB")
    assert str(4096 * 1024**4) in line and "available" in line and "default_pool.cpu_bytes" in line
    assert not (tmp_path / "k.sock").exists()


def test_configured_pools_are_checked_in_total(tmp_path: Path) -> None:
    import psutil

    half = psutil.virtual_memory().available // 2 + (1 << 30)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--socket", f"ipc://{tmp_path}/k.sock",
         "--pool", "a", f"cpu_bytes={half}", "--pool", "b", f"cpu_bytes={half}"],
        env=_daemon_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pools.a.cpu_bytes" in proc.stderr and "pools.b.cpu_bytes" in proc.stderr
    assert str(2 * half) in proc.stderr


def test_a_pool_created_by_hello_that_does_not_fit_is_refused_with_the_numbers(kvtierd_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from kvtier.client.client import Client, DaemonError, PoolLayout
    from kvtier.client.protocol import ErrorCode

    # Named pools are what start-up adds up; any other pool gets default_pool's size at its hello.
    config = tmp_path / "kvtierd.toml"
    config.write_text('[pools.small]\ncpu_bytes = 65536\n')
    daemon = kvtierd_factory(cpu_bytes="4096TiB", config=config)
    layout = PoolLayout(model="m", block_size=4, block_bytes=1 << 20, dtype="bfloat16", num_layers=1,
                        kv_heads=1, head_dim=8)
    with pytest.raises(DaemonError) as info:
        Client(daemon.endpoint, "big", layout, timeout_s=10.0)
    assert info.value.code == ErrorCode.NO_SPACE
    assert "pool 'big'" in info.value.message and str(4096 * 1024**4) in info.value.message
    assert "available" in info.value.message
    # A layout whose block fits no tier is refused too (issue 15, item 12); the daemon is fine.
    with pytest.raises(DaemonError) as info:
        Client(daemon.endpoint, "small", layout, timeout_s=10.0)
    assert info.value.code == ErrorCode.INVALID_FIELD and "no block" in info.value.message
    with Client(daemon.endpoint, "small", PoolLayout(**{**layout.to_wire(), "block_bytes": 4096})) as c:
        assert c.pool_info["cpu_blocks"] == 16
