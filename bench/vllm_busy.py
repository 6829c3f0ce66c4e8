#!/usr/bin/env python3
"""kvtier under vLLM: what restoring a long prefix costs the requests already decoding.

Usage:
    python bench/vllm_busy.py [--cases sync,adaptive,async,recompute] [--reps 3] [--rounds 2] [--json PATH]

The question (docs/vllm.md 3.4): a request arrives whose 4,096-token prefix
kvtierd holds, while other requests decode. With ``load_mode="sync"`` the
restore runs inside the next engine step, before its forward, and every
decoding request waits for it. With ``"async"`` (vLLM's asynchronous loading)
the restore runs on the worker's load thread beside the decode steps, and
the arriving request is scheduled in a step after its load ran.
``"adaptive"`` (the default) picks one per load from the measured restore
rate, step period and running requests (``integrations/adapter/load_modes.py``).
``recompute`` (vLLM without a connector) is the reference: the arriving
request's whole prefill runs in one step.

One run, on this machine: the bench starts one kvtierd (``--device cpu``,
store mode) and, per case and round, a fresh vLLM engine as its own child
process (``--child``), one alive at a time, the case order reversed in odd
rounds. Each engine: a random-weight Llama (the model of ``bench/vllm.py``:
a checkpoint from ``kvtier.testing.vllm_weights.write_model``; float32,
hidden 1024, 4 layers, 8 KiB of KV a token), vLLM's prefix caching off (the
prefix is not in vLLM's own cache: it was evicted, or computed by another
engine), ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``. The prefix is stored in kvtierd
by the first engine that computes it. Per repetition:

1. ``--decoders`` requests (64-token prompts, ``ignore_eos``,
   ``--decode-tokens`` tokens each) start, through ``LLMEngine.add_request``
   and ``step()``; each token's arrival is time-stamped in the bench's
   process (what a client sees).
2. Once each has ``--arrive-after`` tokens, the arriving request (the prefix
   and a unique 32-token suffix, one output token) is added.
3. The engine steps until every request finished.

Reported per case (medians over repetitions): the decoders' inter-token
latency before the arrival (``itl_before_ms``), the longest gap any decoder
saw from the arrival on (``max_gap_ms``), the decoders' delay in all
(``delay_ms``: the time they took from the arrival until each had produced
its next ``--window`` tokens, less ``--window`` before-arrival ITLs; the mean
over decoders), and the arriving request's TTFT. Beside them, from inside
the engine: each step's ``execute_model`` time and, with the connector, its
``start_load_kv`` (the synchronous load's share of a step), and the
worker's ``loads_background`` count (proof that adaptive loaded beside the
forward). Every repetition's arriving token is compared with the recompute
case's for the same suffix (``same_token_as_recompute``).

Results: a table on stdout (progress on stderr, vLLM's logs in ``--log``),
JSON (default ``bench/results/vllm-busy-cpu.json``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
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
# As a script this file's folder is sys.path[0], where bench/vllm.py would shadow vLLM; at the end of
# sys.path it still holds the benches' shared modules.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent] + [
    str(Path(__file__).resolve().parent)]

from vllm_engine import BLOCK_SIZE, RESULT_TAG, model_config, model_kwargs, progress, write_model  # noqa: E402

from kvtier.testing.daemon import KvtierDaemon  # noqa: E402
from kvtier.testing.vllm_trace import take_events as _take_events  # noqa: E402

CASES = ("sync", "adaptive", "async", "recompute")
DECODER_PROMPT_TOKENS = 64
MODEL = model_config()  # bench/vllm.py's model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (default all)")
    p.add_argument("--prefix-tokens", type=int, default=4096, help="the arriving request's prefix, a multiple of 128 (default 4096)")
    p.add_argument("--suffix-tokens", type=int, default=32, help="its unique suffix, < 128 (default 32)")
    p.add_argument("--decoders", type=int, default=4, help="requests decoding when it arrives (default 4)")
    p.add_argument("--decode-tokens", type=int, default=40, help="tokens each decoder generates (default 40)")
    p.add_argument("--arrive-after", type=int, default=10, help="decoder tokens before the arrival (default 10)")
    p.add_argument("--window", type=int, default=8, help="decoder tokens after the arrival that delay_ms covers (default 8)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per engine (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="fresh engines per case, the order reversed in odd rounds (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "vllm-busy-cpu.json", help="JSON report path")
    p.add_argument("--log", type=Path, default=None, help="vLLM's output (default: kvtier-bench-vllm-busy.log in the temp directory)")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)  # internal: one engine's run
    return p


# ---------------------------------------------------------------------------
# In vLLM's engine-core process (collective_rpc, kvtier.testing.vllm_trace):
# step and synchronous-load time stamps
# ---------------------------------------------------------------------------

def _install_trace(worker: Any, connector: bool) -> bool:
    from functools import partial

    from kvtier.testing.vllm_trace import timed as _timed, trace_events

    timed = partial(_timed, trace_events(worker))
    worker.execute_model = timed("exec", worker.execute_model, lambda so, *_: int(so.total_num_scheduled_tokens))
    if connector:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        side = get_kv_transfer_group()._worker
        side.start_load_kv = timed("load", side.start_load_kv,
                                   lambda meta: sum(len(x.keys) for x in meta.loads if not x.background))
    return connector


def _worker_counts(worker: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    return {"blocks_loaded": side.blocks_loaded, "loads_background": side.loads_background,
            "blocks_load_failed": side.blocks_load_failed}


# ---------------------------------------------------------------------------
# One engine (a child process)
# ---------------------------------------------------------------------------

def child_main(spec: dict[str, Any]) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    case = spec["case"]
    prefix = spec["prefix"]
    max_len = -(-(len(prefix) + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE
    blocks = max_len // BLOCK_SIZE * 2 + spec["decoders"] * 2 + 1  # the arriving request, the decoders, spare
    kw: dict[str, Any] = model_kwargs(Path(spec["model_dir"])) | dict(max_model_len=max_len, max_num_batched_tokens=max_len, block_size=BLOCK_SIZE,
                              num_gpu_blocks_override=blocks, enforce_eager=True, seed=0, dtype="float32",
                              enable_prefix_caching=False)
    if case != "recompute":
        kw["kv_transfer_config"] = {"kv_connector": "KvtierConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvtier.integrations.vllm",
                                    "kv_connector_extra_config": {"socket": spec["socket"], "load_mode": case}}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup_s = time.perf_counter() - t0
    connector = llm.collective_rpc(_install_trace, args=(case != "recompute",))[0]
    progress(f"{case}: LLM started in {startup_s:.1f} s")
    one = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    # Warm up, and compute the prefix once (kvtierd then holds it: write-through, flushed by the next step).
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], one, use_tqdm=False)
    llm.generate([TokensPrompt(prompt_token_ids=prefix + spec["warm_suffix"])], one, use_tqdm=False)
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"][:40])], one, use_tqdm=False)
    engine = llm.llm_engine
    decode = SamplingParams(max_tokens=spec["decode_tokens"], temperature=0, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    arrive = SamplingParams(max_tokens=1, temperature=0, detokenize=False, output_kind=RequestOutputKind.DELTA)
    reps = []
    for i, suffix in enumerate(spec["suffixes"]):
        counts_before = llm.collective_rpc(_worker_counts)[0] if connector else None
        llm.collective_rpc(_take_events)
        times: dict[str, list[float]] = {}
        for d, prompt in enumerate(spec["decoder_prompts"][i]):
            rid = f"r{i}-d{d}"
            times[rid] = []
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), decode)
        t_arrive: float | None = None
        t_first: float | None = None
        token: int | None = None
        cached_tokens = 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.monotonic()
            for out in outs:
                if out.request_id in times:
                    times[out.request_id] += [now] * len(out.outputs[0].token_ids)
                elif out.outputs and out.outputs[0].token_ids and t_first is None:
                    t_first, token = now, int(out.outputs[0].token_ids[0])
                    cached_tokens = int(out.num_cached_tokens or 0)
            if t_arrive is None and all(len(t) >= spec["arrive_after"] for t in times.values()):
                t_arrive = time.monotonic()
                engine.add_request(f"r{i}-arrive", TokensPrompt(prompt_token_ids=prefix + suffix), arrive)
        events = llm.collective_rpc(_take_events)[0]
        rep = {"t_arrive": t_arrive, "t_first": t_first, "token": token, "cached_tokens": cached_tokens,
               "decoder_times": list(times.values()), "events": events}
        if connector:
            after = llm.collective_rpc(_worker_counts)[0]
            rep["worker_delta"] = {k: after[k] - counts_before[k] for k in after}
        reps.append(rep)
        progress(f"{case}: repetition {i + 1}/{len(spec['suffixes'])}: TTFT {1e3 * (t_first - t_arrive):.0f} ms")
    sys.stdout.write(RESULT_TAG + json.dumps({"case": case, "startup_s": round(startup_s, 2), "reps": reps}) + "\n")
    sys.stdout.flush()
    return 0


def run_child(spec: dict[str, Any], workdir: Path, log_path: Path) -> dict[str, Any]:
    spec_path = workdir / f"spec-{spec['case']}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    with open(log_path, "a") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                              stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            if proc.returncode != 0:
                break
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"{spec['case']}: the engine exited with {proc.returncode} and no result; see {log_path}")


# ---------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------

def rep_numbers(rep: dict[str, Any], window: int) -> dict[str, Any]:
    """The decoders' view of one arrival; times in ms."""
    t_arrive = rep["t_arrive"]
    before, gaps_after, delays = [], [], []
    for ts in rep["decoder_times"]:
        gaps = [(b - a, b) for a, b in zip(ts, ts[1:])]
        pre = [g for g, end in gaps if end <= t_arrive]
        before += pre
        post = [t for t in ts if t > t_arrive]
        gaps_after += [g for g, end in gaps if end > t_arrive]
        if len(post) >= window and pre:
            delays.append((post[window - 1] - t_arrive) - window * statistics.median(pre))
    itl = statistics.median(before)
    steps = [e for e in rep["events"] if e[0] == "exec" and e[2] > t_arrive]
    loads = [e for e in rep["events"] if e[0] == "load" and e[3]]
    return {"itl_before_ms": 1e3 * itl, "max_gap_ms": 1e3 * max(gaps_after),
            "delay_ms": 1e3 * statistics.mean(delays), "ttft_ms": 1e3 * (rep["t_first"] - t_arrive),
            "longest_step_ms": 1e3 * max(e[2] - e[1] for e in steps),
            "sync_load_ms": 1e3 * sum(e[2] - e[1] for e in loads), "token": rep["token"],
            "cached_tokens": rep["cached_tokens"], **({"worker_delta": rep["worker_delta"]} if "worker_delta" in rep else {})}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    keys = ("itl_before_ms", "max_gap_ms", "delay_ms", "ttft_ms", "longest_step_ms", "sync_load_ms")
    out: dict[str, Any] = {}
    reference = {r["suffix"]: r["token"] for r in runs.get("recompute", [])}
    for case, reps in runs.items():
        s: dict[str, Any] = {k: round(statistics.median(r[k] for r in reps), 2) for k in keys}
        s["min_max"] = {k: [round(min(r[k] for r in reps), 2), round(max(r[k] for r in reps), 2)] for k in keys}
        s["cached_tokens"] = [r["cached_tokens"] for r in reps]
        if case != "recompute":
            s["loads_background"] = sum(r["worker_delta"]["loads_background"] for r in reps)
            s["blocks_load_failed"] = sum(r["worker_delta"]["blocks_load_failed"] for r in reps)
        if reference:
            s["same_token_as_recompute"] = [r["token"] == reference.get(r["suffix"]) for r in reps]
        out[case] = s
    for case in ("adaptive", "async"):
        if "sync" in out and case in out:
            out[f"{case}_over_sync"] = {k: round(out[case][k] / out["sync"][k], 3) if out["sync"][k] else None
                                        for k in ("max_gap_ms", "delay_ms", "ttft_ms")}
    return out


