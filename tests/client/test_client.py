"""The client library against live daemons: deadlines, errors, heartbeats, reconnects."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.client.client import (
    Client,
    DaemonError,
    KvtierError,
    KvtierTimeout,
    PoolLayout,
    SessionLost,
)
from kvtier.client.protocol import ErrorCode
from kvtier.testing.daemon import KvtierDaemon, loopback_tcp_daemon

BLOCK_BYTES = 512
LAYOUT = PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                    kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    return kvtierd_module_factory(gpu_bytes=64 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES, lease_s=0.6)


def test_importing_the_client_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import kvtier.client.client, kvtier.client.protocol, kvtier.client.kv_share, kvtier.client.shm_arena\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_no_daemon_means_a_timeout_at_the_deadline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    with pytest.raises(KvtierTimeout):
        Client(f"ipc://{tmp_path}/nobody.sock", "p", LAYOUT, timeout_s=0.5)
    assert 0.4 < time.monotonic() - t0 < 1.5


def test_error_replies_raise_daemon_error(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "errors", LAYOUT) as c:
        with pytest.raises(DaemonError) as info:
            c.free("never-allocated")
        err = info.value
        assert err.code == ErrorCode.WRONG_MODE and err.name == "WRONG_MODE" and "engine" in err.message
        assert isinstance(err, KvtierError)
        with pytest.raises(KvtierError):
            c.store([b"x" * 16], b"too short")
        with pytest.raises(KvtierError):
            c.lookup([b"not 16 bytes"])  # refused before sending


def test_heartbeats_keep_the_session_and_its_pins(daemon) -> None:  # type: ignore[no-untyped-def]
    hashes = [bytes([7, i]) * 8 for i in range(2)]
    with Client(daemon.endpoint, "heartbeat", LAYOUT) as c:
        assert c.lease_s == 0.6 and c.heartbeat_s == pytest.approx(0.2)
        c.store(hashes, bytes(2 * BLOCK_BYTES))
        assert c.pin(hashes) == ["gpu", "gpu"]
        time.sleep(2.0)  # more than three leases, idle but for heartbeats
        assert c.stats()["pools"]["heartbeat"]["pinned_blocks"] == 2
        assert c.unpin(hashes) == 2


def test_one_client_many_threads(daemon) -> None:  # type: ignore[no-untyped-def]
    # Calls share one socket under the client's lock, which is not fair: a
    # thread may wait while the others store many times. So the threads store
    # no more than the GPU tier holds (4 x 8 x 2 = 64 blocks), and every
    # restore must return all of its blocks, whatever the interleaving.
    errors: list[BaseException] = []
    with Client(daemon.endpoint, "threads", LAYOUT) as c:
        def work(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(8):
                    hashes = [rng.randbytes(16) for _ in range(2)]
                    data = rng.randbytes(2 * BLOCK_BYTES)
                    assert c.store(hashes, data) == (2, 0)
                    got = c.restore(hashes)
                    assert len(got.tiers) == 2 and bytes(got.data) == data
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors


def test_stalled_daemon_timeouts_then_recovery(daemon) -> None:  # type: ignore[no-untyped-def]
    hashes = [bytes([9, i]) * 8 for i in range(2)]
    with Client(daemon.endpoint, "stall", LAYOUT, timeout_s=2.0) as c:
        c.store(hashes, bytes(2 * BLOCK_BYTES))
        daemon.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(KvtierTimeout):
                c.pin(hashes, timeout_s=0.3)  # not idempotent: one attempt, then the error
            assert time.monotonic() - t0 < 0.8
            t0 = time.monotonic()
            with pytest.raises(KvtierTimeout):
                c.lookup(hashes, timeout_s=0.6)  # idempotent: retried until the deadline, not past it
            assert 0.5 < time.monotonic() - t0 < 1.2
        finally:
            daemon.send_signal(signal.SIGCONT)
        # The late replies to the abandoned requests never reach this call.
        assert c.lookup(hashes) == ["gpu", "gpu"]


def test_daemon_restart_new_session_and_lost_pins_reported(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    # Private CPU tiers: a restart empties the cache (what a restart keeps is tests/daemon/test_restart.py).
    daemon = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=16 * BLOCK_BYTES, lease_s=2.0,
                             persist_cpu_tier=False)
    hashes = [bytes([3, i]) * 8 for i in range(3)]
    data = random.Random(3).randbytes(3 * BLOCK_BYTES)
    with Client(daemon.endpoint, "restart", LAYOUT, timeout_s=10.0) as c:
        arena = c.open_arena(4)
        c.store(hashes, data)
        c.pin(hashes[:2])
        old_sid = c.sid
        daemon.restart()
        # The daemon forgot everything: the client opens a new session and
        # tells the caller which pins are gone.
        with pytest.raises(SessionLost) as info:
            c.lookup(hashes)
        assert info.value.lost_pins == sorted(hashes[:2]) and info.value.code == ErrorCode.UNKNOWN_SESSION
        assert c.sid != old_sid
        assert c.lookup(hashes) == []  # the cache died with the old daemon
        # The arena was re-attached to the new session: the shm plane works.
        arena.buffer[: 3 * BLOCK_BYTES] = data
        assert c.store(hashes, slots=[0, 1, 2]) == (3, 0)
        assert bytes(c.restore(hashes).data) == data
        # Holding nothing, a second restart is invisible to idempotent calls.
        daemon.restart()
        assert c.lookup(hashes) == []
        assert c.health()["status"] == "ok"


def test_idle_engine_gets_its_registration_back_after_a_restart(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from kvtier.client.kv_share import allocate_shared_kv

    daemon = kvtierd_factory(cpu_bytes=16 * BLOCK_BYTES, lease_s=0.6)
    engine_layout = replace(LAYOUT, mode="engine")
    kv, _handle = allocate_shared_kv((8, BLOCK_BYTES // 2), "float16", 0)
    with Client(daemon.endpoint, "engine", engine_layout) as c:
        assert c.register_kv("kv", [kv], 0) == 8
        c.allocate_tokens("r", list(range(6)))
        daemon.restart()
        with Client(daemon.endpoint, "engine", engine_layout) as observer:
            deadline_s = time.monotonic() + 10
            # The heartbeat thread re-registers while the engine makes no call.
            while not observer.stats()["pools"]["engine"]["gpu_registered"]:
                assert time.monotonic() < deadline_s, "registration did not come back"
                time.sleep(0.1)
        with pytest.raises(SessionLost) as info:
            c.free("r")
        assert info.value.lost_requests == ["r"] and info.value.lost_pins == []
        assert c.allocate_tokens("r", list(range(6))).block_ids == [0, 1]


def test_a_half_reestablished_session_is_redone_by_the_next_call(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    """A restart, then re-registration times out after the new hello (a busy
    machine): the client must not use that session as if its KV were back."""
    from dataclasses import replace

    from kvtier.client.client import KvtierTimeout
    from kvtier.client.kv_share import allocate_shared_kv

    daemon = kvtierd_factory(cpu_bytes=16 * BLOCK_BYTES, lease_s=5.0)
    engine_layout = replace(LAYOUT, mode="engine")
    kv, _handle = allocate_shared_kv((8, BLOCK_BYTES // 2), "float16", 0)
    with Client(daemon.endpoint, "engine", engine_layout) as c:
        c.register_kv("kv", [kv], 0)
        real_roundtrip = c._roundtrip
        fail_once = {"register_kv": True}

        def flaky(op, *args, **kwargs):  # type: ignore[no-untyped-def]
            if fail_once.pop(op, False):
                raise KvtierTimeout("injected: register_kv timed out during re-establishment")
            return real_roundtrip(op, *args, **kwargs)

        c._roundtrip = flaky  # type: ignore[method-assign]
        daemon.restart()
        # The heartbeat thread or this call re-establishes the session first;
        # either way the injected timeout hits the re-registration.
        with contextlib.suppress(KvtierTimeout):
            c.allocate_tokens("r", list(range(6)))
        wait_for_condition = time.monotonic() + 10
        while fail_once and time.monotonic() < wait_for_condition:
            time.sleep(0.05)
        assert not fail_once, "the injected failure never happened"
        # Without the fix the client kept the half session and this call got
        # INVALID_STATE (no GPU tier registered).
        alloc = c.allocate_tokens("r2", list(range(6)))
        assert len(alloc.block_ids) == 2


def test_lookup_many_answers_as_lookup_does_in_one_round_trip(daemon) -> None:  # type: ignore[no-untyped-def]
    prefixes = [[bytes([9, p, i]) + b"\0" * 13 for i in range(4)] for p in range(20)]
    with Client(daemon.endpoint, "many", LAYOUT) as c:
        for p, hashes in enumerate(prefixes[:10]):
            c.store(hashes[: p % 4 + 1], random.Random(p).randbytes((p % 4 + 1) * BLOCK_BYTES))
        one_by_one = [list(c.lookup(h)) for h in prefixes]
        assert [list(t) for t in c.lookup_many(prefixes)] == one_by_one
        assert c.lookup_many([]) == []
        # Pinned as lookup(pin=True) pins: counted per session, released by unpin.
        held = c.lookup_many(prefixes, pin=True)
        pinned = sum(len(t) for t in held)
        assert pinned == sum(len(t) for t in one_by_one) > 0
        assert c.stats()["pools"]["many"]["pinned_blocks"] == pinned
        for hashes, tiers in zip(prefixes, held):
            c.unpin(hashes[: len(tiers)])
        assert c.stats()["pools"]["many"]["pinned_blocks"] == 0
        # One bad request (refused here, never sent) is an error in its own place; its batch-mate is answered.
        first, bad = c.lookup_many([prefixes[0], [b"short"]])
        assert isinstance(bad, KvtierError) and bad.code == ErrorCode.INVALID_FIELD
        assert list(first) == one_by_one[0]  # type: ignore[arg-type]


def test_one_refused_lookup_of_a_pinned_batch_fails_only_itself(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    """A request the daemon refuses (TOO_MANY_PINS here) once failed the whole batch: the client dropped its
    batch-mates' replies, and the pins the daemon had taken for them were never recorded, nor released."""
    daemon = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=16 * BLOCK_BYTES)  # a session pins up to 16
    with Client(daemon.endpoint, "isolated", LAYOUT) as c:
        held = [bytes([5, i]) * 8 for i in range(12)]
        c.store(held, random.Random(5).randbytes(12 * BLOCK_BYTES))
        assert len(c.pin(held[:12])) == 12
        small, big = held[:2], held[:8]  # 12 + 2 fits; 14 + 8 does not; 14 + 2 fits again
        answers = c.lookup_many([small, big, small], pin=True)
        assert [list(a) if not isinstance(a, KvtierError) else a.code for a in answers] == \
            [["gpu"] * 2, ErrorCode.TOO_MANY_PINS, ["gpu"] * 2]
        assert daemon.stats()["pools"]["isolated"]["pinned_blocks"] == 16
        assert sum(c._session.pins.values()) == 16  # every pin the daemon holds, the client knows of
        for _ in range(2):
            c.unpin(small)
        c.unpin(held)
        assert daemon.stats()["pools"]["isolated"]["pinned_blocks"] == 0 and not c._session.pins


