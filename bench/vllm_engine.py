"""A vLLM engine as a child process of a benchmark, and the random-weight model it runs.

Shared by ``bench/vllm.py`` and ``bench/peers.py`` (the vLLM benches' one copy of it).

Contract
========

- ``model_config(family=..., ...)``: the HuggingFace ``config.json`` of a random-weight
  model of one family (``FAMILIES``): ``llama`` (the default), ``gemma3`` (sliding-window
  layers: vLLM's hybrid KV-cache groups; ``vllm_weights.gemma3_config``) or ``mla``
  (DeepSeek-V2 MLA; ``vllm_weights.deepseek_v2_config``); ``ValueError`` for another.
  ``parameters(cfg)`` counts its parameters (the checkpoint's tensors);
  ``kv_layout(family, cfg)`` its KV: bytes a token, block size (``block_size(family)``:
  ``MLA_BLOCK_SIZE`` for MLA, ``BLOCK_SIZE`` otherwise) and KV-cache groups;
  ``kv_bytes_per_token(cfg, family)`` the first of those.
- ``write_model(folder, cfg)``: the folder vLLM loads, ``config.json`` and a checkpoint
  (``kvtier.testing.vllm_weights``); ``model_kwargs(folder)``: the ``LLM(...)`` arguments
  that load it. ``WEIGHTS`` says how, for the results.
- ``engine_env(reserved_cpus, pythonpath_front, extra, tp)``: the environment of a child
  engine. Every engine gets ``VLLM_CPU_NUM_OF_RESERVED_CPU=reserved_cpus``: vLLM's CPU
  build reserves a core for its scheduler, and one more when a KV connector is
  configured, which on 2 cores gives engines with a connector twice the compute
  threads of those without. At ``tp`` > 1 each rank gets its share of our cores
  (``VLLM_CPU_OMP_THREADS_BIND``).
- ``serve(ops)``: the child's side: answers each command on stdin (``reply`` of
  ``ops[cmd["op"]](cmd)``) until ``{"op": "exit"}`` or the end of stdin; an unknown
  op ends the child (``SystemExit`` naming the known ones).
- ``EngineProc(name, argv, env, log_path)``: starts ``argv`` (a script serving one
  ``LLM``: JSON commands, one a line, on its stdin; one ``RESULT_TAG`` line of JSON
  per command on its stdout, written with ``reply``) in its own process group, with
  the repository as working directory. Every other line of its output goes to
  ``log_path`` prefixed ``[name]``; lines starting ``[bench]`` are echoed to stderr
  (progress). ``recv(timeout_s)`` returns the next reply, or raises ``RuntimeError``
  (the child exited; the message names the log) or ``TimeoutError``; ``call`` sends
  and receives. ``close()`` asks it to exit (``{"op": "exit"}``), waits up to 60 s,
  then kills its process group (its own group only, never by name) and returns its
  exit code (None when it had to be killed).
- ``bench_on_path(folder)``: put ``bench/`` at the END of ``sys.path``. A script run as
  ``python bench/x.py`` has ``bench/`` first, where ``bench/vllm.py`` would shadow vLLM;
  at the end, ``vllm`` is vLLM and ``import report`` / ``import vllm_engine`` still work.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "@@BENCH-RESULT@@ "
BLOCK_SIZE = 128  # vLLM's CPU backend wants a multiple of 32
MLA_BLOCK_SIZE = 16  # vLLM's CPU MLA backend forces it
FAMILIES = ("llama", "gemma3", "mla")
WEIGHT_SEED = 7  # every engine of a run gets the same weights (kvtier.testing.vllm_weights)
CLOSE_TIMEOUT_S = 60.0


def bench_on_path(folder: Path) -> None:
    """``folder`` (bench/) last on ``sys.path``, not first: see the module docstring."""
    here = folder.resolve()
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here] + [str(here)]


def progress(msg: str) -> None:
    """A status line on stderr; a child's lines reach the bench's stderr through ``EngineProc``."""
    sys.stderr.write(f"[bench] {msg}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------

def model_config(*, family: str = "llama", hidden: int = 1024, heads: int = 8, kv_heads: int = 2,
                 layers: int = 4, intermediate: int | None = None, vocab: int = 8192, dtype: str = "float32",
                 max_positions: int = 8192, window: int = 1024) -> dict[str, Any]:
    """A model's config.json. The Llama by default: 62M parameters, 8 KiB of float32 KV a token (see
    bench/vllm.py). ``gemma3``: 5 sliding-window layers of ``window`` tokens to 1 full (``layers`` a
    multiple of 6); ``mla``: ``heads`` KV heads (MLA's latent is shared, ``kv_heads`` unused)."""
    inter = intermediate or int(round(hidden * 2.75 / 256)) * 256
    max_pos = max(8192, max_positions)
    if family == "gemma3":
        from kvtier.testing.vllm_weights import gemma3_config

        return gemma3_config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                             query_pre_attn_scalar=hidden // heads, sliding_window=window, vocab_size=vocab,
                             torch_dtype=dtype, max_position_embeddings=max_pos)
    if family == "mla":
        from kvtier.testing.vllm_weights import deepseek_v2_config

        return deepseek_v2_config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                                  torch_dtype=dtype, max_position_embeddings=max_pos)
    if family != "llama":
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5,
            "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def parameters(cfg: Mapping[str, Any]) -> int:
    """The model's parameters, from the checkpoint's tensors (any family)."""
    from math import prod

    from kvtier.testing.vllm_weights import tensor_specs

    return sum(prod(t.shape) for t in tensor_specs(dict(cfg)))


