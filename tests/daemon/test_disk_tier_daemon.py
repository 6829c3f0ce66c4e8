"""kvtierd with a disk tier (issue 34, item 4), end to end: spills, restarts, torn blocks, a full disk."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvtier.client.session as client_session
from kvtier.client.client import Client, PoolLayout
from kvtier.client.protocol import FEATURE_DISK_TIER, ErrorCode
from kvtier.testing.daemon import KvtierDaemon

BLOCK_BYTES = 8192
LAYOUT = PoolLayout(model="disk-model", block_size=16, block_bytes=BLOCK_BYTES, dtype="float16",
                    num_layers=2, kv_heads=2, head_dim=64)
POOL = "m/tp0"


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def flags(disk_dir: Path, disk_blocks: int = 64) -> dict[str, object]:
    # Four GPU blocks and four CPU blocks: everything stored past eight spills to the disk tier.
    return dict(gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=4 * BLOCK_BYTES, disk_dir=disk_dir,
                disk_bytes=max(disk_blocks * BLOCK_BYTES, 1 << 20), policy="lru")


def store_and_spill(c: Client, hashes: list[bytes], data: list[bytes], spilled: int) -> None:
    """Store in fours; wait until the first ``spilled`` blocks, pushed out of GPU and CPU tiers, are on disk."""
    for i in range(0, len(hashes), 4):
        assert c.store(hashes[i : i + 4], data[i : i + 4]) == (4, 0)
    wait_for(lambda: c.lookup(hashes[:spilled]) == ["disk"] * spilled, 20.0, "the evicted blocks to reach the disk")
    # Clean-ahead's demotions into the CPU tier done: its slots can make room for what a restore reads.
    wait_for(lambda: c.stats()["pools"][POOL]["copies_in_flight"] == 0, 20.0, "the copies in flight")


def test_spilled_blocks_restore_byte_exact_and_old_clients_see_remote(
        kvtierd_factory: Callable[..., KvtierDaemon], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = kvtierd_factory(**flags(tmp_path / "disk"))
    data = [os.urandom(BLOCK_BYTES) for _ in range(16)]
    hashes = [bytes([3, i]) * 8 for i in range(16)]
    with Client(daemon.endpoint, POOL, LAYOUT) as c:
        assert FEATURE_DISK_TIER in c.features
        store_and_spill(c, hashes, data, 8)
        # Eight disk blocks, a CPU tier of four: the restore reads the four that fit, the prefix.
        got = c.restore(hashes[:8])
        assert got.tiers == ["disk"] * 4
        assert bytes(got.data) == b"".join(data[:4])
        assert len(c.lookup(hashes[:8])) == 8  # (the four read may be in the CPU tier, or on disk only again)
        # The restore's clean-ahead demotes into the four CPU slots: once they land, the next four have room.
        wait_for(lambda: c.stats()["pools"][POOL]["copies_in_flight"] == 0, 20.0, "the copies in flight")
        got = c.restore(hashes[4:8])
        assert got.tiers == ["disk"] * 4 and bytes(got.data) == b"".join(data[4:8])
        pool = c.stats()["pools"][POOL]
        assert pool["hit_blocks_disk"] >= 8 and pool["disk"]["disk_hits"] >= 8
        assert pool["disk"]["bytes_read"] >= 8 * BLOCK_BYTES and pool["disk"]["bytes_written"] >= 8 * BLOCK_BYTES
        assert c.health()["disk"] == {POOL: True}
    # A client that does not name "disk_tier" in hello (an older one): the same blocks are "remote".
    monkeypatch.setattr(client_session, "CLIENT_FEATURES", ())
    with Client(daemon.endpoint, POOL, LAYOUT) as old:
        tiers = old.lookup(hashes[8:12])
        assert tiers == ["remote"] * 4
        wait_for(lambda: old.stats()["pools"][POOL]["copies_in_flight"] == 0, 20.0, "the copies in flight")
        got = old.restore(hashes[8:12])
        assert got.tiers == ["remote"] * 4 and bytes(got.data) == b"".join(data[8:12])


def test_sigkill_then_restart_serves_the_disk_blocks_byte_exact(
        kvtierd_factory: Callable[..., KvtierDaemon], tmp_path: Path) -> None:
    daemon = kvtierd_factory(**flags(tmp_path / "disk"))
    data = [os.urandom(BLOCK_BYTES) for _ in range(40)]
    hashes = [bytes([5, i]) * 8 for i in range(40)]
    with Client(daemon.endpoint, POOL, LAYOUT) as c:
        store_and_spill(c, hashes, data, 32)
    daemon.restart()  # SIGKILL: no drain, no index sync
    with Client(daemon.endpoint, POOL, LAYOUT) as c:
        # The pool is new; its disk tier adopts the directory on its own thread.
        wait_for(lambda: c.lookup(hashes[:32]) == ["disk"] * 32, 20.0, "the restarted daemon to adopt the disk tier")
        assert c.stats()["pools"][POOL]["disk"]["adopted_blocks"] >= 32
        for i in range(0, 32, 4):  # the CPU tier holds four: restore in fours
            got = c.restore(hashes[i : i + 4])
            assert got.tiers == ["disk"] * 4
            assert bytes(got.data) == b"".join(data[i : i + 4]), f"blocks {i}..{i + 3} differ after the restart"


def test_a_damaged_block_on_disk_is_never_served(kvtierd_factory: Callable[..., KvtierDaemon], tmp_path: Path) -> None:
    root = tmp_path / "disk"
    daemon = kvtierd_factory(**flags(root))
    data = [os.urandom(BLOCK_BYTES) for _ in range(16)]
    hashes = [bytes([6, i]) * 8 for i in range(16)]
    with Client(daemon.endpoint, POOL, LAYOUT) as c:
        store_and_spill(c, hashes, data, 8)
    daemon.kill()
    (pool_dir,) = root.iterdir()
    # Every slot that holds one of the spilled blocks: flip one byte of block 2's, found by its bytes.
    blob = (pool_dir / "blocks").read_bytes()
    at = blob.index(data[2])
    with open(pool_dir / "blocks", "r+b") as f:
        f.seek(at + 4000)
        f.write(bytes([blob[at + 4000] ^ 0xFF]))
    daemon.spawn()
    with Client(daemon.endpoint, POOL, LAYOUT) as c:
        wait_for(lambda: len(c.lookup(hashes[:8])) == 8, 20.0, "the adoption")
        got = c.restore(hashes[:4])
        assert got.tiers == ["disk"] * 2  # block 2 failed its checksum: the prefix ends before it
        assert bytes(got.data) == b"".join(data[:2])
        assert c.lookup(hashes[:4]) == ["cpu"] * 2
        assert c.stats()["pools"][POOL]["disk"]["disk_corrupt"] == 1


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only): a disk that fills up."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_degrades_to_misses_never_errors(kvtierd_factory: Callable[..., KvtierDaemon],
                                                      small_fs: Path) -> None:
    # 1 MiB of disk tier on a 1 MiB filesystem that also holds its index: not preallocated, and the
    # writes past what fits fail with ENOSPC.
    daemon = kvtierd_factory(**{**flags(small_fs), "disk_bytes": 1 << 20})
    data = [os.urandom(BLOCK_BYTES) for _ in range(200)]
    hashes = [bytes([8, i]) * 8 for i in range(200)]
    with Client(daemon.endpoint, POOL, LAYOUT) as c:
        for i in range(0, len(hashes), 4):
            assert c.store(hashes[i : i + 4], data[i : i + 4]) == (4, 0)  # never an error for the engine
        wait_for(lambda: c.stats()["pools"][POOL]["disk"]["write_errors"] > 0, 20.0, "the disk to fill")
        disk = c.stats()["pools"][POOL]["disk"]
        assert not disk["preallocated"] and "No space" in disk["last_error"]
        # What made it to disk is served byte-exact; the rest is a miss.
        held = 0
        for i in range(0, 192, 4):
            got = c.restore(hashes[i : i + 4])
            assert bytes(got.data) == b"".join(data[i : i + len(got.tiers)])
            held += len(got.tiers)
        assert 0 < held < 192


class DaemonBeforeFeatures:
    """A daemon from before hello's "features", as far as a client can tell: it refuses the field
    (INVALID_FIELD, as any v1 daemon refuses an unknown one) and lists no features."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        from kvtier.client.protocol import decode, encode, error_reply, ok_reply

        self.endpoint = endpoint
        self.hellos: list[dict[str, object]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()

        def serve() -> None:
            while not self._stop.is_set():
                if not self._sock.poll(50):
                    continue
                identity, frame = self._sock.recv_multipart()
                req = decode(frame)
                if req["op"] == "hello":
                    self.hellos.append(req)
                    if "features" in req:
                        reply = error_reply(req["id"], ErrorCode.INVALID_FIELD, "unknown field 'features'")
                    else:
                        reply = ok_reply(req["id"], sid="0" * 32, lease_s=10.0, heartbeat_s=3.0, protocol_version=1,
                                         daemon_version="0.0.9", pool={"block_bytes": BLOCK_BYTES}, limits={})
                else:
                    reply = ok_reply(req["id"], tiers=["gpu"] * len(req.get("hashes", [])), pinned=0)
                self._sock.send_multipart([identity, encode(reply)])

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()


def test_a_new_client_opens_a_session_on_a_daemon_from_before_hello_features(tmp_path: Path) -> None:
    old = DaemonBeforeFeatures(f"ipc://{tmp_path}/old.sock")
    try:
        with Client(old.endpoint, POOL, LAYOUT, heartbeat=False) as c:
            assert c.lookup([bytes(16)]) == ["gpu"]
            assert FEATURE_DISK_TIER not in c.features
        assert [("features" in h) for h in old.hellos] == [True, False]  # refused once, then without it
    finally:
        old.close()


def test_a_hello_naming_features_the_daemon_does_not_know_is_served(
        kvtierd_factory: Callable[..., KvtierDaemon], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = kvtierd_factory(**flags(tmp_path / "disk"))
    monkeypatch.setattr(client_session, "CLIENT_FEATURES", ("a-feature-of-2030", FEATURE_DISK_TIER))
    with Client(daemon.endpoint, POOL, LAYOUT) as c:
        assert c.store([bytes([1]) * 16], [bytes(BLOCK_BYTES)]) == (1, 0)


def test_operators_see_the_disk_tier_in_stats_top_and_prometheus(
        kvtierd_factory: Callable[..., KvtierDaemon], tmp_path: Path) -> None:
    import re
    import sys

    from tests.daemon.test_prometheus import DOCS, free_port, parse, scrape, value

    port = free_port()
    daemon = kvtierd_factory(**flags(tmp_path / "disk"), metrics_port=port)
    data = [os.urandom(BLOCK_BYTES) for _ in range(16)]
    hashes = [bytes([4, i]) * 8 for i in range(16)]
    with Client(daemon.endpoint, POOL, LAYOUT) as c:
        store_and_spill(c, hashes, data, 8)
        assert c.restore(hashes[:4]).tiers == ["disk"] * 4
        # The restore's room in the CPU tier evicted blocks: their write-backs may still be landing.
        before = c.stats()["pools"][POOL]["disk"]
        samples, types = parse(scrape(port))
        disk = c.stats()["pools"][POOL]["disk"]
    assert value(samples, "kvtier_disk_up", pool=POOL) == 1.0
    assert value(samples, "kvtier_disk_read_blocks_total", pool=POOL) == disk["disk_hits"] >= 4
    assert value(samples, "kvtier_disk_read_bytes_total", pool=POOL) == disk["bytes_read"]
    assert 0 < before["bytes_written"] <= value(samples, "kvtier_disk_written_bytes_total", pool=POOL) \
        <= disk["bytes_written"]
    assert value(samples, "kvtier_hit_blocks_total", pool=POOL, tier="disk") >= 4
    assert before["used_blocks"] <= value(samples, "kvtier_blocks", pool=POOL, tier="disk", state="used") \
        <= disk["used_blocks"]
    docs = DOCS.read_text()
    for name in [n for n in types if n.startswith("kvtier_disk")]:
        full = name + ("_total" if types[name] == "counter" else "")
        assert re.search(rf"`{full}[{{`]", docs), f"{full} is not in docs/metrics.md"
    for sub in ("stats", "top"):
        out = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", sub, "--socket", daemon.endpoint,
                              "--timeout", "10", *(["--once", "--interval", "0.2"] if sub == "top" else [])],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "DISK TIER" in out.stdout and " disk " in out.stdout
        (row,) = [line for line in out.stdout.splitlines() if line.split()[:2] == [POOL, "up"]]
        used, capacity = row.split()[2].split("/")
        assert int(used) >= disk["used_blocks"] and int(capacity) == disk["capacity_blocks"]
