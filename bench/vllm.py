#!/usr/bin/env python3
"""kvtier under vLLM: TTFT of a restored prefix, and the scheduler half's cost per call, in one run.

Usage:
    python bench/vllm.py [--prefix-tokens 4096] [--reps 5] [--json PATH] [--skip-ttft] [--skip-sched]

Everything runs on this machine, in one run: the bench starts one kvtierd
(``python -m kvtier.daemon --socket ipc://...``, store mode) and stops it at
the end (SIGTERM, exit status checked).

1. TTFT (time of ``llm.generate`` with ``max_tokens=1``) of a prompt made of a
   long shared prefix (default 4,096 tokens) and a short unique suffix (32
   tokens), on a random-weight Llama (``load_format="dummy"``; default hidden
   1024, 8 heads of 128, 2 KV heads (GQA), 4 layers, float32: prefill is expensive
   on this CPU, the KV per token small; bfloat16 runs 4-25x slower on a CPU without
   AVX-512 BF16, as this one: 72 s for the prefix, 7.5 s for a prefix-cache hit). Cases:

   a. ``kvtier``: vLLM with ``KvtierConnector`` and ``enable_prefix_caching=False``.
      The prefix was computed once by an earlier request (whose full blocks
      the connector stored into kvtierd, write-through); with vLLM's own cache
      off, every repetition's prefix comes from kvtierd (restored into vLLM's
      KV tensors, registered in place). Prefix caching off is the fair way to
      force this: it is the state of a prefix vLLM evicted (or never had: another
      engine or a restart), without adding the eviction traffic of filler requests
      to the timed requests; vLLM's prefix-cache bookkeeping on a miss costs
      nothing worth counting next to a prefill.
   b. ``recompute``: no connector; every repetition's prompt carries a unique
      ``cache_salt``, so no block hits and the whole prompt is prefilled.
   c. ``prefix cache``: the same engine as (b) (prefix caching on), the same
      prompt without a salt: the prefix (computed once before) is a hit in
      vLLM's own prefix cache. (b) and (c) alternate in each repetition.
   d. ``ExampleConnector``: vLLM's example connector (safetensors files, one per
      layer, under ``--example-dir``, default a fresh directory in /dev/shm)
      with prefix caching off, after one request stored the prefix.

   Each configuration is one ``LLM`` started once in a child process of the
   bench (which prints its numbers as JSON and exits, engine processes and
   all, before the next starts); every case sees the same prompts. Reported:
   median TTFT over ``--reps`` repetitions (each a different suffix), the
   tokens vLLM counts as cached, whether the greedy token of every repetition
   equals the recompute's, and for (a) the connector's own load time (the
   worker half's ``load_s``, read through ``collective_rpc``) and kvtierd's
   copy statistics. Ratios: kvtier / recompute (target <= 0.2), kvtier /
   prefix cache (target <= 1.2), kvtier / ExampleConnector (target < 1).

2. The scheduler half's cost (``SchedulerSide``, built directly, no engine)
   against the same kvtierd, on fake requests (``--sched-prompt-tokens``,
   default 4,128 tokens: 32 full blocks of 128, all pre-stored inline so
   every lookup hits). One trial: ``on_new_request`` for N requests, then
   "steps" (``--step-ms`` apart, standing in for the forward) in which every
   still-waiting request gets ``get_num_new_matched_tokens`` until all are
   answered. Scheduler-thread time = time in ``on_new_request`` + in
   ``get_num_new_matched_tokens``; reported per call (amortized: divided by
   the calls) and per request, and the wall time until all N are answered,
   for N = 1 and 64. Beside it, a synchronous design: one blocking
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
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# This file is bench/vllm.py: as a script, its folder is sys.path[0], where "vllm" would be this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

TARGET_VS_RECOMPUTE = 0.2  # kvtier TTFT / recompute TTFT, at most
TARGET_VS_PREFIX_CACHE = 1.2  # kvtier TTFT / vLLM prefix-cache TTFT, at most
TARGET_VS_EXAMPLE = 1.0  # kvtier TTFT / ExampleConnector TTFT, below
TARGET_SCHED_US = 50.0  # scheduler-thread us per get_num_new_matched_tokens call, amortized, 64 waiting
RESULT_TAG = "@@BENCH-RESULT@@ "
BLOCK_SIZE = 128  # vLLM's CPU backend wants a multiple of 32


def progress(msg: str) -> None:
    sys.stderr.write(f"[bench] {msg}\n")
    sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--prefix-tokens", type=int, default=4096, help="shared prefix, a multiple of 128 (default 4096)")
    p.add_argument("--suffix-tokens", type=int, default=32, help="unique suffix per repetition, < 128 (default 32)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per case (default 5)")
    p.add_argument("--hidden", type=int, default=1024, help="model hidden size (default 1024)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8: head_dim 128)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default 2.75 x hidden)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192)")
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32", "float16"),
                   help="model dtype (default float32: on a CPU without AVX-512 BF16, as here, vLLM runs bfloat16 4-25x slower)")
    p.add_argument("--cases", default="vllm,kvtier,example",
                   help="configurations to run, comma-separated: vllm (recompute + prefix cache), kvtier, example")
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
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one LLM configuration, JSON in
    return p


# ---------------------------------------------------------------------------
# kvtierd
# ---------------------------------------------------------------------------

class Daemon:
    def __init__(self, workdir: Path, *, gpu_bytes: str, cpu_bytes: str) -> None:
        self.endpoint = f"ipc://{workdir}/kvtierd.sock"
        self.log_path = workdir / "kvtierd.log"
        self.argv = [sys.executable, "-m", "kvtier.daemon", "--socket", self.endpoint, "--device", "cpu",
                     "--gpu-bytes", gpu_bytes, "--cpu-bytes", cpu_bytes, "--log-level", "warning"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        from kvtier.client.client import KvtierTimeout, probe_health

        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") and k != "NOTIFY_SOCKET"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=REPO)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                probe_health(self.endpoint, timeout_s=0.2)
                return self
            except KvtierTimeout:
                if time.monotonic() > deadline:
                    raise RuntimeError("kvtierd did not answer health in 60 s") from None

    def stats(self) -> dict[str, Any]:
        from kvtier.client.admin import request

        return request(self.endpoint, "stats", timeout_s=5.0)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


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
# 1. TTFT: one child process per LLM configuration
# ---------------------------------------------------------------------------

def model_config(args: argparse.Namespace) -> dict[str, Any]:
    inter = args.intermediate or int(round(args.hidden * 2.75 / 256)) * 256
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.hidden,
            "intermediate_size": inter, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab,
            "max_position_embeddings": max(8192, args.prefix_tokens * 2), "rms_norm_eps": 1e-5,
            "torch_dtype": args.dtype, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def parameters(cfg: dict[str, Any]) -> int:
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return L * per_layer + 2 * v * h + h


def _worker_load_stats(worker: Any) -> dict[str, Any]:  # runs in vLLM's worker process (collective_rpc)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    return {"blocks_loaded": side.blocks_loaded, "blocks_stored": side.blocks_stored, "load_s": side.load_s}


def child_main(spec: dict[str, Any]) -> int:
    """One LLM configuration: warm up, compute the prefix once, time the repetitions; JSON on stdout."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    case = spec["case"]
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    total = spec["prefix_tokens"] + spec["suffix_tokens"]
    max_len = -(-(total + 8) // BLOCK_SIZE) * BLOCK_SIZE
    blocks_per_req = max_len // BLOCK_SIZE
    kw: dict[str, Any] = dict(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True,
                              max_model_len=max_len, max_num_batched_tokens=max_len, block_size=BLOCK_SIZE,
                              num_gpu_blocks_override=blocks_per_req * (spec["reps"] + 4), enforce_eager=True,
                              seed=0, dtype=spec["dtype"])
    if case == "vllm":
        kw["enable_prefix_caching"] = True
    elif case == "kvtier":
        kw["enable_prefix_caching"] = False
        kw["kv_transfer_config"] = {"kv_connector": "KvtierConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvtier.integrations.vllm",
                                    "kv_connector_extra_config": {"socket": spec["socket"]}}
    elif case == "example":
        kw["enable_prefix_caching"] = False
        kw["kv_transfer_config"] = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"shared_storage_path": spec["example_dir"]}}
    else:
        raise SystemExit(f"unknown case {case!r}")
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup_s = time.perf_counter() - t0
    progress(f"{case}: LLM started in {startup_s:.1f} s")
    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False)

    def gen(tokens: list[int], salt: str | None = None) -> dict[str, Any]:
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salt is not None:
            prompt["cache_salt"] = salt
        t = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t
        return {"ttft_s": round(dt, 5), "token": int(out.outputs[0].token_ids[0]),
                "cached_tokens": int(out.num_cached_tokens or 0)}

    prefix, suffixes, warm = spec["prefix"], spec["suffixes"], spec["warm_suffix"]
    res: dict[str, Any] = {"case": case, "startup_s": round(startup_s, 2), "engine_kwargs": {
        k: v for k, v in kw.items() if k not in ("model",)}}
    w = gen(spec["warmup"], salt="warmup")  # kernels, first-touch memory
    progress(f"{case}: warm-up ({len(spec['warmup'])} tokens) {w['ttft_s']:.2f} s")
    first = gen(prefix + warm)  # computes the prefix once (prefix cache / kvtierd / example storage)
    res["first"] = first
    progress(f"{case}: prefix computed once: {first['ttft_s']:.2f} s (cached {first['cached_tokens']})")
    if case == "kvtier":
        time.sleep(1.0)  # the write-through stores of that request run on the worker's background thread
        try:
            res["worker_before"] = llm.collective_rpc(_worker_load_stats)[0]
        except Exception as exc:  # noqa: BLE001
            res["worker_rpc_error"] = f"{type(exc).__name__}: {exc}"
    runs: dict[str, list[dict[str, Any]]] = {}
    for i, sfx in enumerate(suffixes):
        if case == "vllm":
            rc = gen(prefix + sfx, salt=f"recompute-{i}-{time.time_ns()}")
            pc = gen(prefix + sfx)
            runs.setdefault("recompute", []).append(rc)
            runs.setdefault("prefix_cache", []).append(pc)
            progress(f"vllm rep {i}: recompute {rc['ttft_s']:.3f} s (cached {rc['cached_tokens']}, token {rc['token']}) "
                     f"| prefix cache {pc['ttft_s']:.3f} s (cached {pc['cached_tokens']}, token {pc['token']})")
        else:
            r = gen(prefix + sfx)
            runs.setdefault(case, []).append(r)
            progress(f"{case} rep {i}: {r['ttft_s']:.3f} s (cached {r['cached_tokens']}, token {r['token']})")
    res["runs"] = runs
    if case == "kvtier" and "worker_before" in res:
        after = llm.collective_rpc(_worker_load_stats)[0]
        res["worker_after"] = after
        b = res["worker_before"]
        res["worker_reps"] = {k: after[k] - b[k] for k in after}
    del llm
    gc.collect()
    sys.stdout.write(RESULT_TAG + json.dumps(res) + "\n")
    sys.stdout.flush()
    return 0


