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


def _requests_total(client: Client) -> int:
    return int(sum(daemon_stats(client).get("requests_total", {}).values()))


def test_non_reading_clients_hold_a_bounded_number_of_reply_bytes_daemon_wide_and_lost_replies_are_counted(
        kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 32 item 4: four non-reading clients held +1,445 MB of copied replies (each under its own
    max_unread_reply_bytes), RSS stayed up after they left, and replies libzmq dropped at the
    connections' high-water mark were never counted (replies_dropped_total 0 with 19,000 lost).

    Now the copies all connections hold are capped together (max_unread_reply_bytes_total), every
    request's one reply is either delivered or counted as dropped, and the heap is given back once
    the backlog is gone."""
    cap = 32 << 20
    n_clients, restores, heartbeats = 4, 200, 1500  # 512 KiB per restore: 100 MiB each, if nothing capped
    d = kvtierd_factory(gpu_bytes=TIER_BLOCKS * BLOCK_BYTES, cpu_bytes=TIER_BLOCKS * BLOCK_BYTES, device=DEVICE,
                        max_unread_reply_bytes=cap, max_unread_reply_bytes_total=cap, max_message_bytes=8 << 20,
                        log_level="info")
    hs = [bytes([9, i]) * 8 for i in range(8)]
    with Client(d.endpoint, "unread", layout()) as owner:
        # Stored between other blocks: each restore gathers them into a staging buffer, memory the
        # daemon allocates per reply (blocks lying in one run would be lent, costing nothing).
        for i, h in enumerate(hs):
            owner.store([h, bytes([10, i]) * 8], bytes(2 * BLOCK_BYTES))
        rss_before_bytes = d.rss_bytes()
        dropped_before = daemon_stats(owner)["replies_dropped_total"]
        ctx = zmq.Context()
        socks = []
        try:
            for _ in range(n_clients):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.RCVHWM, 1)  # reads nothing, queues almost nothing on its side
                sock.setsockopt(zmq.RCVBUF, 4096)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(d.endpoint)
                sock.send(encode({"v": 1, "op": "hello", "id": 1, "pool": "unread", "layout": layout().to_wire()}))
                assert sock.poll(10_000)
                socks.append((sock, decode(sock.recv())["sid"]))
            requests_before = _requests_total(owner)
            for i in range(restores):
                for sock, sid in socks:
                    sock.send(encode({"v": 1, "op": "restore", "id": 10 + i, "sid": sid, "hashes": hs}))
            for i in range(heartbeats):  # small replies, past the connections' SNDHWM (1000)
                for sock, sid in socks:
                    sock.send(encode({"v": 1, "op": "heartbeat", "id": 10_000 + i, "sid": sid}))
            sent = n_clients * (restores + heartbeats)
            # +1: the stats request that asks counts itself.
            wait_for(lambda: _requests_total(owner) - requests_before >= sent, 120.0, "every request handled")
            time.sleep(1.0)
            stats = daemon_stats(owner)
            held_bytes = stats["reply_bytes_unsent"] - stats["reply_bytes_lent"]
            # The cap, passed by at most one reply per connection that had read everything.
            assert held_bytes <= cap + n_clients * 8 * BLOCK_BYTES, held_bytes
            assert d.rss_bytes() - rss_before_bytes < 4 * cap, (d.rss_bytes() - rss_before_bytes) >> 20
            assert stats["errors_total"].get("code=UNREAD_REPLIES", 0) > 0, stats["errors_total"]
            assert "max_unread_reply_bytes_total" in d.log()
            dropped = {k: v - dropped_before.get(k, 0) for k, v in stats["replies_dropped_total"].items()}
            assert dropped["reason=full"] > 0 and dropped["reason=gone"] == 0, dropped
            # Exactly one reply per request: what the clients read now plus what was counted dropped.
            received = 0
            for sock, _sid in socks:
                while sock.poll(2000):
                    sock.recv_multipart()
                    received += 1
            assert received + dropped["reason=full"] == sent, (received, dropped, sent)
        finally:
            for sock, _sid in socks:
                sock.close(0)
            ctx.term()
        # A backlog of copies filled the heap; read, it is given back to the kernel.
        wait_for(lambda: daemon_stats(owner)["heap_trims_total"] >= 1, 10.0, "the heap trimmed")
        assert d.rss_bytes() - rss_before_bytes < cap, (d.rss_bytes() - rss_before_bytes) >> 20
        assert bytes(owner.restore(hs).data) == bytes(8 * BLOCK_BYTES)
    assert d.alive, d.log_tail()
