"""Lent restores (feature "lend", kvtier.daemon.clients.lends): CPU-tier slots a same-user client copies itself.

Against a real daemon: the lent bytes, read through the client's read-only
mapping of the tier's file, are the stored ones, every byte; a lend holds
its blocks (``clear`` cannot drop them) until released, its lease ends, or
its client dies; another tenant's restore lends nothing of them; a GPU-tier
prefix and a daemon with lending off copy as before.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
import warnings

import pytest
import torch

from kvtier.client.arena_map import ArenaMaps, Lent, LendUnavailable
from kvtier.client.client import Client, PoolLayout
from kvtier.client.protocol import FEATURE_LEND
from kvtier.daemon.clients.lends import LendTable
from kvtier.daemon.clients.sessions import Session
from kvtier.blocks.layout import BlockLayout

BLOCK_BYTES = 1024
CPU_BLOCKS = 32


def layout(**kw: object) -> PoolLayout:
    base = dict(model="lend-model", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=2,
                kv_heads=2, head_dim=64, mode="store")
    base.update(kw)
    return PoolLayout(**base)  # type: ignore[arg-type]


def chain(rng: random.Random, n: int) -> tuple[list[bytes], bytes]:
    return [rng.randbytes(16) for _ in range(n)], rng.randbytes(n * BLOCK_BYTES)


def read_lent(lent: Lent) -> bytes:
    maps = ArenaMaps(BlockLayout.from_buffer)
    try:
        return maps.layout(lent).gather(lent.slots).numpy().tobytes()
    finally:
        maps.close()


def arena_bytes(c: Client, slots: list[int]) -> bytes:
    arena = c.arena
    assert arena is not None
    view = memoryview(arena.buffer).cast("B")
    return b"".join(bytes(view[s * BLOCK_BYTES:(s + 1) * BLOCK_BYTES]) for s in slots)


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    # No GPU tier: every stored block lies in the (persistent) CPU tier.
    return kvtierd_module_factory(gpu_bytes=0, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, lend_lease_s=30)


def test_lent_restore_is_byte_exact_and_holds_its_blocks_until_released(daemon) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(1)
    with Client(daemon.endpoint, "lend-exact", layout()) as c:
        assert FEATURE_LEND in c.features  # this test's user runs the daemon
        hashes, data = chain(rng, 6)
        assert c.store(hashes, data) == (6, 0)
        c.open_arena(8)
        slots = [7, 0, 3, 1, 6, 2]
        # A prefix: the miss ends it; the lent slots are the held blocks' only.
        got = c.restore(hashes[:4] + [b"\xee" * 16] + hashes[4:5], slots=slots, lend=True)
        assert got.lent is not None and list(got.tiers) == ["cpu"] * 4 and len(got.lent.slots) == 4
        assert arena_bytes(c, slots[:4]) == bytes(4 * BLOCK_BYTES)  # lent: the daemon wrote nothing
        assert read_lent(got.lent) == data[:4 * BLOCK_BYTES]
        assert got.lent.intact()
        # Held: clear drops only the two blocks not lent.
        assert c.clear() == 2
        assert c.release_lends([got.lent.id]) == 1
        assert c.release_lends([got.lent.id]) == 0  # idempotent
        assert c.clear() == 4
        # Without lend the same restore copies, as before.
        c.store(hashes, data)
        got = c.restore(hashes, slots=slots)
        assert got.lent is None and arena_bytes(c, slots) == data


def test_a_restore_ends_the_lends_it_names_before_lending_again(daemon) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    with Client(daemon.endpoint, "lend-along", layout()) as c:
        (h1, d1), (h2, d2) = chain(rng, 2), chain(rng, 3)
        c.store(h1, d1)
        c.store(h2, d2)
        c.open_arena(4)
        first = c.restore(h1, slots=[0, 1], lend=True).lent
        assert first is not None and read_lent(first) == d1
        second = c.restore(h2, slots=[0, 1, 2], lend=True, release=[first.id]).lent
        assert second is not None and read_lent(second) == d2
        assert c.clear() == 2  # h1's blocks: their lend ended with the second restore
        assert c.release_lends([first.id, second.id]) == 1


def test_lends_are_the_sessions_own(daemon) -> None:  # type: ignore[no-untyped-def]
    # Another session cannot end a lend it was not given; the holder's bye ends it.
    rng = random.Random(2)
    with Client(daemon.endpoint, "lend-own", layout()) as a, Client(daemon.endpoint, "lend-own", layout()) as b:
        hashes, data = chain(rng, 3)
        a.store(hashes, data)
        a.open_arena(4)
        got = a.restore(hashes, slots=[0, 1, 2], lend=True)
        assert got.lent is not None
        assert b.release_lends([got.lent.id]) == 0
        assert b.clear() == 0
    with Client(daemon.endpoint, "lend-own", layout()) as c:
        assert c.clear() == 3  # a's bye ended its lend


def test_lend_of_a_dead_client_is_released(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    # The client takes a lend and dies without releasing it; the lend outlives it only until its session's
    # lease ends (here 1 s, the lend's own 30 s), then the blocks may go.
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, lend_lease_s=30, lease_s=1.0)
    rng = random.Random(3)
    hashes, data = chain(rng, 4)
    with Client(daemon.endpoint, "lend-dead", layout()) as c:
        c.store(hashes, data)
    script = f"""
