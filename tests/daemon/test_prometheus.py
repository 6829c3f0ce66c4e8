"""The Prometheus endpoint: the loop-to-scrape snapshot handoff, the metric mapping, and a live scrape."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import zmq

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvtier.client.admin import request  # noqa: E402
from kvtier.client.client import Client, DaemonError, PoolLayout  # noqa: E402
from kvtier.client.protocol import ErrorCode  # noqa: E402
from kvtier.daemon.telemetry.prometheus import POOL_METRICS, StatsSnapshot, families_from_stats  # noqa: E402

BLOCK_BYTES = 512
GPU_BLOCKS = 8
CPU_BLOCKS = 16
LAYOUT = PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                    kv_heads=1, head_dim=8)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Samples keyed by (sample name, sorted labels), and family name -> type."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def h(chain: int, i: int) -> bytes:
    return bytes([chain, i]) * 8


# ---- the snapshot handoff -----------------------------------------------------------------------


def test_a_reader_gets_a_snapshot_built_after_it_asked_on_the_loop_thread() -> None:
    wakeups = threading.Event()
    snap = StatsSnapshot(wakeups.set)
    snap.publish({"n": 0})
    builders: list[str] = []
    stop = threading.Event()

    def loop() -> None:  # stands in for Server._turn: only this thread builds
        n = 0
        while not stop.is_set():
            wakeups.wait(0.05)
            wakeups.clear()
            if snap.wanted():
                n += 1
                snap.refresh(lambda n=n: builders.append(threading.current_thread().name) or {"n": n})

    t = threading.Thread(target=loop, name="loop")
    t.start()
    try:
        for expected in (1, 2, 3):
            stats, age_s = snap.get(wait_s=5.0)
            assert stats == {"n": expected} and age_s < 1.0
    finally:
        stop.set()
        t.join()
    assert builders == ["loop"] * 3


def test_without_an_answer_a_reader_gets_the_last_snapshot_and_its_age() -> None:
    now = [100.0]
    snap = StatsSnapshot(None, clock=lambda: now[0])
    assert snap.get(wait_s=0.01) == (None, float("inf"))
    snap.publish({"n": 1})
    now[0] = 107.5
    t0 = time.monotonic()
    assert snap.get(wait_s=0.05) == ({"n": 1}, 7.5)
    assert time.monotonic() - t0 < 1.0


def test_a_failing_build_keeps_the_old_snapshot_and_releases_readers() -> None:
    snap = StatsSnapshot(None)
    snap.publish({"n": 1})
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(snap.get(wait_s=10.0)))
    reader.start()
    while not snap.wanted():
        time.sleep(0.001)
    snap.refresh(lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    reader.join(5.0)
    assert not reader.is_alive() and got[0][0] == {"n": 1}
    assert not snap.wanted()


# ---- the mapping ---------------------------------------------------------------------------------


def test_families_from_a_stats_reply() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    pool = {k.key: 0 for k in POOL_METRICS}
    pool.update(lookups=3, looked_up_blocks=10, hit_blocks_gpu=4, hit_blocks_cpu=3, hit_blocks_remote=1,
                miss_blocks=2, gpu_blocks=8, gpu_free_blocks=6, cpu_blocks=16, cpu_used_blocks=5,
                bytes_store=1024, mode="engine", gpu_registered=False,
                remote={"available": True, "remote_unauthentic": 3, "remote_oversized": 1, "remote_corrupt": 0})
    stats = {"pools": {"p": pool}, "sessions": 1,
             "daemon": {"requests_total": {"op=stats": 2}, "protocol_errors_total": {"code=MALFORMED": 1},
                        "sessions": 1}}

    class One:
        def collect(self) -> Any:
            return families_from_stats(stats, 0.25)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())  # type: ignore[arg-type]
    samples, types = parse(generate_latest(registry).decode())
    assert value(samples, "kvtier_hit_blocks_total", pool="p", tier="remote") == 1
    assert value(samples, "kvtier_copy_bytes_total", pool="p", direction="store") == 1024
    assert value(samples, "kvtier_blocks", pool="p", tier="gpu", state="used") == 2
    assert value(samples, "kvtier_blocks", pool="p", tier="cpu", state="free") == 11
    assert value(samples, "kvtier_gpu_attached", pool="p") == 0
    assert value(samples, "kvtier_pool_info", pool="p", mode="engine") == 1
    assert value(samples, "kvtier_remote_up", pool="p") == 1
    assert value(samples, "kvtier_remote_rejected_blocks_total", pool="p", reason="unauthentic") == 3
    assert value(samples, "kvtier_remote_rejected_blocks_total", pool="p", reason="oversized") == 1
    assert value(samples, "kvtier_remote_rejected_blocks_total", pool="p", reason="corrupt") == 0
    assert value(samples, "kvtier_protocol_errors_total", code="MALFORMED") == 1
    assert value(samples, "kvtier_lease_expiries_total") == 0  # exported before the first expiry
    assert value(samples, "kvtier_stats_age_seconds") == 0.25
    assert types["kvtier_hit_blocks"] == "counter" and types["kvtier_blocks"] == "gauge"
    assert types["kvtier_sessions"] == "gauge" and types["kvtier_requests"] == "counter"


def test_no_snapshot_yet_exports_only_its_age() -> None:
    (fam,) = families_from_stats(None, float("inf"))
    assert fam.name == "kvtier_stats_age_seconds"


# ---- against a live daemon ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metrics_daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    port = free_port()
    daemon = kvtierd_module_factory(metrics_port=port, gpu_bytes=GPU_BLOCKS * BLOCK_BYTES,
                                    cpu_bytes=CPU_BLOCKS * BLOCK_BYTES)
    daemon.metrics_port = port
    return daemon


def _workload(endpoint: str) -> Client:
    """GPU hits, CPU hits, misses, demotions, a fast-failed store, pins; returns the client (pins held)."""
    c = Client(endpoint, "metrics", LAYOUT)
    first = [h(1, i) for i in range(GPU_BLOCKS)]
    second = [h(2, i) for i in range(GPU_BLOCKS)]
    assert c.store(first, bytes(len(first) * BLOCK_BYTES)) == (GPU_BLOCKS, 0)
    assert c.store(second, bytes(len(second) * BLOCK_BYTES)) == (GPU_BLOCKS, 0)  # evicts (demotes) `first`
    assert c.store(first[:2], bytes(2 * BLOCK_BYTES)) == (0, 2)
    assert c.lookup(second) == ["gpu"] * GPU_BLOCKS
    assert c.lookup(first + [h(3, 0)]) == ["cpu"] * GPU_BLOCKS  # then one miss
    assert c.lookup([h(3, 1), *second]) == []  # a gap first: all misses
    assert len(c.restore(first[:3]).tiers) == 3
    assert c.pin(second) == ["gpu"] * GPU_BLOCKS  # no GPU block left to evict
    with pytest.raises(DaemonError) as info:  # and more blocks than the CPU tier has: fails fast
        many = [h(4, i) for i in range(CPU_BLOCKS + 1)]
        c.store(many, bytes(len(many) * BLOCK_BYTES))
    assert info.value.code == ErrorCode.NO_SPACE
    return c


def _malformed(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(b"\xc1 not msgpack")
        assert sock.poll(5000)
        sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


def test_scraped_metrics_match_the_stats_verb(metrics_daemon) -> None:  # type: ignore[no-untyped-def]
    endpoint, port = metrics_daemon.endpoint, metrics_daemon.metrics_port
    client = _workload(endpoint)
    # A session whose client vanished without bye: its lease runs out.
    dead = Client(endpoint, "metrics", LAYOUT, lease_s=0.2, heartbeat=False)
    _malformed(endpoint)
    deadline = time.monotonic() + 10
    while request(endpoint, "stats")["daemon"].get("lease_expiries_total", 0) < 1:
        assert time.monotonic() < deadline, "the short lease never expired"
        time.sleep(0.05)
    try:
        samples, types = parse(scrape(port))
        stats = request(endpoint, "stats")
    finally:
        client.close()
        dead.close(timeout_s=0.2)
    p = stats["pools"]["metrics"]

    def pool_value(name: str, **labels: str) -> float:
        return value(samples, name, pool="metrics", **labels)

    # The counters add up: every looked-up block is a hit of one tier or a miss.
    hits = {t: pool_value("kvtier_hit_blocks_total", tier=t) for t in ("gpu", "cpu", "remote")}
    assert sum(hits.values()) + pool_value("kvtier_miss_blocks_total") == pool_value("kvtier_looked_up_blocks_total")
    # What the workload did, by hand: lookups 8 + 9 + 9 blocks, restore 3 (its uncounted probe aside).
    assert pool_value("kvtier_lookups_total") == 4
    assert pool_value("kvtier_looked_up_blocks_total") == 8 + 9 + 9 + 3
    assert hits == {"gpu": 8, "cpu": 8 + 3, "remote": 0}
    assert pool_value("kvtier_miss_blocks_total") == 1 + 9
    assert pool_value("kvtier_demotions_total") >= GPU_BLOCKS
    assert pool_value("kvtier_store_failures_total") == 1
    assert pool_value("kvtier_stored_blocks_total") == 2 * GPU_BLOCKS
    assert pool_value("kvtier_store_present_blocks_total") == 2
    assert pool_value("kvtier_loaded_blocks_total") == 3
    assert pool_value("kvtier_copy_bytes_total", direction="store") == 2 * GPU_BLOCKS * BLOCK_BYTES
    # Inline restores copy into a staging buffer or lend the tiers' memory in place.
    assert (pool_value("kvtier_copy_bytes_total", direction="load") + pool_value("kvtier_lent_bytes_total")
            == 3 * BLOCK_BYTES)
    assert pool_value("kvtier_pinned_blocks") == GPU_BLOCKS
    assert pool_value("kvtier_blocks", tier="gpu", state="used") == GPU_BLOCKS  # the pinned ones
    assert pool_value("kvtier_capacity_blocks", tier="cpu") == CPU_BLOCKS
    assert value(samples, "kvtier_lease_expiries_total") == 1
    assert value(samples, "kvtier_protocol_errors_total", code="MALFORMED") == 1
    assert value(samples, "kvtier_sessions") == 1  # `client`; `dead` expired
    assert value(samples, "kvtier_stats_age_seconds") < 1.0
    assert types["kvtier_lookups"] == "counter" and types["kvtier_blocks"] == "gauge"

    # And they match the stats verb, series by series.
    for spec in POOL_METRICS:
        if spec.key in p:
            assert pool_value(f"kvtier_{spec.name}" + ("_total" if spec.kind == "counter" else ""),
                              **dict(spec.labels)) == pytest.approx(p[spec.key]), spec.key
    assert pool_value("kvtier_blocks", tier="gpu", state="free") == p["gpu_free_blocks"]
    assert pool_value("kvtier_blocks", tier="cpu", state="used") == p["cpu_used_blocks"]
    assert pool_value("kvtier_cpu_evictions_total") == p["cpu_evictions"]
    assert pool_value("kvtier_restores_total") == p["restores"]
    d = stats["daemon"]
    assert value(samples, "kvtier_lease_expiries_total") == d["lease_expiries_total"]
    assert value(samples, "kvtier_requests_total", op="lookup") == d["requests_total"]["op=lookup"]
    # The scrape came before this stats call, which is the only request in between.
    assert value(samples, "kvtier_requests_total", op="stats") == d["requests_total"]["op=stats"] - 1


def test_every_exported_metric_is_documented(metrics_daemon) -> None:  # type: ignore[no-untyped-def]
    _samples, types = parse(scrape(metrics_daemon.metrics_port))
    docs = DOCS.read_text()
    names = [n for n in types if n.startswith("kvtier_")]
    assert len(names) > 20
    for name in names:
        full = name + ("_total" if types[name] == "counter" else "")
        assert re.search(rf"`{full}[{{`]", docs), f"{full} is not in docs/metrics.md"


def test_the_endpoint_binds_metrics_host_only(metrics_daemon) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", metrics_daemon.metrics_port)) == 0
    try:  # this host's other IPv4 addresses, where the endpoint must not answer
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except socket.gaierror:
        addrs = set()
    addrs = {a for a in addrs if not a.startswith("127.")}
    for addr in addrs:
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((addr, metrics_daemon.metrics_port)) != 0, addr


def test_a_taken_metrics_port_stops_the_daemon_at_start(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="cannot serve"):
            kvtierd_factory(metrics_port=taken.getsockname()[1])


def test_no_metrics_port_no_endpoint(kvtierd) -> None:  # type: ignore[no-untyped-def]
    assert "metrics at" not in kvtierd.log()


def test_idle_connections_cost_no_thread_and_do_not_hold_the_endpoint(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    from kvtier.daemon.telemetry.metrics_endpoint import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS

    port = free_port()
    daemon = kvtierd_factory(metrics_port=port)
    tasks = Path(f"/proc/{daemon.proc.pid}/task")
    assert "kvtier_sessions" in scrape(port)  # the renderer's thread exists from here on
    threads_before = len(list(tasks.iterdir()))
    idle = []
    try:
        for _ in range(MAX_CONNECTIONS - 4):  # each says nothing
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            idle.append(s)
        half = socket.create_connection(("127.0.0.1", port), timeout=5)
        half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        idle.append(half)
        time.sleep(0.5)
        assert len(list(tasks.iterdir())) == threads_before  # no thread per connection
        # Scrapes go on beside them, and a path other than /metrics is a 404.
        for _ in range(3):
            assert "kvtier_sessions" in scrape(port)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing", timeout=5)
        assert err.value.code == 404
        # Past the cap a new connection is closed at once; the silent ones are dropped after the timeout.
        extra = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
        idle.extend(extra)
        assert extra[-1].recv(1) == b""  # the 68th: closed at once
        deadline_s = time.monotonic() + CONNECTION_TIMEOUT_S + 5
        for s in idle[:MAX_CONNECTIONS - 4]:
            s.settimeout(max(0.1, deadline_s - time.monotonic()))
            assert s.recv(1) == b""  # the daemon closed it: silent for CONNECTION_TIMEOUT_S
        assert "kvtier_sessions" in scrape(port)
        assert daemon.alive
    finally:
        for s in idle:
            s.close()


def test_a_named_series_adds_as_inc_does() -> None:
    """``Counters.add`` on a ``series_key`` counts into the same series as ``inc`` with the same labels."""
    from kvtier.daemon.telemetry.metrics import Counters

    m = Counters()
    key = Counters.series_key("requests_total", op="lookup")
    m.add(key)
    m.inc("requests_total", op="lookup")
    m.add(key, 2.5)
    m.add(Counters.series_key("plain_total"))
    assert m.get("requests_total", op="lookup") == 4.5
    assert m.get("requests_total", op="pin") == 0
    assert m.snapshot()["requests_total"] == {"op=lookup": 4.5}
    assert m.snapshot()["plain_total"] == 1
