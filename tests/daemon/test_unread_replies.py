"""Lent blocks come back when their session ends, even if a client never read the replies that lend
them (issue 15): the daemon shuts that connection down, libzmq drops the queued replies, and the
blocks are evictable again. A client that reads is never shut down."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from kvtier.client.client import Client, PoolLayout
from kvtier.client.protocol import decode, encode

BLOCK_BYTES = 64 * 1024
TIER_BLOCKS = 16  # each tier; the test's pool holds at most 2 * TIER_BLOCKS blocks
LEASE_S = 2.0  # the non-reading client's lease: room for one fill of the pool while it lives
# Lending is of host memory: a CUDA GPU tier's blocks are copied, never lent
# (tests/daemon/test_client_limits.py bounds those replies). So these daemons
# run on the CPU on every machine.
DEVICE = "cpu"


def layout() -> PoolLayout:
    return PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                      kv_heads=1, head_dim=8, mode="store")


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def daemon_stats(client: Client) -> dict[str, Any]:
    return client.stats()["daemon"]


def fill_the_pool(client: Client, seed: int) -> None:
    """Store as many new blocks as the pool holds, 8 at a time: each store makes room by evicting older blocks."""
    rng = random.Random(seed)
    for _ in range(2 * TIER_BLOCKS // 8):
        assert client.store([rng.randbytes(16) for _ in range(8)], rng.randbytes(8 * BLOCK_BYTES)) == (8, 0)


@pytest.mark.parametrize("ending", ["expiry", "bye"])
def test_a_non_reading_client_gets_its_connection_shut_and_its_lent_blocks_return_within_a_lease(
        kvtierd_factory, ending: str) -> None:  # type: ignore[no-untyped-def]
    d = kvtierd_factory(gpu_bytes=TIER_BLOCKS * BLOCK_BYTES, cpu_bytes=TIER_BLOCKS * BLOCK_BYTES, lease_s=5.0,
                        device=DEVICE)
    hs = [bytes([7, i]) * 8 for i in range(8)]
    with Client(d.endpoint, "lent", layout()) as owner:
        owner.store(hs, bytes(8 * BLOCK_BYTES))
        rss_before_bytes = d.rss_bytes()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 1)  # reads nothing, queues almost nothing on its side
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.endpoint)
        try:
            sock.send(encode({"v": 1, "op": "hello", "id": 1, "pool": "lent", "layout": layout().to_wire(),
                              "lease_s": LEASE_S}))
            assert sock.poll(10_000)
            sid = decode(sock.recv())["sid"]
            n = 200  # 512 KiB each, all lending the same 8 blocks: 100 MiB of replies, no copy of them
            for i in range(n):
                sock.send(encode({"v": 1, "op": "restore", "id": 10 + i, "sid": sid, "hashes": hs}))
            if ending == "bye":  # it ends its session but still reads nothing: it gets a lease to read
                sock.send(encode({"v": 1, "op": "bye", "id": 9, "sid": sid}))
            # While the session lives its replies keep the blocks lent, and the daemon holds no copies.
            wait_for(lambda: daemon_stats(owner)["reply_bytes_lent"] > 0, 3.0, "replies lending blocks")
            assert d.rss_bytes() - rss_before_bytes < 64 << 20, (rss_before_bytes, d.rss_bytes())
            fill_the_pool(owner, seed=1)
            assert owner.lookup(hs) == ["gpu"] * 8  # lent: the GPU tier could not evict them for the new blocks
            ended_s = time.monotonic()
            # No heartbeat, no read: the lease runs out (or the one after its bye), the connection is shut
            # down, the blocks come back.
            wait_for(lambda: daemon_stats(owner)["reply_bytes_lent"] == 0, 2 * LEASE_S + 1.0, "lent blocks back")
            assert time.monotonic() - ended_s < 2 * LEASE_S + 1.0
            stats = daemon_stats(owner)
            assert stats.get("lease_expiries_total", 0) == (ending == "expiry"), stats
            assert stats["unread_connections_shut_total"] == 1, stats
            assert stats["reply_bytes_unsent"] == 0, stats
            assert "lent replies unread" in d.log()
        finally:
            sock.close(0)
            ctx.term()
        # The blocks are evictable again: new blocks take their room in the GPU tier. (A CPU-tier
        # copy may stay: demoted while the daemon idled, it is the CPU tier's policy's to keep.)
        fill_the_pool(owner, seed=2)
        assert "gpu" not in owner.lookup(hs)
    assert d.alive, d.log_tail()
    with Client(d.endpoint, "lent", layout()) as other:  # and the daemon serves the next client
        other.store([b"n" * 16], bytes(BLOCK_BYTES))
        assert bytes(other.restore([b"n" * 16]).data) == bytes(BLOCK_BYTES)


def test_a_client_that_reads_its_replies_is_never_shut_down(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    d = kvtierd_factory(gpu_bytes=TIER_BLOCKS * BLOCK_BYTES, cpu_bytes=TIER_BLOCKS * BLOCK_BYTES, lease_s=1.0,
                        device=DEVICE)
    hs = [bytes([8, i]) * 8 for i in range(8)]
    with Client(d.endpoint, "reads", layout()) as watcher:
        with Client(d.endpoint, "reads", layout()) as reader:
            reader.store(hs, bytes(8 * BLOCK_BYTES))
            for _ in range(50):
                assert len(reader.restore(hs).tiers) == 8
        time.sleep(2.5)  # past a lease after its bye: when a connection with unread lent replies would be shut
        stats = daemon_stats(watcher)
        assert stats["unread_connections_shut_total"] == 0 and stats["reply_bytes_lent"] == 0, stats