import os
from kvtier.client.client import Client, PoolLayout
lay = PoolLayout(model="lend-model", block_size=4, block_bytes={BLOCK_BYTES}, dtype="bfloat16", num_layers=2,
                 kv_heads=2, head_dim=64, mode="store")
c = Client({daemon.endpoint!r}, "lend-dead", lay)
c.open_arena(4)
got = c.restore({hashes!r}, slots=[0, 1, 2, 3], lend=True)
assert got.lent is not None and len(got.lent.slots) == 4, got
print("lent", flush=True)
os._exit(0)  # dead: no release, no bye, no heartbeat
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "lent" in out.stdout, out.stderr
    with Client(daemon.endpoint, "lend-dead", layout()) as c:
        assert c.clear() == 0  # held by the dead client's lend
        deadline = time.monotonic() + 30
        dropped = 0
        while dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            dropped = c.clear()
        assert dropped == 4


def test_a_lend_ends_with_its_lease_and_says_so(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, lend_lease_s=0.5)
    rng = random.Random(4)
    with Client(daemon.endpoint, "lend-lease", layout()) as c:
        hashes, data = chain(rng, 2)
        c.store(hashes, data)
        c.open_arena(2)
        got = c.restore(hashes, slots=[0, 1], lend=True)
        assert got.lent is not None and got.lent.intact()
        assert c.clear() == 0
        time.sleep(0.8)
        assert not got.lent.intact()  # a copy ending now may have read reused slots: the caller drops it
        assert c.clear() == 2


def test_another_tenant_gets_no_lend_of_a_tenants_blocks(kvtierd_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Tenants' pools are apart, and so are their CPU tiers' files: bob's lend names bob's file, never alice's.
    import hashlib

    tokens = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef01"}
    config = tmp_path / "kvtierd.toml"
    config.write_text("".join(f'[tenants.{t}]\ntoken_sha256 = "{hashlib.sha256(k.encode()).hexdigest()}"\n'
                              for t, k in tokens.items()))
    config.chmod(0o600)
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, config=config)
    rng = random.Random(5)
    lay = layout(hash_algo="sha256")
    hashes, data = chain(rng, 3)
    with Client(daemon.endpoint, "shared-name", lay, token=tokens["alice"]) as a, \
            Client(daemon.endpoint, "shared-name", lay, token=tokens["bob"]) as b:
        a.store(hashes, data)
        a.open_arena(4)
        b.open_arena(4)
        got_b = b.restore(hashes, slots=[0, 1, 2], lend=True)
        assert list(got_b.tiers) == [] and got_b.lent is None  # bob holds none of alice's keys
        b_hashes, b_data = chain(rng, 1)
        b.store(b_hashes, b_data)
        lent_b = b.restore(b_hashes, slots=[0], lend=True).lent
        lent_a = a.restore(hashes, slots=[0, 1, 2], lend=True).lent
        assert lent_a is not None and lent_b is not None and lent_a.path != lent_b.path
        assert read_lent(lent_b) == b_data and read_lent(lent_a) == data
        assert b.release_lends([lent_a.id]) == 0  # not bob's to end


