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
from kvtier.tiers.remote.connection import parse_url
from kvtier.tiers.remote.tier import (
    HEADER,
    HEADER_BYTES,
    Admission,
    RemoteTier,
    RemoteTierError,
    RemoteTierSettings,
    make_pool_key,
)
from kvtier.tiers.remote.values import ValueMac

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
         admission: Admission | None = None, secret: bytes = rs.SECRET, **settings: Any) -> RemoteTier:
    """A tier with FAST settings, ``settings`` replacing some of them."""
    t = RemoteTier(url, pool_key, block_bytes, dataclasses.replace(FAST, **settings), secret=secret,
                   admission=admission)
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
            RemoteTier("redis://127.0.0.1:1/0", bad, BLOCK, secret=rs.SECRET)  # type: ignore[arg-type]
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
        RemoteTier("redis://127.0.0.1:1/0", b"pool-a", BLOCK, {"timeout_s": 1.0}, secret=rs.SECRET)  # type: ignore[arg-type]
    for secret in (b"", b"x" * 31, b"x" * 33, "x" * 32):
        with pytest.raises(RemoteTierError, match="32 bytes"):
            RemoteTier("redis://127.0.0.1:1/0", b"pool-a", BLOCK, secret=secret)  # type: ignore[arg-type]


# ---- standalone --------------------------------------------------------------------------------


