"""Pool names are per tenant (issue 15, "squatting"), against real kvtierd processes.

- With tenants, tenant B creating "llama" first with a wrong layout does not
  stop tenant A from opening "llama" with its own layout and storing and
  restoring byte-exact: they are two pools (A's blocks are not B's, each has
  its own stats), B's stats and errors show nothing of A's pool or layout,
  the operator's ``stats`` shows both (``"<tenant>/<name>"``, with ``tenant``
  and ``name``), Prometheus has a series for each (``tenant`` label),
  ``health`` counts pools and sessions in the same views, and an
  idle pool closed by its TTL is the idle tenant's, not its namesake's.
- Without tenants, two clients naming one pool share it exactly as before
  (one pool, plain names, a layout mismatch for a different layout, no
  ``tenant`` anywhere).

The tenants here are token tenants on an ipc socket: the daemon's own user
asking without a session is the operator.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.client.admin import request
from kvtier.client.client import Client, DaemonError, PoolLayout
from kvtier.client.protocol import ErrorCode
from kvtier.testing.daemon import KvtierDaemon

BLOCK = 1024
A_LAYOUT = PoolLayout(model="alices-model", block_size=4, block_bytes=BLOCK, dtype="bfloat16", num_layers=1,
                      kv_heads=1, head_dim=8, hash_algo="sha256")
# bob's squatting layout: another model, another block size.
B_LAYOUT = PoolLayout(model="bobs-model", block_size=8, block_bytes=2 * BLOCK, dtype="bfloat16", num_layers=1,
                      kv_heads=1, head_dim=8, hash_algo="sha256")
TOKENS = {"alice": "alice-token-0123456789abcdef0123", "bob": "bob-token-0123456789abcdef012345"}

Starter = Callable[..., KvtierDaemon]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tenant_config(root: Path, extra: str = "") -> Path:
    """A config file with token tenants alice and bob (0600: it holds their tokens)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "tenants.toml"
    tables = "".join(f'[tenants.{name}]\ntoken = "{token}"\n' for name, token in TOKENS.items())
    path.write_text(extra + tables)
    os.chmod(path, 0o600)
    return path


@pytest.fixture(scope="module")
def tenant_daemon(kvtierd_module_factory: Starter, tmp_path_factory: pytest.TempPathFactory) -> KvtierDaemon:
    port = free_port()
    daemon = kvtierd_module_factory(config=tenant_config(tmp_path_factory.mktemp("pool-names")), metrics_port=port)
    daemon.metrics_port = port  # type: ignore[attr-defined]
    return daemon


def client(d: KvtierDaemon, tenant: str | None, pool: str, layout: PoolLayout) -> Client:
    return Client(d.endpoint, pool, layout, timeout_s=10.0, **({"token": TOKENS[tenant]} if tenant else {}))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def test_a_tenant_cannot_squat_another_tenants_pool_name(tenant_daemon: KvtierDaemon) -> None:
    hashes = [bytes([7, i]) * 8 for i in range(6)]
    data = os.urandom(6 * BLOCK)
    # bob gets there first, with the wrong layout, and stays.
    with client(tenant_daemon, "bob", "llama", B_LAYOUT) as b:
        assert b.pool_info["name"] == "llama" and b.pool_info["block_bytes"] == 2 * BLOCK
        assert b.store(hashes[:1], bytes(2 * BLOCK)) == (1, 0)
        # alice still opens "llama" with her own layout: her pool, not bob's.
        with client(tenant_daemon, "alice", "llama", A_LAYOUT) as a:
            assert a.pool_info["name"] == "llama" and a.pool_info["block_bytes"] == BLOCK
            assert a.store(hashes, data) == (6, 0)
            got = a.restore(hashes)
            assert list(got.tiers) and len(got) == 6 and bytes(got.data) == data
            # Two pools: what alice stored is not in bob's, and bob's block is not in hers.
            assert b.lookup(hashes) == ["gpu"] and a.lookup(hashes[:1]) == ["gpu"]
            assert len(b.restore(hashes[1:])) == 0
            a_stats, b_stats = a.stats(), b.stats()
            assert a_stats["pools"]["llama"]["block_bytes"] == BLOCK
            assert b_stats["pools"]["llama"]["block_bytes"] == 2 * BLOCK
            assert a_stats["pools"]["llama"]["stores"] == 6 and b_stats["pools"]["llama"]["stores"] == 1
            assert a_stats["pools"]["llama"]["sessions"] == 1 and b_stats["pools"]["llama"]["sessions"] == 1
            # Each tenant sees its own pools by their bare names, and nothing of the other's.
            for mine, other in ((a_stats, "bob"), (b_stats, "alice")):
                assert all("/" not in name and p["tenant"] != other for name, p in mine["pools"].items())
                assert other not in json.dumps(mine, default=str) and list(mine["tenants"]) != [other]
            # bob's own hello with alice's layout mismatches *his* pool: he is told his values, never hers.
            with pytest.raises(DaemonError) as info:
                client(tenant_daemon, "bob", "llama", A_LAYOUT)
            assert info.value.code == ErrorCode.LAYOUT_MISMATCH
            message = str(info.value)
            assert "'llama'" in message and "bobs-model" in message and f"pool has {2 * BLOCK}" in message
            # (the hello's own values are his to know; the pool's are his pool's, never alice's)
            assert "pool has 'alices-model'" not in message and f"pool has {BLOCK}," not in message
            assert "alice/" not in message


