"""Faults: crashing clients, a daemon killed mid-restore, copies that fail or outlive their client.

What must hold (issue 6): a client SIGKILLed while it holds pins, engine
requests, registrations and an arena loses all of them after its lease and
the whole capacity is usable again; a daemon SIGKILLed mid-restore leaves
its client a timeout at the deadline (never a hang), and after the restart
the client has a new session without being asked; a copy that fails fails
only its own request, with TRANSFER_FAILED and a message that says why,
and never leaves wrong bytes behind.

Copy failures and slow copies come from kvtierd's test-only fault hook
(``KVTIER_TEST_FAULTS``, ``kvtier.daemon.faults``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.client.client import Client, DaemonError, KvtierTimeout, SessionLost
from kvtier.client.protocol import ErrorCode, encode, request_header
from kvtier.testing.daemon import KvtierDaemon
from tests.stress.stresslib import (
    FAULTS_ENV,
    REPO_ROOT,
    RawSocket,
    block_content,
    chain_content,
    chain_hashes,
    store_layout,
    wait_for,
)

BLOCK_BYTES = 1024
GPU_BLOCKS = 8
CPU_BLOCKS = 16


def spawn_crasher(mode: str, daemon: KvtierDaemon) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    # From the repository root, where `tests` is a package (see tests/__init__.py).
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.stress.crash_client", mode, daemon.endpoint, str(BLOCK_BYTES), str(GPU_BLOCKS),
         str(CPU_BLOCKS)],
        stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"crash client ({mode}) died before reporting; daemon log:\n{daemon.log_tail()}")
    return proc, json.loads(line)


def sigkill(proc: subprocess.Popen[str]) -> None:
    proc.kill()  # SIGKILL, this pid only
    proc.wait(10)


def stored_chain(c: Client, key: str, n: int) -> list[bytes]:
    hashes = chain_hashes(key, n)
    assert c.store(hashes, chain_content(hashes, BLOCK_BYTES)) == (n, 0)
    return hashes


def test_sigkilled_client_releases_pins_requests_registrations_arena_and_all_capacity(start_daemon) -> None:  # type: ignore[no-untyped-def]
    lease_s = 1.0
    # The crasher pins most of this tiny pool on purpose (what a crash must give back); the pin cap
    # (max_pinned_share, tested in tests/daemon/test_client_limits.py) would refuse that.
    daemon = start_daemon(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, lease_s=lease_s,
                          max_pinned_share=1.0)
    crasher, held = spawn_crasher("hold", daemon)
    try:
        assert os.path.exists(held["arena"])
        with Client(daemon.endpoint, "crash", store_layout(BLOCK_BYTES)) as c:
            stats = c.stats()["pools"]
            assert stats["crash"]["pinned_blocks"] == held["pinned"] >= GPU_BLOCKS
            assert stats["crash"]["gpu_free_blocks"] == 0, "every GPU-tier block should be pinned"
            assert stats["crash-engine"]["gpu_registered"] and stats["crash-engine"]["gpu_free_blocks"] == 0

            sigkill(crasher)
            took_s = wait_for(lambda: c.stats()["sessions"] == 1, 3 * lease_s + 2, "the crashed sessions to expire")
            assert took_s < lease_s + 1.0
            stats = c.stats()
            assert stats["daemon"]["lease_expiries_total"] == 2
            assert stats["pools"]["crash"]["pinned_blocks"] == 0
            assert stats["pools"]["crash"]["gpu_free_blocks"] == GPU_BLOCKS
            engine_pool = stats["pools"]["crash-engine"]
            assert not engine_pool["gpu_registered"] and engine_pool["gpu_blocks"] == 0
            assert not os.path.exists(held["arena"]), "the crashed client's arena was not unlinked"

            # New blocks take the whole capacity: the last chain fills the GPU tier, and
            # every block of both tiers holds one of the new blocks, each pinnable.
            fresh = [stored_chain(c, f"fresh-{i}", GPU_BLOCKS) for i in range(1 + CPU_BLOCKS // GPU_BLOCKS)]
            assert c.lookup(fresh[-1]) == ["gpu"] * GPU_BLOCKS
            held_fresh = [h for chain in fresh for h in chain if c.lookup([h])]
            assert len(held_fresh) >= CPU_BLOCKS
            assert sum(len(c.pin([h])) for h in held_fresh) == len(held_fresh)
            stats = c.stats()["pools"]["crash"]
            assert stats["cpu_used_blocks"] == CPU_BLOCKS and stats["pinned_blocks"] == len(held_fresh)
            assert bytes(c.restore(fresh[-1]).data) == chain_content(fresh[-1], BLOCK_BYTES)

        # And the engine pool takes a new engine with a request over every block.
        from kvtier.client.kv_share import allocate_shared_kv

        kv, _ = allocate_shared_kv((GPU_BLOCKS, BLOCK_BYTES // 2), "float16", 0)
        with Client(daemon.endpoint, "crash-engine", store_layout(BLOCK_BYTES, mode="engine")) as e:
            assert e.register_kv("kv", [kv], 0) == GPU_BLOCKS
            alloc = e.allocate_tokens("all", list(range(GPU_BLOCKS * 4)))
            assert sorted(alloc.block_ids) == list(range(GPU_BLOCKS))
        assert daemon.alive
    finally:
        sigkill(crasher)
        for name in held.get("kv_files", []):
            # A SIGKILLed engine leaves its own KV files (kv_share's contract); the daemon never owned them.
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_client_killed_with_its_copy_in_flight_is_released_after_the_copy(start_daemon) -> None:  # type: ignore[no-untyped-def]
    copy_delay_s = 1.5
    daemon = start_daemon(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, lease_s=0.5,
                          env={FAULTS_ENV: f"store.delay_s={copy_delay_s}"})
    crasher, held = spawn_crasher("inflight", daemon)
    t_killed = time.monotonic()
    sigkill(crasher)
    hashes = [bytes.fromhex(h) for h in held["hashes"]]
    with Client(daemon.endpoint, "crash", store_layout(BLOCK_BYTES)) as c:
        # The loop is not blocked by the slow copy.
        t0 = time.monotonic()
        assert c.health(timeout_s=1.0)["status"] == "ok" and time.monotonic() - t0 < 0.5
        # The lease runs out while the copy still reads the arena: the arena stays until the copy is done...
        wait_for(lambda: c.stats()["daemon"].get("lease_expiries_total", 0) == 1, 3.0, "the lease to expire")
        if time.monotonic() - t_killed < copy_delay_s - 0.3:
            assert os.path.exists(held["arena"]), "arena unlinked while a copy still reads it"
        # ...and goes right after it.
        wait_for(lambda: not os.path.exists(held["arena"]), copy_delay_s + 3.0, "the arena to be unlinked")
        # The store itself completed: the blocks are there, byte-exact.
        got = c.restore(hashes)
        assert bytes(got.data) == chain_content(hashes, BLOCK_BYTES)
        assert c.stats()["pools"]["crash"]["copy_failures"] == 0


def test_daemon_sigkilled_mid_restore_client_raises_at_its_deadline_then_reconnects_alone(start_daemon) -> None:  # type: ignore[no-untyped-def]
    # Private CPU tiers: the restart empties the cache (a persistent tier's restart: tests/daemon/test_restart.py).
    daemon = start_daemon(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, lease_s=1.5,
                          persist_cpu_tier=False, env={FAULTS_ENV: "load.delay_s=5"})
    deadline_s = 2.0
    with Client(daemon.endpoint, "restart", store_layout(BLOCK_BYTES), timeout_s=5.0) as c:
        hashes = stored_chain(c, "mid-restore", 4)
        # Through the shm plane: an inline restore of blocks in one run of
        # slots is sent from the tier without a copy, so nothing would be slow.
        c.open_arena(4)
        old_sid = c.sid
        killer = threading.Timer(0.5, daemon.kill)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(KvtierTimeout):
            c.restore(hashes, slots=[0, 1, 2, 3], timeout_s=deadline_s)
        elapsed_s = time.monotonic() - t0
        killer.join()
        assert not daemon.alive
        assert deadline_s - 0.1 <= elapsed_s <= deadline_s + 0.5, elapsed_s
        # A restarted daemon (without the slow copies): the heartbeat thread opens a session on its own.
        daemon.env.pop(FAULTS_ENV)
        daemon.spawn()
        wait_for(lambda: c.sid != old_sid, 10.0, "the client to open a new session by itself")
        assert c.lookup(hashes) == []  # the cache died with the old daemon: the engine recomputes
        assert c.store(hashes, chain_content(hashes, BLOCK_BYTES)) == (4, 0)
        assert bytes(c.restore(hashes).data) == chain_content(hashes, BLOCK_BYTES)


@pytest.fixture(scope="module")
def faulty_daemon(start_module_daemon) -> KvtierDaemon:  # type: ignore[no-untyped-def]
    # Every 3rd client store copy, every 4th client load copy and every 2nd demotion fails.
    return start_module_daemon(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES,
                               env={FAULTS_ENV: "store.fail_every=3,load.fail_every=4,demote.fail_every=2"})


def test_injected_copy_failures_fail_only_their_request(faulty_daemon: KvtierDaemon) -> None:
    with Client(faulty_daemon.endpoint, "faulty", store_layout(BLOCK_BYTES)) as c, \
            Client(faulty_daemon.endpoint, "faulty", store_layout(BLOCK_BYTES)) as bystander:
        outcomes: list[str] = []
        chains = [chain_hashes(f"faulty-{i}", 2) for i in range(6)]
        for hashes in chains:
            try:
                c.store(hashes, chain_content(hashes, BLOCK_BYTES))
                outcomes.append("ok")
            except DaemonError as exc:
                assert exc.code == ErrorCode.TRANSFER_FAILED and "injected fault" in exc.message, exc
                outcomes.append("failed")
                # Nothing of a failed store is visible, and the store can simply be sent again.
                assert bystander.lookup(hashes) == []
                assert c.store(hashes, chain_content(hashes, BLOCK_BYTES)) == (2, 0)
        assert "failed" in outcomes and "ok" in outcomes
        # 12 blocks for an 8-block GPU tier: some were demoted, and half of the demotions failed.
        # A block whose demotion failed is gone (a short restore), never wrong.
        restored = failed = missing = 0
        for hashes in chains * 2:
            try:
                got = c.restore(hashes)
            except DaemonError as exc:
                assert exc.code == ErrorCode.TRANSFER_FAILED and "injected fault" in exc.message, exc
                failed += 1
                continue
            assert bytes(got.data) == chain_content(hashes[: len(got)], BLOCK_BYTES)
            restored += len(got)
            missing += len(hashes) - len(got)
        assert failed >= 2 and restored >= 8
        stats = c.stats()
        assert stats["pools"]["faulty"]["demotions"] > 0
        assert stats["pools"]["faulty"]["copy_failures"] >= failed + 1
        assert stats["daemon"]["errors_total"]["code=TRANSFER_FAILED"] >= failed + 1
        assert "code=INTERNAL" not in stats["daemon"]["errors_total"]
        assert bystander.health()["status"] == "ok"


def test_injected_load_faults_reach_restores_into_client_memory(start_daemon) -> None:  # type: ignore[no-untyped-def]
    # A small restore into the client's arena is normally lent in place from the tier (no copy engine);
    # the fault seam turns that off (lend_restore_max_bytes 0), so the planned fault reaches it too
    # (a copy from a tier to the client is a "load").
    d = start_daemon(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES,
                     env={FAULTS_ENV: "load.fail_every=1"})
    with Client(d.endpoint, "faulty-shm", store_layout(BLOCK_BYTES)) as c:
        hashes = stored_chain(c, "faulty-shm", 2)
        arena = c.open_arena(2)
        with pytest.raises(DaemonError) as raised:
            c.restore(hashes, slots=[0, 1])
        assert raised.value.code == ErrorCode.TRANSFER_FAILED and "injected fault" in raised.value.message
        assert bytes(arena.buffer[: 2 * BLOCK_BYTES]) == bytes(2 * BLOCK_BYTES)  # nothing written
        assert c.stats()["pools"]["faulty-shm"]["copy_failures"] >= 1


def test_unregister_while_its_copy_is_in_flight_is_refused_and_the_copy_lands(start_daemon) -> None:  # type: ignore[no-untyped-def]
    from kvtier.client.kv_share import allocate_shared_kv

    daemon = start_daemon(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES,
                          env={FAULTS_ENV: "load.delay_s=1.0"})
    kv, _ = allocate_shared_kv((4, BLOCK_BYTES // 2), "float16", 0)
    with Client(daemon.endpoint, "unreg", store_layout(BLOCK_BYTES)) as c, RawSocket(daemon.endpoint) as raw:
        assert c.register_kv("kv", [kv], 0) == 4
        hashes = stored_chain(c, "unreg", 4)
        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.update(got=c.restore(hashes, slots=[3, 2, 1, 0], reg="kv")))
        worker.start()
        time.sleep(0.3)
        # The same session, from another socket, mid-flight: refused, not a use-after-unmap.
        reply, _ = raw.ask([encode(request_header("unregister_kv", 7, c.sid, name="kv"))], timeout_s=0.5) or (None, None)
        assert reply is not None, "the loop blocked behind a copy"
        assert reply["ok"] is False and reply["error"]["code"] == int(ErrorCode.INVALID_STATE), reply
        worker.join(10)
        assert len(result["got"]) == 4
        for i, h in enumerate(hashes):
            assert kv[3 - i].view(dtype=kv.dtype).numpy().tobytes() == block_content(h, BLOCK_BYTES)
        c.unregister_kv("kv")


@pytest.mark.parametrize("persist", [False, True], ids=["private-cpu-tier", "persistent-cpu-tier"])
def test_engine_example_recomputes_after_the_daemon_dies_mid_allocate(start_daemon, persist: bool) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    import torch
    # examples/engine's modules: pyproject's pytest pythonpath has their folder.
    from block_backends import DaemonBackend, InProcessBackend
    from engine import Engine
    from paged_llama import KVGeometry, PagedKVPool, build_model

    torch.set_num_threads(1)
    model = build_model("tiny", seed=0)
    geometry = KVGeometry.of(model.config)
    daemon = start_daemon(cpu_bytes=256 * geometry.block_bytes, lease_s=1.5, persist_cpu_tier=persist,
                          env={FAULTS_ENV: "restore.delay_s=6"})
    reference = Engine(model, InProcessBackend(PagedKVPool.allocate(geometry, 64), cpu_blocks=0, enable_caching=False))
    prompt = list(range(7, 7 + 100))  # 6 full blocks
    want = reference.generate(prompt, 4)
    backend = DaemonBackend(geometry, 8, endpoint=daemon.endpoint, model_name="recompute", timeout_s=2.0)
    eng = Engine(model, backend)
    try:
        assert eng.generate(prompt, 4).output_ids == want.output_ids
        # Unrelated traffic pushes the prompt's blocks out of the 8-slot GPU tier into the CPU tier.
        eng.generate(list(range(500, 620)), 2)
        assert "cpu" in backend.client.lookup(eng.hasher.hash_blocks(prompt))
        old_sid = backend.client.sid
        killer = threading.Timer(0.5, daemon.kill)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(KvtierTimeout):
            eng.generate(prompt, 4)  # its CPU hits are being restored (slowly) when the daemon dies
        assert time.monotonic() - t0 <= 2.0 + 0.5
        killer.join()
        daemon.env.pop(FAULTS_ENV)
        daemon.spawn()
        wait_for(lambda: backend.client.sid != old_sid, 10.0, "the engine's client to reconnect on its own")
        # The same request again, with the same output: a private CPU tier died with the daemon, so the
        # engine recomputes everything; a persistent one was adopted, so its blocks are restored instead.
        try:
            again = eng.generate(prompt, 4)
        except SessionLost:
            again = eng.generate(prompt, 4)
        if persist:
            assert again.hit_tier == "cpu" and again.num_computed_tokens < len(prompt)
        else:
            assert again.hit_tier == "miss" and again.num_computed_tokens == len(prompt)
        assert again.output_ids == want.output_ids
        assert torch.allclose(again.last_prompt_logits, want.last_prompt_logits, atol=1e-4)
    finally:
        backend.close()


def test_fault_spec_parsing_and_a_bad_spec_exits_2(tmp_path: Path) -> None:
    from kvtier.daemon.faults import parse_faults

    assert parse_faults("") is None and parse_faults("  ") is None
    plan = parse_faults("load.fail_every=2, any.delay_s=0")
    assert plan is not None and plan.fail_every == {"load": 2} and plan.delay_s == {"any": 0.0}
    for bad in ("load", "load.fail_every=0", "teleport.delay_s=1", "store.delay_s=-1", "store.explode=1"):
        with pytest.raises(ValueError):
            parse_faults(bad)
    proc = subprocess.run([sys.executable, "-m", "kvtier.daemon", "--socket", f"ipc://{tmp_path}/x.sock"],
                          env={**os.environ, FAULTS_ENV: "load.fail_every=zero"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and FAULTS_ENV in proc.stderr


def test_client_that_outlived_its_lease_gets_its_shm_plane_back(start_daemon) -> None:  # type: ignore[no-untyped-def]
    """Regression: a live client whose lease ran out (paused, starved heartbeats) lost its shm plane for good.

    Lease expiry unlinks the session's arena file (protocol §3), so the
    client's re-attach by name failed with NOT_FOUND, and from then on every
    shm store/restore got INVALID_STATE while ``open_arena`` said "this client
    already has an arena". Now the loss is reported once (``SessionLost``,
    ``lost_arena``) and ``open_arena`` makes a new arena.
    """
    daemon = start_daemon(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, lease_s=0.5)
    with Client(daemon.endpoint, "expired", store_layout(BLOCK_BYTES), heartbeat=False) as c:
        arena = c.open_arena(4)
        hashes = chain_hashes("expired", 4)
        for slot, h in enumerate(hashes):
            arena.slot_view(slot)[:] = block_content(h, BLOCK_BYTES)
        assert c.store(hashes, slots=[0, 1, 2, 3]) == (4, 0)
        path = arena.path
        wait_for(lambda: not os.path.exists(path), 5.0, "the expired session's arena to be unlinked")
        with pytest.raises(SessionLost) as info:
            c.restore(hashes, slots=[0, 1, 2, 3])
        assert info.value.lost_arena and c.arena is None
        # A new arena (new memory: the old views are not the daemon's any more) and the plane works.
        arena = c.open_arena(4)
        got = c.restore(hashes, slots=[3, 2, 1, 0])
        assert len(got) == 4
        assert [bytes(arena.slot_view(3 - i)) for i in range(4)] == [block_content(h, BLOCK_BYTES) for h in hashes]
