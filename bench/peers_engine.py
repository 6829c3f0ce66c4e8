#!/usr/bin/env python3
"""One vLLM engine of bench/peers.py (a child process; ``python bench/peers_engine.py SPEC.json``).

It starts one ``LLM`` from the spec's engine arguments (the system's KV
connector, if any, is in them), loads the run's checkpoint
(``vllm_engine.write_model``: the next token depends on the whole prefix's
KV), installs the time stamps of
``bench/vllm_timing.py``, answers ``{"ready": ...}`` and then serves JSON
commands, one a line on stdin, one tagged JSON line each on stdout
(``bench/vllm_engine.py``):

- ``{"op": "run", "pid", "tokens", "max_tokens", "salt", "reset"}``: one request,
  alone on the engine: ``reset`` first drops vLLM's own prefix cache (untimed;
  a connector's store is kept), ``salt`` is the prompt's ``cache_salt``. The
  request goes through ``LLMEngine.add_request`` and ``step()`` (greedy,
  ``ignore_eos``); its TTFT is submit -> the step that returned its first token,
  its e2e submit -> the last. Answers ``ttft_s``, ``e2e_s``, ``answer`` (the tokens),
  ``cached_tokens`` (vLLM's ``num_cached_tokens``: its own prefix-cache hit plus
  what the connector loaded), ``prompt_tokens`` and the TTFT's ``breakdown``.
- ``{"op": "stats"}``: KvtierConnector's worker counters (None for the others).
- ``{"op": "exit"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
# bench/ at the end of sys.path: first, bench/vllm.py would shadow vLLM.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH] + [str(BENCH)]

import vllm_timing  # noqa: E402
from vllm_engine import progress, reply  # noqa: E402


def main(spec: dict[str, Any]) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    import cloudpickle
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from kvtier.testing.vllm_trace import take_events

    name = spec["name"]
    trace = spec["trace_connector"]
    sched_path = spec.get("sched_events")
    sched_file = open(sched_path) if sched_path else None  # noqa: SIM115
    t0 = time.perf_counter()
    llm = LLM(**spec["engine_kwargs"])
    startup_s = time.perf_counter() - t0
    cloudpickle.register_pickle_by_value(vllm_timing)  # the worker needs no import of bench/
    info = llm.collective_rpc(vllm_timing.install_trace, args=(trace,))[0]
    progress(f"{name}: LLM started in {startup_s:.1f} s")
    engine = llm.llm_engine
    reply({"ready": True, "startup_s": round(startup_s, 2), "trace": info})
    seq = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "stats":
            reply({"worker": llm.collective_rpc(vllm_timing.kvtier_worker_stats)[0] if trace == "kvtier" else None})
            continue
        if op != "run":
            raise SystemExit(f"unknown command {op!r}")
        res: dict[str, Any] = {"pid": cmd["pid"]}
        if cmd.get("reset"):  # drop vLLM's own copy of every block (nothing runs now)
            res["reset_prefix_cache"] = bool(llm.reset_prefix_cache())
        llm.collective_rpc(take_events)
        if sched_file is not None:
            sched_file.read()
        prompt = TokensPrompt(prompt_token_ids=cmd["tokens"])
        if cmd.get("salt") is not None:
            prompt["cache_salt"] = cmd["salt"]
        params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        seq += 1
        tokens: list[int] = []
        cached = 0
        t_first: float | None = None
        t_submit = time.monotonic()
        engine.add_request(f"{cmd['pid']}#{seq}", prompt, params)
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.monotonic()
            for out in outs:
                new = list(out.outputs[0].token_ids) if out.outputs else []
                if new and t_first is None:
                    t_first = now
                tokens += new
                cached = max(cached, int(out.num_cached_tokens or 0))
        t_done = time.monotonic()
        events = llm.collective_rpc(take_events)[0]
        if sched_file is not None:
            time.sleep(0.005)  # a lookup's done-callback may land just after
            events += [tuple(json.loads(x)) for x in sched_file.read().splitlines() if x]
        events.sort(key=lambda e: e[1])
        t_first = t_first if t_first is not None else t_done
        res |= {"ttft_s": round(t_first - t_submit, 5), "e2e_s": round(t_done - t_submit, 5), "answer": tokens,
                "cached_tokens": cached, "prompt_tokens": len(cmd["tokens"]),
                "breakdown": vllm_timing.breakdown(t_submit, t_first, events)}
        reply(res)
    reply({"bye": True})
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: peers_engine.py SPEC.json (started by bench/peers.py)")
    sys.exit(main(json.loads(Path(sys.argv[1]).read_text())))