@pytest.fixture
def tcp_daemon(tmp_path) -> Iterator[KvtierDaemon]:  # type: ignore[no-untyped-def]
    """On tcp://, a request read after its client closed the socket still runs: a daemon too slow for a deadline."""
    daemon = loopback_tcp_daemon(tmp_path / "d", {"gpu_bytes": 16 * BLOCK_BYTES, "cpu_bytes": 16 * BLOCK_BYTES})
    yield daemon
    daemon.kill()


def test_unpin_tag_releases_the_pins_of_a_batch_whose_replies_were_lost(tcp_daemon: KvtierDaemon) -> None:
    """A pinned batch that timed out: the daemon pinned, the client never read the replies. The tag's pins
    go with ``unpin_tag``; untagged pins stay the session's (released at its end)."""
    daemon = tcp_daemon
    hashes = [bytes([6, i]) * 8 for i in range(3)]
    with Client(daemon.endpoint, "lost", LAYOUT, timeout_s=10.0) as c:
        c.store(hashes, random.Random(6).randbytes(3 * BLOCK_BYTES))
        daemon.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(KvtierTimeout):
                c.lookup_many([hashes, hashes[:1], hashes[:2]], pin=True, pin_tags=["r1", "r2", None], timeout_s=1.0)
        finally:
            daemon.send_signal(signal.SIGCONT)
        assert wait_for(lambda: daemon.stats()["pools"]["lost"]["pinned_blocks"] == 6)
        assert not c._session.pins  # none of it was heard of here
        assert c.unpin_tag("r1") == 3 and c.unpin_tag("r2") == 1 and c.unpin_tag("r2") == 0
        assert daemon.stats()["pools"]["lost"]["pinned_blocks"] == 2  # the untagged request's
        assert c.unpin(hashes[:2]) == 2
        # Tagged pins the client did see come off by hash, as untagged ones do, and by tag.
        assert list(c.lookup(hashes, pin=True, pin_tag="r3")) == ["gpu"] * 3
        assert c.unpin(hashes[:1], pin_tag="r3") == 1 and c.unpin(hashes[:1]) == 0  # not the session's own
        assert c.unpin_tag("r3") == 2
        assert daemon.stats()["pools"]["lost"]["pinned_blocks"] == 0 and not c._session.pins
        with pytest.raises(DaemonError) as info:
            c._call("unpin", {})  # neither hashes nor a tag: which pins?
        assert info.value.code == ErrorCode.INVALID_FIELD
        # A tag's pins belong to the session too: they go when it ends.
        c.lookup(hashes, pin=True, pin_tag="r4")
        assert daemon.stats()["pools"]["lost"]["pinned_blocks"] == 3
    assert daemon.stats()["pools"]["lost"]["pinned_blocks"] == 0


