"""The systems bench/peers.py compares, and how each one's engine is configured.

Contract
========

``SYSTEMS`` names them; ``SYSTEM_INFO[name]`` says what each is. Per system and
round the bench opens one ``Sidecar`` (the state that outlives an engine, fresh
each round, so no round starts with another's blocks): kvtierd for kvtier, a
Redis server for LMCache's sharing phases, a /dev/shm folder for
ExampleConnector. ``Sidecar.engine(sharing)`` gives an engine's
``EngineConfig``: its ``kv_transfer_config``, interpreter, PYTHONPATH folders
and environment. ``sharing=True`` is the configuration of the phases that need
engines to share (two engines at once, an engine restarted): for each peer the
nearest it offers. ``Sidecar.close()`` stops what it started and returns what
it knows of it (kvtierd's exit code).

- ``kvtier``: ``KvtierConnector`` to the round's kvtierd (``--device cpu``,
  ``--gpu-bytes 256MiB``, the rest of ``offload_bytes`` as ``--cpu-bytes``);
  every engine of the round shares it by design.
- ``lmcache``: LMCache 0.5.6's ``LMCacheConnectorV1``, local CPU backend of
  ``offload_bytes``, with the CPU copy of ``peer_shims/lmcache_cpu``
  (``PEERS_LMCACHE_CPU=1``, ``PYTHONHASHSEED=0``, run by ``--peers-python``,
  a venv holding LMCache). Sharing: its remote backend on a Redis server of
  the round's (``LMCACHE_REMOTE_URL``, naive serde), beside the local CPU one.
- ``native``: vLLM's ``OffloadingConnector`` with ``peer_shims/native_cpu_spec``'s
  CPU copy, ``offload_bytes`` of CPU blocks. It offers nothing between
  processes: each engine keeps its own.
- ``example``: vLLM's ``ExampleConnector``, safetensors files in the round's
  /dev/shm folder (every engine of the round shares it).
- ``prefix_cache``: vLLM alone, prefix caching on.
- ``recompute``: vLLM alone, prefix caching off: every prompt computed in full
  (the reference answers).
Every engine but ``recompute``'s has prefix caching on (vLLM's default, and what
a deployment runs: vLLM's own cache answers first, the connector below it).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.testing.daemon import KvtierDaemon
from kvtier.testing.redis_servers import RedisServer, have_redis

SYSTEMS = ("kvtier", "lmcache", "native", "example", "prefix_cache", "recompute")
PEERS = ("lmcache", "native", "example")  # the other KV connectors
KVTIERD_GPU_BYTES = 256 << 20

SYSTEM_INFO = {
    "kvtier": "KvtierConnector -> kvtierd (one per round, shared by every engine of it)",
    "lmcache": "LMCache 0.5.6 LMCacheConnectorV1, local CPU backend (+ Redis remote backend when engines share)",
    "native": "vLLM OffloadingConnector, CPU offloading (per engine: it offers no sharing)",
    "example": "vLLM ExampleConnector, files in /dev/shm (shared)",
    "prefix_cache": "vLLM's own prefix cache alone",
    "recompute": "vLLM, prefix caching off: every prompt computed",
}

LMCACHE_SETUP = """LMCache is not importable by {python}.
Make a venv for the peers (a copy of this one, LMCache added without its dependencies):
  cp -a {venv} /work/peers-venv
  grep -rlI '{venv}' /work/peers-venv/bin | xargs sed -i 's#{venv}#/work/peers-venv#g'
  /work/peers-venv/bin/python -m pip install --no-deps lmcache==0.5.6 aiofile aiofiles caio sortedcontainers \\
      nvtx setuptools_scm redis
