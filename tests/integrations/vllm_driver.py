"""A vLLM engine in its own process, driven by the vLLM tests over stdin/stdout.

``python vllm_driver.py --model-dir DIR [--socket ENDPOINT] [--gpu-blocks N] [--tp N] [--layers N]
[--arch llama|deepseek_v2|gemma3] [--block-size N] [--prompt-embeds] [--kv-events ENDPOINT]``
writes the random-weight model (``kvtier.testing.vllm_weights``, seed 0: a
Llama, a DeepSeek-V2 with MLA, or a Gemma 3) into DIR, starts ``vllm.LLM`` on it (with
KvtierConnector when ``--socket`` is given), prints ``@@ready``, then serves one JSON command
per stdin line and answers each with one ``@@{json}`` line on stdout (vLLM's
own logs share stdout; the prefix tells them apart):

- ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n}`` ->
  ``{"outputs": [[ids...], ...], "cached": [num_cached_tokens, ...],
  "preemptions": vLLM's count so far}``
  (greedy, all prompts submitted together); with ``"prompt_logprobs": k``
  the reply also has ``"prompt_logprobs"``: per prompt, the logprob of each
  prompt token (null for the first); with ``"embeds": [[seed, length],
  ...]`` instead of ``prompts`` (``--prompt-embeds``), each prompt is
  ``length`` seeded random embeddings;
- ``{"op": "abort", "prompts": [[ids...], ...], "steps": k}``: submits the
  prompts, runs ``k`` engine steps, aborts whatever has not finished ->
  ``{"aborted": [...], "finished": [...]}``;
- ``{"op": "preemptions"}`` -> ``{"preemptions": n}``;
- ``{"op": "log_stats"}``: vLLM's stats logger logs now (its "KV Transfer
  metrics" line carries the connector's counters) -> ``{"logged": true}``;
- ``{"op": "metrics", "prefix": p}`` -> vLLM's metrics (``LLM.get_metrics``)
  whose name starts with ``p``: ``{"metrics": [[name, labels, value], ...]}``;
- ``{"op": "perturb_weights", "seed": s}``: changes every weight (seeded
  noise: ``write_update``) and loads the new weights into the workers in
  place (vLLM's ``reload_weights``), as an RL weight update does ->
  ``{"perturbed": number of tensors}``;
- ``{"op": "reset", "connector": bool}``: ``LLM.reset_prefix_cache`` (with
  ``reset_connector``) -> ``{"reset": what it returned}``;
- ``{"op": "config"}`` -> what vLLM decided at start-up:
  ``{"hybrid_kv_cache_manager": bool, "prefix_caching": bool}``;
- ``{"op": "exit"}``.

Each engine is one process so that the tests can run two at once, restart one,
and kill the daemon under one, exactly as engines are deployed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

BLOCK_SIZE = 128
WEIGHT_SEED = 0

# The connector's INFO lines (reconnections, loads it could not restore) go into the engine's log, in this process
# and in vLLM's, which import this module again when they start: a failed test's log then says what kvtier did.
_kvtier_log = logging.getLogger("kvtier")
if not _kvtier_log.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("kvtier[%(process)d] %(asctime)s %(levelname)s %(message)s"))
    _kvtier_log.addHandler(_handler)
    _kvtier_log.setLevel(logging.INFO)


def cpu_bind(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``tp`` ranks its own share of this process's cores."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // tp
    if share < 1:
        raise SystemExit(f"--tp {tp} needs at least {tp} cores; this process may use {len(cores)}")
    return "|".join(",".join(str(c) for c in cores[i * share:(i + 1) * share]) for i in range(tp))


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def embeds_prompt(seed: int, length: int, hidden: int) -> Any:
    """A prompt of ``length`` seeded random embeddings (std 1, as the model's own)."""
    import torch
    from vllm.inputs import EmbedsPrompt

    gen = torch.Generator().manual_seed(seed)
    return EmbedsPrompt(prompt_embeds=torch.randn(length, hidden, generator=gen).to(torch.bfloat16))


def preemptions(llm: Any) -> int:
    """vLLM's cumulative count of preempted requests."""
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name.startswith("vllm:num_preemptions")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--socket", help="kvtierd endpoint; without it vLLM runs with no connector")
    ap.add_argument("--gpu-blocks", type=int, default=16,
                    help="vLLM's own KV cache, in blocks of 128 tokens (one is vLLM's null block)")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (each rank's threads get their own cores)")
    ap.add_argument("--layers", type=int, default=2, help="the model's layers (hidden 256, 4 heads)")
    ap.add_argument("--arch", choices=("llama", "deepseek_v2", "gemma3"), default="llama",
                    help="llama (2 KV heads), deepseek_v2 (MLA: kv_lora_rank 512 + rope 64) or gemma3 "
                         "(5 sliding-window layers of 128 tokens to 1 full; vLLM runs it with kvtier only where "
                         "the connector supports hybrid KV-cache groups)")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                    help="vLLM's block size in tokens (vLLM's CPU MLA backend forces 16)")
    ap.add_argument("--prompt-embeds", action="store_true", help="vLLM's enable_prompt_embeds")
    ap.add_argument("--max-model-len", type=int,
                    help="default: what --gpu-blocks hold less one block (a hybrid model needs more blocks a token)")
    ap.add_argument("--kv-events", metavar="ENDPOINT",
                    help="publish vLLM's KV cache events on this ZMQ endpoint (vLLM binds it)")
    args = ap.parse_args()
    if args.tp > 1:
        # vLLM's CPU backend binds each rank's threads to a NUMA node; one node here, so by hand.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(args.tp))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's CPU backend reserves one more core for an engine with a KV connector: on 2 cores an engine
    # with kvtier then computes on 2 OpenMP threads and one without on 1, whose other reduction order
    # flips near-tied greedy tokens. The same reservation for every engine: the same arithmetic.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.testing.vllm_weights import (
        deepseek_v2_config,
        gemma3_config,
        llama_config,
        tensor_specs,
        write_model,
        write_update,
    )

    make_config = {"llama": llama_config, "deepseek_v2": deepseek_v2_config, "gemma3": gemma3_config}[args.arch]
    config = make_config(num_hidden_layers=args.layers)
    write_model(args.model_dir, config, WEIGHT_SEED)

    kw: dict[str, Any] = {}
    if args.socket:
        kw["kv_transfer_config"] = {
            "kv_connector": "KvtierConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_connector_extra_config": {"socket": args.socket, **json.loads(args.extra)},
        }
    if args.kv_events:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=args.kv_events)
    if args.prompt_embeds:
        kw["enable_prompt_embeds"] = True
    llm = LLM(model=args.model_dir, skip_tokenizer_init=True,
              max_model_len=args.max_model_len or (args.gpu_blocks - 1) * args.block_size,
              block_size=args.block_size, num_gpu_blocks_override=args.gpu_blocks, enforce_eager=True, seed=0,
              tensor_parallel_size=args.tp,
              disable_log_stats=False, **kw)
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "preemptions":
            reply({"preemptions": preemptions(llm)})
            continue
        if op == "log_stats":  # vLLM's stats logger, now (KV Transfer metrics included), into this log
            llm.llm_engine.do_log_stats()
            reply({"logged": True})
            continue
        if op == "metrics":
            reply({"metrics": [[m.name, m.labels, m.value] for m in llm.get_metrics()
                               if m.name.startswith(cmd["prefix"]) and hasattr(m, "value")]})
            continue
        if op == "perturb_weights":
            update = write_update(args.model_dir, int(cmd["seed"]), base_seed=WEIGHT_SEED)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(update)})
            reply({"perturbed": len(tensor_specs(config))})
            continue
        if op == "config":
            cfg = llm.llm_engine.vllm_config
            reply({"hybrid_kv_cache_manager": not cfg.scheduler_config.disable_hybrid_kv_cache_manager,
                   "prefix_caching": bool(cfg.cache_config.enable_prefix_caching)})
            continue
        if op == "reset":
            reply({"reset": llm.reset_prefix_cache(reset_connector=bool(cmd["connector"]))})
            continue
        params = SamplingParams(max_tokens=int(cmd.get("max_tokens", 8)), temperature=0.0, detokenize=False, ignore_eos=True,
                                prompt_logprobs=cmd.get("prompt_logprobs"))
        prompts: list[Any] = ([embeds_prompt(seed, n, int(config["hidden_size"])) for seed, n in cmd["embeds"]]
                              if "embeds" in cmd else [TokensPrompt(prompt_token_ids=list(p)) for p in cmd["prompts"]])
        if op == "generate":
            outs = llm.generate(prompts, params, use_tqdm=False)
            out: dict[str, Any] = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                                   "cached": [int(o.num_cached_tokens or 0) for o in outs],
                                   "preemptions": preemptions(llm)}
            if cmd.get("prompt_logprobs") is not None:
                out["prompt_logprobs"] = [[None if lp is None else float(lp[tok].logprob)
                                           for tok, lp in zip(o.prompt_token_ids, o.prompt_logprobs)] for o in outs]
            reply(out)
        elif op == "abort":
            engine = llm.llm_engine
            ids = [f"abort-{cmd.get('tag', '')}-{i}" for i in range(len(prompts))]
            for rid, p in zip(ids, prompts):
                engine.add_request(rid, p, params)
            finished: list[str] = []
            for _ in range(int(cmd.get("steps", 0))):
                finished += [o.request_id for o in engine.step() if o.finished]
            left = [r for r in ids if r not in finished]
            engine.abort_request(left)
            while engine.has_unfinished_requests():
                engine.step()
            reply({"aborted": left, "finished": finished})
        else:
            reply({"error": f"unknown op {op!r}"})
    reply({"bye": True})


if __name__ == "__main__":
    main()