def run_child(spec: dict[str, Any], log_path: Path, timeout_s: float = 600) -> dict[str, Any]:
    spec_path = Path(spec["workdir"]) / f"spec-{spec['case']}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)]
    result: dict[str, Any] | None = None
    with open(log_path, "a") as log:
        log.write(f"\n===== {spec['case']}: {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if line.startswith(RESULT_TAG):
                    result = json.loads(line[len(RESULT_TAG):])
                elif line.startswith("[bench]"):
                    sys.stderr.write(line)
                    sys.stderr.flush()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{spec['case']}: no result in {timeout_s} s")
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            try:  # whatever of its engine is left (its own process group only)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if result is None:
        raise RuntimeError(f"{spec['case']}: the child exited with {rc} and no result; see {log_path}")
    result["child_exit_code"] = rc
    return result


def ttft_section(args: argparse.Namespace, daemon: Daemon, workdir: Path, log_path: Path) -> dict[str, Any]:
    cfg = model_config(args)
    model_dir = workdir / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    rng = random.Random(args.seed)
    vocab = args.vocab

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = toks(args.prefix_tokens)
    base = {"workdir": str(workdir), "model_dir": str(model_dir), "dtype": args.dtype, "reps": args.reps,
            "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens, "prefix": prefix,
            "warm_suffix": toks(args.suffix_tokens), "suffixes": [toks(args.suffix_tokens) for _ in range(args.reps)],
            "warmup": toks(256), "socket": daemon.endpoint}
    example_dir = args.example_dir or Path(tempfile.mkdtemp(prefix="kvtier-bench-example-",
                                                             dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    base["example_dir"] = str(example_dir)
    hd = args.hidden // args.heads
    kv_bytes_per_token = args.layers * 2 * args.kv_heads * hd * (4 if args.dtype == "float32" else 2)
    out: dict[str, Any] = {"model": cfg | {"parameters": parameters(cfg), "weights": "load_format=dummy (random)"},
                           "kv_bytes_per_token": kv_bytes_per_token,
                           "prefix_kv_bytes": kv_bytes_per_token * args.prefix_tokens,
                           "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
                           "block_size": BLOCK_SIZE, "reps": args.reps, "example_dir": str(example_dir),
                           "cases": {}}
    progress(f"model: {parameters(cfg) / 1e6:.0f}M parameters, hidden {args.hidden}, {args.heads} heads, "
             f"{args.kv_heads} KV heads, {args.layers} layers, {args.dtype}; KV {kv_bytes_per_token} B/token, "
             f"prefix {out['prefix_kv_bytes'] / 2**20:.0f} MiB")
    try:
        for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
            before = pool_stats(daemon.stats(), "vllm/") if case == "kvtier" else None
            progress(f"starting configuration {case!r}")
            res = run_child(base | {"case": case}, log_path)
            if case == "kvtier":
                after = pool_stats(daemon.stats(), "vllm/")
                res["kvtierd_pool_after"] = after
                res["kvtierd_pool_delta"] = numeric_diff(after, before or {})
            out["cases"][case] = res
    finally:
        if args.example_dir is None:
            shutil.rmtree(example_dir, ignore_errors=True)
    return out


def summarize_ttft(t: dict[str, Any]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for res in t["cases"].values():
        runs.update(res["runs"])
    med = {name: statistics.median(r["ttft_s"] for r in rs) for name, rs in runs.items()}
    s: dict[str, Any] = {"median_ttft_s": {k: round(v, 4) for k, v in med.items()},
                         "cached_tokens": {k: [r["cached_tokens"] for r in rs] for k, rs in runs.items()},
                         "tokens": {k: [r["token"] for r in rs] for k, rs in runs.items()}}
    ref = runs.get("recompute")
    if ref:
        s["same_token_as_recompute"] = {k: [a["token"] == b["token"] for a, b in zip(rs, ref)]
                                        for k, rs in runs.items() if k != "recompute"}
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    if "kvtier" in med:
        for other, target, op in (("recompute", TARGET_VS_RECOMPUTE, "<="), ("prefix_cache", TARGET_VS_PREFIX_CACHE, "<="),
                                  ("example", TARGET_VS_EXAMPLE, "<")):
            if other in med:
                r = med["kvtier"] / med[other]
                ratios[f"kvtier/{other}"] = round(r, 4)
                targets[f"kvtier/{other}"] = {"target": f"{op} {target}",
                                              "met": r <= target if op == "<=" else r < target}
    s["ratios"] = ratios
    s["targets"] = targets
    kv = t["cases"].get("kvtier", {})
    if "worker_reps" in kv:
        w = kv["worker_reps"]
        s["connector_load"] = {"blocks_loaded": w["blocks_loaded"], "load_s_total": round(w["load_s"], 5),
                               "load_ms_per_request": round(1e3 * w["load_s"] / max(1, len(runs.get("kvtier", []))), 3)}
    return s


# ---------------------------------------------------------------------------
# 2. The scheduler half's cost per call
# ---------------------------------------------------------------------------

class FakeRequest:
    """What SchedulerSide reads of vllm.v1.request.Request."""

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        self.num_tokens = len(tokens)
        self.prompt_token_ids = tokens
        self.lora_request = None
        self.cache_salt = None
        self.mm_features: list[Any] = []


def sched_section(args: argparse.Namespace, daemon: Daemon) -> dict[str, Any]:
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
    pool = PoolChoice(name="bench/vllm-sched/b128", layout=layout, layer_names=("layer0",), block_size=bs)
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
        calls0, calls_s0 = sched.calls, sched.calls_s
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
        calls, calls_s = sched.calls - calls0, sched.calls_s - calls_s0
        for r in reqs:
            sched.request_finished(r)  # unpins on the background thread
        sched._jobs.wait_idle(10)
        want = max_blocks * bs
        return {"n": n, "calls": calls, "gnmt_s": calls_s, "on_new_s": new_s, "steps": steps, "wall_s": wall,
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
        names = {"recompute": "b. recompute (no connector, salted)", "prefix_cache": "c. vLLM prefix cache",
                 "kvtier": "a. KvtierConnector (prefix caching off)", "example": "d. ExampleConnector (prefix caching off)"}
        print(f"\nTTFT (generate, max_tokens=1), {t['prefix_tokens']}-token prefix + {t['suffix_tokens']} new tokens, "
              f"median of {t['reps']}; {t['model']['parameters'] / 1e6:.0f}M-parameter random Llama, "
              f"{t['model']['torch_dtype']}, prefix KV {t['prefix_kv_bytes'] / 2**20:.0f} MiB")
        print("| case | TTFT | cached tokens | same token as recompute |")
        print("|---|---:|---|---|")
        for k in ("kvtier", "recompute", "prefix_cache", "example"):
            if k in med:
                same = s.get("same_token_as_recompute", {}).get(k)
                same_s = "-" if k == "recompute" else (f"{sum(same)}/{len(same)}" if same else "?")
                print(f"| {names[k]} | {med[k] * 1e3:.1f} ms | {sorted(set(s['cached_tokens'][k]))} | {same_s} |")
        for name, r in s["ratios"].items():
            tg = s["targets"][name]
            print(f"{name}: {r:.3f}x (target {tg['target']}: {'met' if tg['met'] else 'NOT met'})")
        if "connector_load" in s:
            c = s["connector_load"]
            print(f"connector load (worker half, start_load_kv): {c['load_ms_per_request']:.1f} ms per request "
                  f"({c['blocks_loaded']} blocks over {t['reps']} requests)")
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
    if args.prefix_tokens % BLOCK_SIZE or not 0 < args.suffix_tokens < BLOCK_SIZE:
        raise SystemExit(f"--prefix-tokens must be a multiple of {BLOCK_SIZE} and --suffix-tokens in (0, {BLOCK_SIZE})")
    report: dict[str, Any] = {"kind": "vllm", "date": _dt.datetime.now().isoformat(timespec="seconds"),
                              "environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    os.chmod(workdir, 0o700)
    log_path = args.log or Path(tempfile.gettempdir()) / "kvtier-bench-vllm.log"
    log_path.write_text("")
    daemon = Daemon(workdir, gpu_bytes="256MiB", cpu_bytes="1GiB").start()
    report["kvtierd"] = {"argv": daemon.argv[2:]}
    progress(f"kvtierd pid {daemon.proc.pid if daemon.proc else '?'} on {daemon.endpoint}; vLLM logs in {log_path}")
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
