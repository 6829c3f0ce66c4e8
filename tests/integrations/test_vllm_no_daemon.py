"""The connector with no kvtierd listening: nothing waits, and a daemon that comes later is found.

Both halves are driven directly (no engine), as test_vllm_scheduler.py and
test_vllm_worker.py do, against a socket nobody serves: first the missing
file of a mistyped socket (docs/vllm.md's old snippet), then the stale file
a killed daemon leaves, then a real kvtierd started on it later. Every call
on the request path must come back far below ``timeout_s`` (5 s here; the
bounds are generous because the test box is loaded): connecting and
reconnecting belong to the link's background thread.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.client.client import Client, PoolLayout
from kvtier.client.hashing import BlockHasher, hash_token_blocks
from kvtier.integrations.adapter.transfers import BlockTransfer, StepTransfers
from kvtier.integrations.vllm.keys import RequestKeys
from kvtier.integrations.vllm.pool import PoolChoice
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.settings import ConnectorSettings
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.testing.daemon import KvtierDaemon
from kvtier.testing.vllm_requests import FakeRequest

BS, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS = 32, 2, 16, 2, 8
BLOCK_BYTES = LAYERS * 2 * BS * HEADS * HEAD_DIM * 2  # bfloat16
TIMEOUT_S = 5.0  # the connector's timeout_s: what a call must never wait for
FAST_S = 0.5  # a call on the request path takes well under this even on a loaded box
FLAGS = {"log_level": "debug", "gpu_bytes": 64 * BLOCK_BYTES, "cpu_bytes": 64 * BLOCK_BYTES}


def _pool(name: str) -> PoolChoice:
    layout = PoolLayout(model=name, block_size=BS, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=LAYERS,
                        kv_heads=HEADS, head_dim=HEAD_DIM, mode="store")
    return PoolChoice.single(f"test/{name}", layout, tuple(f"layer.{i}" for i in range(LAYERS)), BS)


def _settings(endpoint: str, **extra: Any) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"socket": endpoint, "timeout_s": TIMEOUT_S, "retry_s": 0.2,
                                                "data_plane": "registered", **extra})


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def _prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i) % 30000 + 3 for i in range(blocks * BS + 1)]


def _stale_socket_file(path: Path) -> None:
    """What a SIGKILLed daemon leaves: a socket file nobody listens on (connect: ECONNREFUSED)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


def _wait_up(link_is_up: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not link_is_up():
        assert time.monotonic() < deadline, "the link did not reach the daemon started later"
        time.sleep(0.05)


@pytest.mark.parametrize("socket_file", ["missing", "stale"])
def test_lookups_answer_no_hit_at_once_and_a_daemon_started_later_is_found(
        tmp_path: Path, socket_file: str, caplog: pytest.LogCaptureFixture) -> None:
    daemon = KvtierDaemon(tmp_path / "d", flags=FLAGS)  # described, not started: nothing listens yet
    sock_path = Path(daemon.socket_file)
    if socket_file == "stale":
        _stale_socket_file(sock_path)
    caplog.set_level(logging.INFO, logger="kvtier.integrations")
    pool = _pool("nodaemon")
    sched, startup_s = _timed(lambda: SchedulerSide(_settings(daemon.endpoint, lookup_wait_ms=3.0), pool))
    client: Client | None = None
    try:
        # A missing file is known at once; a stale one costs start-up (not a request) one hello's timeout.
        assert startup_s < (FAST_S if socket_file == "missing" else TIMEOUT_S + FAST_S)
        # Over several retry_s periods: every new request is answered "no hit" at its first ask.
        worst_s = 0.0
        t_end = time.monotonic() + 1.5
        i = 0
        while time.monotonic() < t_end:
            req = FakeRequest(f"r{i}", _prompt(i, 4))
            answer, spent_s = _timed(lambda req=req: (sched.on_new_request(req),  # type: ignore[arg-type]
                                                      sched.get_num_new_matched_tokens(req, 0))[1])  # type: ignore[arg-type]
            assert answer == (0, False), answer
            sched.request_finished(req)  # type: ignore[arg-type]
            worst_s = max(worst_s, spent_s)
            i += 1
            time.sleep(0.02)
        assert worst_s < FAST_S, worst_s
        unavailable = [r.getMessage() for r in caplog.records if "no kvtierd answering" in r.getMessage()]
        assert len(unavailable) == 1, unavailable  # one line for the outage, not one per call or retry
        assert daemon.endpoint in unavailable[0] and "--print-config" in unavailable[0], unavailable[0]

        # kvtierd starts on that socket: the link's background thread finds it, no request waits for it.
        if socket_file == "stale":
            sock_path.unlink()
        daemon.spawn()
        client = Client(daemon.endpoint, pool.name, pool.layout)
        tokens = _prompt(99, 4)
        keys = RequestKeys(BlockHasher(BS), FakeRequest("s", tokens)).upto(4)  # type: ignore[arg-type]
        client.store(keys, bytes(len(keys) * BLOCK_BYTES))
        _wait_up(sched._link.is_up)
        req = FakeRequest("hit", tokens)
        sched.on_new_request(req)  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while (answer := sched.get_num_new_matched_tokens(req, 0))[0] is None and time.monotonic() < deadline:  # type: ignore[arg-type]
            time.sleep(0.005)
        assert answer == (4 * BS, False)
        sched.request_finished(req)  # type: ignore[arg-type]
        assert any("connected to kvtierd" in r.getMessage() for r in caplog.records)
    finally:
        sched.close()
        if client is not None:
            client.close()
        daemon.cleanup()


def _kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn((NUM_BLOCKS, 2, HEADS, BS, HEAD_DIM), generator=g).to(torch.bfloat16)
            for i in range(LAYERS)}


