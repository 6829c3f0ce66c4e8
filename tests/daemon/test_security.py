"""Transport security and tenants against real kvtierd processes.

- ipc socket modes (0600 default, 0660 from KVTIER_SOCKET_MODE as the unit sets it);
- ``kvtier keygen``;
- tcp:// with CURVE: a client without keys or with an unknown key gets no
  reply at all (its own short deadline), a registered key works, a key file
  added while the daemon runs works without a restart;
- tenants: tenant A never sees tenant B's blocks through any verb (lookup,
  pin, restore, allocate hits, clear, stats), a sid is no use to another
  identity, tokens, quotas.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvtier.client.client import Client, DaemonError, KvtierTimeout, PoolLayout, probe_health
from kvtier.client.curve import CurveKeys, create_key_pair, read_public_key
from kvtier.client.protocol import ErrorCode, decode, encode
from kvtier.testing.daemon import KvtierDaemon

BLOCK = 1024
LAYOUT = PoolLayout(model="m", block_size=4, block_bytes=BLOCK, dtype="bfloat16", num_layers=1, kv_heads=1,
                    head_dim=8, hash_algo="sha256")
SHORT_S = 1.0  # how long a rejected client waits for the reply that never comes
TOKEN = "tokenco-secret-0123456789"


# ---- ipc socket modes and keygen ---------------------------------------------------------------


def test_ipc_socket_is_0600_by_default_and_0660_from_the_units_environment(kvtierd_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    default = kvtierd_factory()
    assert stat.S_IMODE(os.stat(default.socket_file).st_mode) == 0o600
    # The unit sets KVTIER_SOCKET_MODE=0660; the harness passes flags, the environment is tested in test_config.
    group = kvtierd_factory(socket_mode="0660")
    assert stat.S_IMODE(os.stat(group.socket_file).st_mode) == 0o660


def test_daemon_accepts_kvtier_socket_mode_from_the_environment(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_SOCKET_MODE"] = "0660"
    proc = subprocess.run([sys.executable, "-m", "kvtier.daemon", "--print-config"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert 'socket_mode = "0660"' in proc.stdout


def test_keygen_writes_a_private_secret_and_refuses_to_overwrite(tmp_path: Path) -> None:
    from kvtier.tools.cli import main

    assert main(["keygen", str(tmp_path / "keys"), "--name", "engine-0"]) == 0
    public, secret = tmp_path / "keys" / "engine-0.key", tmp_path / "keys" / "engine-0.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    keys = CurveKeys.load(public, secret)
    assert keys.public == read_public_key(public) and len(keys.secret) == 40
    assert "secret" not in repr(keys).replace("secret_key", "")
    with pytest.raises(SystemExit, match="exists"):
        main(["keygen", str(tmp_path / "keys"), "--name", "engine-0"])



def test_keygen_writes_a_remote_tier_secret_that_kvtierd_reads(tmp_path: Path) -> None:
    from kvtier.tiers.remote.secret import load_secret
    from kvtier.tools.cli import main

    old = os.umask(0o002)  # a permissive umask: the file must be 0600 whatever it says
    try:
        assert main(["keygen", str(tmp_path / "keys"), "--remote-secret"]) == 0
    finally:
        os.umask(old)
    path = tmp_path / "keys" / "remote.remote_secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert len(text) == 65 and text.endswith("\n") and load_secret(path) == bytes.fromhex(text)
    with pytest.raises(SystemExit, match="exists"):
        main(["keygen", str(tmp_path / "keys"), "--remote-secret"])
    assert main(["keygen", str(tmp_path / "keys"), "--remote-secret", "--name", "other"]) == 0
    assert load_secret(tmp_path / "keys" / "other.remote_secret") != load_secret(path)
    with pytest.raises(SystemExit, match="no public half"):
        main(["keygen", str(tmp_path / "keys"), "--remote-secret", "--print-public", "--name", "x"])
    # What kvtierd refuses at start (exit 2, remote_secret_key_file named): readable by others, not a secret.
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        load_secret(path)
    bad = tmp_path / "bad"
    bad.write_text("0123")
    bad.chmod(0o600)
    with pytest.raises(ValueError, match="kvtier keygen"):
        load_secret(bad)

# ---- daemons on tcp:// ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tcp_daemon(root: Path, config: str, probe: CurveKeys | None) -> KvtierDaemon:
    """kvtierd on a free loopback tcp:// port, set up by a config file: a debug log, then ``config``.

    ``probe``: the client keys its readiness probe uses (a CURVE daemon answers no one else).
    """
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "kvtierd.toml"
    config_path.write_text(f'socket = "{endpoint}"\nlog_level = "debug"\n' + textwrap.dedent(config))
    return KvtierDaemon.start(root, endpoint=endpoint, flags={"config": config_path}, health_curve=probe)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("curve")
    out: dict[str, Any] = {"root": root, "clients": root / "clients"}
    (root / "clients").mkdir()
    for name in ("server", "alice", "bob", "carol", "mallory", "dave"):
        out[name] = create_key_pair(root / "own", name)  # (public file, secret file)
    # carol is authorised through the directory; alice and bob as tenants; mallory and dave are unknown.
    (root / "clients" / "carol.key").write_bytes(out["carol"][0].read_bytes())
    return out


def client_keys(keys: dict[str, Any], name: str) -> CurveKeys:
    return CurveKeys.load(keys["server"][0], keys[name][1])


def curve_kwargs(keys: dict[str, Any], name: str) -> dict[str, Any]:
    return {"curve_server_key": keys["server"][0], "curve_secret_key_file": keys[name][1]}


@pytest.fixture(scope="module")
def curve_daemon(keys: dict[str, Any]) -> Iterator[KvtierDaemon]:
    """CURVE without tenants: any authorised key is the (one) anonymous tenant."""
    d = tcp_daemon(keys["root"] / "plain", f"""
        curve_secret_key_file = "{keys['server'][1]}"
        curve_public_keys_dir = "{keys['clients']}"
        hash_algo = "sha256"
        [default_pool]
        gpu_bytes = {16 * BLOCK}
        cpu_bytes = {16 * BLOCK}
    """, probe=client_keys(keys, "carol"))
    yield d
    d.stop()


def test_tcp_client_without_keys_gets_no_reply(curve_daemon: KvtierDaemon) -> None:
    t0 = time.monotonic()
    with pytest.raises(KvtierTimeout):
        Client(curve_daemon.endpoint, "p", LAYOUT, timeout_s=SHORT_S)
    assert time.monotonic() - t0 < SHORT_S + 2.0
    with pytest.raises(KvtierTimeout):
        probe_health(curve_daemon.endpoint, timeout_s=SHORT_S)


def test_tcp_client_with_an_unknown_key_gets_no_reply(curve_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    with pytest.raises(KvtierTimeout):
        Client(curve_daemon.endpoint, "p", LAYOUT, timeout_s=SHORT_S, **curve_kwargs(keys, "mallory"))
    # Right client key, wrong idea of the server's key: no handshake either.
    wrong_server = CurveKeys.load(keys["mallory"][0], keys["carol"][1])
    with pytest.raises(KvtierTimeout):
        probe_health(curve_daemon.endpoint, timeout_s=SHORT_S, curve=wrong_server)


def test_tcp_client_with_a_registered_key_works(curve_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    hashes = [bytes([7, i]) * 8 for i in range(4)]
    data = os.urandom(4 * BLOCK)
    with Client(curve_daemon.endpoint, "p", LAYOUT, timeout_s=10.0, **curve_kwargs(keys, "carol")) as c:
        assert c.store(hashes, data) == (4, 0)
        got = c.restore(hashes)
        assert got.tiers == ["gpu"] * 4 and bytes(got.data) == data
        c.heartbeat()  # the heartbeat socket is a CURVE client too


def test_a_key_added_to_the_directory_works_without_a_restart(curve_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    with pytest.raises(KvtierTimeout):
        probe_health(curve_daemon.endpoint, timeout_s=SHORT_S, curve=client_keys(keys, "dave"))
    (keys["clients"] / "dave.key").write_bytes(keys["dave"][0].read_bytes())
    time.sleep(1.1)  # the directory is re-read at most once a second
    assert probe_health(curve_daemon.endpoint, timeout_s=5.0, curve=client_keys(keys, "dave"))["status"] == "ok"


# ---- tenants ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenant_daemon(keys: dict[str, Any]) -> Iterator[KvtierDaemon]:
    alice, bob = (read_public_key(keys[n][0]).decode() for n in ("alice", "bob"))
    # Two or more tenants: hash_algo defaults to sha256 (LAYOUT says sha256).
    d = tcp_daemon(keys["root"] / "tenants", f"""
        curve_secret_key_file = "{keys['server'][1]}"
        curve_public_keys_dir = "{keys['clients']}"
        [default_pool]
        gpu_bytes = {4 * BLOCK}
        cpu_bytes = {16 * BLOCK}
        clean_ahead_blocks = 0
        [tenants.alice]
        public_key = "{alice}"
        [tenants.bob]
        public_key = "{bob}"
        [tenants.tokenco]
        token = "{TOKEN}"
        cpu_quota_bytes = {2 * BLOCK}
    """, probe=client_keys(keys, "carol"))
    yield d
    d.stop()


def tenant_client(d: KvtierDaemon, keys: dict[str, Any], name: str, pool: str = "shared", **kw: Any) -> Client:
    return Client(d.endpoint, pool, kw.pop("layout", LAYOUT), timeout_s=10.0, **curve_kwargs(keys, name), **kw)


def no_hashes_in(value: Any, path: str = "") -> None:
    """Stats carry counters and names, never block keys (bytes)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise AssertionError(f"bytes at {path or '/'}")
    if isinstance(value, dict):
        for k, v in value.items():
            assert not isinstance(k, (bytes, bytearray)), f"bytes key at {path}"
            no_hashes_in(v, f"{path}/{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            no_hashes_in(v, f"{path}/{i}")


def test_tenant_a_never_sees_tenant_b_blocks(tenant_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    hashes = [bytes([1, i]) * 8 for i in range(8)]
    a_data, b_data = os.urandom(8 * BLOCK), os.urandom(8 * BLOCK)
    with tenant_client(tenant_daemon, keys, "alice") as a, tenant_client(tenant_daemon, keys, "bob") as b:
        # 8 blocks, a 4-block GPU tier: alice's chain lies in both tiers.
        assert a.store(hashes[:4], a_data[: 4 * BLOCK]) == (4, 0)
        assert a.store(hashes[4:], a_data[4 * BLOCK:]) == (4, 0)
        a_tiers = a.lookup(hashes)
        assert len(a_tiers) == 8 and set(a_tiers) == {"gpu", "cpu"}
        # bob, same pool name (his own pool: names are per tenant), same hashes: nothing, whichever verb asks.
        assert b.lookup(hashes) == []
        assert b.lookup(hashes, pin=True) == []
        assert b.pin(hashes) == []
        assert b.unpin(hashes) == 0
        assert len(b.restore(hashes)) == 0
        # Content addressing does not leak either: bob's store of the same hashes
        # is new to him (a "present" count would tell him alice has them).
        assert b.store(hashes[:4], b_data[: 4 * BLOCK]) == (4, 0)
        assert bytes(b.restore(hashes[:4]).data) == b_data[: 4 * BLOCK]
        got = a.restore(hashes)
        assert len(got) == 8 and bytes(got.data) == a_data
        # clear is per tenant: bob's clear leaves alice's blocks.
        assert b.clear() >= 4
        assert b.lookup(hashes) == []
        assert len(a.lookup(hashes)) == 8
        # stats: bob sees his own tenant counters only, and no keys anywhere.
        stats = b.stats()
        no_hashes_in(stats)
        assert list(stats["tenants"]) == ["bob"]
        assert a.stats()["tenants"].keys() == {"alice"}
        # events would hand out pool keys: refused to tenants.
        with pytest.raises(DaemonError) as info:
            b.events(0)
        assert info.value.code == ErrorCode.INVALID_STATE and "tenants" in str(info.value)


def test_allocate_hits_are_per_tenant(tenant_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    from kvtier.client.kv_share import allocate_shared_kv

    engine_layout = PoolLayout(**{**LAYOUT.to_wire(), "mode": "engine"})
    kv, handle = allocate_shared_kv((8, BLOCK // 2), "float16", 0)
    bob_kv, bob_handle = allocate_shared_kv((8, BLOCK // 2), "float16", 0)
    try:
        # One pool name, two pools (names are per tenant): each engine registers its own GPU tier.
        with tenant_client(tenant_daemon, keys, "alice", "engine", layout=engine_layout) as a, \
                tenant_client(tenant_daemon, keys, "bob", "engine", layout=engine_layout) as b:
            a.register_kv("kv", [kv], 0)
            b.register_kv("kv", [bob_kv], 0)
            tokens = list(range(12))
            first = a.allocate_tokens("r1", tokens)
            assert first.num_hit_blocks == 0
            a.free("r1")
            again = a.allocate_tokens("r2", tokens)
            assert again.num_hit_blocks == 3 and again.tiers == ["gpu"] * 3
            a.free("r2")
            other = b.allocate_tokens("r1", tokens)  # same tokens, same hashes, another tenant
            assert other.num_hit_blocks == 0
            b.free("r1")
    finally:
        for h in (handle, bob_handle):
            if os.path.exists(f"/dev/shm/{h['name']}"):
                os.unlink(f"/dev/shm/{h['name']}")


def raw(sock: zmq.Socket, header: dict[str, Any]) -> dict[str, Any]:
    sock.send(encode({"v": 1, **header}))
    assert sock.poll(5000), "no reply"
    return decode(sock.recv_multipart()[0])


def test_a_sid_is_no_use_to_another_identity(tenant_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    with tenant_client(tenant_daemon, keys, "alice") as a:
        a.store([b"\2" * 16], bytes(BLOCK))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        client_keys(keys, "bob").apply(sock)
        sock.connect(tenant_daemon.endpoint)
        try:
            reply = raw(sock, {"op": "lookup", "id": 1, "sid": a.sid, "hashes": [b"\2" * 16]})
            assert reply["ok"] is False and reply["error"]["code"] == int(ErrorCode.UNKNOWN_SESSION)
        finally:
            sock.close()
            ctx.term()
        assert a.lookup([b"\2" * 16]) == ["gpu"]  # alice's session is untouched


def test_tenant_identity_from_tokens_and_refusals(tenant_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    # carol's key is authorised but belongs to no tenant: she needs a token.
    with pytest.raises(DaemonError) as info:
        tenant_client(tenant_daemon, keys, "carol")
    assert info.value.code == ErrorCode.UNAUTHORIZED
    with pytest.raises(DaemonError) as info:
        tenant_client(tenant_daemon, keys, "carol", token="not-the-token-0123456789")
    assert info.value.code == ErrorCode.UNAUTHORIZED
    with pytest.raises(DaemonError) as info:  # alice's key with tokenco's token: two identities
        tenant_client(tenant_daemon, keys, "alice", token=TOKEN)
    assert info.value.code == ErrorCode.UNAUTHORIZED
    hashes = [bytes([3, i]) * 8 for i in range(2)]
    with tenant_client(tenant_daemon, keys, "carol", token=TOKEN) as t, tenant_client(tenant_daemon, keys, "alice") as a:
        assert t.store(hashes, bytes(2 * BLOCK)) == (2, 0)
        assert t.lookup(hashes) == ["gpu", "gpu"]
        assert a.lookup(hashes) == []
        assert list(t.stats()["tenants"]) == ["tokenco"]
    # The refusals created nothing: no pool for an unauthorised hello.
    with tenant_client(tenant_daemon, keys, "alice") as a:
        assert "refused-pool" not in a.stats()["pools"]
    with pytest.raises(DaemonError):
        tenant_client(tenant_daemon, keys, "carol", pool="refused-pool")


def test_cpu_quota_drops_demotions_and_refuses_spilling_stores(tenant_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    # tokenco: 2-block CPU quota; the GPU tier has 4 blocks, shared by everyone in the pool.
    with tenant_client(tenant_daemon, keys, "carol", "quota", token=TOKEN) as t:
        first = [bytes([4, i]) * 8 for i in range(4)]
        second = [bytes([5, i]) * 8 for i in range(4)]
        assert t.store(first, bytes(4 * BLOCK)) == (4, 0)
        assert t.store(second, bytes(4 * BLOCK)) == (4, 0)  # evicts `first`: only 2 demotions fit the quota
        mine = t.stats()["tenants"]["tokenco"]
        assert mine["cpu_resident_bytes"] == 2 * BLOCK and mine["dropped_demotions"] == 2
        # 4 fit the GPU tier, the other 3 would spill into the CPU tier past the quota: refused.
        third = [bytes([6, i]) * 8 for i in range(7)]
        with pytest.raises(DaemonError) as info:
            t.store(third, bytes(7 * BLOCK))
        assert info.value.code == ErrorCode.NO_SPACE and "quota" in info.value.message
        assert t.stats()["tenants"]["tokenco"]["refused_stores"] == 1
    # The operator (no tenant identity: carol's key, no token) sees every tenant.
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    client_keys(keys, "carol").apply(sock)
    sock.connect(tenant_daemon.endpoint)
    try:
        stats = raw(sock, {"op": "stats", "id": 1})
    finally:
        sock.close()
        ctx.term()
    assert {"alice", "bob", "tokenco"} <= stats["tenants"].keys()
    no_hashes_in(stats)


def test_tenant_daemon_requires_sha256_layouts(tenant_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    with pytest.raises(DaemonError) as info:
        tenant_client(tenant_daemon, keys, "alice", "xxh", layout=PoolLayout(**{**LAYOUT.to_wire(), "hash_algo": "xxh3_128"}))
    assert info.value.code == ErrorCode.LAYOUT_MISMATCH and "sha256" in info.value.message


def test_stats_health_and_mismatches_show_a_tenant_nothing_of_other_tenants_pools(
        tenant_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    secret_layout = PoolLayout(model="bobs-secret-model", block_size=4, block_bytes=BLOCK, dtype="bfloat16",
                               num_layers=1, kv_heads=1, head_dim=8, hash_algo="sha256", mode="store")
    with tenant_client(tenant_daemon, keys, "bob", "bob-private", layout=secret_layout) as b:
        assert "bob-private" in b.stats()["pools"]
        with tenant_client(tenant_daemon, keys, "alice", "alice-own") as a:
            st = a.stats()
            assert "bob-private" not in st["pools"] and "alice-own" in st["pools"]
            assert list(st["tenants"]) == ["alice"]
            assert st["sessions"] == 1  # hers only
            assert "bob-private" not in json.dumps(a.health())
        # alice names bob's pool with another layout: names are per tenant, so she
        # gets a pool of her own by that name, and learns nothing of his.
        with tenant_client(tenant_daemon, keys, "alice", "bob-private") as a:
            st = a.stats()
            assert st["pools"]["bob-private"]["sessions"] == 1  # hers: bob's session is not in it
            assert "bobs-secret-model" not in json.dumps(st, default=str)
        assert b.stats()["pools"]["bob-private"]["sessions"] == 1  # his pool: untouched, his session only
        with pytest.raises(DaemonError) as info:  # bob, who uses the pool, is told its layout
            tenant_client(tenant_daemon, keys, "bob", "bob-private")
        assert "bobs-secret-model" in str(info.value)


def test_kvtier_stats_and_top_reach_a_curve_daemon_with_keys(curve_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    with Client(curve_daemon.endpoint, "seen-by-stats", LAYOUT, timeout_s=10.0, **curve_kwargs(keys, "carol")):
        pass
    cli = [sys.executable, "-m", "kvtier.tools.cli"]
    auth = ["--curve-server-key", str(keys["server"][0]), "--curve-secret-key-file", str(keys["carol"][1])]
    out = subprocess.run([*cli, "stats", "--socket", curve_daemon.endpoint, *auth, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "seen-by-stats" in json.loads(out.stdout)["pools"]
    out = subprocess.run([*cli, "top", "--socket", curve_daemon.endpoint, *auth, "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "seen-by-stats" in out.stdout, out.stderr
    # Without keys the daemon never answers: a clear error, not a hang.
    out = subprocess.run([*cli, "stats", "--socket", curve_daemon.endpoint, "--timeout", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no answer" in out.stderr
    out = subprocess.run([*cli, "stats", "--socket", curve_daemon.endpoint, auth[0], auth[1]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "both" in out.stderr


def test_per_tenant_hits_and_quota_use_are_counted_and_exported(tenant_daemon: KvtierDaemon, keys: dict[str, Any]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.daemon.telemetry.prometheus import families_from_stats

    hs = [bytes([9, i]) * 8 for i in range(4)]
    with tenant_client(tenant_daemon, keys, "alice", "tenant-metrics") as a:
        before = a.stats()["tenants"]["alice"]
        a.store(hs[:2], bytes(2 * BLOCK))
        assert list(a.lookup(hs)) == ["gpu", "gpu"]
        after = a.stats()["tenants"]["alice"]
    assert after["looked_up_blocks"] - before["looked_up_blocks"] == 4
    assert after["hit_blocks"]["gpu"] - before["hit_blocks"]["gpu"] == 2
    # The operator's view as Prometheus series (what /metrics serves): one per tenant.
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    class Once:
        def collect(self):  # type: ignore[no-untyped-def]
            return families_from_stats({"pools": {}, "daemon": {}, "tenants": {"alice": after, "bob": after}})

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Once())  # type: ignore[arg-type]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
    assert samples[("kvtier_tenant_hit_blocks_total", (("tenant", "alice"), ("tier", "gpu")))] == after["hit_blocks"]["gpu"]
    assert samples[("kvtier_tenant_looked_up_blocks_total", (("tenant", "bob"),))] == after["looked_up_blocks"]
    assert ("kvtier_tenant_cpu_resident_bytes", (("tenant", "alice"),)) in samples


# ---- wrong tenant tokens (issue 32 item 9) -------------------------------------------------------


def test_wrong_tenant_tokens_are_rate_limited_per_peer(tmp_path: Path) -> None:
    """Issue 32 item 9: tenant tokens could be guessed at 4,900/s (hello after hello, no delay). Now a
    peer (here the test's uid on ipc) gets ``max_auth_failures_per_minute`` wrong tokens, then its
    hellos with a token are refused untried (TOO_MANY_AUTH_FAILURES, naming the wait) until its bucket
    refills; hellos keep being answered at once, so the limit costs the daemon nothing."""
    from kvtier.client.admin import request
    from tests.stress import hostile_clients

    per_minute = 6  # a try every 10 s once the burst is spent
    layout = PoolLayout(model="m", block_size=4, block_bytes=BLOCK, dtype="bfloat16", num_layers=1, kv_heads=1,
                        head_dim=8)
    config = tmp_path / "kvtierd.toml"
    config.write_text(textwrap.dedent(f"""
        max_auth_failures_per_minute = {per_minute}
        [tenants.tokenco]
        token = "{TOKEN}"
    """))
    config.chmod(0o600)
    with KvtierDaemon(tmp_path / "d", flags={"config": config, "cpu_bytes": 16 * BLOCK, "gpu_bytes": 4 * BLOCK}) as d:
        seconds = 3.0
        guesser = hostile_clients.spawn("guess", d.endpoint, seconds)
        out = json.loads(hostile_clients.result(guesser, 60))
        codes = out["codes"]
        guesses_per_s = codes.get("UNAUTHORIZED", 0) / seconds
        # Every hello answered, fast: refusals cost the loop no more than the token check did.
        assert out["answered"] > 100, out
        assert codes.get("UNAUTHORIZED", 0) <= per_minute + seconds * per_minute / 60 + 1, (codes, guesses_per_s)
        assert codes.get("TOO_MANY_AUTH_FAILURES", 0) == out["answered"] - codes.get("UNAUTHORIZED", 0), codes
        # The right token from the same peer waits its turn like any other (it is not even checked)...
        with pytest.raises(DaemonError) as info:
            Client(d.endpoint, "p", layout, token=TOKEN, timeout_s=10.0)
        assert info.value.code == ErrorCode.TOO_MANY_AUTH_FAILURES
        wait_s = float(re.search(r"try again in ([0-9.]+) s", str(info.value)).group(1))  # type: ignore[union-attr]
        assert "max_auth_failures_per_minute 6" in str(info.value) and 0 < wait_s <= 60 / per_minute
        # ...and is served once the bucket holds a try again.
        time.sleep(wait_s + 0.2)
        with Client(d.endpoint, "p", layout, token=TOKEN, timeout_s=10.0) as c:
            assert list(c.stats()["tenants"]) == ["tokenco"]
        # The operator (the daemon's own user on ipc) sees both counts.
        daemon_stats = request(d.endpoint, "stats", timeout_s=10.0)["daemon"]
        assert daemon_stats["auth_failures_total"] == codes["UNAUTHORIZED"]
        assert daemon_stats["auth_refused_total"] == codes["TOO_MANY_AUTH_FAILURES"] + 1


def test_the_auth_failure_limiter_refills_and_keeps_a_bounded_table() -> None:
    from kvtier.daemon.access import auth_limits
    from kvtier.daemon.access.auth_limits import AuthFailureLimiter

    now = [0.0]
    lim = AuthFailureLimiter(6, clock=lambda: now[0])  # a try every 10 s after a burst of 6
    for _ in range(6):
        assert lim.wait_s(1000) == 0.0
        lim.failed(1000)
    assert lim.wait_s(1000) == pytest.approx(10.0)
    assert lim.wait_s("10.0.0.1") == 0.0  # another peer has its own bucket
    now[0] = 9.9
    assert lim.wait_s(1000) == pytest.approx(0.1)
    now[0] = 10.0
    assert lim.wait_s(1000) == 0.0
    lim.failed(1000)
    assert lim.wait_s(1000) == pytest.approx(10.0)
    now[0] = 1000.0  # refilled to the burst, never past it
    for _ in range(6):
        assert lim.wait_s(1000) == 0.0
        lim.failed(1000)
    assert lim.wait_s(1000) > 0
    assert (lim.failures_total, lim.refused_total) == (13, 4)
    auth_limits.MAX_PEERS, saved = 4, auth_limits.MAX_PEERS
    try:
        for peer in range(10):
            lim.failed(f"10.0.0.{peer}")
        assert len(lim._buckets) <= 4
    finally:
        auth_limits.MAX_PEERS = saved


def test_gil_held_peer_uid_reads_each_descriptor_afresh() -> None:
    """Unix socket: our uid; anything else, or a number reused by a TCP socket, None (nothing cached)."""
    import os
    import socket

    from kvtier.daemon.access import gil_held

    a, b = socket.socketpair()
    fd = a.fileno()
    assert gil_held.peer_uid(fd) == os.getuid()
    assert gil_held.unix_peer_uid(fd) == os.getuid()
    a.close()
    b.close()
    assert gil_held.peer_uid(fd) is None
    assert gil_held.unix_peer_uid(fd) is None
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if tcp.fileno() == fd:  # the number reused by a socket without a peer uid
            assert gil_held.peer_uid(fd) is None
        assert gil_held.peer_uid(tcp.fileno()) is None
    finally:
        tcp.close()
    with open(os.devnull, "rb") as f:
        assert gil_held.peer_uid(f.fileno()) is None
    assert gil_held.peer_uid(-1) is None


def test_gil_held_peer_uid_answers_each_thread_from_its_own_buffers() -> None:
    """Two threads asking at once, one about a unix socket and one about a TCP socket, never get each other's answer."""
    import os
    import socket
    import threading

    from kvtier.daemon.access import gil_held

    a, b = socket.socketpair()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    wrong: list[object] = []

    def ask(fd: int, want: int | None) -> None:
        for _ in range(20000):
            got = gil_held.peer_uid(fd)
            if got != want:
                wrong.append(got)
                return

    threads = [threading.Thread(target=ask, args=(a.fileno(), os.getuid())),
               threading.Thread(target=ask, args=(tcp.fileno(), None))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in (a, b, tcp):
            s.close()
    assert wrong == []
    assert gil_held.peer_of(a.fileno()) is None  # closed: no answer
