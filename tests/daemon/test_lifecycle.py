"""Leases, crashed clients, signals and start-up errors, against real daemon processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvtier.client.client import Client, DaemonError, PoolLayout
from kvtier.client.protocol import ErrorCode, decode, encode

BLOCK_BYTES = 1024
LAYOUT = PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                    kv_heads=1, head_dim=8)


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


CRASHER = textwrap.dedent(
    """
    import sys, time
    from kvtier.client.client import Client, PoolLayout
    layout = PoolLayout(model="m", block_size=4, block_bytes=1024, dtype="bfloat16", num_layers=1,
                        kv_heads=1, head_dim=8)
    c = Client(sys.argv[1], "lease", layout)
    hashes = [bytes([i]) * 16 for i in range(4)]
    c.store(hashes, bytes(4 * 1024))
    assert c.pin(hashes) == ["gpu"] * 4
    arena = c.open_arena(2)
    from kvtier.client.kv_share import allocate_shared_kv
    engine = Client(sys.argv[1], "lease-engine", PoolLayout(**{**layout.to_wire(), "mode": "engine"}))
    kv, handle = allocate_shared_kv((4, 512), "float16", 0)
    engine.register_kv("kv", [kv], 0)
    assert engine.allocate_tokens("r", list(range(9))).block_ids == [0, 1, 2]
    print(arena.path, handle["name"], flush=True)
    time.sleep(60)
    """
)


def test_sigkilled_client_loses_pins_arena_and_registration_after_the_lease(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=4 * BLOCK_BYTES, lease_s=1.0)
    crasher = subprocess.Popen([sys.executable, "-c", CRASHER, daemon.endpoint], stdout=subprocess.PIPE, text=True)
    kv_name = ""
    try:
        assert crasher.stdout is not None
        arena_path, kv_name = crasher.stdout.readline().split()
        assert os.path.exists(arena_path)
        with Client(daemon.endpoint, "lease", LAYOUT) as c:
            assert c.stats()["pools"]["lease"]["pinned_blocks"] == 4
            assert c.stats()["pools"]["lease-engine"]["gpu_registered"]
            other = [bytes([100 + i]) * 16 for i in range(8)]
            # All four GPU blocks are pinned by the crasher; what the GPU tier
            # cannot take overflows into the CPU tier, which holds only four.
            with pytest.raises(DaemonError) as info:
                c.store(other, bytes(8 * BLOCK_BYTES))
            assert info.value.code == ErrorCode.NO_SPACE
            # The crasher's heartbeats keep it alive well past one lease...
            time.sleep(1.5)
            assert c.stats()["pools"]["lease"]["pinned_blocks"] == 4
            crasher.kill()
            crasher.wait()
            t0 = time.monotonic()
            # ...and without them, the lease runs out and everything is released.
            wait_for(lambda: c.stats()["pools"]["lease"]["pinned_blocks"] == 0, 5.0, "pins released")
            assert time.monotonic() - t0 < 2.5
            # Both of the crasher's sessions expire (each on its own lease, so
            # the second may lag the first by a heartbeat); ours lives on.
            wait_for(lambda: c.stats()["daemon"]["lease_expiries_total"] == 2, 2.0, "both sessions expired")
            stats = c.stats()
            assert stats["sessions"] == 1
            assert not os.path.exists(arena_path)
            # The crashed engine's registration (its GPU tier) and request went too.
            engine_stats = stats["pools"]["lease-engine"]
            assert not engine_stats["gpu_registered"] and engine_stats["gpu_blocks"] == 0
            assert c.store(other, bytes(8 * BLOCK_BYTES)) == (8, 0)
            # Our own session survived on heartbeats alone.
            assert c.stats()["daemon"]["lease_expiries_total"] == 2
    finally:
        crasher.kill()
        crasher.wait()
        # A SIGKILLed engine leaves its shared KV file behind (kv_share's contract).
        if kv_name and os.path.exists(f"/dev/shm/{kv_name}"):
            os.unlink(f"/dev/shm/{kv_name}")


def raw_request(sock: zmq.Socket, header: dict[str, Any]) -> dict[str, Any]:
    sock.send(encode({"v": 1, **header}))
    assert sock.poll(5000)
    return decode(sock.recv_multipart()[0])


def test_lookups_do_not_renew_the_lease(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(lease_s=0.6)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        hello = raw_request(sock, {"op": "hello", "id": 1, "pool": "p", "layout": LAYOUT.to_wire()})
        sid = hello["sid"]
        assert hello["lease_s"] == 0.6
        # Heartbeats renew: 1.2 s of them, twice the lease.
        for i in range(6):
            assert raw_request(sock, {"op": "heartbeat", "id": 10 + i, "sid": sid})["ok"]
            time.sleep(0.2)
        # Lookups (and stats, health) do not.
        t0 = time.monotonic()
        rid = 100
        while time.monotonic() - t0 < 1.2:
            rid += 1
            reply = raw_request(sock, {"op": "lookup", "id": rid, "sid": sid, "hashes": [b"\1" * 16]})
            if not reply["ok"]:
                break
            time.sleep(0.1)
        reply = raw_request(sock, {"op": "heartbeat", "id": 999, "sid": sid})
        assert reply["ok"] is False and reply["error"]["code"] == int(ErrorCode.UNKNOWN_SESSION)
    finally:
        sock.close()
        ctx.term()


def test_sigterm_drains_replies_to_everything_and_exits_0(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=64 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)
    socket_path = Path(daemon.socket_file)
    assert socket_path.exists() and (socket_path.stat().st_mode & 0o777) == 0o600
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        sid = raw_request(sock, {"op": "hello", "id": 1, "pool": "p", "layout": LAYOUT.to_wire()})["sid"]
        n = 40
        for i in range(n):
            hashes = [bytes([i, j]) * 8 for j in range(8)]
            sock.send_multipart([encode({"v": 1, "op": "store", "id": 100 + i, "sid": sid, "hashes": hashes}),
                                 os.urandom(8 * BLOCK_BYTES)])
        daemon.send_signal(signal.SIGTERM)
        replies: dict[int, dict[str, Any]] = {}
        while len(replies) < n and sock.poll(5000):
            header = decode(sock.recv_multipart()[0])
            assert header["id"] not in replies, "two replies to one request"
            replies[header["id"]] = header
        assert sorted(replies) == list(range(100, 100 + n))
        # Pipelined stores can outrun the 64-block GPU tier while their copies
        # are in flight: those fail fast with NO_SPACE, by design.
        allowed = {int(ErrorCode.SHUTTING_DOWN), int(ErrorCode.NO_SPACE)}
        for header in replies.values():
            assert header["ok"] or header["error"]["code"] in allowed
        assert daemon.proc.wait(15) == 0
    finally:
        sock.close()
        ctx.term()
    assert not socket_path.exists()
    assert "stopping (SIGTERM)" in daemon.log()


def test_sigint_exits_0_and_a_second_signal_exits_at_once(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory()
    assert daemon.stop(signal.SIGINT, timeout_s=15.0) == 0
    daemon = kvtierd_factory()
    daemon.send_signal(signal.SIGTERM)
    daemon.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    daemon.proc.wait(5)
    assert time.monotonic() - t0 < 2.0


def test_second_daemon_on_the_same_socket_is_refused(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory()
    proc = subprocess.run([sys.executable, "-m", "kvtier.daemon", "--socket", daemon.endpoint],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "already serving" in proc.stderr
    assert daemon.alive


def test_invalid_config_names_the_key_and_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.daemon", "--lease-s", "-1",
                           "--socket", f"ipc://{tmp_path}/x.sock"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "lease_s" in proc.stderr


# Runs kvtierd's main() in this very process after a finder that holds the start-up at the first import of
# GATE_MODULE: it creates REACHED, then waits for RELEASE to exist. kvtierd's start-up takes seconds on a
# loaded host; this stands the test exactly where a SIGTERM used to find no handler yet.
GATED_LAUNCHER = textwrap.dedent("""
    import importlib.abc, os, sys, time
    gate, reached, release, *argv = sys.argv[1:]
    class Gate(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == gate:
                sys.meta_path.remove(self)
                open(reached, "w").close()
                while not os.path.exists(release):
                    time.sleep(0.01)
            return None
    sys.meta_path.insert(0, Gate())
    from kvtier.daemon.__main__ import main
    sys.exit(main(argv))
""")


@pytest.mark.parametrize("gate", ["zmq", "torch"])
def test_a_sigterm_at_any_point_of_the_start_up_is_a_clean_stop(tmp_path: Path, gate: str) -> None:
    """SIGTERM while kvtierd imports zmq (its configuration's imports came before the handler: exit 143)
    or torch: exit 0, nothing served, no socket left behind."""
    reached, release, sock = tmp_path / "reached", tmp_path / "release", tmp_path / "k.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.Popen([sys.executable, "-c", GATED_LAUNCHER, gate, str(reached), str(release),
                             "--socket", f"ipc://{sock}", "--cpu-bytes", "64K", "--gpu-bytes", "16K"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline_s = time.monotonic() + 60
        while not reached.exists():
            assert proc.poll() is None and time.monotonic() < deadline_s, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # delivered while the import is held
        release.touch()
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 0, err[-2000:]
    assert "SIGTERM during start-up: stopping before serving" in err and not sock.exists()
