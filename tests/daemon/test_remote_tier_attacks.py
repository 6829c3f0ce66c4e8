"""Someone else writes to the daemons' Redis: nothing they write is served as a block (issue 32, item 5).

Two real kvtierd processes share one real redis-server as their remote tier
(as in test_remote_tier_daemons.py). Daemon A stores blocks until some are
written back to Redis; then an "attacker" with write access to Redis (the
test's own redis-py client) rewrites values there, and daemon B is asked for
the blocks. The attacker knows the format (it is documented) and reads the
keys with SCAN; it does not know the daemons' secret.

- a valid value copied onto another block's key;
- a value with attacker bytes under a block's key, with a checksum header
  that is correct for those bytes (the old, unkeyed format), and one in the
  current format with an unkeyed tag;
- a key injected for a hash nobody stored (a valid value copied there);
- a value far larger than a block under a block's key.

None of them may be served: B's restore returns no block for them (a miss,
never a wrong block), and B counts them in its remote tier's counters.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvtier.client.client import Client, PoolLayout
from kvtier.testing import redis_servers as rs

pytestmark = pytest.mark.skipif(not rs.have_redis(), reason=rs.MISSING_REASON)

BLOCK_BYTES = 4096
LAYOUT = PoolLayout(model="shared-model", block_size=16, block_bytes=BLOCK_BYTES, dtype="float16",
                    num_layers=2, kv_heads=2, head_dim=64)
POOL = "m/tp0"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[rs.RedisServer]:
    srv = rs.RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


@pytest.fixture
def daemons(kvtierd_factory, redis_server: rs.RedisServer, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Daemons A and B on one Redis, with one shared remote secret."""
    flags = dict(gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=4 * BLOCK_BYTES, remote_url=redis_server.url,
                 remote_secret_key_file=rs.secret_file(tmp_path / "secret"))
    return kvtierd_factory(**flags), kvtierd_factory(**flags)