def test_no_lend_when_off_or_from_the_gpu_tier(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(6)
    off = kvtierd_factory(gpu_bytes=0, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, lend_lease_s=0)
    with Client(off.endpoint, "lend-off", layout()) as c:
        assert FEATURE_LEND not in c.features
        hashes, data = chain(rng, 2)
        c.store(hashes, data)
        c.open_arena(2)
        got = c.restore(hashes, slots=[0, 1], lend=True)  # not sent: the daemon does not list it
        assert got.lent is None and arena_bytes(c, [0, 1]) == data
    gpu = kvtierd_factory(gpu_bytes=8 * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, device="cpu")
    with Client(gpu.endpoint, "lend-gpu", layout()) as c:
        hashes, data = chain(rng, 2)
        c.store(hashes, data)
        assert c.lookup(hashes) == ["gpu", "gpu"]
        c.open_arena(2)
        got = c.restore(hashes, slots=[0, 1], lend=True)
        assert got.lent is None and arena_bytes(c, [0, 1]) == data


def test_arena_maps_refuse_a_replaced_or_short_file(tmp_path) -> None:
    path = tmp_path / "tier.data"
    path.write_bytes(bytes(range(256)) * 8)  # 2 KiB: two 1 KiB rows
    inode = path.stat().st_ino
    maps = ArenaMaps(BlockLayout.from_buffer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the read-only mapping's warning stays inside ArenaMaps
        rows = maps.layout(Lent(1, str(path), inode, BLOCK_BYTES, [1], time.monotonic_ns() + 10**9))
    assert torch.equal(rows.gather([1])[0], torch.frombuffer(bytearray(bytes(range(256)) * 4), dtype=torch.uint8))
    with pytest.raises(LendUnavailable, match="need"):
        maps.layout(Lent(2, str(path), inode, BLOCK_BYTES, [2], time.monotonic_ns() + 10**9))
    path.unlink()  # a restarted daemon's new file under the old name (maps keeps the old inode alive)
    path.write_bytes(bytes(4 * BLOCK_BYTES))
    with pytest.raises(LendUnavailable, match="another file"):
        ArenaMaps(BlockLayout.from_buffer).layout(Lent(3, str(path), inode, BLOCK_BYTES, [0], time.monotonic_ns()))
    again = maps.layout(Lent(4, str(path), path.stat().st_ino, BLOCK_BYTES, [3], time.monotonic_ns() + 10**9))
    assert bytes(again.gather([3]).numpy()) == bytes(BLOCK_BYTES)
    maps.close()
    with pytest.raises(LendUnavailable, match="cannot open"):
        ArenaMaps(BlockLayout.from_buffer).layout(Lent(5, str(tmp_path / "gone"), 1, BLOCK_BYTES, [0], 0))


def test_lend_table_lends_only_to_the_daemons_user() -> None:
    table = LendTable(lease_s=1.0)
    import os

    mine = Session("s1", "p", "c", 10.0, 0.0, uid=os.geteuid())
    other = Session("s2", "p", "c", 10.0, 0.0, uid=os.geteuid() + 12345)
    tcp = Session("s3", "p", "c", 10.0, 0.0, uid=None)
    assert table.may_lend(mine) and not table.may_lend(other) and not table.may_lend(tcp)
    assert table.offer(other, object(), [b"k" * 16]) is None  # refused before the pool is asked
    assert not LendTable(lease_s=0).may_lend(mine)


def test_no_new_lend_while_a_hand_over_is_under_way() -> None:
    # The server pauses the table from a successor's start: held requests of the swap then wait for copies,
    # not for leases (tests/integrations/test_vllm.py's upgrade under vLLM failed its lookups before).
    import os

    table = LendTable(lease_s=1.0)
    mine = Session("s1", "p", "c", 10.0, 0.0, uid=os.geteuid())
    table.paused = True
    assert table.may_lend(mine)  # still told the feature: the pause is the swap's, not the session's
    assert table.offer(mine, object(), [b"k" * 16]) is None  # declined before the pool is asked


def test_lends_are_counted_in_stats_top_and_prometheus(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    # granted = released + expired + dropped + held, and the bytes held, as kvtier stats, top and a scrape show them.
    import socket
    import urllib.request

    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.client.admin import request
    from kvtier.tools.stats import format_stats
    from kvtier.tools.top import render_frame

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, lend_lease_s=0.5, metrics_port=port)
    keys = ("lends_granted_total", "lends_released_total", "lends_expired_total", "lends_dropped_total", "lends_held",
            "lends_held_bytes")

    def counts() -> tuple[int, ...]:
        d = request(daemon.endpoint, "stats")["daemon"]
        return tuple(int(d[k]) for k in keys)

    assert counts() == (0, 0, 0, 0, 0, 0)
    rng = random.Random(9)
    with Client(daemon.endpoint, "lend-count", layout()) as c:
        hashes, data = chain(rng, 3)
        c.store(hashes, data)
        c.open_arena(3)
        first = c.restore(hashes, slots=[0, 1, 2], lend=True).lent
        assert first is not None
        assert counts() == (1, 0, 0, 0, 1, 3 * BLOCK_BYTES)
        prev = request(daemon.endpoint, "stats")
        assert c.release_lends([first.id]) == 1
        assert counts() == (1, 1, 0, 0, 0, 0)
        expiring = c.restore(hashes[:2], slots=[0, 1], lend=True).lent
        assert expiring is not None and counts()[4:] == (1, 2 * BLOCK_BYTES)
        deadline = time.monotonic() + 10
        while counts()[2] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert counts() == (2, 1, 1, 0, 0, 0)
        held = c.restore(hashes[:1], slots=[0], lend=True).lent
        assert held is not None and counts() == (3, 1, 1, 0, 1, BLOCK_BYTES)
        cur = request(daemon.endpoint, "stats")
        text = format_stats(cur, daemon.endpoint)
        assert f"1 held ({BLOCK_BYTES / 1024:.1f} KiB); granted 3, released 1, expired 1, dropped 0" in text, text
        frame = render_frame(prev, cur, 1.0, endpoint=daemon.endpoint, interval_s=1.0, clock="now")
        assert "lends 1 held" in frame and "granted 2.0/s" in frame and "expired 1 (+1)" in frame, frame
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
        assert families["kvtier_lends_granted"].type == "counter"
        assert families["kvtier_lends_granted"].samples[0].value == 3
        assert families["kvtier_lends_expired"].samples[0].value == 1
        assert families["kvtier_lends_held"].type == "gauge" and families["kvtier_lends_held"].samples[0].value == 1
        assert families["kvtier_lends_held_bytes"].samples[0].value == BLOCK_BYTES
    # The bye ended the session, and its lend with it.
    assert counts() == (3, 1, 1, 1, 0, 0)
