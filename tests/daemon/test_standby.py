"""A standby kvtierd (``standby = true``, issue 34's first-hit target): real processes, the primary SIGKILLed.

The primary starts a standby that imports everything, inherits the listening
socket and waits. These tests check the two promises: after a SIGKILL of the
primary at a seeded random instant during stores, the standby serves every
acknowledged block byte-exact (or counts it dropped at adoption) and keeps
a standby of its own; and while the primary lives, even stopped dead
(SIGSTOP), the standby never serves and never touches the CPU tier; a clean
stop stands it down.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvtier.client.client import Client, KvtierError, KvtierTimeout, PoolLayout, probe_health
from kvtier.testing.daemon import KvtierDaemon, ReparentedProcess, become_subreaper

BB = 4096
LAYOUT = PoolLayout(model="standby", block_size=4, block_bytes=BB, dtype="bfloat16", num_layers=1, kv_heads=1,
                    head_dim=8)
FLAGS: dict[str, object] = {"gpu_bytes": 0, "cpu_bytes": 8192 * BB, "log_level": "info", "standby": True}
START_TIMEOUT_S = 180.0  # two daemons import torch at once on a loaded 2-core host
TAKEOVER_TIMEOUT_S = 30.0  # generous for a loaded host; bench/restart.py measures the real figure


def key(i: int) -> bytes:
    return struct.pack("<QQ", 0x5354414E4442, i)


def content(k: bytes) -> bytes:
    seed = hashlib.sha256(k).digest()
    return (seed * (BB // len(seed) + 1))[:BB]


def standby_ready(daemon: KvtierDaemon, primary_pid: int, timeout_s: float = START_TIMEOUT_S) -> int:
    """The pid of the standby ``primary_pid`` started, once it said it waits (the primary logs it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for line in daemon.log().splitlines():
            if "is ready: it serves if this daemon dies" in line and "standby kvtierd pid" in line:
                pid = int(line.split("standby kvtierd pid ", 1)[1].split()[0])
                if pid in [p.pid for p in psutil.Process(primary_pid).children()]:
                    return pid
        assert time.monotonic() < deadline, f"no standby of pid {primary_pid} got ready:\n{daemon.log_tail()}"
        time.sleep(0.1)


def serving_pid(daemon: KvtierDaemon, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid = probe_health(daemon.endpoint, timeout_s=0.5).get("pid")
            if isinstance(pid, int):
                return pid
        except KvtierTimeout:
            pass
        assert time.monotonic() < deadline, f"nothing serves {daemon.endpoint}:\n{daemon.log_tail()}"


def stood_down_status(daemon: KvtierDaemon, pid: int, timeout_s: float = 60.0) -> int | None:
    """The exit status of a standby that stood down: reaped by its primary (which logs it), or here."""
    proc = ReparentedProcess(pid)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"standby {pid} still runs:\n{daemon.log_tail()}"
        time.sleep(0.05)
    if proc.returncode is not None and proc.returncode != -1:
        return proc.returncode
    line = f"standby kvtierd pid {pid} exited (status "
    for text in daemon.log().splitlines():
        if line in text:
            return int(text.split(line, 1)[1].split(")")[0])
    return None


def served(c: Client, keys: list[bytes]) -> tuple[set[bytes], int]:
    """(the keys the daemon serves, how many came back with bytes not their own)."""
    held: set[bytes] = set()
    wrong = 0
    i = 0
    while i < len(keys):
        batch = keys[i:i + 64]
        r = c.restore(batch)
        n = len(r.tiers)
        data = bytes(r.data) if n else b""
        for j, k in enumerate(batch[:n]):
            held.add(k)
            wrong += data[j * BB:(j + 1) * BB] != content(k)
        i += n + 1 if n < len(batch) else n
    return held, wrong


def _is_kvtierd(p: psutil.Process) -> bool:
    try:
        return "kvtier.daemon" in " ".join(p.cmdline())
    except psutil.Error:
        return False


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[KvtierDaemon]:
    become_subreaper()  # the standbys outlive their primaries: reaped here
    d = KvtierDaemon(tmp_path / "d", flags=FLAGS, start_timeout_s=START_TIMEOUT_S)
    # Only the kvtierd processes this fixture started are reaped below: the test process has other children
    # (torch's shared-memory manager, module-scoped daemons, Redis servers) that later tests still use.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    d.spawn()
    try:
        yield d
    finally:
        serving = None
        try:
            serving = probe_health(d.endpoint, timeout_s=1.0).get("pid")
        except KvtierTimeout:
            pass
        if isinstance(serving, int) and serving != d.pid:
            d.proc = ReparentedProcess(serving)
        leftovers = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and _is_kvtierd(p)]
        d.cleanup()  # SIGTERM: the serving one drains and stands its standby down
        _, alive = psutil.wait_procs(leftovers, timeout=60)
        for p in alive:
            p.kill()


def test_sigkill_of_the_primary_the_standby_serves_every_acknowledged_block_and_keeps_a_standby(
        daemon: KvtierDaemon) -> None:
    """Two rounds: stores run, the primary is SIGKILLed at a seeded instant, its standby serves at once. Every
    acknowledged block is served byte-exact or counted dropped at adoption; the new primary starts its own
    standby, which serves the next round."""
    rng = random.Random(3434)
    acked: list[bytes] = []
    primary = daemon.pid
    for round_ in range(2):
        standby = standby_ready(daemon, primary)
        stop = threading.Event()
        errors: list[BaseException] = []
        progress = threading.Semaphore(0)

        def write(first: int) -> None:
            n = first
            try:
                with Client(daemon.endpoint, "p", LAYOUT, timeout_s=2.0) as c:
                    while not stop.is_set():
                        keys = [key(n + i) for i in range(8)]
                        n += 8
                        c.store(keys, b"".join(content(k) for k in keys))
                        acked.extend(keys)
                        progress.release()
            except KvtierError:
                pass  # the primary died under the call: that batch is unacknowledged
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        writer = threading.Thread(target=write, args=(round_ * 100_000,))
        writer.start()
        for _ in range(rng.randint(5, 150)):
            assert progress.acquire(timeout=30), f"the writer stalled: {errors}"
        time.sleep(rng.uniform(0.0, 0.005))
        os.kill(primary, signal.SIGKILL)
        stop.set()
        writer.join(30)
        assert not errors, errors
        # Nothing else may serve: the standby does, on the same socket.
        assert serving_pid(daemon, TAKEOVER_TIMEOUT_S) == standby
        with Client(daemon.endpoint, "p", LAYOUT, timeout_s=30.0) as c:
            deadline = time.monotonic() + 30
            while (s := c.stats()["pools"]["p"])["cpu_adoption_pending_blocks"]:
                assert time.monotonic() < deadline, s
                time.sleep(0.05)
            have, wrong = served(c, acked)
        assert wrong == 0
        missing = set(acked) - have
        assert len(missing) <= s["cpu_adoption_dropped_blocks"], (len(missing), s)
        assert len(have) > 0
        primary = standby
    log = daemon.log()
    assert log.count("took over from kvtierd pid") == 2


def test_a_living_primary_is_never_doubled_and_a_clean_stop_stands_the_standby_down(daemon: KvtierDaemon) -> None:
    primary = daemon.pid
    standby = standby_ready(daemon, primary)
    keys = [key(i) for i in range(64)]
    with Client(daemon.endpoint, "p", LAYOUT, timeout_s=30.0) as c:
        c.store(keys, b"".join(content(k) for k in keys))
        counters = c.stats()["daemon"]
        assert (counters["standby_pid"], counters["standby_ready"]) == (standby, 1)
    # A primary that lives but does not answer (stopped dead): the standby must not serve in its place.
    os.kill(primary, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with pytest.raises(KvtierTimeout):
                probe_health(daemon.endpoint, timeout_s=0.5)
        assert psutil.Process(standby).status() != psutil.STATUS_ZOMBIE
        assert "adopting what it left" not in daemon.log()
    finally:
        os.kill(primary, signal.SIGCONT)
    assert serving_pid(daemon, TAKEOVER_TIMEOUT_S) == primary
    with Client(daemon.endpoint, "p", LAYOUT, timeout_s=30.0) as c:
        have, wrong = served(c, keys)
    assert (len(have), wrong) == (64, 0)
    # A clean stop is not a death: the standby exits 0 without serving, and nothing serves the socket after.
    assert daemon.stop() == 0
    assert stood_down_status(daemon, standby) == 0
    with pytest.raises(KvtierTimeout):
        probe_health(daemon.endpoint, timeout_s=1.0)
    assert "stood this standby down" in daemon.log()
    assert "took over from" not in daemon.log()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_the_systemd_drop_in_verifies_with_the_unit(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    shutil.copy(repo / "systemd" / "kvtierd@.service", tmp_path / "kvtierd@0.service")
    (tmp_path / "kvtierd@0.service.d").mkdir()
    drop_in = tmp_path / "kvtierd@0.service.d" / "standby.conf"
    shutil.copy(repo / "systemd" / "kvtierd-standby.conf", drop_in)
    text = drop_in.read_text()
    assert "Environment=KVTIER_STANDBY=true" in text and "ExitType=cgroup" in text and "NotifyAccess=all" in text
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "kvtierd@0.service")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "standby.conf" not in proc.stderr and "kvtierd" not in proc.stderr, proc.stderr


def test_an_upgrade_stands_the_standby_down_and_the_successor_keeps_its_own(daemon: KvtierDaemon) -> None:
    """A standby beside an upgrade's successor would be a second claimant of the tiers: SIGUSR2 stands it down
    (exit 0, nothing served); the successor, once it serves, starts its own, which serves when it is killed."""
    old = daemon.pid
    old_standby = standby_ready(daemon, old)
    keys = [key(i) for i in range(64)]
    with Client(daemon.endpoint, "p", LAYOUT, timeout_s=30.0) as c:
        c.store(keys, b"".join(content(k) for k in keys))
    assert daemon.upgrade(timeout_s=START_TIMEOUT_S) == 0
    assert stood_down_status(daemon, old_standby) == 0
    new = daemon.pid
    assert new not in (old, old_standby)
    new_standby = standby_ready(daemon, new)
    os.kill(new, signal.SIGKILL)
    assert serving_pid(daemon, TAKEOVER_TIMEOUT_S) == new_standby
    with Client(daemon.endpoint, "p", LAYOUT, timeout_s=30.0) as c:
        have, wrong = served(c, keys)
    assert (len(have), wrong) == (64, 0)
    assert "stands down: an upgrade's successor takes over instead" in daemon.log()


def test_a_primary_killed_while_its_standby_still_starts_is_served_once_the_standby_is_up(
        daemon: KvtierDaemon) -> None:
    keys = [key(i) for i in range(32)]
    with Client(daemon.endpoint, "p", LAYOUT, timeout_s=30.0) as c:
        c.store(keys, b"".join(content(k) for k in keys))
    primary = daemon.pid
    deadline = time.monotonic() + 30
    while not (kids := psutil.Process(primary).children()):
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.01)
    assert "is ready: it serves" not in daemon.log()  # still importing
    os.kill(primary, signal.SIGKILL)
    assert serving_pid(daemon, START_TIMEOUT_S) == kids[0].pid
    with Client(daemon.endpoint, "p", LAYOUT, timeout_s=30.0) as c:
        have, wrong = served(c, keys)
    assert (len(have), wrong) == (32, 0)