def test_round_trip_byte_exact(tiers: list[RemoteTier], redis_url: str, server: rs.RedisServer) -> None:
    t = make(tiers, redis_url)
    assert t.available
    hs, data = hashes(40), blocks(40)
    put(t, hs, data)
    got = t.fetch(hs)
    assert all(g is not None and g.nbytes == BLOCK and bytes(g) == d for g, d in zip(got, data))
    # The stored value is header + payload, under the documented key, tagged for that key.
    key = b"kvtier:v2:pool-a:" + hs[0].hex().encode()
    raw = server.client().get(key)
    magic, version, length, tag = HEADER.unpack_from(raw)
    assert (magic, version, length, HEADER_BYTES) == (b"KVT1", 2, BLOCK, 32)
    assert tag == ValueMac(rs.SECRET).tag(key, memoryview(data[0])) == t.encode_header(hs[0], data[0])[16:]
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
    hs, data = hashes(7, seed=2), blocks(7)
    put(t, hs, data)
    r = server.client()
    # 0: one payload byte flipped (the MAC); 1: truncated; 2: bad magic; 3: another format version;
    # 4: header claims another length, value padded to look right; 5: the old format (v1: 24-byte
    # header, unkeyed xxh3-64), its checksum right for its bytes and its size a block's; 6 untouched.
    v0 = bytearray(r.get(t.key(hs[0])))
    v0[HEADER_BYTES + 1234] ^= 0x40
    r.set(t.key(hs[0]), bytes(v0))
    r.set(t.key(hs[1]), r.get(t.key(hs[1]))[: HEADER_BYTES + BLOCK // 2])
    v2 = bytearray(r.get(t.key(hs[2])))
    v2[:4] = b"XXXX"
    r.set(t.key(hs[2]), bytes(v2))
    v3 = bytearray(r.get(t.key(hs[3])))
    v3[4] = 3
    r.set(t.key(hs[3]), bytes(v3))
    payload = data[4][:-8]
    r.set(t.key(hs[4]), t.encode_header(hs[4], payload) + payload + b"\0" * 8)
    old = os.urandom(BLOCK + HEADER_BYTES - 24)
    r.set(t.key(hs[5]), struct.pack("<4sBxxxQQ", b"KVT1", 1, len(old), xxhash.xxh3_64_intdigest(old)) + old)
    got = t.fetch(hs)
    assert got[:6] == [None] * 6
    assert got[6] is not None and bytes(got[6]) == data[6]
    s = t.stats()
    assert (s["remote_corrupt"], s["remote_unauthentic"], s["remote_oversized"]) == (5, 1, 0)
    assert s["remote_hits"] == 1 and s["remote_misses"] == 0
    # Malformed values are deleted in the background, so they stop answering lookups; a value
    # that only fails its MAC is left alone (a daemon with a wrong secret must not delete the
    # fleet's blocks) and stays a miss.
    assert t.flush(5)
    assert [r.exists(t.key(h)) for h in hs] == [1, 0, 0, 0, 0, 0, 1]
    assert t.fetch(hs[:1]) == [None] and t.stats()["remote_unauthentic"] == 2


def test_a_value_is_served_only_under_its_own_key_pool_and_secret(tiers: list[RemoteTier], redis_url: str,
                                                                 server: rs.RedisServer) -> None:
    a = make(tiers, redis_url, pool_key=b"pool-a")
    b = make(tiers, redis_url, pool_key=b"pool-b")
    other_secret = make(tiers, redis_url, pool_key=b"pool-a", secret=bytes(32))
    hs, data = hashes(4, seed=17), blocks(4)
    put(a, hs[:2], data[:2])
    r = server.client()
    value = r.get(a.key(hs[0]))
    r.set(a.key(hs[1]), value)  # another block's key, same pool
    r.set(a.key(hs[2]), value)  # a key nobody stored
    r.set(b.key(hs[0]), value)  # the same block hash in another pool (another layout)
    assert a.fetch(hs[1:3]) == [None, None]
    assert b.fetch(hs[:1]) == [None]
    # A daemon with another secret reads nothing of ours, and deletes nothing.
    assert other_secret.exists_prefix(hs[:1]) == 1  # present, of a block's size ...
    assert other_secret.fetch(hs[:1]) == [None]  # ... but not authentic
    assert other_secret.flush(5) and r.exists(a.key(hs[0])) == 1
    assert bytes(a.fetch(hs[:1])[0]) == data[0]
    assert a.stats()["remote_unauthentic"] == 2 and b.stats()["remote_unauthentic"] == 1
    assert other_secret.stats()["remote_unauthentic"] == 1
    assert all(t.stats()["deletes_queued"] == 0 for t in (a, b, other_secret))


def test_an_oversized_value_is_never_read(tiers: list[RemoteTier], redis_url: str, server: rs.RedisServer) -> None:
    block = 4096
    t = make(tiers, redis_url, pool_key=b"pool-big", block_bytes=block)
    hs, data = hashes(4, seed=18), blocks(4, block)
    put(t, hs, data)
    r = server.client()
    r.set(t.key(hs[1]), os.urandom(64 << 20))  # 64 MiB under a 4 KiB block's key
    r.delete(t.key(hs[2]))
    r.rpush(t.key(hs[2]), b"x")  # another type: WRONGTYPE for string commands
    # Lookups stop at a value that is not a block's size, or not a string at all.
    assert t.exists_prefix(hs) == 1
    assert t.exists_prefix(hs[2:]) == 0 and t.exists_prefix(hs[3:]) == 1
    sent_before = r.info("stats")["total_net_output_bytes"]
    got = t.fetch(hs)
    sent_bytes = r.info("stats")["total_net_output_bytes"] - sent_before
    assert bytes(got[0]) == data[0] and got[1] is None and got[2] is None and bytes(got[3]) == data[3]
    # The fetch asked for one byte past a block's value: the 64 MiB never crossed the wire.
    assert sent_bytes < 4 * (block + HEADER_BYTES) + 64 * 1024, sent_bytes
    s = t.stats()
    assert s["remote_oversized"] == 1 and s["remote_errors"] == 1 and s["remote_hits"] == 2
    assert t.flush(5) and r.exists(t.key(hs[1])) == 0  # deleted: it was never this pool's


def test_lookups_without_scripting_check_sizes_too(tiers: list[RemoteTier], redis_url: str,
                                                  server: rs.RedisServer) -> None:
    server.client().acl_setuser("noscripts2", enabled=True, passwords=["+pw"], keys=["*"],
                                commands=["+@all", "-@scripting"])
    t = make(tiers, f"redis://noscripts2:pw@127.0.0.1:{server.port}/0", pool_key=b"pool-ns")
    hs = hashes(3, seed=19)
    put(t, hs, blocks(3))
    server.client().append(t.key(hs[1]), b"!")
    assert t.exists_prefix(hs) == 1 and not t._use_script


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
    t = RemoteTier(redis_url, b"pool-a", BLOCK, FAST, secret=rs.SECRET)
    hs, data = hashes(50, seed=5), blocks(50)
    for h, d in zip(hs, data):
        t.write_back(h, d)
    assert t.close(timeout_s=5.0)
    assert t.stats()["writes_done"] == 50
    assert not t.write_back(hs[0], data[0])  # closed: dropped, counted
    reader = RemoteTier(redis_url, b"pool-a", BLOCK, FAST, secret=rs.SECRET)
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
    assert got[3] is None and a.stats()["remote_unauthentic"] == 1
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
