"""Shared pieces of the stress suite: a kvtierd process, deterministic block content, raw sockets.

Used by the pytest files in this folder and by the full-run scripts
(``python -m tests.stress.fuzz_full`` and the others), so it depends on
nothing of pytest.

Contract
========

- ``start_stress_daemon(root, flags=..., env=...)``: a ``kvtier.testing.daemon.KvtierDaemon``
  on ``ipc://<root>/kvtierd.sock`` with the given flags (``gpu_bytes=4096``
  becomes ``--gpu-bytes 4096``), extra environment (e.g.
  ``KVTIER_TEST_FAULTS``) and one OpenMP thread, answering ``health``.
  ``kill()`` / ``restart()`` / ``spawn()`` / ``stop()`` signal only that
  process, by pid; ``rss_bytes()`` reads its resident set size.
- ``block_content(h, nbytes)``: the bytes of the block whose hash is ``h``,
  derived only from ``h`` (a PCG64 stream seeded with the hash's XXH3-64),
  so any process can check any restore byte for byte without having seen
  the store.
- ``chain_hashes(key, n)``: ``n`` chained 16-byte block hashes for a text
  key (XXH3-128 over the parent hash and the block index), the same in every
  process.
- ``RawSocket``: a DEALER socket for hand-made frames; ``ask(frames)`` sends
  one message and returns the decoded reply header and its payload frames,
  or None when no reply came in ``timeout_s``.
- ``percentile(values, p)`` and ``latency_summary(values_s)``: nearest-rank
  percentiles, milliseconds.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import xxhash
import zmq

from kvtier.client.client import PoolLayout
from kvtier.client.protocol import decode
from kvtier.testing.daemon import KvtierDaemon

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
START_TIMEOUT_S = 60.0
# The test-only fault-injection variable read by kvtierd's composition root
# (see kvtier.daemon.faults); never set in production.
FAULTS_ENV = "KVTIER_TEST_FAULTS"


def store_layout(block_bytes: int, *, mode: str = "store", model: str = "stress-model") -> PoolLayout:
    """A pool layout whose geometry is consistent with ``block_bytes`` (fp16 K and V, 4 tokens)."""
    head_dim = block_bytes // (2 * 2 * 4)
    return PoolLayout(model=model, block_size=4, block_bytes=block_bytes, dtype="float16", num_layers=1,
                      kv_heads=1, head_dim=max(1, head_dim), mode=mode)


@functools.lru_cache(maxsize=8192)
def block_content(h: bytes, nbytes: int) -> bytes:
    """The content of the block with hash ``h``: a pure function of (h, nbytes)."""
    seed = xxhash.xxh3_64_intdigest(h)
    return np.random.Generator(np.random.PCG64(seed)).bytes(nbytes)


def chain_hashes(key: str, n: int, *, parent: bytes = b"") -> list[bytes]:
    """``n`` chained block hashes under ``key`` (a prefix family), continuing ``parent``."""
    out: list[bytes] = []
    for i in range(n):
        parent = xxhash.xxh3_128_digest(parent + key.encode() + i.to_bytes(4, "little"))
        out.append(parent)
    return out


def chain_content(hashes: Sequence[bytes], block_bytes: int) -> bytes:
    return b"".join(block_content(h, block_bytes) for h in hashes)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until ``predicate()``; returns the seconds it took."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def start_stress_daemon(root: Path, *, flags: Mapping[str, object] | None = None,
                 env: Mapping[str, str] | None = None) -> KvtierDaemon:
    """A kvtierd for the suite (see the module docstring), started and answering."""
    # One OpenMP thread: the daemon's copies are memory-bound, and on 2 cores
    # more threads only fight the clients.
    return KvtierDaemon.start(root, flags=flags, env=env, omp_threads=1, start_timeout_s=START_TIMEOUT_S)


class RawSocket:
    """A DEALER socket for hand-made frames (see the module docstring)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self._new()

    def _new(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def reset(self) -> None:
        """A fresh connection (after the daemon dropped this one, or stale replies)."""
        self.sock.close(linger=0)
        self.sock = self._new()

    def ask(self, frames: Sequence[bytes], timeout_s: float = 5.0) -> tuple[Any, list[bytes]] | None:
        self.sock.send_multipart(list(frames), copy=True)
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        reply = self.sock.recv_multipart()
        try:
            return decode(reply[0]), reply[1:]
        except Exception:  # the caller judges an undecodable reply
            return reply[0], reply[1:]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> RawSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of ``values``; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def latency_summary(values_s: Sequence[float]) -> dict[str, float]:
    """Count and p50/p99/max in milliseconds."""
    return {
        "count": len(values_s),
        "p50_ms": round(percentile(values_s, 50) * 1e3, 3),
        "p99_ms": round(percentile(values_s, 99) * 1e3, 3),
        "max_ms": round(max(values_s) * 1e3, 3) if values_s else math.nan,
    }


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    vm = psutil.virtual_memory()
    return {
        # Other processes share the cores: latencies are only comparable at similar load.
        "load_avg_1m_at_report": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "memory_gib": round(vm.total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "description": f"{os.cpu_count()}-core VM, {round(vm.total / 2**30)} GiB, "
                       + ("CUDA GPU" if torch.cuda.is_available() else "no GPU (CPU tiers and thread copy engine)"),
    }


def write_result(name: str, payload: Mapping[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` (pretty, sorted keys) and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    return path


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain fixed-width table on stdout."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if n else c.ljust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