then pass --peers-python /work/peers-venv/bin/python (or leave lmcache out of --systems)."""


@dataclass(slots=True)
class EngineConfig:
    kv_transfer_config: dict[str, Any] | None
    prefix_caching: bool
    python: str
    trace_connector: str | None  # what vllm_timing.install_trace wraps
    pythonpath_front: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def check_lmcache(python: str, venv: str) -> None:
    """Raise SystemExit with the set-up steps when ``python`` cannot import LMCache."""
    ok = subprocess.run([python, "-c", "import importlib.util as u; raise SystemExit(u.find_spec('lmcache') is None)"],
                        capture_output=True, timeout=120).returncode == 0
    if not ok:
        raise SystemExit(LMCACHE_SETUP.format(python=python, venv=venv))


class Sidecar:
    """One system's state for one round (see the module docstring)."""

    def __init__(self, system: str, workdir: Path, *, offload_bytes: int, block_size: int, python: str,
                 peers_python: str, shims: Path, repo: Path) -> None:
        self.system = system
        self.workdir = workdir
        self.offload_bytes = offload_bytes
        self.block_size = block_size
        self.python = python
        self.peers_python = peers_python
        self.shims = shims
        self.daemon: KvtierDaemon | None = None
        self.redis: RedisServer | None = None
        self.example_dir: Path | None = None
        if system == "kvtier":
            self.daemon = KvtierDaemon.start(workdir / "kvtierd", cwd=repo, flags={
                "device": "cpu", "gpu_bytes": KVTIERD_GPU_BYTES, "cpu_bytes": offload_bytes - KVTIERD_GPU_BYTES,
                "log_level": "warning"})
        elif system == "example":
            self.example_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-peers-example-",
                                                     dir="/dev/shm" if Path("/dev/shm").is_dir() else None))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"system": self.system}
        if self.daemon is not None:
            out["kvtierd_argv"] = self.daemon.argv[2:]
        if self.redis is not None:
            out["redis_url"] = self.redis.url
        if self.example_dir is not None:
            out["example_dir"] = str(self.example_dir)
        return out

    def engine(self, sharing: bool) -> EngineConfig:
        s = self.system
        if s == "recompute":
            return EngineConfig(None, False, self.python, None)
        if s == "prefix_cache":
            return EngineConfig(None, True, self.python, None)
        if s == "kvtier":
            assert self.daemon is not None
            return EngineConfig({"kv_connector": "KvtierConnector", "kv_role": "kv_both",
                                 "kv_connector_module_path": "kvtier.integrations.vllm",
                                 "kv_connector_extra_config": {"socket": self.daemon.endpoint}},
                                True, self.python, "kvtier")
        if s == "native":
            return EngineConfig({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                 "kv_connector_extra_config": {"spec_name": "CPUTorchOffloadingSpec",
                                                               "spec_module_path": "native_cpu_spec",
                                                               "cpu_bytes_to_use": self.offload_bytes}},
                                True, self.python, "other", [str(self.shims)])
        if s == "example":
            return EngineConfig({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                 "kv_connector_extra_config": {"shared_storage_path": str(self.example_dir)}},
                                True, self.python, "other")
        if s == "lmcache":
            env = {"PEERS_LMCACHE_CPU": "1", "PEERS_BLOCK_SIZE": str(self.block_size),
                   # Without it the scheduler and worker processes hash tokens differently and nothing hits.
                   "PYTHONHASHSEED": "0",
                   "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": str(self.offload_bytes / 2**30)}
            if sharing:
                env |= {"LMCACHE_REMOTE_URL": self._redis_url(), "LMCACHE_REMOTE_SERDE": "naive"}
            return EngineConfig({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, True,
                                self.peers_python, "other", [str(self.shims / "lmcache_cpu")], env)
        raise ValueError(f"unknown system {s!r}")

    def _redis_url(self) -> str:
        if self.redis is None:
            if not have_redis():
                raise SystemExit("lmcache's sharing phases need redis-server on PATH (apt-get install -y redis-server)")
            self.redis = RedisServer(self.workdir / "redis").start()
        return self.redis.url.removesuffix("/0")

    def close(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.daemon is not None:
            out["kvtierd_exit_code"] = self.daemon.stop()
        if self.redis is not None:
            try:
                out["redis_used_memory"] = int(self.redis.client().info("memory")["used_memory"])
            except Exception:  # noqa: BLE001 -- a fact left out, not an error
                pass
            self.redis.stop()
        if self.example_dir is not None:
            shutil.rmtree(self.example_dir, ignore_errors=True)
        return out