def test_a_pinned_lookup_is_not_resent_after_a_timeout(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    """Resent, the daemon ran it twice and held two pins per block, one of which the client never knew of."""
    daemon = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=16 * BLOCK_BYTES)
    hashes = [bytes([7, i]) * 8 for i in range(2)]
    with Client(daemon.endpoint, "no-resend", LAYOUT, timeout_s=10.0) as c:
        c.store(hashes, random.Random(7).randbytes(2 * BLOCK_BYTES))
        real = c._roundtrip
        lost: list[str] = []

        def reply_lost_once(op: str, *args: Any, **kwargs: Any) -> Any:
            reply = real(op, *args, **kwargs)  # the daemon ran it ...
            if op == "lookup" and not lost:
                lost.append(op)
                raise KvtierTimeout("lookup: the reply was lost")  # ... and its answer never came
            return reply

        c._roundtrip = reply_lost_once  # type: ignore[method-assign]
        assert list(c.lookup(hashes)) == ["gpu"] * 2  # without pin: resent, answered
        lost.clear()
        with pytest.raises(KvtierTimeout):
            c.lookup(hashes, pin=True, pin_tag="r")
        assert daemon.stats()["pools"]["no-resend"]["pinned_blocks"] == 2  # once, not twice
        assert c.unpin_tag("r") == 2
        assert daemon.stats()["pools"]["no-resend"]["pinned_blocks"] == 0


def wait_for(condition, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.02)
    return True


def test_lookup_many_reopens_a_forgotten_session(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=16 * BLOCK_BYTES)
    hashes = [bytes([4, i]) * 8 for i in range(2)]
    with Client(daemon.endpoint, "many-restart", LAYOUT, timeout_s=10.0) as c:
        c.store(hashes, random.Random(1).randbytes(2 * BLOCK_BYTES))
        old_sid = c.sid
        daemon.restart()
        assert c.lookup_many([hashes, hashes[:1]]) == [[], []]  # a new session, an empty cache
        assert c.sid != old_sid