def test_the_worker_never_waits_for_a_missing_daemon_and_uses_one_started_later(tmp_path: Path) -> None:
    daemon = KvtierDaemon(tmp_path / "d", flags=FLAGS)
    kv = _kv(1)
    keys = hash_token_blocks(list(range(3 * BS)), BS)
    w = WorkerSide(_settings(daemon.endpoint), _pool("nodaemon-worker"), NUM_BLOCKS)
    try:
        _, spent_s = _timed(lambda: w.register_kv_caches(kv))
        assert spent_s < FAST_S + 1.0, spent_s  # moving the KV into /dev/shm is most of it
        for _ in range(10):  # over several retry_s periods
            _, store_s = _timed(lambda: (w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys, [0, 1, 2], "r")])),
                                         w.wait_for_stores()))
            _, load_s = _timed(lambda: w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [3, 4, 5], "r")])))
            assert store_s < FAST_S and load_s < FAST_S, (store_s, load_s)
            assert w.get_block_ids_with_load_errors() == {3, 4, 5}  # vLLM recomputes them
            time.sleep(0.1)

        daemon.spawn()
        _wait_up(w._link.is_up)  # type: ignore[union-attr]
        w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys, [0, 1, 2], "r")]))
        w.wait_for_stores()
        w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [5, 6, 7], "r")]))
        assert w.get_block_ids_with_load_errors() == set()
        for src, dst in zip([0, 1, 2], [5, 6, 7]):
            for t in kv.values():
                assert torch.equal(t[src].view(torch.int16), t[dst].view(torch.int16))
    finally:
        w.shutdown()
        daemon.cleanup()


def test_a_daemon_killed_mid_run_costs_one_call_then_nothing_until_it_is_back(tmp_path: Path) -> None:
    daemon = KvtierDaemon(tmp_path / "d", flags=FLAGS)
    daemon.spawn()
    kv = _kv(2)
    keys = hash_token_blocks(list(range(3 * BS)), BS)
    w = WorkerSide(_settings(daemon.endpoint, timeout_s=2.0), _pool("killed-worker"), NUM_BLOCKS)
    try:
        w.register_kv_caches(kv)
        assert w._link is not None and w._link.is_up()
        daemon.kill()  # its socket file stays: a stale file
        # The store in flight when it died waits for its deadline (the daemon might still have been reading
        # vLLM's blocks until then); it marks the daemon down.
        w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys, [0, 1, 2], "r")]))
        w.wait_for_stores()
        assert not w._link.is_up()
        for _ in range(10):
            _, store_s = _timed(lambda: (w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys, [0, 1, 2], "r")])),
                                         w.wait_for_stores()))
            _, load_s = _timed(lambda: w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [3, 4, 5], "r")])))
            assert store_s < FAST_S and load_s < FAST_S, (store_s, load_s)
            assert w.get_block_ids_with_load_errors() == {3, 4, 5}
            time.sleep(0.1)
        daemon.spawn()  # same socket: the old client finds it, opens a new session, registers the KV again
        _wait_up(w._link.is_up)
        w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys, [0, 1, 2], "r")]))
        w.wait_for_stores()
        w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [5, 6, 7], "r")]))
        assert w.get_block_ids_with_load_errors() == set()
        for src, dst in zip([0, 1, 2], [5, 6, 7]):
            assert torch.equal(kv["layer.0"][src].view(torch.int16), kv["layer.0"][dst].view(torch.int16))
    finally:
        w.shutdown()
        daemon.cleanup()


def test_a_registration_failing_with_any_error_leaves_the_link_retrying(tmp_path: Path) -> None:
    """``on_connect`` may fail with an error of its own (torch, the kernel, a layout check), not a kvtier one:
    the background thread must outlive it and try again, or the link would stay down until vLLM restarts."""
    from kvtier.integrations.adapter.link import DaemonLink

    daemon = KvtierDaemon(tmp_path / "d", flags=FLAGS)
    daemon.spawn()
    pool = _pool("failing-registration")
    tries: list[int] = []

    def on_connect(client: Client) -> None:
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("registration failed once")

    link = DaemonLink(daemon.endpoint, pool.name, pool.layout, retry_s=0.1,
                      client_kwargs={"timeout_s": TIMEOUT_S}, on_connect=on_connect)
    try:
        assert not link.wait_first_attempt(TIMEOUT_S + FAST_S)  # the first registration failed: down, not dead
        assert link.call(lambda c: (c.heartbeat(), True)[1]) is None  # and no call waits meanwhile
        _wait_up(link.is_up)
        assert len(tries) == 2 and link.attempts == 2
        assert link.call(lambda c: (c.heartbeat(), True)[1]) is True
    finally:
        link.close()
        daemon.cleanup()
