"""A vLLM engine as a child process of a benchmark, and the random-weight model it runs.

Shared by ``bench/vllm.py`` and ``bench/peers.py`` (the vLLM benches' one copy of it).

Contract
========

- ``model_config(...)``: the HuggingFace ``config.json`` of a random-weight Llama.
  ``parameters(cfg)``
  counts its parameters, ``kv_bytes_per_token(cfg)`` its KV bytes a token.
- ``write_model(folder, cfg)``: the folder vLLM loads, ``config.json`` and a checkpoint
  (``kvtier.testing.vllm_weights``); ``model_kwargs(folder)``: the ``LLM(...)`` arguments
  that load it. ``WEIGHTS`` says how, for the results.
- ``engine_env(reserved_cpus, pythonpath_front, extra)``: the environment of a child
  engine. Every engine gets ``VLLM_CPU_NUM_OF_RESERVED_CPU=reserved_cpus``: vLLM's CPU
  build reserves a core for its scheduler, and one more when a KV connector is
  configured, which on 2 cores gives engines with a connector twice the compute
  threads of those without.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "@@BENCH-RESULT@@ "
BLOCK_SIZE = 128  # vLLM's CPU backend wants a multiple of 32
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

def model_config(*, hidden: int = 1024, heads: int = 8, kv_heads: int = 2, layers: int = 4,
                 intermediate: int | None = None, vocab: int = 8192, dtype: str = "float32",
                 max_positions: int = 8192) -> dict[str, Any]:
    """A Llama's config.json: by default 62M parameters, 8 KiB of float32 KV a token (see bench/vllm.py)."""
    inter = intermediate or int(round(hidden * 2.75 / 256)) * 256
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "max_position_embeddings": max(8192, max_positions), "rms_norm_eps": 1e-5,
            "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def parameters(cfg: Mapping[str, Any]) -> int:
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return L * per_layer + 2 * v * h + h


def kv_bytes_per_token(cfg: Mapping[str, Any]) -> int:
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = 4 if cfg["torch_dtype"] == "float32" else 2
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * hd * elem


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
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment, the CPU reservation, ``pythonpath_front`` before $PYTHONPATH, then ``extra``."""
    env = dict(os.environ)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
    if pythonpath_front:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath_front, *[x for x in [env.get("PYTHONPATH")] if x]])
    env.update(extra or {})
    return env


def reply(obj: Mapping[str, Any]) -> None:
    """The child's answer to one command (one tagged JSON line on stdout)."""
    sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


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
