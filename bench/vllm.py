#!/usr/bin/env python3
"""kvtier under vLLM: TTFT of a restored prefix, and the scheduler half's cost per call, in one run.

Usage:
    python bench/vllm.py [--model llama|gemma3|mla] [--prefix-tokens 4096] [--reps 5] [--cases ...] [--json PATH]
                         [--skip-ttft] [--skip-sched]

Everything runs on this machine, in one run: the bench starts one kvtierd
(``python -m kvtier.daemon --socket ipc://...``, store mode) and stops it at
the end (SIGTERM, exit status checked).

1. TTFT (time of ``llm.generate`` with ``max_tokens=1``, one request at a time) of a prompt made of a
   long shared prefix (default 4,096 tokens) and a short unique suffix (32 tokens), on a random-weight
   Llama (a checkpoint written by ``kvtier.testing.vllm_weights.write_model``, so the next token
   depends on the whole prefix's KV; default hidden 1024, 8 heads of 128, 2 KV heads (GQA), 4 layers,
   float32: a 4,096-token prefill costs ~10 s on this CPU, so a restore has a lot to beat, while the KV is
   8 KiB a token, 32 MiB for the prefix, so the copy is not free either; bfloat16 runs 4-25x slower on a
   CPU without AVX-512 BF16, as this one: 72 s for the prefix, 7.5 s for a prefix-cache hit). Cases:

   a. ``kvtier``: vLLM with ``KvtierConnector`` and ``enable_prefix_caching=False``: every repetition's
      prefix comes from kvtierd (stored once, write-through, by an earlier request) into vLLM's KV
      tensors. Prefix caching off is the state of a prefix vLLM evicted (or never had: another engine,
      a restart) without the eviction traffic of filler requests.
   b. ``recompute``: no connector; a unique ``cache_salt`` per repetition: the whole prompt is prefilled.
   c. ``prefix_cache``: the engine of (b) (prefix caching on), unsalted: a hit in vLLM's own cache.
   d. ``example``: vLLM's ``ExampleConnector`` (safetensors files under ``--example-dir``, default a
      fresh directory in /dev/shm), prefix caching off.
   e. ``kvtier_pc_evicted`` (for information): ``KvtierConnector`` with prefix caching ON, the prefix
      evicted from vLLM's cache (``LLM.reset_prefix_cache()``, untimed) before each repetition.
   f. ``kvtier_staged`` (for information): as (a) with ``data_plane="staged"`` (vLLM's KV tensors stay
      in vLLM's own memory, blocks go through a shared arena) instead of the registered plane (KV
      tensors moved to /dev/shm, kvtierd copies in place).
   g. ``kvtier_layers`` (for information): as (a) with ``layer_overlap=true``: the worker copies the
      restore's first layer before the forward and the others beside it, each waited for by its layer's
      attention (``wait_for_layer_load``).

   Fairness: every engine (one ``LLM`` per configuration, (b) and (c) share one) is a child process of
   the bench, answering JSON commands on stdin (one tagged JSON line on stdout each). By default
   (``--schedule sequential``) one engine is alive at a time: it starts, warms up, computes the prefix
   once, runs its cases' repetitions (round robin between (b) and (c)) and exits before the next one
   starts. On this 2-core machine an idle vLLM engine beside the measured one skews its forward pass
   several-fold (one run with all six alive put the same restore at 124 ms alone and 700-1,000 ms
   beside the others), so ``--schedule round-robin`` (all alive, repetition i runs every case once,
   the order rotated by i) is only for hosts with cores to spare. vLLM reserves a core for its
   scheduler, and one more when a KV connector is configured, which on 2 cores left the engines
   without a connector 1 compute thread and those with one 2 (their prefills 9.6 s against 6.0 s):
   every engine gets ``VLLM_CPU_NUM_OF_RESERVED_CPU=--reserved-cpus`` (default 1). Each engine has 4 requests' worth of
   KV blocks (~130 MiB). The load average is recorded before and after each engine's repetitions.

   Reported: median (min, max) TTFT over ``--reps`` repetitions (each a different suffix), the tokens
   vLLM counts as cached, whether every case's greedy token equals the recompute's, and each request's
   TTFT cut at time stamps (CLOCK_MONOTONIC, shared by the processes): the engine worker's
   ``execute_model`` / ``sample_tokens`` / model forward and, with KvtierConnector, the worker half's
   ``start_load_kv`` (wrapped through ``collective_rpc``) and the scheduler half's ``on_new_request``,
   lookup completion and ``get_num_new_matched_tokens`` (vLLM's EngineCore process is spawned, so these
   are wrapped by a ``sitecustomize`` the bench writes into its temp directory and puts on the engine's
   PYTHONPATH). For the kvtier cases: arrival -> lookup answer (bench submit -> the first
   ``get_num_new_matched_tokens`` that answers; with the empty engine steps in between), the load
   (``start_load_kv``; the worker half's ``load_s`` delta per repetition via ``collective_rpc`` beside
   it), and the rest (alloc -> load start, the forward without the load, output). Ratios of medians
   (and the median of the per-repetition ratios): kvtier / recompute (target <= 0.2), kvtier / prefix
   cache (target <= 1.2), kvtier / ExampleConnector (target < 1).

   Model families (``--model``; the same cases, sizes from the flags):

   - ``llama`` (default): the model above, one KV-cache group.
   - ``gemma3``: a Gemma-3-like model (``vllm_weights.gemma3_config``: q/k and sandwich norms, 5
     sliding-window layers of ``--window`` tokens, default 1,024 as Gemma 3's, to 1 full; ``--layers``
     a multiple of 6, default 6), run with vLLM's hybrid KV-cache manager on: 6 KV-cache groups in one
     kvtier pool. A hit restores every block of the full layers and, of each sliding layer, only the
     blocks of the window at the hit's end. Reported besides: blocks restored per hit against that
     bound (target: no more), and against all groups' blocks.
   - ``mla``: a DeepSeek-V2-like MLA model (kv_lora_rank 512 + rope 64, the 576 vLLM's CPU MLA needs;
     block size 16, which vLLM's CPU MLA forces). vLLM's CPU build runs MLA with prefix caching and
     chunked prefill off and cannot compute on a prefix, so nothing is loaded (the connector refuses)
     and the TTFT cases are all recomputes: reported for the record, no target. Then the one-copy
     check: the same prompts (the prefix and ``--reps`` suffixes) through a kvtier engine at TP=1 and
     at TP=``--mla-tp`` (default 2), each on a fresh kvtierd, and the bytes each holds (target: TP=2
     at most 1.05x TP=1).

   For every family: the bytes restored per hit (kvtierd's ``loads`` x block bytes) and the bytes
   kvtierd holds per cached token (its blocks x block bytes over the tokens of the full blocks stored).

2. The scheduler half's cost (``SchedulerSide``, built directly, no engine)
   against the same kvtierd, on fake requests (``--sched-prompt-tokens``,
   default 4,128 tokens: 32 full blocks of 128, all pre-stored inline so
   every lookup hits). One trial: ``on_new_request`` for N requests, then
   "steps" (``--step-ms`` apart, standing in for the forward) in which every
   still-waiting request gets ``get_num_new_matched_tokens`` until all are
   answered. Scheduler-thread time = time in ``on_new_request`` + in
   ``get_num_new_matched_tokens``; reported per call (amortized: divided by
   the calls) and per request, and the wall time until all N are answered,
   for N = 1 and 64. The engine counts as idle (as before its first step), so a
   first ask may wait up to ``lookup_wait_ms`` per step for its lookup: that
   wait is scheduler-thread time too, reported apart (it replaces an empty
   engine step). Beside it, a synchronous design: one blocking
   ``Client.lookup(pin=True)`` (keys hashed first) per request on the
   scheduler thread. Target: <= 50 us per call amortized with 64 waiting.

Results: a table on stdout (progress on stderr, vLLM's own logs in
``--log``), JSON (default ``bench/results/vllm-cpu.json``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# This file is bench/vllm.py: as a script, its folder is sys.path[0], where "vllm" would be this file.
# At the end of sys.path it still holds the benches' shared modules (vllm_engine, vllm_timing).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent] + [
    str(Path(__file__).resolve().parent)]

import vllm_timing  # noqa: E402
from vllm_engine import (BLOCK_SIZE, FAMILIES, WEIGHTS, EngineProc, engine_env, kv_layout,  # noqa: E402
                         model_kwargs, parameters, progress, reply, serve, write_model)
from vllm_engine import model_config as _model_config  # noqa: E402
from vllm_timing import breakdown  # noqa: E402

from kvtier.testing.daemon import KvtierDaemon  # noqa: E402
from kvtier.testing.vllm_requests import FakeRequest  # noqa: E402
from kvtier.testing.vllm_trace import take_events as _take_events  # noqa: E402

TARGET_VS_RECOMPUTE = 0.2  # kvtier TTFT / recompute TTFT, at most
TARGET_VS_PREFIX_CACHE = 1.2  # kvtier TTFT / vLLM prefix-cache TTFT, at most
TARGET_VS_EXAMPLE = 1.0  # kvtier TTFT / ExampleConnector TTFT, below
TARGET_SCHED_US = 50.0  # scheduler-thread us per get_num_new_matched_tokens call, amortized, 64 waiting
TARGET_MLA_TP_BYTES = 1.05  # MLA: kvtierd's bytes at TP=N over those at TP=1, at most
MODELS = FAMILIES  # --model: vllm_engine's model families
WARMUP_TOKENS = 256


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--model", choices=MODELS, default="llama",
                   help="model family: llama (one KV-cache group), gemma3 (sliding-window layers: hybrid KV-cache "
                        "groups), mla (DeepSeek-V2 MLA; vLLM's CPU build serves it from no prefix) (default llama)")
    p.add_argument("--window", type=int, default=1024, help="gemma3: the sliding window in tokens (default 1024)")
    p.add_argument("--mla-tp", type=int, default=2, help="mla: the TP size whose kvtierd bytes are compared with TP=1's")
    p.add_argument("--prefix-tokens", type=int, default=4096, help="shared prefix, a multiple of 128 (default 4096)")
    p.add_argument("--suffix-tokens", type=int, default=32, help="unique suffix per repetition, < 128 (default 32)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per case (default 5)")
    p.add_argument("--hidden", type=int, default=1024, help="model hidden size (default 1024)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8: head_dim 128)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--layers", type=int, default=None, help="layers (default 4; gemma3 6)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default 2.75 x hidden)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192)")
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32", "float16"),
                   help="model dtype (default float32: on a CPU without AVX-512 BF16, as here, vLLM runs bfloat16 4-25x slower)")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"timed cases, comma-separated, in round-robin order (default {','.join(CASES)})")
    p.add_argument("--schedule", choices=("sequential", "round-robin"), default="sequential",
                   help="sequential (default): one engine alive at a time, its repetitions back to back; round-robin: "
                        "all engines alive, every repetition runs every case (on 2 cores the idle engines skew it)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole sequence of engines this many times, odd rounds in reverse order, each engine "
                        "a fresh process (default 1); the medians cover every round")
    p.add_argument("--kvtierd-gpu-bytes", default="256MiB",
                   help="kvtierd's GPU-tier size (default 256MiB: the prefix stays there, and kvtierd copies each "
                        "restore); 0: every block lies in the CPU tier, whose restores the worker copies itself (lends)")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (default 1: vLLM's own choice without a "
                        "connector; with one it reserves another core, which 2 cores cannot give)")
    p.add_argument("--example-dir", type=Path, default=None,
                   help="ExampleConnector's storage (default: a fresh directory in /dev/shm, removed at the end)")
    p.add_argument("--sched-reqs", default="1,64", help="waiting requests per scheduler trial (default 1,64)")
    p.add_argument("--sched-trials", type=int, default=20, help="trials per N (default 20)")
    p.add_argument("--sched-prompt-tokens", type=int, default=4128, help="prompt tokens of a fake request (default 4128)")
    p.add_argument("--step-ms", type=float, default=1.0, help="simulated time between scheduler steps (default 1.0)")
    p.add_argument("--skip-ttft", action="store_true", help="only the scheduler benchmark")
    p.add_argument("--skip-sched", action="store_true", help="only the TTFT benchmark")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "vllm-cpu.json", help="JSON report path")
    p.add_argument("--log", type=Path, default=None,
                   help="vLLM's own output (default: kvtier-bench-vllm.log in the temp directory)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one live LLM configuration
    return p


# ---------------------------------------------------------------------------
# kvtierd's numbers
# ---------------------------------------------------------------------------

def pool_stats(stats: dict[str, Any], prefix: str) -> dict[str, Any]:
    pools = stats.get("pools", {})
    for name, p in (pools.items() if isinstance(pools, dict) else ((q.get("name", ""), q) for q in pools)):
        if str(name).startswith(prefix):
            return {"name": name, **p}
    return {}


def numeric_diff(after: Any, before: Any) -> Any:
    """after - before for every number in two nested dicts of the same shape."""
    if isinstance(after, dict):
        out = {k: numeric_diff(v, before.get(k) if isinstance(before, dict) else None) for k, v in after.items()}
        return {k: v for k, v in out.items() if v is not None}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - before if isinstance(before, (int, float)) and not isinstance(before, bool) else after
    return None


# ---------------------------------------------------------------------------
# 1. TTFT: one long-lived child process per LLM configuration, all alive at once
# ---------------------------------------------------------------------------

ENGINES = ("vllm", "kvtier", "example", "kvtier_pc", "kvtier_staged", "kvtier_layers")  # engine configurations (child processes)
# Timed cases -> the engine serving them. Each repetition runs every case once (round robin).
CASES = {"kvtier": "kvtier", "recompute": "vllm", "prefix_cache": "vllm", "example": "example",
         "kvtier_pc_evicted": "kvtier_pc", "kvtier_staged": "kvtier_staged", "kvtier_layers": "kvtier_layers"}
KVTIER_CASES = ("kvtier", "kvtier_pc_evicted", "kvtier_staged", "kvtier_layers")


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return _model_config(family=args.model, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                         layers=args.layers, intermediate=args.intermediate, vocab=args.vocab, dtype=args.dtype,
                         max_positions=args.prefix_tokens * 2, window=args.window)


def restore_bound_blocks(layout: dict[str, Any], hit_blocks: int) -> int:
    """The group blocks a hit of ``hit_blocks`` blocks needs: every block of a full group, the window's of a
    sliding one (vLLM's rule, integrations/adapter/groups.py)."""
    bs, total = layout["block_size"], 0
    for g in layout["groups"]:
        if g["kind"] == "full":
            total += hit_blocks
        else:
            skipped = max(0, hit_blocks * bs - g["window"] + 1) // bs
            total += hit_blocks - min(hit_blocks, skipped)
    return total


def child_main(spec: dict[str, Any]) -> int:
    """One LLM configuration, alive for the whole run: JSON commands on stdin, one tagged JSON line each on stdout."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    engine = spec["engine"]
    import cloudpickle
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    total = spec["prefix_tokens"] + spec["suffix_tokens"]
    bs = spec.get("block_size", BLOCK_SIZE)
    max_len = -(-(total + 8) // BLOCK_SIZE) * BLOCK_SIZE
    blocks_per_req = max_len // bs * spec.get("groups", 1)  # a hybrid model: every group's table (an upper bound)
    # 4 requests' worth: the prefix-cache engine keeps the prefix (LRU) while two salted recomputes
    # pass between two of its hits; the others need one request's worth. 1 MiB a block by default.
    kw: dict[str, Any] = model_kwargs(Path(spec["model_dir"])) | dict(
        max_model_len=max_len, max_num_batched_tokens=max_len, block_size=bs,
        num_gpu_blocks_override=blocks_per_req * 4 + 1, enforce_eager=True, seed=0, dtype=spec["dtype"],
        tensor_parallel_size=spec.get("tp", 1))
    # A generous timeout: an engine starting on a loaded 2-core machine once missed kvtierd's hello at 2 s,
    # ran its first requests without it (stored nothing) and so had nothing to restore.
    kvtier_cfg = {"kv_connector": "KvtierConnector", "kv_role": "kv_both",
                  "kv_connector_module_path": "kvtier.integrations.vllm",
                  "kv_connector_extra_config": {"socket": spec["socket"], "timeout_s": 10.0}}
    if engine == "vllm":
        kw["enable_prefix_caching"] = True
    elif engine == "kvtier":
        kw["enable_prefix_caching"] = False
        kw["kv_transfer_config"] = kvtier_cfg
    elif engine == "kvtier_pc":
        kw["enable_prefix_caching"] = True
        kw["kv_transfer_config"] = kvtier_cfg
    elif engine == "kvtier_staged":  # vLLM's KV tensors stay where vLLM put them; blocks go through an arena
        kw["enable_prefix_caching"] = False
        kw["kv_transfer_config"] = kvtier_cfg | {"kv_connector_extra_config": {
            **kvtier_cfg["kv_connector_extra_config"], "data_plane": "staged"}}
    elif engine == "kvtier_layers":  # the restore's later layers beside the forward
        kw["enable_prefix_caching"] = False
        kw["kv_transfer_config"] = kvtier_cfg | {"kv_connector_extra_config": {
            **kvtier_cfg["kv_connector_extra_config"], "layer_overlap": True}}
    elif engine == "example":
        kw["enable_prefix_caching"] = False
        kw["kv_transfer_config"] = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"shared_storage_path": spec["example_dir"]}}
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    connector = engine.startswith("kvtier")
    sched_events = Path(spec["workdir"]) / f"sched-events-{engine}.jsonl"  # see vllm_timing.scheduler_hook
    sched_events.touch()
    sched_file = open(sched_events)  # noqa: SIM115
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup_s = time.perf_counter() - t0
    cloudpickle.register_pickle_by_value(vllm_timing)  # the worker needs no import of bench/
    info = llm.collective_rpc(vllm_timing.install_trace, args=("kvtier" if connector else None,))[0]
    progress(f"{engine}: LLM started in {startup_s:.1f} s (engine core pid {info['pid']})")
    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False)

    def worker_stats() -> dict[str, Any] | None:
        return llm.collective_rpc(vllm_timing.kvtier_worker_stats)[0] if connector else None

    prefix, suffixes = spec["prefix"], spec["suffixes"]
    reply({"ready": True, "engine": engine, "startup_s": round(startup_s, 2), "trace": info,
           "engine_kwargs": {k: v for k, v in kw.items() if k != "model"}})

    def gen(cmd: dict[str, Any]) -> dict[str, Any]:
        """One request (``which``: warmup, first: the prefix once, rep ``i``), timed and cut at the time stamps."""
        which = cmd["which"]
        tokens = (spec["warmup"] if which == "warmup" else
                  prefix + (spec["warm_suffix"] if which == "first" else suffixes[cmd["i"]]))
        res: dict[str, Any] = {}
        if cmd.get("reset"):  # drop every block of vLLM's prefix cache (nothing runs now)
            res["reset_prefix_cache"] = bool(llm.reset_prefix_cache())
        before = worker_stats()
        llm.collective_rpc(_take_events)
        sched_file.read()
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if cmd.get("salt") is not None:
            prompt["cache_salt"] = cmd["salt"]
        t_submit = time.monotonic()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        t_done = time.monotonic()
        events = llm.collective_rpc(_take_events)[0]
        time.sleep(0.005)  # a lookup's done-callback may land just after
        events += [tuple(json.loads(x)) for x in sched_file.read().splitlines() if x]
        events.sort(key=lambda e: e[1])
        res |= {"ttft_s": round(t_done - t_submit, 5), "token": int(out.outputs[0].token_ids[0]),
                "cached_tokens": int(out.num_cached_tokens or 0),
                "breakdown": breakdown(t_submit, t_done, events),
                # every time stamp, ms after submit: [what, start, end, tokens / blocks / answer]
                "events_ms": [[e[0], round(1e3 * (e[1] - t_submit), 3),
                               round(1e3 * (e[2] - t_submit), 3) if isinstance(e[2], float) else None,
                               e[3] if e[0] != "new" else None] for e in events]}
        if before is not None:
            after = worker_stats()
            res["worker_delta"] = {k: round(after[k] - before[k], 6) for k in after}
        return res

    serve({"stats": lambda _cmd: {"worker": worker_stats()}, "gen": gen})
    reply({"bye": True})
    return 0


def start_engine(spec: dict[str, Any], log_path: Path) -> EngineProc:
    """One child (``--child SPEC``): a live LLM answering JSON commands (``vllm_engine.EngineProc``)."""
    name = spec.get("name", spec["engine"])
    spec_path = Path(spec["workdir"]) / f"spec-{name}.json"
    spec_path.write_text(json.dumps(spec))
    front: list[str] = []
    extra: dict[str, str] = {}
    if spec["engine"].startswith("kvtier"):
        hook, extra = vllm_timing.scheduler_hook(Path(spec["workdir"]) / "pyhook",
                                                 Path(spec["workdir"]) / f"sched-events-{spec['engine']}.jsonl")
        front.append(hook)
    return EngineProc(name, [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                      engine_env(spec["reserved_cpus"], front, extra, tp=int(spec.get("tp", 1))), log_path)


def ttft_section(args: argparse.Namespace, daemon: KvtierDaemon, workdir: Path, log_path: Path) -> dict[str, Any]:
    cfg = model_config(args)
    model_dir = workdir / "model"
    write_model(model_dir, cfg)  # answers that depend on the whole prefix's KV (vllm_engine.write_model)
    rng = random.Random(args.seed)
    vocab = args.vocab

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"--cases: unknown case {c!r}; known: {', '.join(CASES)}")
    engines = list(dict.fromkeys(CASES[c] for c in cases))  # in the order of --cases
    prefix = toks(args.prefix_tokens)
    base = {"workdir": str(workdir), "model_dir": str(model_dir), "dtype": args.dtype,
            "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens, "prefix": prefix,
            "warm_suffix": toks(args.suffix_tokens), "suffixes": [toks(args.suffix_tokens) for _ in range(args.reps)],
            "warmup": toks(256), "socket": daemon.endpoint, "reserved_cpus": args.reserved_cpus}
    example_dir = args.example_dir or Path(tempfile.mkdtemp(prefix="kvtier-bench-example-",
                                                             dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    base["example_dir"] = str(example_dir)
    layout = kv_layout(args.model, cfg)
    base |= {"block_size": layout["block_size"], "groups": len(layout["groups"])}
    kv_bytes_per_token = layout["kv_bytes_per_token"]
    hit_blocks = args.prefix_tokens // layout["block_size"]
    out: dict[str, Any] = {"family": args.model, "kv_layout": layout,
                           "restore_bound_blocks": restore_bound_blocks(layout, hit_blocks),
                           "all_groups_blocks": hit_blocks * len(layout["groups"]),
                           "model": cfg | {"parameters": parameters(cfg), "weights": WEIGHTS},
                           "kv_bytes_per_token": kv_bytes_per_token,
                           "prefix_kv_bytes": kv_bytes_per_token * args.prefix_tokens,
                           "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
                           "block_size": layout["block_size"], "reps": args.reps, "example_dir": str(example_dir),
                           "case_order": ("one engine alive at a time; its cases round robin" if args.schedule == "sequential"
                                          else "all engines alive; repetition i runs every case once, the order rotated by i"),
                           "engines": {}, "runs": {c: [] for c in cases}}
    progress(f"model: {parameters(cfg) / 1e6:.0f}M parameters, hidden {args.hidden}, {args.heads} heads, "
             f"{args.kv_heads} KV heads, {args.layers} layers, {args.dtype}; KV {kv_bytes_per_token} B/token, "
             f"prefix {out['prefix_kv_bytes'] / 2**20:.0f} MiB")
    groups = [[e] for e in engines] if args.schedule == "sequential" else [engines]
    out["schedule"] = args.schedule
    pool_before = pool_stats(daemon.stats(), "vllm/")
    out["load_average_before_reps"] = list(os.getloadavg())
    t_reps = time.perf_counter()
    out["rounds"] = args.rounds
    try:
        for r in range(args.rounds):
            # Odd rounds go in reverse: an engine's place in the run (drift, a warmer machine) is averaged out.
            for group in groups if r % 2 == 0 else groups[::-1]:
                _run_group(args, daemon, base, log_path, group, [c for c in cases if CASES[c] in group], out, r)
    finally:
        if args.example_dir is None:
            shutil.rmtree(example_dir, ignore_errors=True)
    out["reps_wall_s"] = round(time.perf_counter() - t_reps, 1)
    out["load_average_after_reps"] = list(os.getloadavg())
    pool_after = pool_stats(daemon.stats(), "vllm/")
    out["kvtierd_pool_after"] = pool_after
    out["kvtierd_pool_delta_reps"] = numeric_diff(pool_after, pool_before or {})
    if args.model == "mla":
        out["mla_tp_bytes"] = mla_tp_section(args, base, workdir, log_path)
    return out


def held_bytes(pool: dict[str, Any]) -> int:
    """What a pool of kvtierd holds: each block once, whatever its tier."""
    return int(pool.get("held_blocks", 0)) * int(pool.get("block_bytes", 0))


def mla_tp_section(args: argparse.Namespace, base: dict[str, Any], workdir: Path, log_path: Path) -> dict[str, Any]:
    """The same prompts through a kvtier engine at TP=1 and at TP=``--mla-tp``, each on a fresh kvtierd: its bytes."""
    out: dict[str, Any] = {"target": f"TP={args.mla_tp} bytes <= {TARGET_MLA_TP_BYTES} x TP=1 bytes"}
    for tp in (1, args.mla_tp):
        d = KvtierDaemon.start(workdir / f"kvtierd-tp{tp}", flags={"device": "cpu", "gpu_bytes": "64MiB",
                                                                  "cpu_bytes": "1GiB", "log_level": "warning"},
                               cwd=REPO)
        name = f"kvtier_tp{tp}"
        p = start_engine(base | {"engine": "kvtier", "name": name, "tp": tp, "socket": d.endpoint}, log_path)
        try:
            progress(f"starting engine {name!r} (TP={tp}) on a fresh kvtierd")
            p.recv(1200)
            for which, i in [("warmup", None), ("first", None)] + [("rep", i) for i in range(args.reps)]:
                cmd: dict[str, Any] = {"op": "gen", "which": which}
                if i is not None:
                    cmd["i"] = i
                if which == "warmup":
                    cmd["salt"] = "warmup"
                p.call(1800, **cmd)
            time.sleep(1.0)  # write-through stores run on the workers' background threads
            pools = {n: q for n, q in d.stats().get("pools", {}).items() if n.startswith("vllm/")}
            out[f"tp{tp}"] = {"pools": {n: {k: q.get(k) for k in ("held_blocks", "block_bytes", "stores", "sessions",
                                                                    "loads", "lookups")} for n, q in pools.items()},
                              "held_bytes": sum(held_bytes(q) for q in pools.values())}
            progress(f"{name}: kvtierd holds {out[f'tp{tp}']['held_bytes'] / 2**20:.1f} MiB in {sorted(pools)}")
        finally:
            out.setdefault("exit_codes", {})[name] = p.close()
            out.setdefault("kvtierd_exit_codes", {})[name] = d.stop()
    one, many = out["tp1"]["held_bytes"], out[f"tp{args.mla_tp}"]["held_bytes"]
    out["ratio"] = round(many / one, 4) if one else None
    out["met"] = bool(one) and many <= TARGET_MLA_TP_BYTES * one
    return out


def _run_group(args: argparse.Namespace, daemon: KvtierDaemon, base: dict[str, Any], log_path: Path,
               engines: list[str], cases: list[str], out: dict[str, Any], round_no: int = 0) -> None:
    """Start ``engines`` (alive together), compute the prefix once in each, run the repetitions of ``cases``, stop them."""
    procs: dict[str, EngineProc] = {}
    key = {n: n if round_no == 0 else f"{n}#{round_no + 1}" for n in engines}  # its record in out["engines"]
    try:
        # One after another (each engine's start-up picks a free port; starting them together could race),
        # each one's warm-up and first computation of the prefix queued as soon as it is up.
        for name in engines:
            progress(f"starting engine {name!r}")
            procs[name] = p = start_engine(base | {"engine": name}, log_path)
            ready = p.recv(900)
            out["engines"][key[name]] = {k: v for k, v in ready.items() if k != "ready"}
            p.send(op="gen", which="warmup", salt="warmup")  # kernels, first-touch memory
            p.send(op="gen", which="first")  # the prefix once: vLLM's prefix cache / kvtierd / example files
        for name, p in procs.items():
            w, first = p.recv(1800), p.recv(1800)
            out["engines"][key[name]] |= {"warmup": w, "first": first}
            progress(f"{name}: warm-up {w['ttft_s']:.2f} s, prefix computed once {first['ttft_s']:.2f} s "
                     f"(cached {first['cached_tokens']})")
        time.sleep(1.0)  # the write-through stores of the first request run on the worker's background thread
        for name, p in procs.items():
            if name.startswith("kvtier"):
                out["engines"][key[name]]["worker_before"] = p.call(60, op="stats")["worker"]
        out.setdefault("load_average_per_group", []).append({"engines": engines, "before": list(os.getloadavg())})
        for i in range(args.reps):
            k = i % len(cases)
            for case in cases[k:] + cases[:k]:
                p = procs[CASES[case]]
                cmd: dict[str, Any] = {"op": "gen", "which": "rep", "i": i}  # suffix i: the same prompts each round
                if case == "recompute":
                    cmd["salt"] = f"recompute-{i}-{time.time_ns()}"
                if case == "kvtier_pc_evicted":
                    cmd["reset"] = True
                d0 = daemon.stats() if case.startswith("kvtier") else None
                r = p.call(900, **cmd)
                if d0 is not None:
                    d = numeric_diff(pool_stats(daemon.stats(), "vllm/"), pool_stats(d0, "vllm/"))
                    r["kvtierd_delta"] = {k2: d.get(k2) for k2 in ("lookups", "looked_up_blocks", "hit_blocks_gpu",
                                                                   "hit_blocks_cpu", "loads", "bytes_load",
                                                                   "seconds_load", "stores")}
                r["load_average_1m"] = round(os.getloadavg()[0], 2)
                out["runs"][case].append(r)
                b = r["breakdown"]
                extra = ""
                if "load_ms" in b:
                    extra = (f" [arrival->answer {b.get('arrival_to_answer_ms', float('nan')):.1f} ms, "
                             f"load {b['load_ms']:.1f} ms, rest {b.get('rest_ms', float('nan')):.1f} ms]")
                progress(f"rep {i} {case}: {r['ttft_s'] * 1e3:.1f} ms (cached {r['cached_tokens']}, "
                         f"token {r['token']}){extra}")
        out["load_average_per_group"][-1]["after"] = list(os.getloadavg())
        for name, p in procs.items():
            if name.startswith("kvtier"):
                out["engines"][key[name]]["worker_after"] = p.call(60, op="stats")["worker"]
    finally:
        for name, p in procs.items():
            out["engines"].setdefault(key[name], {})["exit_code"] = p.close()


BREAKDOWN_KEYS = ("model_forward_ms", "forward_tokens", "arrival_to_answer_ms", "submit_to_on_new_request_ms", "lookup_round_trip_ms",
                  "on_new_request_to_answer_ms", "empty_steps_before_forward", "gnmt_calls", "gnmt_us_total",
                  "answer_to_load_start_ms", "load_ms", "load_blocks", "submit_to_forward_ms", "forward_step_ms",
                  "forward_without_load_ms", "after_forward_ms", "rest_ms", "submit_to_first_step_ms")


def summarize_ttft(t: dict[str, Any]) -> dict[str, Any]:
    runs = {k: v for k, v in t["runs"].items() if v}
    med = {name: statistics.median(r["ttft_s"] for r in rs) for name, rs in runs.items()}
    s: dict[str, Any] = {"median_ttft_s": {k: round(v, 4) for k, v in med.items()},
                         "min_ttft_s": {k: round(min(r["ttft_s"] for r in rs), 4) for k, rs in runs.items()},
                         "max_ttft_s": {k: round(max(r["ttft_s"] for r in rs), 4) for k, rs in runs.items()},
                         "cached_tokens": {k: [r["cached_tokens"] for r in rs] for k, rs in runs.items()},
                         "tokens": {k: [r["token"] for r in rs] for k, rs in runs.items()}}
    ref = runs.get("recompute")
    if ref:
        s["same_token_as_recompute"] = {k: [a["token"] == b["token"] for a, b in zip(rs, ref)]
                                        for k, rs in runs.items() if k != "recompute"}
        s["all_same_token_as_recompute"] = all(all(v) for v in s["same_token_as_recompute"].values())
    # Medians of each part of the TTFT, per case (keys a case's time stamps allow).
    s["median_breakdown_ms"] = {}
    for name, rs in runs.items():
        parts = {}
        for key in BREAKDOWN_KEYS:
            vals = [r["breakdown"][key] for r in rs if key in r.get("breakdown", {})]
            if vals:
                parts[key] = round(statistics.median(vals), 3)
        parts["ttft_ms"] = round(1e3 * med[name], 3)
        # The TTFT less the model's forward pass: what the case adds around the same computation. Engines
        # differ by a few ms in the forward itself (104.8 / 109.4 / 113.2 ms in one run for identical work),
        # which this takes out of the comparison.
        outside = [1e3 * r["ttft_s"] - r["breakdown"]["model_forward_ms"] for r in rs
                   if "model_forward_ms" in r.get("breakdown", {})]
        if outside:
            parts["outside_model_forward_ms"] = round(statistics.median(outside), 3)
        s["median_breakdown_ms"][name] = parts
    for name in KVTIER_CASES:
        if name in runs and all("worker_delta" in r for r in runs[name]):
            ws = [r["worker_delta"] for r in runs[name]]
            s.setdefault("connector_load_worker", {})[name] = {
                "blocks_loaded_per_request": [w["blocks_loaded"] for w in ws],
                "load_ms_median": round(1e3 * statistics.median(w["load_s"] for w in ws), 3),
                "load_ms_per_request": [round(1e3 * w["load_s"], 3) for w in ws]}
            # A restore that fails is a miss, not an error: vLLM recomputes the blocks after the step (the
            # token stays right, num_cached_tokens still counts them), so the TTFT measures a recompute.
            want = t.get("restore_bound_blocks", t["prefix_tokens"] // t["block_size"])
            if t.get("family") != "mla":  # vLLM's CPU MLA takes no prefix: nothing is restored
                s.setdefault("restored_every_block", {})[name] = all(w["blocks_loaded"] == want for w in ws)
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    for mine in KVTIER_CASES:
        if mine not in med:
            continue
        for other, target, op in (("recompute", TARGET_VS_RECOMPUTE, "<="),
                                  ("prefix_cache", TARGET_VS_PREFIX_CACHE, "<="), ("example", TARGET_VS_EXAMPLE, "<")):
            if other in med:
                r = med[mine] / med[other]
                ratios[f"{mine}/{other}"] = round(r, 4)
                if mine == "kvtier":
                    targets[f"kvtier/{other}"] = {"target": f"{op} {target}",
                                                  "met": r <= target if op == "<=" else r < target}
    # The same ratios per repetition (the cases of one repetition ran back to back).
    if "kvtier" in runs:
        for other in ("recompute", "prefix_cache", "example"):
            if other in runs:
                per = [a["ttft_s"] / b["ttft_s"] for a, b in zip(runs["kvtier"], runs[other])]
                ratios[f"kvtier/{other}_per_rep"] = [round(x, 3) for x in per]
                ratios[f"kvtier/{other}_median_of_per_rep"] = round(statistics.median(per), 4)
    # Bytes: restored per hit (kvtierd's loads, in blocks of one group), held per cached token.
    pool = t.get("kvtierd_pool_after") or {}
    block_bytes = int(pool.get("block_bytes", 0))
    restored: dict[str, Any] = {}
    for name in KVTIER_CASES:
        loads = [r.get("kvtierd_delta", {}).get("loads") for r in runs.get(name, [])]
        loads = [x for x in loads if x is not None]
        if loads:
            restored[name] = {"blocks_per_hit": loads, "bytes_per_hit_median": int(statistics.median(loads)) * block_bytes}
    s["restored"] = restored
    s["restore_bound_blocks"] = t.get("restore_bound_blocks")
    s["all_groups_blocks"] = t.get("all_groups_blocks")
    # The full blocks the kvtier engines stored: the prefix, the warm-up, and the suffixes' full blocks
    # (none at 128 tokens a block; MLA's blocks are 16). Each repetition's suffix is the same every round.
    bs = t["block_size"]
    stored_tokens = t["prefix_tokens"] + WARMUP_TOKENS + t["suffix_tokens"] // bs * bs * (1 + t["reps"])
    if block_bytes:
        s["held_bytes"] = held_bytes(pool)
        s["held_bytes_per_cached_token"] = round(held_bytes(pool) / stored_tokens, 1)
    family = t.get("family", "llama")
    if family == "gemma3" and "kvtier_pc_evicted" in restored or family == "gemma3" and "kvtier" in restored:
        worst = max(max(v["blocks_per_hit"]) for v in restored.values())
        targets["restored_blocks_per_hit"] = {"target": f"<= {t['restore_bound_blocks']} (full layers' blocks + the "
                                                        "windows' of the sliding layers)",
                                              "met": worst <= t["restore_bound_blocks"]}
    if family == "mla":
        # vLLM's CPU build cannot serve MLA from a prefix (prefix caching and chunked prefill off): every case
        # recomputes, so the TTFT ratios are no restore's.
        for k in list(targets):
            targets[k] = {"target": "n/a: vLLM's CPU build serves MLA from no prefix", "met": None}
        mla = t.get("mla_tp_bytes")
        if mla:
            targets["mla_tp_bytes"] = {"target": mla["target"], "met": mla["met"], "ratio": mla["ratio"]}
    s["ratios"] = ratios
    s["targets"] = targets
    return s


# ---------------------------------------------------------------------------
# 2. The scheduler half's cost per call
# ---------------------------------------------------------------------------

def sched_section(args: argparse.Namespace, daemon: KvtierDaemon) -> dict[str, Any]:
    from kvtier.client.client import Client, PoolLayout
    from kvtier.client.hashing import BlockHasher
    from kvtier.integrations.vllm.keys import RequestKeys
    from kvtier.integrations.vllm.pool import PoolChoice
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.settings import ConnectorSettings

    bs = BLOCK_SIZE
    # A small block (1 layer, 1 KV head of 8): a lookup's cost does not depend on the block's bytes,
    # and 64 distinct prompts x 32 blocks are stored inline in a moment.
    layout = PoolLayout(model="bench-vllm-sched", block_size=bs, block_bytes=bs * 2 * 1 * 8 * 2, dtype="bfloat16",
                        num_layers=1, kv_heads=1, head_dim=8, mode="store")
    pool = PoolChoice.single("bench/vllm-sched/b128", layout, ("layer0",), bs)
    settings = ConnectorSettings.from_extra_config({"socket": daemon.endpoint})
    hasher = BlockHasher(bs, settings.hash_algo)
    ns = [int(x) for x in args.sched_reqs.split(",")]
    rng = random.Random(args.seed + 1)
    nmax = max(ns)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.sched_prompt_tokens)] for _ in range(nmax)]
    max_blocks = (args.sched_prompt_tokens - 1) // bs
    client = Client(daemon.endpoint, pool.name, layout, client_name="bench")
    for i, toks in enumerate(prompts):
        keys = RequestKeys(hasher, FakeRequest(f"store-{i}", toks)).upto(max_blocks)
        client.store(keys, bytes(len(keys) * layout.block_bytes))
    progress(f"sched: stored {nmax} prompts x {max_blocks} blocks")
    sched = SchedulerSide(settings, pool)
    step_s = args.step_ms / 1e3
    seq = iter(range(10**9))

    def trial(n: int) -> dict[str, Any]:
        reqs = [FakeRequest(f"r{next(seq)}", prompts[i]) for i in range(n)]
        calls0, calls_s0, waited0 = sched.calls, sched.calls_s, sched.waited_s
        t_start = time.perf_counter()
        new_s = 0.0
        for r in reqs:
            t = time.perf_counter()
            sched.on_new_request(r)
            new_s += time.perf_counter() - t
        waiting = list(reqs)
        answers: dict[str, int] = {}
        steps = 0
        while waiting:
            steps += 1
            sched.begin_step()  # what vLLM's build_connector_meta does at the end of each step
            still = []
            for r in waiting:
                got, _ = sched.get_num_new_matched_tokens(r, 0)
                if got is None:
                    still.append(r)
                else:
                    answers[r.request_id] = got
            waiting = still
            if waiting:
                time.sleep(step_s)
        wall = time.perf_counter() - t_start
        calls, calls_s, waited_s = sched.calls - calls0, sched.calls_s - calls_s0, sched.waited_s - waited0
        for r in reqs:
            sched.request_finished(r)  # unpins on the background thread
        sched._jobs.wait_idle(10)
        want = max_blocks * bs
        return {"n": n, "calls": calls, "gnmt_s": calls_s, "waited_s": waited_s, "on_new_s": new_s, "steps": steps,
                "wall_s": wall,
                "all_hit": all(v == want for v in answers.values())}

    def sync_trial(n: int) -> dict[str, Any]:
        reqs = [FakeRequest(f"s{next(seq)}", prompts[i]) for i in range(n)]
        t0 = time.perf_counter()
        hits = []
        pinned = []
        hash_s = 0.0
        for r in reqs:
            th = time.perf_counter()
            keys = RequestKeys(hasher, r).upto((r.num_tokens - 1) // bs)
            hash_s += time.perf_counter() - th
            tiers = client.lookup(keys, pin=True)
            hits.append(len(tiers) == len(keys))
            pinned.append(keys[: len(tiers)])
        wall = time.perf_counter() - t0
        for keys in pinned:
            client.unpin(keys)
        return {"n": n, "wall_s": wall, "hash_s": hash_s, "all_hit": all(hits)}

    out: dict[str, Any] = {"prompt_tokens": args.sched_prompt_tokens, "blocks_per_lookup": max_blocks,
                           "step_ms": args.step_ms, "trials": args.sched_trials, "pool_layout": layout.to_wire(),
                           "results": {}}
    try:
        for _ in range(3):  # connect, warm up
            trial(nmax)
            sync_trial(nmax)
        for n in ns:
            tr = [trial(n) for _ in range(args.sched_trials)]
            sy = [sync_trial(n) for _ in range(args.sched_trials)]
            calls = sum(t["calls"] for t in tr)
            sched_s = sum(t["gnmt_s"] + t["on_new_s"] for t in tr)
            reqs = n * len(tr)
            res = {
                "n": n,
                "calls_per_request": round(calls / reqs, 3),
                "steps_median": statistics.median(t["steps"] for t in tr),
                "us_per_call_amortized": round(1e6 * sched_s / calls, 3),
                "us_per_call_gnmt_only": round(1e6 * sum(t["gnmt_s"] for t in tr) / calls, 3),
                # Of that, the first asks' bounded wait for the lookup (lookup_wait_ms, idle engine only):
                # it replaces an empty engine step, so it is scheduler time not spent stepping.
                "us_per_call_waiting_for_lookups": round(1e6 * sum(t["waited_s"] for t in tr) / calls, 3),
                "us_per_call_excluding_waits": round(1e6 * (sched_s - sum(t["waited_s"] for t in tr)) / calls, 3),
                "us_on_new_request_per_request": round(1e6 * sum(t["on_new_s"] for t in tr) / reqs, 3),
                "us_scheduler_thread_per_request": round(1e6 * sched_s / reqs, 3),
                "ms_wall_until_all_answered_median": round(1e3 * statistics.median(t["wall_s"] for t in tr), 3),
                "all_hit": all(t["all_hit"] for t in tr),
                "sync_us_per_request": round(1e6 * sum(t["wall_s"] for t in sy) / reqs, 3),
                "sync_us_hashing_per_request": round(1e6 * sum(t["hash_s"] for t in sy) / reqs, 3),
                "sync_ms_wall_all_n_median": round(1e3 * statistics.median(t["wall_s"] for t in sy), 3),
                "sync_all_hit": all(t["all_hit"] for t in sy),
            }
            res["sync_over_async_scheduler_thread_per_request"] = round(
                res["sync_us_per_request"] / res["us_scheduler_thread_per_request"], 2)
            out["results"][str(n)] = res
            progress(f"sched N={n}: {res['us_per_call_amortized']:.1f} us/call amortized "
                     f"({res['calls_per_request']:.1f} calls/request), {res['us_scheduler_thread_per_request']:.1f} "
                     f"us/request; all answered in {res['ms_wall_until_all_answered_median']:.2f} ms; "
                     f"sync {res['sync_us_per_request']:.1f} us/request")
    finally:
        sched.close()
        client.close()
    big = out["results"].get("64")
    if big is not None:
        out["target"] = {"us_per_call_amortized_64_waiting": f"<= {TARGET_SCHED_US}",
                         "met": big["us_per_call_amortized"] <= TARGET_SCHED_US}
    return out


# ---------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                           "cpu_count": os.cpu_count(), "machine": platform.machine(),
                           "load_average": list(os.getloadavg())}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for mod in ("vllm", "torch"):
        try:
            from importlib.metadata import version

            env[mod] = version(mod if mod != "vllm" else "vllm-cpu")
        except Exception:  # noqa: BLE001
            try:
                env[mod] = version(mod)
            except Exception:  # noqa: BLE001
                env[mod] = None
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                           check=False).stdout.strip()
    except OSError:
        pass
    return env


def print_tables(report: dict[str, Any]) -> None:
    t = report.get("ttft")
    if t and "summary" in t:
        s = t["summary"]
        med = s["median_ttft_s"]
        names = {"kvtier": "a. KvtierConnector (prefix caching off)", "recompute": "b. recompute (no connector, salted)",
                 "prefix_cache": "c. vLLM prefix cache", "example": "d. ExampleConnector (prefix caching off)",
                 "kvtier_pc_evicted": "e. KvtierConnector, prefix caching on, prefix evicted",
                 "kvtier_staged": "f. KvtierConnector, staged data plane (prefix caching off)",
                 "kvtier_layers": "g. KvtierConnector, layers restored beside the forward (prefix caching off)"}
        print(f"\nTTFT (generate, max_tokens=1), {t['prefix_tokens']}-token prefix + {t['suffix_tokens']} new tokens, "
              f"median of {t['reps']} x {t.get('rounds', 1)} round(s) ({t.get('case_order', 'round robin, all engines alive')}); {t['model']['parameters'] / 1e6:.0f}M-parameter "
              f"random {t.get('family', 'llama')}, {t['model']['torch_dtype']}, prefix KV {t['prefix_kv_bytes'] / 2**20:.0f} MiB; "
              f"load average {t['load_average_before_reps'][0]:.1f} -> {t['load_average_after_reps'][0]:.1f}")
        print("| case | TTFT median | min - max | forward step | cached tokens | same token as recompute |")
        print("|---|---:|---:|---:|---|---|")
        for k in names:
            if k in med:
                same = s.get("same_token_as_recompute", {}).get(k)
                same_s = "-" if k == "recompute" else (f"{sum(same)}/{len(same)}" if same else "?")
                fw = s["median_breakdown_ms"][k].get("forward_step_ms")
                print(f"| {names[k]} | {med[k] * 1e3:.1f} ms | {s['min_ttft_s'][k] * 1e3:.0f} - "
                      f"{s['max_ttft_s'][k] * 1e3:.0f} ms | {fw if fw is not None else float('nan'):.1f} ms | "
                      f"{sorted(set(s['cached_tokens'][k]))} | {same_s} |")
        for name, r in s["ratios"].items():
            if name in s["targets"]:
                tg = s["targets"][name]
                verdict = "n/a" if tg["met"] is None else ("met" if tg["met"] else "NOT met")
                print(f"{name}: {r:.3f}x (target {tg['target']}: {verdict}; median of the "
                      f"per-repetition ratios {s['ratios'].get(name + '_median_of_per_rep', float('nan')):.3f})")
            elif not name.endswith("per_rep"):
                print(f"{name}: {r:.3f}x (for information)")
        for k, ok in s.get("restored_every_block", {}).items():
            if not ok:
                print(f"WARNING {k}: the connector did not restore every prefix block in every repetition "
                      f"(worker blocks_loaded {s['connector_load_worker'][k]['blocks_loaded_per_request']}): "
                      f"vLLM recomputed them, its TTFT is not a restore's; see kvtierd's log / --log")
        for k in KVTIER_CASES:
            b = s["median_breakdown_ms"].get(k)
            if b and "load_ms" in b:
                print(f"{k} TTFT {b['ttft_ms']:.1f} ms (medians): arrival -> lookup answer "
                      f"{b.get('arrival_to_answer_ms', float('nan')):.1f} ms (submit -> on_new_request "
                      f"{b.get('submit_to_on_new_request_ms', float('nan')):.1f}, lookup round trip "
                      f"{b.get('lookup_round_trip_ms', float('nan')):.1f}, {b.get('empty_steps_before_forward', 0):.0f} "
                      f"empty step(s)), load {b['load_ms']:.1f} ms ({b.get('load_blocks', 0):.0f} blocks), rest "
                      f"{b.get('rest_ms', float('nan')):.1f} ms (answer -> load {b.get('answer_to_load_start_ms', float('nan')):.1f}, "
                      f"forward without load {b.get('forward_without_load_ms', float('nan')):.1f}, after forward "
                      f"{b.get('after_forward_ms', float('nan')):.1f})")
        for k, r in s.get("restored", {}).items():
            print(f"{k}: restored per hit {r['bytes_per_hit_median'] / 2**20:.2f} MiB ({sorted(set(r['blocks_per_hit']))} "
                  f"blocks of one KV-cache group; a hit's bound {s['restore_bound_blocks']}, all groups' blocks "
                  f"{s['all_groups_blocks']})")
        if "held_bytes_per_cached_token" in s:
            print(f"kvtierd holds {s['held_bytes'] / 2**20:.1f} MiB: {s['held_bytes_per_cached_token']:.0f} bytes per "
                  f"cached token (the model's KV: {t['kv_bytes_per_token']} bytes a token)")
        for name, tg in s["targets"].items():
            if not name.startswith("kvtier/"):
                print(f"{name}: target {tg['target']}: "
                      f"{'met' if tg['met'] else ('n/a' if tg['met'] is None else 'NOT met')}"
                      + (f" (ratio {tg['ratio']})" if "ratio" in tg else ""))
        mla = t.get("mla_tp_bytes")
        if mla:
            print("MLA one copy: kvtierd bytes " + ", ".join(f"{k} {v['held_bytes'] / 2**20:.2f} MiB"
                                                             for k, v in mla.items() if k.startswith("tp")))
        outside = {k: b["outside_model_forward_ms"] for k, b in s["median_breakdown_ms"].items()
                   if "outside_model_forward_ms" in b}
        if outside:
            print("TTFT less the model's forward pass (medians; what each case adds around the same computation): "
                  + ", ".join(f"{k} {v:.1f} ms" for k, v in outside.items()))
        for k in ("prefix_cache", "example", "recompute"):
            b = s["median_breakdown_ms"].get(k)
            if b and "forward_step_ms" in b:
                print(f"{k} TTFT {b['ttft_ms']:.1f} ms (medians): submit -> forward {b['submit_to_forward_ms']:.1f} ms, "
                      f"forward step {b['forward_step_ms']:.1f} ms, after forward {b['after_forward_ms']:.1f} ms")
    sc = report.get("scheduler")
    if sc:
        print(f"\nScheduler half (SchedulerSide against kvtierd; {sc['blocks_per_lookup']}-block lookups, all hits, "
              f"steps {sc['step_ms']} ms apart, {sc['trials']} trials)")
        print("| waiting | us/call amortized | calls/request | us/request (sched thread) | "
              "all answered after | sync lookup us/request |")
        print("|---:|---:|---:|---:|---:|---:|")
        for n, r in sc["results"].items():
            print(f"| {n} | {r['us_per_call_amortized']:.1f} | {r['calls_per_request']:.1f} | "
                  f"{r['us_scheduler_thread_per_request']:.1f} | {r['ms_wall_until_all_answered_median']:.2f} ms | "
                  f"{r['sync_us_per_request']:.1f} |")
        if "target" in sc:
            print(f"64 waiting: target {sc['target']['us_per_call_amortized_64_waiting']} us/call amortized: "
                  f"{'met' if sc['target']['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return child_main(json.loads(Path(args.child).read_text()))
    if args.layers is None:
        args.layers = 6 if args.model == "gemma3" else 4
    if args.model == "gemma3" and args.layers % 6:
        raise SystemExit("--layers: gemma3's pattern is 5 sliding-window layers to 1 full: a multiple of 6")
    if args.prefix_tokens % BLOCK_SIZE or not 0 < args.suffix_tokens < BLOCK_SIZE:
        raise SystemExit(f"--prefix-tokens must be a multiple of {BLOCK_SIZE} and --suffix-tokens in (0, {BLOCK_SIZE})")
    report: dict[str, Any] = {"kind": "vllm", "date": _dt.datetime.now().isoformat(timespec="seconds"),
                              "environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))  # 0700; the daemon's socket and log
    log_path = args.log or Path(tempfile.gettempdir()) / "kvtier-bench-vllm.log"
    log_path.write_text("")
    # cwd: the repository, wherever the bench is run from.
    daemon = KvtierDaemon.start(workdir, flags={"device": "cpu", "gpu_bytes": args.kvtierd_gpu_bytes, "cpu_bytes": "1GiB",
                                                "log_level": "warning"}, cwd=REPO)
    report["kvtierd"] = {"argv": daemon.argv[2:]}
    progress(f"kvtierd pid {daemon.pid} on {daemon.endpoint}; vLLM logs in {log_path}")
    t_start = time.perf_counter()
    try:
        if not args.skip_sched:
            report["scheduler"] = sched_section(args, daemon)
        if not args.skip_ttft:
            t = ttft_section(args, daemon, workdir, log_path)
            t["summary"] = summarize_ttft(t)
            report["ttft"] = t
    finally:
        rc = daemon.stop()
        report["kvtierd"]["exit_code"] = rc
        shutil.rmtree(workdir, ignore_errors=True)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    report["environment"]["load_average_end"] = list(os.getloadavg())
    print_tables(report)
    print(f"kvtierd exited with {rc}; bench wall time {report['wall_s']:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
