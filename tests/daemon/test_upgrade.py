"""Zero-downtime upgrade and socket activation (issue 34 item 3): real kvtierd processes hand over a live socket.

A client keeps restoring blocks, each checked byte for byte against the key
it was stored under, while the daemon behind the socket changes: SIGUSR2
(``systemctl reload``: the daemon starts its successor and hands it the
listening socket and the CPU tier), or a stop and a new start on a socket
the test holds as systemd would (``kvtierd@.socket``). The client must see
no failed call, at most one call sent more than once, and every block back.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.client.client import Client, PoolLayout, probe_health
from kvtier.testing.daemon import KvtierDaemon

BB = 4096
N_BLOCKS = 48
LAYOUT = PoolLayout(model="upgrade", block_size=4, block_bytes=BB, dtype="bfloat16", num_layers=1, kv_heads=1,
                    head_dim=8)
FLAGS: dict[str, object] = {"log_level": "info", "gpu_bytes": 0, "cpu_bytes": 256 * BB}
START_TIMEOUT_S = 180.0  # two daemons start at once on a loaded 2-core host: seconds each, importing torch
CALL_TIMEOUT_S = 120.0  # a cold restart's gap (a whole start) must not time the client's calls out


def key(i: int) -> bytes:
    return struct.pack("<QQ", 0x3433, i)


def content(k: bytes) -> bytes:
    seed = hashlib.sha256(k).digest()
    return (seed * (BB // len(seed) + 1))[:BB]


KEYS = [key(i) for i in range(N_BLOCKS)]


class CountingClient(Client):
    """A Client that counts what it sends per call: a call sent more than once was retried."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sends: Counter[str] = Counter()
        super().__init__(*args, **kwargs)
        real = self._roundtrip

        def counted(op: str, *a: Any, **kw: Any) -> Any:
            self.sends[op] += 1
            return real(op, *a, **kw)

        self._roundtrip = counted  # type: ignore[method-assign]


