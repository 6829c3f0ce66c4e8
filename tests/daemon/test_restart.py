"""The cache outlives the daemon (issue 34): real kvtierd processes killed, stopped and restarted.

Each block's bytes are ``content(key)``, so every byte a restarted daemon
serves is checked against what was stored under that key. The daemons keep
their CPU tiers in ``<workdir>/arenas`` (``KvtierDaemon``'s default): what a
restart adopts is what the killed process left there.
"""

from __future__ import annotations

import hashlib
import random
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.client.client import Client, KvtierError, PoolLayout
from kvtier.testing.daemon import KvtierDaemon

BB = 4096
LAYOUT = PoolLayout(model="restart", block_size=4, block_bytes=BB, dtype="bfloat16", num_layers=1, kv_heads=1,
                    head_dim=8)


def key(i: int, tag: int = 0) -> bytes:
    return struct.pack("<QQ", tag, i)


def content(k: bytes) -> bytes:
    seed = hashlib.sha256(k).digest()
    return (seed * (BB // len(seed) + 1))[:BB]


def pool_stats(daemon: KvtierDaemon, pool: str = "p") -> dict[str, Any]:
    return daemon.stats()["pools"][pool]


def wait_verified(daemon: KvtierDaemon, pool: str = "p", timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        s = pool_stats(daemon, pool)
        if s["cpu_adoption_pending_blocks"] == 0:
            return s
        assert time.monotonic() < deadline, f"adopted blocks still unverified: {s}"
        time.sleep(0.05)


def served(c: Client, keys: list[bytes]) -> tuple[set[bytes], int]:
    """(the keys the daemon serves, how many of them came back with bytes not their own)."""
    held: set[bytes] = set()
    wrong = 0
    i = 0
    while i < len(keys):
        batch = keys[i:i + 64]  # a restore serves the longest held prefix: one round trip when all are held
        r = c.restore(batch)
        n = len(r.tiers)
        data = bytes(r.data) if n else b""
        for j, k in enumerate(batch[:n]):
            held.add(k)
            wrong += data[j * BB:(j + 1) * BB] != content(k)
        i += n + 1 if n < len(batch) else n  # the key after the prefix is not held
    return held, wrong


def test_kills_at_random_instants_during_stores_lose_nothing_acknowledged_uncounted(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    """The issue's loop: stores run, SIGKILL lands at a seeded random instant, a new kvtierd adopts. Every
    block ever acknowledged is served byte-exact or counted among the blocks dropped at adoption; no byte
    served is wrong. (The tier holds every block stored: nothing is evicted.)"""
    rng = random.Random(34)
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=16384 * BB, log_level="info")
    acked: list[bytes] = []
    dropped_total = 0
    for round_ in range(5):
        stop = threading.Event()
        errors: list[BaseException] = []
        progress = threading.Semaphore(0)  # one release per acknowledged batch

        def write(first: int) -> None:
            n = first
            try:
                with Client(daemon.endpoint, "p", LAYOUT, timeout_s=2.0) as c:
                    while not stop.is_set():
                        keys = [key(n + i) for i in range(8)]
                        n += 8
                        c.store(keys, b"".join(content(k) for k in keys))
                        acked.extend(keys)  # acknowledged: the reply came back
                        progress.release()
            except KvtierError:
                pass  # the daemon died under the call: that batch is unacknowledged
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        writer = threading.Thread(target=write, args=(round_ * 100_000,))
        writer.start()
        for _ in range(rng.randint(5, 300)):  # stores under way: 40 to 2,400 blocks acknowledged this round
            assert progress.acquire(timeout=30), f"the writer stalled: {errors}"
        time.sleep(rng.uniform(0.0, 0.005))  # then a random instant inside the next store
        daemon.kill()  # SIGKILL, at whatever the daemon was doing
        stop.set()
        writer.join(30)
        assert not errors, errors
        daemon.spawn()
        stats = wait_verified(daemon)
        dropped_total += stats["cpu_adoption_dropped_blocks"]
        with Client(daemon.endpoint, "p", LAYOUT, timeout_s=10.0) as c:
            have, wrong = served(c, acked)
        assert wrong == 0
        missing = set(acked) - have
        assert len(missing) <= dropped_total, (len(missing), dropped_total)
        assert stats["cpu_adopted_blocks"] >= len(have & set(acked)) > 0
    assert "adopted" in daemon.log()


def test_sigterm_then_start_adopts_and_the_stop_first_demotes_what_only_the_gpu_tier_held(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    # No clean-ahead: stored blocks stay in the GPU tier only, until the stop demotes them.
    daemon = kvtierd_factory(gpu_bytes=64 * BB, cpu_bytes=256 * BB, clean_ahead_blocks=0, log_level="info")
    keys = [key(i, 1) for i in range(40)]
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        c.store(keys, b"".join(content(k) for k in keys))
        assert set(c.lookup(keys)) == {"gpu"}
    assert daemon.stop() == 0
    assert "40 blocks only the GPU tier held demoted" in daemon.log()
    daemon.spawn()
    assert wait_verified(daemon)["cpu_adopted_blocks"] == 40
    out = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "stats", "--socket", daemon.endpoint],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ADOPTED AT START"))
    assert lines[start + 2].split() == ["p", "40", "0", "0"], out
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        assert c.lookup(keys) == ["cpu"] * 40
        have, wrong = served(c, keys)
    assert have == set(keys) and wrong == 0
    # A SIGKILL takes what only the GPU tier held: it does not survive (the CPU tier's blocks do).
    more = [key(i, 2) for i in range(10)]
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        c.store(more, b"".join(content(k) for k in more))
    daemon.restart()
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        have, wrong = served(c, keys + more)
    assert have == set(keys) and wrong == 0


def test_a_changed_configuration_starts_empty_or_keeps_what_fits(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=64 * BB, log_level="info")
    keys = [key(i, 3) for i in range(48)]
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        for i in range(0, 48, 8):
            c.store(keys[i:i + 8], b"".join(content(k) for k in keys[i:i + 8]))
    # A smaller cpu_bytes: the newest blocks that fit stay.
    daemon.kill()
    daemon.argv[daemon.argv.index("--cpu-bytes") + 1] = str(20 * BB)
    daemon.spawn()
    stats = wait_verified(daemon)
    assert (stats["cpu_blocks"], stats["cpu_adopted_blocks"], stats["cpu_adoption_dropped_blocks"]) == (20, 20, 28)
    assert "shrank from 64 to 20 blocks" in daemon.log()
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        have, wrong = served(c, keys)
        assert have == set(keys[-20:]) and wrong == 0
    # Another layout at the first hello after a restart: the pool starts empty, and the log says why.
    daemon.restart()
    other = PoolLayout(model="restart", block_size=4, block_bytes=BB, dtype="float16", num_layers=1, kv_heads=1,
                       head_dim=8)
    with Client(daemon.endpoint, "p", other) as c:
        assert c.lookup(keys[-20:]) == []
        assert c.stats()["pools"]["p"]["cpu_used_blocks"] == 0
    assert "dtype: 'bfloat16' -> 'float16'" in daemon.log() and "starts empty" in daemon.log()


def test_another_format_starts_empty_in_one_log_line(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=16 * BB, log_level="info")
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        c.store([key(1)], content(key(1)))
    daemon.kill()
    [index] = Path(daemon.arena_dir).glob("*.index")
    raw = bytearray(index.read_bytes())
    raw[8:12] = struct.pack("<I", 7)  # what a kvtier with another on-disk format would have left
    index.write_bytes(bytes(raw))
    daemon.spawn()
    lines = [line for line in daemon.log().splitlines() if "format 7" in line]
    assert len(lines) == 1 and "starts empty" in lines[0], lines
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        assert c.lookup([key(1)]) == []
        c.store([key(2)], content(key(2)))
    daemon.restart()
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        assert served(c, [key(1), key(2)]) == ({key(2)}, 0)


def arena_mappings(daemon: KvtierDaemon) -> list[str]:
    return [line for line in Path(f"/proc/{daemon.pid}/maps").read_text().splitlines() if "/kvtierd-" in line]


def test_an_idle_pool_that_expires_frees_its_arena_and_persistence_can_be_off(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=16 * BB, pool_idle_ttl_s=3)
    with Client(daemon.endpoint, "p", LAYOUT) as c:
        c.store([key(1)], content(key(1)))
        assert len(list(Path(daemon.arena_dir).iterdir())) == 2  # its index and its data
    daemon.restart()  # adopted at start-up, and no hello joins it: it expires as an idle pool does
    assert arena_mappings(daemon)
    deadline = time.monotonic() + 30
    while list(Path(daemon.arena_dir).iterdir()) or arena_mappings(daemon):
        assert time.monotonic() < deadline, f"the expired pool's arena is still there: {arena_mappings(daemon)}"
        time.sleep(0.1)
    assert "no session for" in daemon.log()
    off = kvtierd_factory(gpu_bytes=0, cpu_bytes=16 * BB, persist_cpu_tier=False)
    with Client(off.endpoint, "p", LAYOUT) as c:
        c.store([key(1)], content(key(1)))
    off.restart()
    with Client(off.endpoint, "p", LAYOUT) as c:
        assert c.lookup([key(1)]) == []  # private memory: a restart empties it, as before
    assert not any(Path(off.workdir).glob("**/kvtierd-*"))


def test_tenants_pools_are_adopted_in_their_own_namespaces(tmp_path: Path) -> None:
    toml = tmp_path / "kvtierd.toml"
    toml.write_text('hash_algo = "sha256"\n[tenants.alpha]\ntoken = "alpha-token-0123456789"\n'
                    '[tenants.beta]\ntoken = "beta-token-0123456789"\n')
    layout = PoolLayout(model="restart", block_size=4, block_bytes=BB, dtype="bfloat16", num_layers=1,
                        kv_heads=1, head_dim=8, hash_algo="sha256")
    with KvtierDaemon(tmp_path / "d", flags={"config": toml, "gpu_bytes": 0, "cpu_bytes": 32 * BB}) as daemon:
        with Client(daemon.endpoint, "p", layout, token="alpha-token-0123456789") as a:
            a.store([key(1)], content(key(1)))
        daemon.restart()
        stats = daemon.stats()["pools"]
        assert stats["alpha/p"]["cpu_adopted_blocks"] + stats["alpha/p"]["cpu_adoption_pending_blocks"] == 1
        with Client(daemon.endpoint, "p", layout, token="beta-token-0123456789") as b:
            assert b.lookup([key(1)]) == []  # beta's "p" is another pool, another namespace
        with Client(daemon.endpoint, "p", layout, token="alpha-token-0123456789") as a:
            assert served(a, [key(1)]) == ({key(1)}, 0)