def print_table(summary: dict[str, Any], cases: list[str]) -> None:
    head = ["case", "ITL before", "max gap", "delay", "longest step", "sync load", "TTFT", "bg loads", "same token"]
    rows = [head]
    for c in cases:
        s = summary[c]
        same = s.get("same_token_as_recompute")
        rows.append([c, f"{s['itl_before_ms']:.1f}", f"{s['max_gap_ms']:.1f}", f"{s['delay_ms']:.1f}",
                     f"{s['longest_step_ms']:.1f}", f"{s['sync_load_ms']:.1f}", f"{s['ttft_ms']:.1f}",
                     str(s.get("loads_background", "-")), f"{sum(same)}/{len(same)}" if same else "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print("\nA restored prefix arriving while requests decode (ms, medians; see the module docstring)")
    for r in rows:
        print("  " + "  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths))))
    for case in ("adaptive", "async"):
        if f"{case}_over_sync" in summary:
            print(f"  {case} / sync: " + ", ".join(f"{k} {v}x" for k, v in summary[f"{case}_over_sync"].items()))


def environment() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    env: dict[str, Any] = {"python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                           "load_average": list(os.getloadavg())}
    for dist in ("vllm-cpu", "torch"):
        try:
            env[dist] = version(dist)
        except PackageNotFoundError:
            env[dist] = None
    env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                       check=False).stdout.strip()
    return env


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child.read_text()))
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        raise SystemExit(f"--cases: unknown {bad}; choose from {', '.join(CASES)}")
    if args.prefix_tokens % BLOCK_SIZE or not 0 < args.suffix_tokens < BLOCK_SIZE:
        raise SystemExit(f"--prefix-tokens must be a multiple of {BLOCK_SIZE} and --suffix-tokens in (0, {BLOCK_SIZE})")
    if not 0 < args.arrive_after < args.decode_tokens - args.window:
        raise SystemExit("--arrive-after must be at least 1 and leave --window decoder tokens after it")
    rng = random.Random(args.seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, MODEL["vocab_size"]) for _ in range(n)]

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-busy-"))
    log_path = args.log or Path(tempfile.gettempdir()) / "kvtier-bench-vllm-busy.log"
    log_path.write_text("")
    model_dir = workdir / "model"
    model_dir.mkdir()
    write_model(model_dir, model_config(max_positions=2 * args.prefix_tokens))
    suffixes = [toks(args.suffix_tokens) for _ in range(args.reps)]
    base = {"model_dir": str(model_dir), "prefix": toks(args.prefix_tokens), "warm_suffix": toks(args.suffix_tokens),
            "suffixes": suffixes, "warmup": toks(256), "decoders": args.decoders,
            "decoder_prompts": [[toks(DECODER_PROMPT_TOKENS) for _ in range(args.decoders)] for _ in suffixes],
            "decode_tokens": args.decode_tokens, "arrive_after": args.arrive_after}
    report: dict[str, Any] = {"kind": "vllm-busy", "date": _dt.datetime.now().isoformat(timespec="seconds"),
                              "environment": environment(), "args": {k: str(v) for k, v in vars(args).items()},
                              "model": MODEL, "prefix_kv_bytes": args.prefix_tokens * 8192}
    daemon = KvtierDaemon.start(workdir, flags={"device": "cpu", "gpu_bytes": "256MiB", "cpu_bytes": "1GiB",
                                                "log_level": "warning"}, cwd=REPO)
    progress(f"kvtierd pid {daemon.pid}; vLLM logs in {log_path}")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    t_start = time.perf_counter()
    try:
        for r in range(args.rounds):
            for case in cases if r % 2 == 0 else cases[::-1]:
                progress(f"round {r + 1}/{args.rounds}: {case}")
                res = run_child(base | {"case": case, "socket": daemon.endpoint}, workdir, log_path)
                for i, rep in enumerate(res["reps"]):
                    runs[case].append(rep_numbers(rep, args.window) | {"suffix": i, "round": r})
    finally:
        report["kvtierd_exit_code"] = daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    report["environment"]["load_average_end"] = list(os.getloadavg())
    report["runs"] = runs
    report["summary"] = summarize(runs)
    print_table(report["summary"], cases)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"kvtierd exited with {report['kvtierd_exit_code']}; {report['wall_s']:.0f} s; wrote {args.json}")
    return 0 if report["kvtierd_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
