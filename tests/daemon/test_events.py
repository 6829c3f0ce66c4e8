"""The ``events`` verb against a real kvtierd: what a router following a pool learns, over ZMQ."""

from __future__ import annotations

import os
import time

import pytest

from kvtier.client.client import Client, DaemonError, KvtierError, PoolLayout
from kvtier.client.protocol import ErrorCode

BLOCK = 512
LAYOUT = PoolLayout(model="ev", block_size=4, block_bytes=BLOCK, dtype="bfloat16", num_layers=1, kv_heads=1,
                    head_dim=128, mode="store")


def keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def follow(c: Client, cursor: int, held: set[bytes]) -> int:
    """Apply the events after ``cursor`` to ``held`` (what a router believes); returns the new cursor."""
    got = c.events(cursor, max_events=3)  # small pages: the cursor must carry across them
    assert not got.lost
    for stored, key in got.changes:
        (held.add if stored else held.discard)(key)
    return got.next if got.next == cursor else follow(c, got.next, held)


def test_a_follower_of_the_events_holds_what_the_pool_holds(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=4 * BLOCK, cpu_bytes=4 * BLOCK)
    held: set[bytes] = set()
    with Client(daemon.endpoint, "ev", LAYOUT) as c:
        assert "events" in c.features
        assert c.events(0).changes == [] and c.events(0).next == 0
        first = keys(4, 1)
        c.store(first, os.urandom(4 * BLOCK))
        cursor = follow(c, 0, held)
        assert held == set(first)
        # Twelve more in a 4 + 4 block pool: the first ones go for good, and the follower knows.
        for tag in (2, 3, 4):
            c.store(keys(4, tag), os.urandom(4 * BLOCK))
        cursor = follow(c, cursor, held)
        assert not held & set(first)
        assert held == {k for k in keys(4, 2) + keys(4, 3) + keys(4, 4) if c.lookup([k])}
        # clear drops everything nobody uses: all removed. A block clean-ahead is still copying into the
        # CPU tier goes (and is announced gone) when its copy lands, which under load can be after the
        # next read of the journal: wait until no block is held, then the follower must hold none.
        every = [k for tag in (1, 2, 3, 4) for k in keys(4, tag)]
        deadline_s = time.monotonic() + 30
        c.clear()
        while any(c.lookup([k]) for k in every):
            assert time.monotonic() < deadline_s, "clear left blocks nobody uses"
            time.sleep(0.1)
            c.clear()
        cursor = follow(c, cursor, held)
        assert held == set()
        with pytest.raises(DaemonError) as info:
            c._call("events", {"since": -1})
        assert info.value.code == ErrorCode.INVALID_FIELD


def test_after_a_restart_an_old_cursor_reads_as_lost(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=4 * BLOCK, cpu_bytes=4 * BLOCK, persist_cpu_tier=False)
    with Client(daemon.endpoint, "ev", LAYOUT) as c:
        c.store(keys(3, 5), os.urandom(3 * BLOCK))
        cursor = c.events(0).next
        assert cursor == 3
    daemon.restart()
    with Client(daemon.endpoint, "ev", LAYOUT) as c:
        got = c.events(cursor)
        # The new daemon holds nothing and numbers from 1 again: the follower must drop what it believed.
        assert got.lost and got.changes == [] and got.next == 0


def test_after_a_restart_that_adopts_the_cpu_tier_an_old_cursor_reads_as_lost_too(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=8 * BLOCK)  # stores go straight to the CPU tier
    with Client(daemon.endpoint, "ev", LAYOUT) as c:
        c.store(keys(3, 6), os.urandom(3 * BLOCK))
        cursor = c.events(0).next
        assert cursor == 3
    daemon.restart()
    with Client(daemon.endpoint, "ev", LAYOUT) as c:
        got = c.events(cursor)
        # The new daemon adopted the three blocks and numbers its events past any the old one handed
        # out: the follower learns that it lost track, and what the new daemon holds.
        assert got.lost and got.changes == [(True, k) for k in got_order(got.changes, keys(3, 6))]
        assert got.next > cursor and c.events(got.next).changes == []


def got_order(changes: list[tuple[bool, bytes]], wanted: list[bytes]) -> list[bytes]:
    """``wanted`` in the order ``changes`` names them (adoption replays the arena's order)."""
    order = [k for _, k in changes]
    assert sorted(order) == sorted(wanted), (order, wanted)
    return order


def test_a_client_says_when_its_daemon_lacks_events(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory()
    with Client(daemon.endpoint, "ev", LAYOUT) as c:
        c._session.features = tuple(f for f in c.features if f != "events")  # as a daemon from before them
        with pytest.raises(KvtierError, match="upgrade"):
            c.events(0)
