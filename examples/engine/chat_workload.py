#!/usr/bin/env python3
"""Replay a multi-turn chat through the example engine and report TTFT and hit tier per turn.

Several conversations share one system prompt; each turn's prompt is the
conversation so far (system prompt, earlier user turns and the engine's own
answers) plus a new user message. Conversations are served round-robin, turn
by turn, and the GPU tier (the engine's KV pool) holds little more than the
largest request, so by the time a conversation comes back its earlier turns
have been evicted from the GPU tier and demoted into the CPU tier: a turn's
prefix is a mix of GPU-tier hits (the shared system prompt, touched by every
request) and CPU-tier hits (the conversation's own history).

With ``--baseline`` (the default) every prompt is then served again with
caching defeated (a unique ``cache_salt`` per request, so nothing can be
reused, through the same engine and backend): that gives each turn's
recompute TTFT beside its reuse TTFT, and checks that both produce the same
logits (max abs difference) and the same greedy answer.

Tokens are synthetic ids (seeded) and the model has random weights: the
example measures KV reuse, not language. Prints a table and totals; writes
JSON (``--json-out``, default ``bench/results/chat-<model>-<backend>-<device>.json``).

Examples::

    python examples/engine/chat_workload.py --model-size tiny           # seconds, in-process tiers
    python examples/engine/chat_workload.py --backend daemon --endpoint ipc:///tmp/kvtier.sock
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine import Engine, RequestResult, build_engine
from paged_llama import MODEL_PRESETS, parameters_millions

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--model-size", choices=sorted(MODEL_PRESETS), default="small",
                   help="random-init Llama preset: tiny (tests), small (~56M, default), 200m (~200M)")
    p.add_argument("--backend", choices=("inproc", "daemon"), default="inproc",
                   help="inproc: kvtier tiers in this process; daemon: kvtierd at --endpoint (default: inproc)")
    p.add_argument("--endpoint", help="kvtierd ZMQ endpoint for --backend daemon, e.g. ipc:///tmp/kvtier.sock")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device for the model and KV pool (default: cuda if available, else cpu)")
    p.add_argument("--conversations", type=int, default=4, help="number of conversations (default: 4)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (default: 3)")
    p.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt length (default: 1024)")
    p.add_argument("--user-tokens", type=int, default=64, help="mean user message length, +-25%% (default: 64)")
    p.add_argument("--answer-tokens", type=int, default=16, help="greedy tokens generated per turn (default: 16)")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="KV pool (GPU tier) size in 16-token blocks (default: the largest request + 2)")
    p.add_argument("--cpu-blocks", type=int, default=4096,
                   help="CPU tier size in blocks, in-process backend only (the daemon sizes its own)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="replay every prompt with caching defeated, for recompute TTFT and an exactness check")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the synthetic tokens")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json-out", type=Path, default=None,
                   help="where to write the JSON report (default: bench/results/chat-<model>-<backend>-<device>.json)")
    p.add_argument("--quiet", action="store_true", help="print only the totals")
    return p


def max_request_tokens(args: argparse.Namespace) -> int:
    """An upper bound of the longest prompt plus its answer."""
    per_turn = int(args.user_tokens * 1.25) + 1 + args.answer_tokens
    return args.system_tokens + args.turns * per_turn


def environment(device: str) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "load_average_1m": os.getloadavg()[0],
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def warn_if_busy(print_fn: Any = print) -> float:
    """Say so when other processes keep the CPU busy; returns the 1-minute load average.

    Timings on a shared CPU are inflated, and torch's OpenMP parallel regions
    suffer most: a region waits for its slowest thread, and a thread that has
    lost its core waits a whole scheduler slice. ``--threads 1`` is immune to
    that (and half as fast on an idle 2-core machine).
    """
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if load > 0.5 * cores and torch.get_num_threads() > 1:
        print_fn(f"warning: load average {load:.1f} on {cores} cores: other processes are using the CPU, timings "
                 f"will be inflated and noisy (torch uses {torch.get_num_threads()} threads; --threads 1 is steadier)")
    return load


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f}"


def run(args: argparse.Namespace, *, print_fn: Any = print) -> dict[str, Any]:
    """Run the workload (see the module docstring); returns the JSON report."""
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = warn_if_busy(print_fn)
    bs = 16
    gpu_blocks = args.gpu_blocks or -(-max_request_tokens(args) // bs) + 2
    t_build = time.perf_counter()
    eng: Engine = build_engine(args.model_size, gpu_blocks=gpu_blocks, cpu_blocks=args.cpu_blocks,
                               backend=args.backend, endpoint=args.endpoint, device=args.device, seed=args.seed)
    build_s = time.perf_counter() - t_build
    vocab = eng.model.config.vocab_size
    rng = random.Random(args.seed)
    say = (lambda *a, **k: None) if args.quiet else print_fn
    print_fn(f"model: random-init Llama '{args.model_size}' ({parameters_millions(eng.model):.0f}M parameters, "
             f"{eng.model.config.num_hidden_layers} layers, {eng.kv.geometry.num_kv_heads} KV heads, float32) on "
             f"{args.device}; backend: {args.backend}; GPU tier (engine KV pool): {gpu_blocks} blocks of {bs} tokens "
             f"({gpu_blocks * eng.kv.geometry.block_bytes / 2**20:.0f} MiB)")
    print_fn(f"workload: {args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens} "
             f"tokens, user turns ~{args.user_tokens} tokens, {args.answer_tokens} answer tokens per turn")

    # Warm the kernels (first calls allocate and pick algorithms): not part of any measurement.
    eng.generate([rng.randrange(vocab) for _ in range(64)], 2, cache_salt="warmup")

    system = [rng.randrange(vocab) for _ in range(args.system_tokens)]
    histories = [list(system) for _ in range(args.conversations)]
    turns: list[dict[str, Any]] = []
    prompts: list[list[int]] = []
    results: list[RequestResult] = []
    say(f"\n{'conv':>4} {'turn':>4} {'prompt':>7} {'reused':>7} {'gpu blk':>7} {'cpu blk':>7} {'computed':>8} "
        f"{'hit':>8} {'TTFT ms':>9}")
    t_run = time.perf_counter()
    for turn in range(args.turns):
        for conv in range(args.conversations):
            n_user = max(1, round(args.user_tokens * rng.uniform(0.75, 1.25)))
            prompt = histories[conv] + [rng.randrange(vocab) for _ in range(n_user)]
            res = eng.generate(prompt, args.answer_tokens, request_id=f"conv{conv}-turn{turn}")
            histories[conv] = prompt + res.output_ids
            prompts.append(prompt)
            results.append(res)
            rec = {"conversation": conv, "turn": turn, **res.summary()}
            turns.append(rec)
            say(f"{conv:>4} {turn:>4} {res.prompt_len:>7} {res.num_cached_tokens:>7} {rec['hit_blocks_gpu']:>7} "
                f"{rec['hit_blocks_cpu']:>7} {res.num_computed_tokens:>8} {res.hit_tier:>8} {fmt_ms(res.ttft_s)}")
    run_s = time.perf_counter() - t_run
    stats = eng.backend.stats()

    report: dict[str, Any] = {
        "kind": "chat-workload",
        "model": {"preset": args.model_size, "parameters": sum(p.numel() for p in eng.model.parameters()),
                  "weights": f"random init, torch.manual_seed({args.seed}), float32", **MODEL_PRESETS[args.model_size]},
        "backend": args.backend,
        "device": args.device,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "gpu_blocks": gpu_blocks,
        "block_size": bs,
        "block_bytes": eng.kv.geometry.block_bytes,
        "environment": environment(args.device) | {"load_average_1m_start": load_start},
        "model_build_s": round(build_s, 3),
        "turns": turns,
        "pool_stats": stats,
    }

    baseline_ttft: list[float] = []
    if args.baseline:
        say(f"\nbaseline: the same {len(prompts)} prompts again, caching defeated (unique cache_salt per request)")
        max_diff = 0.0
        same_outputs = 0
        for i, (prompt, res) in enumerate(zip(prompts, results)):
            base = eng.generate(prompt, args.answer_tokens, cache_salt=f"no-reuse-{args.seed}-{i}-{time.time_ns()}")
            if base.num_hit_blocks:
                raise AssertionError(f"salted request {i} hit {base.num_hit_blocks} blocks")
            diff = float((base.last_prompt_logits - res.last_prompt_logits).abs().max())
            max_diff = max(max_diff, diff)
            same = base.output_ids == res.output_ids
            same_outputs += same
            baseline_ttft.append(base.ttft_s)
            turns[i].update(recompute_ttft_s=round(base.ttft_s, 6), max_abs_logit_diff=diff, same_greedy_output=same)
        report["exactness"] = {"max_abs_logit_diff": max_diff, "same_greedy_outputs": same_outputs,
                               "requests": len(prompts)}

    # ---- table with the baseline beside, and totals ----------------------------------------
    if args.baseline:
        say(f"\n{'conv':>4} {'turn':>4} {'prompt':>7} {'computed':>8} {'hit':>8} {'TTFT ms':>9} "
            f"{'recompute ms':>12} {'speedup':>7} {'logit diff':>10} {'same out':>8}")
        for rec in turns:
            say(f"{rec['conversation']:>4} {rec['turn']:>4} {rec['prompt_tokens']:>7} {rec['computed_tokens']:>8} "
                f"{rec['hit_tier']:>8} {fmt_ms(rec['ttft_s'])} {rec['recompute_ttft_s'] * 1e3:12.1f} "
                f"{rec['recompute_ttft_s'] / rec['ttft_s']:6.1f}x {rec['max_abs_logit_diff']:10.1e} "
                f"{'yes' if rec['same_greedy_output'] else 'NO':>8}")
    prompt_tokens = sum(r.prompt_len for r in results)
    cached_tokens = sum(r.num_cached_tokens for r in results)
    gpu_blk = sum(r.hit_tiers.count("gpu") for r in results)
    cpu_blk = sum(r.hit_tiers.count("cpu") for r in results)
    by_tier: dict[str, list[float]] = {}
    for r in results:
        by_tier.setdefault(r.hit_tier, []).append(r.ttft_s)
    totals: dict[str, Any] = {
        "requests": len(results),
        "prompt_tokens": prompt_tokens,
        "reused_tokens": cached_tokens,
        "computed_tokens": prompt_tokens - cached_tokens,
        "reuse_fraction": round(cached_tokens / prompt_tokens, 4),
        "hit_blocks_gpu": gpu_blk,
        "hit_blocks_cpu": cpu_blk,
        "ttft_sum_s": round(sum(r.ttft_s for r in results), 4),
        "ttft_mean_s_by_hit_tier": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_tier.items())},
        "requests_by_hit_tier": {k: len(v) for k, v in sorted(by_tier.items())},
        "workload_wall_s": round(run_s, 3),
    }
    if args.baseline:
        totals["recompute_ttft_sum_s"] = round(sum(baseline_ttft), 4)
        totals["ttft_speedup"] = round(sum(baseline_ttft) / totals["ttft_sum_s"], 2)
    report["totals"] = totals

    print_fn("\ntotals:")
    print_fn(f"  requests {len(results)}; prompt tokens {prompt_tokens}; reused {cached_tokens} "
             f"({100 * cached_tokens / prompt_tokens:.0f}%: {gpu_blk} blocks from the GPU tier, {cpu_blk} restored from "
             f"the CPU tier); computed {prompt_tokens - cached_tokens}")
    print_fn("  requests by hit tier: " + ", ".join(f"{k} {len(v)} (mean TTFT {1e3 * sum(v) / len(v):.0f} ms)"
                                               for k, v in sorted(by_tier.items())))
    line = f"  TTFT total with kvtier {totals['ttft_sum_s']:.2f} s"
    if args.baseline:
        ex = report["exactness"]
        line += (f", recomputing everything {totals['recompute_ttft_sum_s']:.2f} s ({totals['ttft_speedup']:.1f}x); "
                 f"max abs logit diff {ex['max_abs_logit_diff']:.1e}, identical greedy answers "
                 f"{ex['same_greedy_outputs']}/{ex['requests']}")
    print_fn(line)
    print_fn(f"  pool: demotions {stats.get('demotions')}, restores {stats.get('restores')}, "
             f"CPU tier {stats.get('cpu_used_blocks')}/{stats.get('cpu_blocks')} blocks used")

    out = args.json_out or RESULTS_DIR / f"chat-{args.model_size}-{args.backend}-{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_fn(f"  wrote {out}")
    eng.backend.close()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.backend == "daemon" and not args.endpoint:
        print("--backend daemon needs --endpoint", file=sys.stderr)
        return 2
    report = run(args)
    ex = report.get("exactness")
    if ex and (ex["max_abs_logit_diff"] > 1e-4 or ex["same_greedy_outputs"] != ex["requests"]):
        print("FAILED: reuse changed the outputs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
