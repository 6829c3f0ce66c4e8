"""A call the client gave up on leaves the client's memory alone (protocol feature "deadlines").

When a store or restore on the shm or kv plane times out, the client (the
vLLM connector) hands the memory its slots name back to the engine, which
writes other KV there. The request may still sit in the daemon's socket (a
daemon stopped or stalled past the timeout) or in its copy queue: executed
late, a store would keep the engine's new bytes under the old keys, and a
restore would overwrite the engine's new KV. Each test runs the race for
real against a kvtierd process, then runs it again as a client without
deadlines (an older one) to show the race is real, so the first half
cannot pass by missing it.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from kvtier.client.client import Client, KvtierTimeout
from kvtier.testing.daemon import KvtierDaemon
from tests.stress.stresslib import FAULTS_ENV, chain_content, chain_hashes, store_layout, wait_for

BLOCK_BYTES = 1024
N = 4
GARBAGE = b"\xa5" * (N * BLOCK_BYTES)


def late_refusals(c: Client) -> int:
    return int(c.stats()["daemon"].get("errors_total", {}).get("code=DEADLINE_EXCEEDED", 0))


@pytest.mark.parametrize("deadlines", [True, False], ids=["deadlines", "older-client"])
def test_a_store_that_timed_out_while_the_daemon_was_stopped_stores_nothing(tmp_path: Path, deadlines: bool) -> None:
    # On tcp://: on ipc:// a request whose connection closed before the daemon took it up is refused
    # earlier, as from no known user (FOREIGN_SESSION), unless its descriptor number was reused by then
    # (the client's next connection, the same user). On tcp nothing but the deadline stops it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with KvtierDaemon(tmp_path / "d", endpoint=f"tcp://127.0.0.1:{port}", env={"KVTIER_INSECURE_TCP": "true"},
                      flags={"log_level": "info", "gpu_bytes": 8 * BLOCK_BYTES, "cpu_bytes": 16 * BLOCK_BYTES},
                      omp_threads=1) as daemon, \
            Client(daemon.endpoint, "late-store", store_layout(BLOCK_BYTES), timeout_s=5.0) as c:
        assert c.deadlines  # same host, same clock
        c._session.deadlines = deadlines
        arena = c.open_arena(N)
        hashes = chain_hashes("late-store", N)
        arena.buffer[: N * BLOCK_BYTES] = chain_content(hashes, BLOCK_BYTES)
        daemon.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(KvtierTimeout):
                c.store(hashes, slots=list(range(N)), timeout_s=0.5)
            # The engine has its memory back and computes other KV there.
            arena.buffer[: N * BLOCK_BYTES] = GARBAGE
        finally:
            daemon.send_signal(signal.SIGCONT)
        if deadlines:
            # The request that waited in the socket is refused as it is taken up.
            wait_for(lambda: late_refusals(c) >= 1, 10.0, "the late store to be refused")
            assert c.lookup(hashes) == []
            assert c.stats()["pools"]["late-store"]["stores"] == 0
        else:
            # Without a deadline the daemon stores what it reads now: the engine's new bytes, under the old keys.
            wait_for(lambda: len(c.lookup(hashes)) == N, 10.0, "the late store to land")
            assert bytes(c.restore(hashes).data) == GARBAGE
            assert late_refusals(c) == 0


@pytest.mark.parametrize("deadlines", [True, False], ids=["deadlines", "older-client"])
def test_a_restore_whose_copy_outlived_the_call_does_not_write_the_engines_memory(start_daemon, deadlines: bool) -> None:  # type: ignore[no-untyped-def]
    # Each restore's copy out of the tiers takes 1 s on the daemon's copy worker; the call gives up at 0.4 s.
    daemon: KvtierDaemon = start_daemon(gpu_bytes=8 * BLOCK_BYTES, cpu_bytes=16 * BLOCK_BYTES,
                                        env={FAULTS_ENV: "load.delay_s=1.0"})
    with Client(daemon.endpoint, "late-restore", store_layout(BLOCK_BYTES), timeout_s=5.0) as c:
        assert c.deadlines
        c._session.deadlines = deadlines
        hashes = chain_hashes("late-restore", N)
        assert c.store(hashes, chain_content(hashes, BLOCK_BYTES)) == (N, 0)
        arena = c.open_arena(N)
        with pytest.raises(KvtierTimeout):
            c.restore(hashes, slots=list(range(N)), timeout_s=0.4)
        # The engine recomputes those blocks, or reuses the slots for another request.
        arena.buffer[: N * BLOCK_BYTES] = GARBAGE
        if deadlines:
            # Of the requests sent (the call resent it once in time), those the daemon took up are refused; a
            # resend whose connection closed first may never arrive, or come as FOREIGN_SESSION (an unknown uid).
            wait_for(lambda: late_refusals(c) >= 1, 15.0, "a late restore to be refused")
            time.sleep(1.5)  # another copy of the request, already past the loop, ends within one delayed copy
            wait_for(lambda: c.stats()["pools"]["late-restore"]["copies_in_flight"] == 0, 15.0, "the copies to end")
            assert bytes(arena.buffer[: N * BLOCK_BYTES]) == GARBAGE
            # The blocks are still there for the next, timely restore.
            got = c.restore(hashes, slots=list(range(N)), timeout_s=10.0)
            assert len(got) == N and bytes(arena.buffer[: N * BLOCK_BYTES]) == chain_content(hashes, BLOCK_BYTES)
        else:
            wait_for(lambda: bytes(arena.buffer[: N * BLOCK_BYTES]) != GARBAGE, 15.0, "the late restore to land")
            assert late_refusals(c) == 0