def block_size(family: str) -> int:
    return MLA_BLOCK_SIZE if family == "mla" else BLOCK_SIZE


def kv_layout(family: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The family's KV a token, its block size, and its KV-cache groups (vLLM's hybrid manager for gemma3)."""
    elem = 4 if cfg["torch_dtype"] == "float32" else 2
    layers = cfg["num_hidden_layers"]
    bs = block_size(family)
    if family == "mla":
        per_layer = (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * elem  # one latent, every rank
        return {"block_size": bs, "kv_bytes_per_token": layers * per_layer,
                "groups": [{"kind": "full", "layers": layers}]}
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_layer = 2 * cfg["num_key_value_heads"] * hd * elem
    if family == "gemma3":
        # vLLM's hybrid manager: one group per layer position of the 5:1 pattern (layers / 6 layers each).
        per_group = layers // 6
        groups = [{"kind": "sliding_window", "window": cfg["sliding_window"], "layers": per_group}] * 5
        groups += [{"kind": "full", "layers": per_group}]
        return {"block_size": bs, "kv_bytes_per_token": layers * per_layer, "groups": groups,
                "group_block_bytes": per_group * per_layer * bs}
    return {"block_size": bs, "kv_bytes_per_token": layers * per_layer, "groups": [{"kind": "full", "layers": layers}]}


def kv_bytes_per_token(cfg: Mapping[str, Any], family: str = "llama") -> int:
    return int(kv_layout(family, cfg)["kv_bytes_per_token"])


# How every engine of a bench gets its weights: the two functions below are the one place.
WEIGHTS = f"kvtier.testing.vllm_weights.write_model(seed={WEIGHT_SEED}), bfloat16 checkpoint"


def write_model(folder: Path, cfg: Mapping[str, Any]) -> Path:
    """The folder vLLM loads: ``config.json`` and a checkpoint under which the greedy answer depends on the
    whole prefix's KV (``kvtier.testing.vllm_weights``; vLLM's dummy weights make it depend on the last
    token only, and "same answer as the recompute" could not tell right KV from wrong). Every engine of a
    run loads the same one."""
    from kvtier.testing.vllm_weights import write_model as write_checkpoint

    return write_checkpoint(folder, dict(cfg), WEIGHT_SEED)


def model_kwargs(folder: Path) -> dict[str, Any]:
    """The ``LLM(...)`` arguments that load the model of ``write_model(folder, ...)``."""
    return {"model": str(folder), "skip_tokenizer_init": True}


# ---------------------------------------------------------------------------
# The child process
# ---------------------------------------------------------------------------

def engine_env(reserved_cpus: int, pythonpath_front: Sequence[str] = (),
               extra: Mapping[str, str] | None = None, tp: int = 1) -> dict[str, str]:
    """Our environment, the CPU reservation, the ranks' cores, ``pythonpath_front`` before $PYTHONPATH,
    then ``extra``."""
    env = dict(os.environ)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
    if tp > 1:  # vLLM's CPU backend binds each rank to a NUMA node; one node here, so each its cores
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // tp)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cores[i * share:(i + 1) * share]))
                                                    for i in range(tp))
    if pythonpath_front:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath_front, *[x for x in [env.get("PYTHONPATH")] if x]])
    env.update(extra or {})
    return env


def reply(obj: Mapping[str, Any]) -> None:
    """The child's answer to one command (one tagged JSON line on stdout)."""
    sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(ops: Mapping[str, Callable[[dict[str, Any]], Mapping[str, Any]]]) -> None:
    """The child's command loop: one ``reply`` of ``ops[op](cmd)`` a command, until ``exit`` or end of stdin."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            return
        handler = ops.get(cmd["op"])
        if handler is None:
            raise SystemExit(f"unknown command {cmd['op']!r}; known: exit, {', '.join(ops)}")
        reply(handler(cmd))


class EngineProc:
    """One child serving an ``LLM``: JSON commands on stdin, one tagged JSON line each on stdout."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True,
                                     env=dict(env))
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
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
                elif line.startswith("[bench]"):
                    sys.stderr.write(line)
                    sys.stderr.flush()

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._replies.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._reader.join(5)
                    if not self._replies.empty():
                        continue
                    raise RuntimeError(f"{self.name}: the engine exited with {self.proc.returncode}; "
                                       f"see {self.log_path}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no answer in {timeout_s} s; see {self.log_path}") from None

    def call(self, timeout_s: float, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.recv(timeout_s)

    def close(self) -> int | None:
        rc = None
        try:
            if self.proc.poll() is None:
                self.send(op="exit")
            rc = self.proc.wait(CLOSE_TIMEOUT_S)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            self.proc.kill()
            self.proc.wait(10)
        finally:
            try:  # whatever of its engine is left (its own process group only)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return rc
