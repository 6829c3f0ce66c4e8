"""RemoteTier against real servers: a standalone redis-server and a 3-node Redis Cluster.

The servers are started by the fixtures below (loopback only, nothing on
disk; see kvtier.testing.redis_servers). Without redis-server installed the whole
module is skipped with the apt command to install it.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvtier.testing import redis_servers as rs
from kvtier.tiers.remote_connection import parse_url
from kvtier.tiers.remote_tier import (
    HEADER,
    HEADER_BYTES,
    Admission,
    RemoteTier,
    RemoteTierError,
    RemoteTierSettings,
    make_pool_key,
)

pytestmark = pytest.mark.skipif(not rs.have_redis(), reason=rs.MISSING_REASON)

BLOCK = 64 * 1024
# Short timeouts and backoff so fault tests finish in seconds, not minutes.
FAST = RemoteTierSettings(timeout_s=0.3, connect_timeout_s=0.3, retry_initial_s=0.02, retry_max_s=0.2,
                          health_interval_s=0.2)


def hashes(n: int, seed: int = 0) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{seed}:{i}".encode()) for i in range(n)]


def blocks(n: int, size: int = BLOCK) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[rs.RedisServer]:
    srv = rs.RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture
def redis_url(server: rs.RedisServer) -> str:
    server.client().flushall()
    return server.url


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[rs.RedisServer]:
    """A server this test may stop, kill and restart."""
    srv = rs.RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[rs.RedisClusterProcs]:
    procs = rs.RedisClusterProcs(tmp_path_factory.mktemp("cluster"))
    try:
        procs.start()
    except BaseException:
        procs.stop()
        raise
    yield procs
    procs.stop()


@pytest.fixture
def tiers() -> Iterator[list[RemoteTier]]:
    """Tiers made by a test, closed even when it fails."""
    made: list[RemoteTier] = []
    yield made
    for t in made:
        t.close(timeout_s=1.0)


def make(tiers: list[RemoteTier], url: str, pool_key: bytes = b"pool-a", block_bytes: int = BLOCK,
         admission: Admission | None = None, **settings: Any) -> RemoteTier:
    """A tier with FAST settings, ``settings`` replacing some of them."""
    t = RemoteTier(url, pool_key, block_bytes, dataclasses.replace(FAST, **settings), admission=admission)
    tiers.append(t)
    return t


def put(t: RemoteTier, hs: list[bytes], data: list[bytes]) -> None:
    for h, d in zip(hs, data):
        assert t.write_back(h, d)
    assert t.flush(10.0)
    assert t.stats()["writes_done"] >= len(hs)


# ---- configuration ---------------------------------------------------------------------------


def test_url_parsing() -> None:
    ep = parse_url("redis://127.0.0.1:6379/2")
    assert not ep.cluster and ep.url == "redis://127.0.0.1:6379/2"
    assert parse_url("valkey://127.0.0.1:6379/0").url == "redis://127.0.0.1:6379/0"
    ep = parse_url("redis+cluster://user:s3cret@127.0.0.1:7000,127.0.0.1:7001")
    assert ep.cluster and ep.nodes == (("127.0.0.1", 7000), ("127.0.0.1", 7001))
    assert dict(ep.options) == {"username": "user", "password": "s3cret"}
    assert "s3cret" not in ep.display
    assert dict(parse_url("rediss+cluster://127.0.0.1:7000").options) == {"ssl": True}
    for bad in ("http://x:1", "redis+cluster://nohostport", "unix+cluster:///tmp/s"):
        with pytest.raises(RemoteTierError):
            parse_url(bad)


def test_pool_key_validation_and_make_pool_key() -> None:
    for bad in (b"", b"a:b", b"a*", b"{tag}", "str", b"x" * 129):
        with pytest.raises(RemoteTierError):
            RemoteTier("redis://127.0.0.1:1/0", bad, BLOCK)  # type: ignore[arg-type]
    k1 = make_pool_key("llama-8b/tp0", 16, 131072, {"dtype": "bf16"}, "tenant-a")
    k2 = make_pool_key("llama-8b/tp0", 16, 131072, {"dtype": "bf16"}, "tenant-b")
    assert k1 != k2 and len(k1) == 32 and k1 == make_pool_key("llama-8b/tp0", 16, 131072, {"dtype": "bf16"}, "tenant-a")


def test_settings_defaults_and_validation() -> None:
    d = RemoteTierSettings()
    assert (d.write_queue_blocks, d.writer_threads, d.write_batch_blocks, d.reader_threads) == (1024, 2, 32, 1)
    assert (d.fetch_round_trip_bytes, d.timeout_s, d.connect_timeout_s, d.max_connections) == (64 << 20, 0.5, 0.5, 64)
    assert (d.retry_initial_s, d.retry_max_s, d.retry_jitter_fraction, d.health_interval_s) == (0.05, 5.0, 0.2, 2.0)
    assert d.ttl_s is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.timeout_s = 1.0  # type: ignore[misc]
    bad: list[dict[str, Any]] = [
        dict(write_queue_blocks=0), dict(writer_threads=-1), dict(write_batch_blocks=2.0), dict(reader_threads=True),
        dict(fetch_round_trip_bytes=0), dict(max_connections=0), dict(timeout_s=0.0), dict(connect_timeout_s=-1),
        dict(health_interval_s=float("nan")), dict(retry_initial_s=float("inf")), dict(retry_max_s=0.01),
        dict(retry_jitter_fraction=1.0), dict(retry_jitter_fraction=-0.1), dict(ttl_s=0), dict(ttl_s=1.5),
    ]
    for kw in bad:
        field = next(iter(kw))
        with pytest.raises(RemoteTierError, match=field):
            RemoteTierSettings(**kw)
    with pytest.raises(RemoteTierError, match="RemoteTierSettings"):
        RemoteTier("redis://127.0.0.1:1/0", b"pool-a", BLOCK, {"timeout_s": 1.0})  # type: ignore[arg-type]


# ---- standalone --------------------------------------------------------------------------------


def test_round_trip_byte_exact(tiers: list[RemoteTier], redis_url: str, server: rs.RedisServer) -> None:
    t = make(tiers, redis_url)
    assert t.available
    hs, data = hashes(40), blocks(40)
    put(t, hs, data)
    got = t.fetch(hs)
    assert all(g is not None and g.nbytes == BLOCK and bytes(g) == d for g, d in zip(got, data))
    # The stored value is header + payload, under the documented key.
    raw = server.client().get(b"kvtier:v1:pool-a:" + hs[0].hex().encode())
    magic, version, length, digest = HEADER.unpack_from(raw)
    assert (magic, version, length, digest) == (b"KVT1", 1, BLOCK, xxhash.xxh3_64_intdigest(data[0]))
    assert raw[HEADER_BYTES:] == data[0]
    s = t.stats()
    assert s["remote_hits"] == 40 and s["bytes_fetched"] == 40 * BLOCK and s["bytes_written"] == 40 * BLOCK
    # fetch_async: the same answer from a reader thread.
    fut = t.fetch_async(hs[:5])
    assert [bytes(g) for g in fut.result(5)] == data[:5]


def test_fetch_in_several_round_trips(tiers: list[RemoteTier], redis_url: str) -> None:
    t = make(tiers, redis_url, fetch_round_trip_bytes=3 * (BLOCK + HEADER_BYTES))
    hs, data = hashes(10, seed=16), blocks(10)
    put(t, hs[:4] + hs[5:], data[:4] + data[5:])
    got = t.fetch(hs)
    assert got[4] is None
    assert [bytes(g) for i, g in enumerate(got) if i != 4] == data[:4] + data[5:]
    assert t.stats()["remote_misses"] == 1


def test_copy_false_and_buffer_types(tiers: list[RemoteTier], redis_url: str) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    t = make(tiers, redis_url)
    hs = hashes(4, seed=7)
    arr = np.frombuffer(os.urandom(BLOCK), dtype=np.uint8)
    ten = torch.frombuffer(bytearray(os.urandom(BLOCK)), dtype=torch.uint8)
    two_d = np.frombuffer(os.urandom(BLOCK), dtype=np.uint8).reshape(64, -1)
    raw = os.urandom(BLOCK)
    assert t.write_back(hs[0], arr)
    assert t.write_back(hs[1], ten)
    assert t.write_back(hs[2], two_d)
    assert t.write_back(hs[3], raw, copy=False)
    assert t.flush(5)
    got = t.fetch(hs)
    assert [bytes(g) for g in got] == [arr.tobytes(), ten.numpy().tobytes(), two_d.tobytes(), raw]
    with pytest.raises(ValueError):
        t.write_back(hs[0], b"short")


def test_exists_prefix_semantics(tiers: list[RemoteTier], redis_url: str) -> None:
    t = make(tiers, redis_url)
    hs = hashes(8, seed=1)
    present = [0, 1, 2, 4, 5]
    put(t, [hs[i] for i in present], blocks(len(present)))
    assert t.exists_prefix(hs) == 3  # stops at the first absent block, even though 4 and 5 exist
    assert t.exists_prefix(hs[:2]) == 2
    assert t.exists_prefix(hs[3:]) == 0
    assert t.exists_prefix(hs[4:6]) == 2
    assert t.exists_prefix([]) == 0
    s = t.stats()
    assert s["exists_calls"] == 4 and s["exists_hit_blocks"] == 7


def test_lookup_without_scripting_falls_back_to_pipeline(tiers: list[RemoteTier], redis_url: str,
                                                        server: rs.RedisServer) -> None:
    # A user who may not run scripts (managed services often forbid EVAL) also exercises URL credentials.
    server.client().acl_setuser("noscripts", enabled=True, passwords=["+pw"], keys=["*"],
                                commands=["+@all", "-@scripting"])
    url = f"redis://noscripts:pw@127.0.0.1:{server.port}/0"
    t = make(tiers, url)
    hs = hashes(6, seed=15)
    put(t, [hs[0], hs[1], hs[3]], blocks(3))
    assert t.exists_prefix(hs) == 2 and not t._use_script
    assert t.exists_prefix(hs) == 2 and t.available
    assert "pw" not in t.stats()["url"]


def test_corruption_is_a_miss_never_a_wrong_block(tiers: list[RemoteTier], redis_url: str,
                                                  server: rs.RedisServer) -> None:
    t = make(tiers, redis_url)
    hs, data = hashes(6, seed=2), blocks(6)
    put(t, hs, data)
    r = server.client()
    # 0: one payload byte flipped (checksum); 1: truncated; 2: bad magic; 3: newer format version;
    # 4: header claims another length, value padded to look right; 5 untouched.
    v0 = bytearray(r.get(t.key(hs[0])))
    v0[HEADER_BYTES + 1234] ^= 0x40
    r.set(t.key(hs[0]), bytes(v0))
    r.set(t.key(hs[1]), r.get(t.key(hs[1]))[: HEADER_BYTES + BLOCK // 2])
    v2 = bytearray(r.get(t.key(hs[2])))
    v2[:4] = b"XXXX"
    r.set(t.key(hs[2]), bytes(v2))
    v3 = bytearray(r.get(t.key(hs[3])))
    v3[4] = 2
    r.set(t.key(hs[3]), bytes(v3))
    payload = data[4][:-8]
    r.set(t.key(hs[4]), struct.pack("<4sBxxxQQ", b"KVT1", 1, len(payload), xxhash.xxh3_64_intdigest(payload))
          + payload + b"\0" * 8)
    got = t.fetch(hs)
    assert got[:5] == [None] * 5
    assert got[5] is not None and bytes(got[5]) == data[5]
    s = t.stats()
    assert s["remote_corrupt"] == 5 and s["remote_hits"] == 1 and s["remote_misses"] == 0
    # Corrupt keys are deleted in the background, so they stop answering EXISTS.
    assert t.flush(5)
    assert t.exists_prefix(hs[:1]) == 0
    assert r.exists(t.key(hs[5])) == 1


def test_pool_key_isolation(tiers: list[RemoteTier], redis_url: str) -> None:
    a = make(tiers, redis_url, pool_key=b"pool-a")
    b = make(tiers, redis_url, pool_key=b"pool-b")
    hs = hashes(4, seed=3)
    da, db = blocks(4), blocks(4)
    put(a, hs[:3], da[:3])
    assert b.exists_prefix(hs) == 0 and b.fetch(hs) == [None] * 4
    put(b, hs, db)
    assert [bytes(g) for g in a.fetch(hs[:3])] == da[:3]
    assert [bytes(g) for g in b.fetch(hs)] == db
    assert a.fetch(hs[3:]) == [None]


def test_admission_filter_and_ttl(tiers: list[RemoteTier], redis_url: str, server: rs.RedisServer) -> None:
    class EveryOther:
        def __init__(self) -> None:
            self.n = 0

        def admit(self, key: bytes) -> bool:
            self.n += 1
            return self.n % 2 == 0

    t = make(tiers, redis_url, admission=EveryOther(), ttl_s=300)
    hs = hashes(4, seed=4)
    accepted = [t.write_back(h, d) for h, d in zip(hs, blocks(4))]
    assert accepted == [False, True, False, True]
    assert t.flush(5)
    s = t.stats()
    assert s["writes_not_admitted"] == 2 and s["writes_done"] == 2
    assert 0 < server.client().ttl(t.key(hs[1])) <= 300


def test_close_drains_the_queue(redis_url: str) -> None:
    t = RemoteTier(redis_url, b"pool-a", BLOCK, FAST)
    hs, data = hashes(50, seed=5), blocks(50)
    for h, d in zip(hs, data):
        t.write_back(h, d)
    assert t.close(timeout_s=5.0)
    assert t.stats()["writes_done"] == 50
    assert not t.write_back(hs[0], data[0])  # closed: dropped, counted
    reader = RemoteTier(redis_url, b"pool-a", BLOCK, FAST)
    try:
        assert [bytes(g) for g in reader.fetch(hs)] == data
    finally:
        reader.close()


# ---- faults ------------------------------------------------------------------------------------


def test_hung_server_write_back_never_blocks(tiers: list[RemoteTier], own_server: rs.RedisServer) -> None:
    block = 256 * 1024
    t = make(tiers, own_server.url, block_bytes=block, write_queue_blocks=8, writer_threads=1,
             write_batch_blocks=8)
    data = os.urandom(block)
    hs = hashes(300, seed=6)
    own_server.pause()
    try:
        lat_s = []
        for h in hs:
            t0 = time.perf_counter()
            t.write_back(h, data)
            lat_s.append(time.perf_counter() - t0)
        # Reads are bounded by timeout_s and answer "miss" (the engine path never hangs).
        t0 = time.perf_counter()
        assert t.exists_prefix(hs[:4]) == 0
        assert time.perf_counter() - t0 < 2 * FAST.timeout_s + 0.2
    finally:
        own_server.resume()
    s = t.stats()
    assert s["writes_dropped_full"] > 0
    assert s["writes_queued"] + s["writes_dropped_full"] + s["writes_dropped_unavailable"] == len(hs)
    assert statistics.median(lat_s) < 1e-3
    assert max(lat_s) < 1e-3, f"slowest write_back {max(lat_s) * 1e3:.2f} ms"
    # Once the server runs again the tier recovers and writes go through.
    assert t.wait_available(5.0)
    assert t.write_back(hs[0], data) and t.flush(5) and bytes(t.fetch(hs[:1])[0]) == data


def test_server_killed_and_restarted(tiers: list[RemoteTier], own_server: rs.RedisServer) -> None:
    t = make(tiers, own_server.url)
    hs, data = hashes(10, seed=8), blocks(10)
    put(t, hs, data)
    own_server.kill()
    # Every operation answers "miss" without raising; the tier notices and says so.
    assert t.exists_prefix(hs) == 0
    assert t.fetch(hs) == [None] * 10
    assert not t.available
    assert not t.write_back(hs[0], data[0])
    s = t.stats()
    assert s["available"] is False and s["unavailable_events"] == 1 and s["writes_dropped_unavailable"] >= 1
    assert "Error" in s["last_error"]
    t0 = time.perf_counter()
    for _ in range(100):  # unavailable: no network, no waiting
        assert t.exists_prefix(hs) == 0
    assert time.perf_counter() - t0 < 0.05
    # Same port again (empty: --save ''): the tier reconnects on its own, no call needed.
    own_server.start()
    wait_for(lambda: t.available, 3.0, "reconnect after restart")
    assert t.stats()["reconnects"] == 1
    assert t.exists_prefix(hs) == 0  # the data died with the server
    put(t, hs, data)
    assert [bytes(g) for g in t.fetch(hs)] == data


def test_server_down_at_start(tiers: list[RemoteTier], tmp_path: Path) -> None:
    srv = rs.RedisServer(tmp_path / "late")
    t = make(tiers, srv.url)
    try:
        assert not t.available
        assert t.exists_prefix(hashes(3)) == 0 and t.fetch(hashes(3)) == [None] * 3
        assert not t.write_back(hashes(1)[0], os.urandom(BLOCK))
        srv.start()
        wait_for(lambda: t.available, 3.0, "first connect")
        hs, data = hashes(3, seed=9), blocks(3)
        put(t, hs, data)
        assert [bytes(g) for g in t.fetch(hs)] == data
    finally:
        srv.stop()


def test_health_check_notices_death_without_traffic(tiers: list[RemoteTier], own_server: rs.RedisServer) -> None:
    t = make(tiers, own_server.url)
    own_server.kill()
    wait_for(lambda: not t.available, 2.0, "health check to notice")


# ---- cluster -----------------------------------------------------------------------------------


def test_cluster_round_trip_spreads_over_nodes(tiers: list[RemoteTier], cluster: rs.RedisClusterProcs) -> None:
    t = make(tiers, cluster.url)
    assert t.available and t.stats()["mode"] == "cluster"
    hs, data = hashes(60, seed=10), blocks(60)
    put(t, hs, data)
    assert t.exists_prefix(hs) == 60
    absent = hashes(1, seed=99)
    assert t.exists_prefix(hs[:17] + absent + hs[17:]) == 17
    got = t.fetch(hs)
    assert all(g is not None and bytes(g) == d for g, d in zip(got, data))
    per_node = [s.client().dbsize() for s in cluster.servers]
    assert sum(per_node) >= 60 and all(n > 0 for n in per_node), per_node


def test_cluster_corruption_and_isolation(tiers: list[RemoteTier], cluster: rs.RedisClusterProcs) -> None:
    import redis.cluster

    a = make(tiers, cluster.url, pool_key=b"cl-a")
    b = make(tiers, cluster.url, pool_key=b"cl-b")
    hs, data = hashes(8, seed=11), blocks(8)
    put(a, hs, data)
    assert b.exists_prefix(hs) == 0
    rc = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.servers[0].port)
    try:
        v = bytearray(rc.get(a.key(hs[3])))
        v[-1] ^= 1
        rc.set(a.key(hs[3]), bytes(v))
    finally:
        rc.close()
    got = a.fetch(hs)
    assert got[3] is None and a.stats()["remote_corrupt"] == 1
    assert all(bytes(g) == d for i, (g, d) in enumerate(zip(got, data)) if i != 3)


def test_cluster_resharding_mid_run(tiers: list[RemoteTier], cluster: rs.RedisClusterProcs) -> None:
    t = make(tiers, cluster.url, pool_key=b"cl-reshard")
    hs, data = hashes(60, seed=12), blocks(60)
    put(t, hs, data)
    # Move a third of the slots (keys included) under a client with a stale slot map: MOVED/ASK.
    src, dst = cluster.servers[0], cluster.servers[1]
    cluster.reshard(src, dst, 3000)
    got = t.fetch(hs)
    assert all(g is not None and bytes(g) == d for g, d in zip(got, data))
    assert t.exists_prefix(hs) == 60
    hs2, data2 = hashes(30, seed=13), blocks(30)
    put(t, hs2, data2)
    assert [bytes(g) for g in t.fetch(hs2)] == data2
    cluster.reshard(dst, src, 3000)  # put it back for the other tests
    assert t.exists_prefix(hs) == 60
    # MOVED/ASK were followed inside redis-py: no error, no outage.
    s = t.stats()
    assert s["remote_errors"] == 0 and s["unavailable_events"] == 0 and s["available"]


def test_cluster_node_killed_and_restarted(tiers: list[RemoteTier], cluster: rs.RedisClusterProcs) -> None:
    t = make(tiers, cluster.url, pool_key=b"cl-fault")
    hs, data = hashes(30, seed=14), blocks(30)
    put(t, hs, data)
    victim = cluster.servers[2]
    victim.kill()
    # Some keys lived on the dead primary: reads answer with misses, nothing raises, the tier goes down.
    got = t.fetch(hs)
    assert any(g is None for g in got)
    assert all(g is None or bytes(g) == d for g, d in zip(got, data))
    wait_for(lambda: not t.available, 3.0, "tier to go unavailable")
    assert t.exists_prefix(hs) == 0
    assert not t.write_back(hs[0], data[0])
    # The node comes back with its nodes.conf (slots kept, data gone): the tier recovers by itself.
    victim.start()
    cluster.wait_ok(15.0)
    wait_for(lambda: t.available, 5.0, "tier to recover")
    assert t.stats()["reconnects"] >= 1
    put(t, hs, data)
    assert [bytes(g) for g in t.fetch(hs)] == data