def wait_for(cond, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stored_in_redis(client: Client, hashes: list[bytes], data: list[bytes], head: int) -> None:
    """Store through ``client`` in fours until the first ``head`` blocks were pushed out into Redis."""
    for i in range(0, len(hashes), 4):
        assert client.store(hashes[i : i + 4], data[i : i + 4]) == (4, 0)
    wait_for(lambda: client.lookup(hashes[:head]) == ["remote"] * head, 10.0, "the evicted blocks to reach Redis")


def key_of(redis_client, block_hash: bytes) -> bytes:  # type: ignore[no-untyped-def]
    """The server key of a block, found as an attacker would: SCAN for the hash."""
    found = [k for k in redis_client.scan_iter(match=b"kvtier:*", count=1000) if k.endswith(block_hash.hex().encode())]
    assert len(found) == 1, found
    return found[0]


def remote_stats(client: Client) -> dict:  # type: ignore[type-arg]
    return client.stats()["pools"][POOL]["remote"]


def setup_blocks(daemons, seed: int) -> tuple[Client, Client, list[bytes], list[bytes]]:  # type: ignore[no-untyped-def]
    a, b = daemons
    data = [os.urandom(BLOCK_BYTES) for _ in range(12)]
    hashes = [bytes([seed, i]) * 8 for i in range(12)]
    ca, cb = Client(a.endpoint, POOL, LAYOUT), Client(b.endpoint, POOL, LAYOUT)
    stored_in_redis(ca, hashes, data, 4)
    return ca, cb, hashes, data


def assert_not_served(cb: Client, block_hash: bytes, wrong: bytes) -> None:
    got = cb.restore([block_hash])
    served_wrong = bytes(got.data) == wrong
    assert not served_wrong, "daemon B served the attacker's value as the block"
    assert got.tiers == [] and got.data.nbytes == 0, got.tiers


def test_a_value_copied_to_another_key_is_not_served(daemons, redis_server: rs.RedisServer) -> None:  # type: ignore[no-untyped-def]
    ca, cb, hashes, data = setup_blocks(daemons, 21)
    with ca, cb:
        r = redis_server.client()
        # Block 1's key now holds block 0's value, byte for byte (the header and checksum are block 0's).
        r.set(key_of(r, hashes[1]), r.get(key_of(r, hashes[0])))
        assert_not_served(cb, hashes[1], data[0])
        # The untouched block is still served, byte-exact.
        got = cb.restore(hashes[:1])
        assert got.tiers == ["remote"] and bytes(got.data) == data[0]
        stats = remote_stats(cb)
        assert stats["remote_unauthentic"] >= 1 and stats["remote_hits"] >= 1


def test_attacker_bytes_with_a_correct_checksum_are_not_served(daemons, redis_server: rs.RedisServer) -> None:  # type: ignore[no-untyped-def]
    ca, cb, hashes, data = setup_blocks(daemons, 22)
    with ca, cb:
        r = redis_server.client()
        evil = os.urandom(BLOCK_BYTES)
        # The old value format: magic, version 1, length, xxh3-64 of the payload: all correct for ``evil``.
        r.set(key_of(r, hashes[0]),
              struct.pack("<4sBxxxQQ", b"KVT1", 1, BLOCK_BYTES, xxhash.xxh3_64_intdigest(evil)) + evil)
        assert_not_served(cb, hashes[0], evil)
        # The current format, every field right but the tag, which only the secret can make:
        # here the tag of another block's value, and an unkeyed digest of the payload.
        legit = r.get(key_of(r, hashes[2]))
        header_bytes = len(legit) - BLOCK_BYTES
        r.set(key_of(r, hashes[1]), legit[:header_bytes] + evil)
        assert_not_served(cb, hashes[1], evil)
        tag_bytes = 16
        unkeyed = xxhash.xxh3_128_digest(key_of(r, hashes[3]) + evil)
        r.set(key_of(r, hashes[3]), legit[: header_bytes - tag_bytes] + unkeyed + evil)
        assert_not_served(cb, hashes[3], evil)
        # The old-format value is not a value's size (lookups stop there); the other two fail their MAC.
        assert remote_stats(cb)["remote_unauthentic"] >= 2


def test_an_injected_key_for_a_hash_nobody_stored_is_not_served(daemons, redis_server: rs.RedisServer) -> None:  # type: ignore[no-untyped-def]
    ca, cb, hashes, data = setup_blocks(daemons, 23)
    with ca, cb:
        r = redis_server.client()
        victim_key = key_of(r, hashes[0])
        nobody = bytes([23, 99]) * 8
        injected = victim_key[: -len(hashes[0].hex())] + nobody.hex().encode()
        r.set(injected, r.get(victim_key))
        assert_not_served(cb, nobody, data[0])
        assert remote_stats(cb)["remote_unauthentic"] >= 1


def test_an_oversized_value_is_a_miss_and_is_not_read(daemons, redis_server: rs.RedisServer) -> None:  # type: ignore[no-untyped-def]
    ca, cb, hashes, data = setup_blocks(daemons, 24)
    with ca, cb:
        r = redis_server.client()
        big = os.urandom(64 << 20)
        r.set(key_of(r, hashes[0]), big)
        sent_before = r.info("stats")["total_net_output_bytes"]
        assert cb.lookup_many([hashes[:1]], pin=True) == [[]]  # a pinning lookup fetches: nothing to pin
        got = cb.restore(hashes[:1])
        assert got.tiers == [] and bytes(got.data) == b""
        # Neither B's lookup nor its fetch made the server send the 64 MiB value.
        assert r.info("stats")["total_net_output_bytes"] - sent_before < 1 << 20
        del big


def test_a_daemon_with_another_secret_serves_nothing_and_deletes_nothing(  # type: ignore[no-untyped-def]
        daemons, kvtierd_factory, redis_server: rs.RedisServer, tmp_path: Path) -> None:
    ca, cb, hashes, data = setup_blocks(daemons, 25)
    other = kvtierd_factory(gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=4 * BLOCK_BYTES, remote_url=redis_server.url,
                            remote_secret_key_file=rs.secret_file(tmp_path / "other-secret"))
    with ca, cb, Client(other.endpoint, POOL, LAYOUT) as cc:
        got = cc.restore(hashes[:4])
        assert got.tiers == [] and got.data.nbytes == 0
        assert remote_stats(cc)["remote_unauthentic"] >= 1 and remote_stats(cc)["deletes_queued"] == 0
        # The blocks are still there for the daemons that hold the right secret.
        got = cb.restore(hashes[:4])
        assert got.tiers == ["remote"] * 4 and bytes(got.data) == b"".join(data[:4])