def test_the_operator_sees_both_pools_apart_and_prometheus_has_both_series(tenant_daemon: KvtierDaemon) -> None:
    with client(tenant_daemon, "bob", "shared-name", B_LAYOUT) as b, \
            client(tenant_daemon, "alice", "shared-name", A_LAYOUT) as a:
        a.store([b"\1" * 16], bytes(BLOCK))
        stats = request(tenant_daemon.endpoint, "stats")  # no session, the daemon's own user: the operator
        pools = stats["pools"]
        assert {"alice/shared-name", "bob/shared-name"} <= pools.keys()
        for tenant, block_bytes in (("alice", BLOCK), ("bob", 2 * BLOCK)):
            p = pools[f"{tenant}/shared-name"]
            assert p["tenant"] == tenant and p["name"] == "shared-name" and p["block_bytes"] == block_bytes
            assert p["sessions"] == 1
        assert pools["alice/shared-name"]["stores"] == 1 and pools["bob/shared-name"]["stores"] == 0
        assert "shared-name" not in pools  # no pool under the bare name: every pool is a tenant's
        text = scrape(tenant_daemon.metrics_port)  # type: ignore[attr-defined]
        assert 'kvtier_block_bytes{pool="shared-name",tenant="alice"} 1024.0' in text
        assert 'kvtier_block_bytes{pool="shared-name",tenant="bob"} 2048.0' in text
        assert 'kvtier_pool_sessions{pool="shared-name",tenant="alice"} 1.0' in text
        assert 'kvtier_pool_info{mode="store",pool="shared-name",tenant="bob"} 1.0' in text
        assert b.stats()["pools"]["shared-name"]["stores"] == 0
        # health counts in the same views: a tenant its own pools and sessions, the operator all.
        b_health, op_health = b.health(), request(tenant_daemon.endpoint, "health")
        assert b_health["pools"] == len(b.stats()["pools"]) and b_health["sessions"] == 1
        assert op_health["pools"] == len(pools) and op_health["sessions"] == 2


def test_an_idle_tenants_pool_is_reclaimed_not_its_namesake(kvtierd_factory: Starter, tmp_path: Path) -> None:
    d = kvtierd_factory(config=tenant_config(tmp_path / "ttl", "pool_idle_ttl_s = 0.5\n"))
    hashes = [bytes([9, i]) * 8 for i in range(2)]
    with client(d, "bob", "llama", A_LAYOUT) as b:
        b.store(hashes, bytes(2 * BLOCK))
        with client(d, "alice", "llama", A_LAYOUT) as a:
            a.store(hashes, bytes(2 * BLOCK))
        # alice's "llama" has no session now: its TTL closes it; bob's, in use, stays with its blocks.
        deadline_s = time.monotonic() + 10.0
        while "alice/llama" in request(d.endpoint, "stats")["pools"]:
            assert time.monotonic() < deadline_s, "alice's idle pool was never closed"
            time.sleep(0.1)
        assert "bob/llama" in request(d.endpoint, "stats")["pools"]
        assert b.lookup(hashes) == ["gpu", "gpu"]
    assert "pool 'alice/llama' closed" in d.log_path.read_text()


def test_without_tenants_clients_share_pools_by_name_as_before(kvtierd: KvtierDaemon) -> None:
    layout = PoolLayout(**{**A_LAYOUT.to_wire(), "hash_algo": "xxh3_128"})
    hashes = [bytes([5, i]) * 8 for i in range(3)]
    data = os.urandom(3 * BLOCK)
    with client(kvtierd, None, "llama", layout) as one, client(kvtierd, None, "llama", layout) as two:
        assert one.pool_info["name"] == two.pool_info["name"] == "llama"
        assert one.store(hashes, data) == (3, 0)
        got = two.restore(hashes)  # one pool: the other client's blocks
        assert bytes(got.data) == data
        assert two.store(hashes, data) == (0, 3)
        with pytest.raises(DaemonError) as info:  # one namespace: a different layout is a mismatch, as always
            client(kvtierd, None, "llama", PoolLayout(**{**layout.to_wire(), "model": "other"}))
        assert info.value.code == ErrorCode.LAYOUT_MISMATCH and "alices-model" in str(info.value)
        for stats in (one.stats(), request(kvtierd.endpoint, "stats")):
            assert list(stats["pools"]) == ["llama"] and stats["pools"]["llama"]["sessions"] == 2
            assert "tenant" not in stats["pools"]["llama"] and "name" not in stats["pools"]["llama"]
            assert "tenants" not in stats