class Restorer:
    """A thread that restores random runs of KEYS until stopped: failures, wrong bytes, calls sent twice."""

    def __init__(self, c: CountingClient, seed: int) -> None:
        self.c = c
        self.seed = seed
        self.calls = 0
        self.retried: list[dict[str, int]] = []  # the sends of each call that took more than one
        self.errors: list[str] = []
        self.wrong = 0
        self.max_call_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Restorer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT_S + 10)

    def wait_calls(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        target = self.calls + n
        while self.calls < target:
            assert time.monotonic() < deadline and not self.errors, (self.calls, self.errors)
            time.sleep(0.01)

    def _run(self) -> None:
        import random

        rng = random.Random(self.seed)
        while not self._stop.is_set():
            start = rng.randrange(N_BLOCKS - 8)
            batch = KEYS[start:start + 1 + rng.randrange(8)]
            before = dict(self.c.sends)
            t0 = time.monotonic()
            try:
                r = self.c.restore(batch)
                data = bytes(r.data)
                if len(r.tiers) != len(batch):
                    self.errors.append(f"restore served {len(r.tiers)} of {len(batch)} blocks")
                self.wrong += sum(data[j * BB:(j + 1) * BB] != content(k) for j, k in enumerate(batch[:len(r.tiers)]))
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.max_call_s = max(self.max_call_s, time.monotonic() - t0)
            sent = {op: n - before.get(op, 0) for op, n in self.c.sends.items() if n != before.get(op, 0)}
            if sum(sent.values()) > 1:
                self.retried.append(sent)
            self.calls += 1


def store_all(c: Client) -> None:
    assert c.store(KEYS, b"".join(content(k) for k in KEYS)) == (N_BLOCKS, 0)


def all_served(c: Client) -> None:
    r = c.restore(KEYS)
    assert len(r.tiers) == N_BLOCKS
    data = bytes(r.data)
    assert all(data[j * BB:(j + 1) * BB] == content(k) for j, k in enumerate(KEYS))


class Notifications:
    """systemd's side of NOTIFY_SOCKET, read as it arrives (a full datagram queue would block the daemons)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.got: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.got.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def daemons() -> Iterator[list[KvtierDaemon]]:
    started: list[KvtierDaemon] = []
    yield started
    for d in started:
        d.kill()


def test_upgrade_hands_the_socket_and_the_cpu_tier_to_a_successor_while_a_client_restores(
        tmp_path: Path, daemons: list[KvtierDaemon]) -> None:
    notify = Notifications(tmp_path / "notify.sock")
    d = KvtierDaemon(tmp_path / "d", flags=FLAGS, start_timeout_s=START_TIMEOUT_S,
                     env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    daemons.append(d)
    d.spawn()
    path = Path(d.socket_file)
    inode = path.stat().st_ino
    old_pid = d.pid
    with CountingClient(d.endpoint, "p", LAYOUT, timeout_s=CALL_TIMEOUT_S) as c:
        store_all(c)
        with Restorer(c, seed=1) as r:
            r.wait_calls(20)
            assert d.upgrade() == 0, d.log_tail(40)
            r.wait_calls(50)
        assert r.errors == [] and r.wrong == 0, (r.errors, d.log_tail(40))
        # The call in flight at the swap was answered SHUTTING_DOWN and sent again: it alone.
        assert len(r.retried) <= 1, r.retried
        assert probe_health(d.endpoint)["pid"] == d.pid != old_pid
        all_served(c)
        s = d.stats()["pools"]["p"]
        assert s["cpu_adopted_blocks"] == N_BLOCKS and s["cpu_adoption_dropped_blocks"] == 0
    # The very socket, never unlinked nor re-created.
    assert path.stat().st_ino == inode
    log = d.log()
    assert "hand-over: kvtierd pid %d is ready" % d.pid in log and "stopped: handed over" in log
    # systemd learns the successor is the main process; the old daemon never says STOPPING.
    got = notify.got
    assert any(m.get("MAINPID") == str(d.pid) and m.get("READY") == "1" for m in got), got
    assert any(m.get("RELOADING") == "1" for m in got), got
    assert not any("STOPPING" in m for m in got), got
    # The successor stops like any daemon: drained, its socket file removed (a kvtierd made it).
    assert d.stop() == 0
    assert not path.exists()
    notify.close()


def test_an_upgrade_whose_successor_cannot_start_leaves_the_daemon_serving(tmp_path: Path,
                                                                         daemons: list[KvtierDaemon]) -> None:
    config = tmp_path / "kvtierd.toml"
    config.write_text("lease_s = 10\n")
    d = KvtierDaemon(tmp_path / "d", flags={**FLAGS, "config": config}, start_timeout_s=START_TIMEOUT_S)
    daemons.append(d)
    d.spawn()
    pid = d.pid
    path = Path(d.socket_file)
    inode = path.stat().st_ino
    with CountingClient(d.endpoint, "p", LAYOUT, timeout_s=CALL_TIMEOUT_S) as c:
        store_all(c)
        before = d.stats()["pools"]["p"]
        sid = c._session.sid
        with Restorer(c, seed=2) as r:
            config.write_text("lease_s = -1\n")  # the new start refuses this: exit 2
            d.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + START_TIMEOUT_S
            while "upgrade failed" not in d.log():
                assert time.monotonic() < deadline, d.log_tail(30)
                time.sleep(0.1)
            r.wait_calls(20)
        assert r.errors == [] and r.wrong == 0 and r.retried == [], (r.errors, r.retried)
        assert probe_health(d.endpoint)["pid"] == pid
        assert "exit status 2" in d.log()
        # Nothing changed: the same socket file, the same CPU tier (nothing released, nothing adopted), the same
        # session (no call was answered SHUTTING_DOWN), every block there.
        assert path.stat().st_ino == inode
        after = d.stats()["pools"]["p"]
        assert after["cpu_used_blocks"] == before["cpu_used_blocks"] == N_BLOCKS, (before, after)
        assert after["cpu_adopted_blocks"] == before["cpu_adopted_blocks"] == 0
        assert c._session.sid == sid
        all_served(c)
        # Fixed, the next upgrade goes through, the cache with it.
        config.write_text("lease_s = 10\n")
        assert d.upgrade() == 0
        assert d.pid != pid
        all_served(c)


# The successor crashes while it adopts (after the release, before it serves): a launcher that runs kvtierd's
# main() (the command the successor is started with too) and, in the successor only, breaks the adoption.
CRASHING_SUCCESSOR = (
    "import os, sys\n"
    "if os.environ.get('KVTIER_HANDOVER_FDS'):\n"
    "    from kvtier.daemon.pooling import pools\n"
    "    def crash(self, *args, **kwargs):\n"
    "        os._exit(3)\n"
    "    pools.PoolRegistry.adopt_arenas = crash\n"
    "from kvtier.daemon.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_a_successor_that_dies_after_the_release_gives_the_cpu_tier_back(tmp_path: Path,
                                                                         daemons: list[KvtierDaemon]) -> None:
    d = KvtierDaemon(tmp_path / "d", flags=FLAGS, start_timeout_s=START_TIMEOUT_S,
                     command=(sys.executable, "-c", CRASHING_SUCCESSOR))
    daemons.append(d)
    d.spawn()
    pid = d.pid
    with CountingClient(d.endpoint, "p", LAYOUT, timeout_s=CALL_TIMEOUT_S) as c:
        store_all(c)
        with Restorer(c, seed=3) as r:
            d.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + START_TIMEOUT_S
            while "upgrade failed" not in d.log():
                assert time.monotonic() < deadline, d.log_tail(30)
                time.sleep(0.1)
            r.wait_calls(20)
        # The requests held during the release ran here after all; sessions ended with the release.
        assert r.errors == [] and r.wrong == 0, (r.errors, d.log_tail(30))
        assert probe_health(d.endpoint)["pid"] == pid
        assert "went away after the release" in d.log()
        all_served(c)
        assert d.stats()["pools"]["p"]["cpu_adopted_blocks"] == N_BLOCKS


def test_a_predecessor_killed_during_the_upgrade_leaves_its_successor_to_adopt(tmp_path: Path,
                                                                              daemons: list[KvtierDaemon]) -> None:
    from kvtier.testing.daemon import ReparentedProcess, become_subreaper

    d = KvtierDaemon(tmp_path / "d", flags=FLAGS, start_timeout_s=START_TIMEOUT_S)
    daemons.append(d)
    d.spawn()
    become_subreaper()
    old = d.pid
    with CountingClient(d.endpoint, "p", LAYOUT, timeout_s=CALL_TIMEOUT_S) as c:
        store_all(c)
        d.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "SIGUSR2: upgrading" not in d.log():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        d.kill()  # SIGKILL while the successor starts
        new = None
        while new is None or new == old:
            assert time.monotonic() < deadline, d.log_tail(30)
            try:
                new = probe_health(d.endpoint, timeout_s=0.5)["pid"]
            except Exception:  # noqa: BLE001 - nobody answers until the successor adopted and serves
                time.sleep(0.1)
        d.proc = ReparentedProcess(new)
        all_served(c)
        assert "died before it released" in d.log()
        assert d.stats()["pools"]["p"]["cpu_adopted_blocks"] == N_BLOCKS


def test_a_restart_that_binds_the_socket_anew_costs_the_client_no_failed_call(tmp_path: Path,
                                                                             daemons: list[KvtierDaemon]) -> None:
    # systemctl restart without the socket unit: the stopping daemon removes its socket file as it starts to drain,
    # so the client's new connection waits for the next daemon's rather than reaching the old one again.
    d = KvtierDaemon(tmp_path / "d", flags=FLAGS, start_timeout_s=START_TIMEOUT_S)
    daemons.append(d)
    d.spawn()
    path = Path(d.socket_file)
    with CountingClient(d.endpoint, "p", LAYOUT, timeout_s=CALL_TIMEOUT_S) as c:
        store_all(c)
        with Restorer(c, seed=5) as r:
            r.wait_calls(20)
            assert d.stop() == 0
            assert not path.exists()
            d.spawn()
            r.wait_calls(20)
        assert r.errors == [] and r.wrong == 0, (r.errors, d.log_tail(30))
        assert len(r.retried) <= 1, r.retried
        all_served(c)
        assert d.stats()["pools"]["p"]["cpu_adopted_blocks"] == N_BLOCKS


def test_a_stopping_daemon_removes_its_own_socket_file_and_never_a_newer_one(tmp_path: Path) -> None:
    from kvtier.daemon.process.listener import bind_listener

    path = tmp_path / "s" / "kvtierd.sock"
    old = bind_listener(f"ipc://{path}", 0o600)
    os.unlink(path)  # (as a draining daemon does first) ...
    new = bind_listener(f"ipc://{path}", 0o600)  # ... and a new daemon binds the path meanwhile
    inode = path.stat().st_ino
    try:
        old.close(remove_file=True)
        assert path.exists() and path.stat().st_ino == inode, "the old daemon removed the new one's socket file"
    finally:
        new.close(remove_file=True)
    assert not path.exists()


# ---- socket activation: the test holds the socket, as systemd does for kvtierd@.socket ---------------------


def listening_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o660)
    sock.listen(128)
    return sock


def test_socket_activation_a_restart_keeps_the_socket_and_the_client_waits_instead_of_failing(
        tmp_path: Path, daemons: list[KvtierDaemon]) -> None:
    workdir = tmp_path / "d"
    workdir.mkdir(mode=0o700)
    path = workdir / "kvtierd.sock"
    held = listening_socket(path)
    inode = path.stat().st_ino
    d = KvtierDaemon(workdir, flags=FLAGS, start_timeout_s=START_TIMEOUT_S, listen_fd=held.fileno())
    daemons.append(d)
    d.spawn()
    assert "socket activation" in d.log()
    with CountingClient(d.endpoint, "p", LAYOUT, timeout_s=CALL_TIMEOUT_S) as c:
        store_all(c)
        with Restorer(c, seed=4) as r:
            r.wait_calls(20)
            assert d.stop() == 0  # systemctl restart: SIGTERM, drained...
            assert path.exists() and path.stat().st_ino == inode  # ...the socket is systemd's: left alone
            d.spawn()  # ...and the new daemon gets the same socket
            r.wait_calls(20)
        assert r.errors == [] and r.wrong == 0, (r.errors, d.log_tail(30))
        # The call caught by the stop was answered SHUTTING_DOWN and waited for the new daemon in the backlog.
        assert len(r.retried) <= 1, r.retried
        all_served(c)
    assert d.stop() == 0
    assert path.stat().st_ino == inode
    held.close()


def test_socket_activation_refuses_a_socket_that_is_not_the_configured_one(tmp_path: Path) -> None:
    other = listening_socket(tmp_path / "other.sock")
    d = KvtierDaemon(tmp_path / "d", flags=FLAGS, start_timeout_s=START_TIMEOUT_S, listen_fd=other.fileno())
    try:
        with pytest.raises(RuntimeError, match="exited with 1"):
            d.spawn()
        assert "not the configured socket" in d.log() and "other.sock" in d.log()
    finally:
        d.kill()
        other.close()


# ---- the listening socket's sources, without a daemon --------------------------------------------------------


def test_systemd_listener_takes_only_descriptors_meant_for_this_process(tmp_path: Path) -> None:
    from kvtier.daemon.process.listener import systemd_listener

    env = {"LISTEN_PID": str(os.getppid()), "LISTEN_FDS": "1"}
    assert systemd_listener(f"ipc://{tmp_path}/x.sock", env) is None
    assert env == {}, "the variables are consumed either way: a successor must not read them as its own"
    assert systemd_listener(f"ipc://{tmp_path}/x.sock", {}) is None


@pytest.mark.parametrize("endpoint_of, ok", [
    (lambda p, port: f"ipc://{p}/a.sock", True),
    (lambda p, port: f"ipc://{p}/b.sock", False),
    (lambda p, port: "ipc://@kvtier-upgrade-test", False),
    (lambda p, port: f"tcp://127.0.0.1:{port}", False),
])
def test_an_inherited_descriptor_must_be_the_configured_socket(tmp_path: Path,
                                                               endpoint_of: Callable[[Path, int], str],
                                                               ok: bool) -> None:
    from kvtier.daemon.process.listener import ListenerMismatch, check_listener

    sock = listening_socket(tmp_path / "a.sock")
    try:
        endpoint = endpoint_of(tmp_path, 5555)
        if ok:
            check_listener(sock.fileno(), endpoint)
        else:
            with pytest.raises(ListenerMismatch):
                check_listener(sock.fileno(), endpoint)
    finally:
        sock.close()


def test_tcp_listeners_bind_as_libzmq_would_and_check_their_port() -> None:
    from kvtier.daemon.process.listener import ListenerMismatch, bind_listener, check_listener

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    listener = bind_listener(f"tcp://127.0.0.1:{port}", 0o600)
    try:
        check_listener(listener.fd, f"tcp://127.0.0.1:{port}")
        check_listener(listener.fd, f"tcp://*:{port}")
        with pytest.raises(ListenerMismatch):
            check_listener(listener.fd, f"tcp://127.0.0.1:{port + 1}")
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it listens
    finally:
        listener.close(remove_file=True)


# ---- two processes accept on one socket (an upgrade's redirect, a standby's take-over) ----------------------


@pytest.mark.parametrize("origin", ["bound", "systemd"])
def test_a_connection_another_process_accepted_first_never_stalls_libzmq(tmp_path: Path, origin: str) -> None:
    """Both daemons accept during a hand-over: when the other one wins a connection, libzmq's accept must not
    block its I/O thread (a blocking listening socket did: the old daemon then hung in ``zmq_ctx_term`` until a
    client's call timed out, 1 run in 4 of the upgrade tests)."""
    import select

    import zmq

    from kvtier.daemon.process.listener import bind_listener, inherited_listener

    path = tmp_path / "s" / "kvtierd.sock"
    endpoint = f"ipc://{path}"
    if origin == "bound":
        listener = bind_listener(endpoint, 0o600)
    else:  # systemd's socket units hand over a blocking socket (NonBlocking=false)
        path.parent.mkdir()
        listener = inherited_listener(os.dup(listening_socket(path).detach()), endpoint, origin="systemd",
                                      owns_file=False)
    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.USE_FD, listener.for_zmq())
    router.bind(endpoint)
    # The other process: accepts whatever it wins, without touching the socket's blocking flag.
    other = socket.socket(fileno=os.dup(listener.fd))
    stop = threading.Event()
    won = [0]

    def steal() -> None:
        while not stop.is_set():
            if select.select([other], [], [], 0.05)[0]:
                try:
                    conn, _ = other.accept()
                except BlockingIOError:
                    continue  # libzmq won this one
                won[0] += 1
                conn.close()

    thief = threading.Thread(target=steal, daemon=True)
    thief.start()
    try:
        # Connect until the other process wins one, then nothing more: a libzmq woken for that connection too
        # must not wait in accept() for the next one.
        for _ in range(500):
            before = won[0]
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.connect(str(path))
            deadline_s = time.monotonic() + 0.2
            while won[0] == before and time.monotonic() < deadline_s:
                time.sleep(0.005)
            if won[0] > before:
                break
        time.sleep(0.2)
        # libzmq closes at once: its I/O thread is not stuck in accept().
        router.close()
        term = threading.Thread(target=zctx.term, daemon=True)
        term.start()
        term.join(10.0)
        assert not term.is_alive(), "zmq_ctx_term hung: libzmq's I/O thread is blocked in accept()"
        assert won[0] > 0, "the race never happened: the test proves nothing"
    finally:
        stop.set()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            try:
                c.connect(str(path))  # wakes an accept() that blocks
            except OSError:
                pass
        thief.join(5.0)
        other.close()
        listener.close(remove_file=True)
