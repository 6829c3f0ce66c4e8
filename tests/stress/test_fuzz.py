"""Protocol fuzzing against a live kvtierd (the CI subset; ``fuzz_full.py`` is the full run).

A victim client stores blocks (inline and shared-memory planes, through the
CPU tier) and pins a chain; then Hypothesis-generated structured requests
and seeded generated frames of every category in ``fuzzlib.CATEGORIES`` hit
the daemon. Every frame must get exactly one well-formed reply with the
right id (none only for a frame over the hard limit), never ``INTERNAL``;
afterwards the daemon answers health, its error counters account for every
rejection the fuzzer saw, the daemon logged no traceback, and every victim
block restores byte-exact through both planes.

``KVTIER_FUZZ_CASES`` / ``KVTIER_FUZZ_EXAMPLES`` raise the counts (defaults
suit CI: about 9.5k frames in all).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings

from kvtier.client.client import Client, DaemonError
from kvtier.client.protocol import ErrorCode, encode
from kvtier.testing.daemon import KvtierDaemon
from tests.stress.fuzzlib import (
    CountingClient,
    FuzzCase,
    FuzzWorld,
    Judge,
    Victim,
    after_checks,
    hypothesis_requests,
    run_campaign,
    victim_snapshot,
)
from tests.stress.stresslib import RawSocket, store_layout

BLOCK_BYTES = 1024
GPU_BLOCKS = 16
CPU_BLOCKS = 64
MAX_PAYLOAD_BYTES = 8 * BLOCK_BYTES
NUM_CASES = int(os.environ.get("KVTIER_FUZZ_CASES", "8000"))
NUM_EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "1500"))

logging.getLogger("kvtier.client").setLevel(logging.ERROR)  # the fuzz sessions' reconnect chatter


@dataclass
class Fuzzed:
    daemon: KvtierDaemon
    victim: Victim
    world: FuzzWorld
    judge: Judge
    errors_before: Counter[str]
    stats_before: dict[str, int]


@pytest.fixture(scope="module")
def fuzzed(start_module_daemon) -> Iterator[Fuzzed]:  # type: ignore[no-untyped-def]
    daemon = start_module_daemon(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES,
                                 max_message_bytes=MAX_PAYLOAD_BYTES, lease_s=5.0, log_level="warning")
    layout = store_layout(BLOCK_BYTES)
    client = CountingClient(daemon.endpoint, "victim", layout)
    victim = Victim(client, BLOCK_BYTES)
    victim.store(num_chains=6, chain_blocks=8)  # 48 blocks: more than the GPU tier, all within the CPU tier
    stats = client.stats()
    pool = stats["pools"]["victim"]
    assert pool["demotions"] > 0 and pool["pinned_blocks"] == 8
    world = FuzzWorld.open(daemon.endpoint, BLOCK_BYTES, "victim", layout.to_wire(), MAX_PAYLOAD_BYTES)
    judge = Judge(daemon.endpoint, world.hard_limit_bytes)
    yield Fuzzed(daemon, victim, world, judge, *victim_snapshot(victim))
    judge.close()
    world.close()
    client.close()


def test_hypothesis_structured_requests_get_one_wellformed_reply_each(fuzzed: Fuzzed) -> None:
    judge = fuzzed.judge

    @settings(max_examples=NUM_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(hypothesis_requests(fuzzed.world))
    def one(frames: list[bytes]) -> None:
        before = judge.num_failures
        judge.send(FuzzCase("hypothesis", frames))
        assert judge.num_failures == before, judge.failures[-1]

    one()
    assert judge.cases["hypothesis"] >= NUM_EXAMPLES // 2


def test_generated_frames_of_every_category_get_one_wellformed_reply_each(fuzzed: Fuzzed) -> None:
    judge = fuzzed.judge
    took_s = run_campaign(fuzzed.world, judge, NUM_CASES, seed=20261121)
    assert judge.num_failures == 0, "\n".join(judge.failures)
    for category, outcomes in judge.by_category.items():
        assert sum(outcomes.values()) > 0, category
    # Fuzzing reached the handlers, not only the decoder.
    for name in ("ok", "UNKNOWN_SESSION", "NOT_FOUND", "INVALID_STATE", "WRONG_MODE", "LAYOUT_MISMATCH", "TOO_LARGE"):
        assert judge.replies[name] > 0, (name, judge.replies)
    assert judge.slowest_s < 2.0, judge.slowest_s
    assert took_s < 120


def test_after_fuzzing_health_counters_and_every_victim_block(fuzzed: Fuzzed) -> None:
    assert fuzzed.judge.replies, "no fuzzing ran"
    log = fuzzed.daemon.log_path.read_text(errors="replace")
    problems = after_checks(fuzzed.victim, fuzzed.judge, fuzzed.errors_before, fuzzed.stats_before, log)
    assert problems == [], (problems, fuzzed.daemon.log_tail(40))
    assert fuzzed.daemon.alive


# ---- regressions found by fuzzing: layouts that make the daemon build millions of block records ----

MAX_BLOCKS_PER_TIER = 1 << 23


@pytest.fixture(scope="module")
def big_tier_daemon(start_module_daemon) -> KvtierDaemon:  # type: ignore[no-untyped-def]
    # A 16 MiB CPU tier: 16Ki blocks of 1 KiB, but 16Mi "blocks" of 1 byte. Pool
    # "tinyengine" gets a 4 KiB CPU tier, so only its registration can be too big.
    return start_module_daemon(gpu_bytes=1 << 20, cpu_bytes=16 << 20, log_level="warning",
                               env={"KVTIER_POOLS__TINYENGINE__CPU_BYTES": "4096"})


def test_hello_with_a_tiny_block_size_is_refused_at_once(big_tier_daemon: KvtierDaemon) -> None:
    """Regression: block_bytes=1 made one hello build ~17M block records (5 s of a stalled loop, +750 MB)."""
    rss_before = big_tier_daemon.rss_bytes()
    tiny = {**store_layout(1024).to_wire(), "block_bytes": 1}
    with RawSocket(big_tier_daemon.endpoint) as raw:
        t0 = time.monotonic()
        got = raw.ask([encode({"v": 1, "op": "hello", "id": 3, "pool": "tiny", "layout": tiny})], timeout_s=30)
        elapsed_s = time.monotonic() - t0
    assert got is not None
    reply, _ = got
    assert reply["ok"] is False and reply["error"]["code"] == int(ErrorCode.INVALID_FIELD), reply
    assert "block_bytes" in reply["error"]["message"]
    assert elapsed_s < 1.0, elapsed_s
    assert big_tier_daemon.rss_bytes() - rss_before < 64 << 20
    # Sensible layouts still work, and the refused pool was never created.
    with Client(big_tier_daemon.endpoint, "fine", store_layout(1024)) as c:
        assert c.pool_info["cpu_blocks"] == 16 << 10
        assert "tiny" not in c.stats()["pools"]


def test_register_kv_with_too_many_blocks_is_refused_at_once(big_tier_daemon: KvtierDaemon) -> None:
    """Regression: an engine registration is the GPU tier; its block count is bounded the same way."""
    from kvtier.client.kv_share import allocate_shared_kv

    layout = {**store_layout(1024, mode="engine").to_wire(), "block_bytes": 2, "model": "tinyengine"}
    kv, _ = allocate_shared_kv((MAX_BLOCKS_PER_TIER + 1, 1), "float16", 0)  # 16 MiB, 2 bytes per block
    rss_before = big_tier_daemon.rss_bytes()
    with Client(big_tier_daemon.endpoint, "tinyengine", layout) as c:
        t0 = time.monotonic()
        with pytest.raises(DaemonError) as info:
            c.register_kv("kv", [kv], 0, timeout_s=30)
        assert time.monotonic() - t0 < 1.5
        assert info.value.code == ErrorCode.INVALID_FIELD and "blocks" in info.value.message
        assert not c.stats()["pools"]["tinyengine"]["gpu_registered"]
    assert big_tier_daemon.rss_bytes() - rss_before < 64 << 20


def test_unpin_of_many_hashes_is_linear_not_quadratic(big_tier_daemon: KvtierDaemon) -> None:
    """Regression: unpin scanned all of the session's pins for every hash asked for (O(pins x hashes)).

    8192 pins and an unpin of 8192 hashes it does not hold stalled the
    daemon's loop for ~10 s (65536 of each: ~10 min), for every client.
    """
    from tests.stress.stresslib import chain_content, chain_hashes

    n = 8192
    with Client(big_tier_daemon.endpoint, "pins", store_layout(1024), timeout_s=60) as c:
        hashes = chain_hashes("pins", 2)
        c.store(hashes, chain_content(hashes, 1024))
        assert c.pin([hashes[0]] * n) == ["gpu"] * n  # one block, pinned n times
        t0 = time.monotonic()
        assert c.unpin([hashes[1]] * n) == 0  # none of these is pinned: every lookup misses
        assert c.unpin([hashes[0]] * (n - 1)) == n - 1
        assert time.monotonic() - t0 < 1.0
        # Pins count: one pin is left, and it still holds the block.
        assert c.stats()["pools"]["pins"]["pinned_blocks"] == 1
        assert c.unpin([hashes[0], hashes[0]]) == 1
        assert c.stats()["pools"]["pins"]["pinned_blocks"] == 0
