"""The single-node replay: one bookkeeping ``TieredPool`` driven by a request trace, and the sweep.

The accounting is in the package docstring (``kvtier.tools.replay``) and in ``ACCOUNTING``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies import DEFAULT_POLICY
from kvtier.tools.replay.progress import progress_bar
from kvtier.tools.traces import Request

__all__ = [
    "ACCOUNTING",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_BYTES_PER_TOKEN",
    "DEFAULT_CPU_TOKENS",
    "DEFAULT_GPU_TOKENS",
    "DEFAULT_POLICY",
    "DEFAULT_SWEEP_CPU_TOKENS",
    "DEFAULT_SWEEP_POLICIES",
    "HINT_SETS",
    "ReplayConfig",
    "ReplayResult",
    "replay",
    "request_hints",
    "sweep",
]

DEFAULT_BLOCK_SIZE = 512
DEFAULT_GPU_TOKENS = 100_000
DEFAULT_CPU_TOKENS = 3_000_000
DEFAULT_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V · layers · KV heads · head dim · bf16 (Llama-3.1-8B)
DEFAULT_SWEEP_CPU_TOKENS = (0, 250_000, 500_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000, 10_000_000,
                            20_000_000)
DEFAULT_SWEEP_POLICIES = ("lru", "arc", "s3fifo", "lru+admit2", "chain")

# Hint sets a replay can pass (``--hints``): "none" passes nothing; "session" passes
# RequestHints(session=<the trace's session id>, at_s=<timestamp in s>) with every request that has one;
# "session+output" adds output_tokens=<the request's output length>, which an engine reports with the
# request's stores as it generates (the replay's requests take no time, so it comes with the request).
HINT_SETS = ("none", "session", "session+output")

ACCOUNTING = [
    "Requests are processed one at a time in trace (arrival) order.",
    "Only full blocks count: block i is full when (i+1)*block_size <= input_length.",
    "A request's blocks hit in order until the first block that is in no tier; a hit counts for the first "
    "tier that holds it (gpu, then cpu).",
    "The request's full blocks are then allocated in the GPU tier (pool.allocate: GPU hits touched, CPU hits "
    "restored, the rest allocated, evicted blocks demoted to the CPU tier if admitted) and freed last-to-first "
    "(vLLM order).",
    "A request with more full blocks than the GPU tier is looked up in full, then only its first gpu_blocks "
    "blocks are allocated (truncated_requests, truncated_blocks).",
    "Block hit rate = hit blocks / looked-up blocks. Token hit rate = hit blocks * block_size / input tokens.",
    "Bytes: demotions * block_bytes GPU->CPU, restores * block_bytes CPU->GPU.",
    "Hints (--hints session): a request with a session field carries RequestHints(session, at_s=timestamp) on "
    "its lookup and allocation; --hints session+output adds output_tokens=output_length (an engine reports it "
    "while the request generates; a replayed request takes no time); --retain-s X adds retain_s=X to every "
    "request (at_s=timestamp even without sessions).",
    "Bounds: infinite cache (every block seen before, prefix-stop) and Belady MIN (with bypass) for one cache of "
    "gpu_blocks + cpu_blocks.",
]


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    gpu_blocks: int
    cpu_blocks: int
    policy: str = DEFAULT_POLICY
    block_size: int = DEFAULT_BLOCK_SIZE
    block_bytes: int = DEFAULT_BLOCK_SIZE * DEFAULT_BYTES_PER_TOKEN
    # Which hints each request carries (HINT_SETS): "none", "session" (the trace's session field), or
    # "session+output" (and the request's output length).
    hints: str = "none"
    # A TTL what-if: every request carries retain_s (0: none).
    retain_s: float = 0.0

    def __post_init__(self) -> None:
        if self.hints not in HINT_SETS:
            raise ValueError(f"unknown hint set {self.hints!r}; choose from {', '.join(HINT_SETS)}")
        if not self.retain_s >= 0.0:
            raise ValueError(f"retain_s must be >= 0, got {self.retain_s}")
        if self.gpu_blocks < 1:
            raise ValueError(f"the GPU tier needs at least one block, got {self.gpu_blocks}")
        if self.cpu_blocks < 0:
            raise ValueError(f"cpu_blocks must be >= 0, got {self.cpu_blocks}")
        if self.block_size < 1 or self.block_bytes < 1:
            raise ValueError("block_size and block_bytes must be >= 1")


@dataclass(slots=True)
class ReplayResult:
    config: ReplayConfig
    requests: int = 0
    input_tokens: int = 0
    looked_up_blocks: int = 0
    hit_blocks_gpu: int = 0
    hit_blocks_cpu: int = 0
    miss_blocks: int = 0
    truncated_requests: int = 0
    truncated_blocks: int = 0
    demotions: int = 0
    demotions_not_admitted: int = 0
    demotions_dropped_full: int = 0
    restores: int = 0
    cpu_evictions: int = 0
    seconds: float = 0.0
    bounds: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_blocks(self) -> int:
        return self.hit_blocks_gpu + self.hit_blocks_cpu

    def block_hit_rate(self, tier: str = "total") -> float:
        n = {"gpu": self.hit_blocks_gpu, "cpu": self.hit_blocks_cpu, "total": self.hit_blocks}[tier]
        return n / self.looked_up_blocks if self.looked_up_blocks else 0.0

    def token_hit_rate(self, tier: str = "total") -> float:
        n = {"gpu": self.hit_blocks_gpu, "cpu": self.hit_blocks_cpu, "total": self.hit_blocks}[tier]
        return n * self.config.block_size / self.input_tokens if self.input_tokens else 0.0

    @property
    def bytes_gpu_to_cpu(self) -> int:
        return self.demotions * self.config.block_bytes

    @property
    def bytes_cpu_to_gpu(self) -> int:
        return self.restores * self.config.block_bytes

    def to_dict(self) -> dict[str, Any]:
        tiers = ("gpu", "cpu", "total")
        return {
            "config": asdict(self.config),
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "looked_up_blocks": self.looked_up_blocks,
            "hit_blocks": {"gpu": self.hit_blocks_gpu, "cpu": self.hit_blocks_cpu, "total": self.hit_blocks},
            "miss_blocks": self.miss_blocks,
            "block_hit_rate": {t: self.block_hit_rate(t) for t in tiers},
            "token_hit_rate": {t: self.token_hit_rate(t) for t in tiers},
            "truncated_requests": self.truncated_requests,
            "truncated_blocks": self.truncated_blocks,
            "demotions": self.demotions,
            "demotions_not_admitted": self.demotions_not_admitted,
            "demotions_dropped_full": self.demotions_dropped_full,
            "restores": self.restores,
            "cpu_evictions": self.cpu_evictions,
            "bytes": {"gpu_to_cpu": self.bytes_gpu_to_cpu, "cpu_to_gpu": self.bytes_cpu_to_gpu},
            "seconds": round(self.seconds, 3),
            "bounds": self.bounds,
        }


def request_hints(req: Request, config: ReplayConfig) -> RequestHints | None:
    """What ``req`` tells the pool under ``config``'s hint set and TTL what-if (None: nothing)."""
    with_session = config.hints in ("session", "session+output") and req.session is not None
    session = str(req.session).encode() if with_session else None
    if session is None and config.retain_s == 0.0:
        return None
    output_tokens = req.output_length if with_session and config.hints == "session+output" else 0
    return RequestHints(session=session, retain_s=config.retain_s, at_s=req.timestamp / 1000.0,
                        output_tokens=output_tokens)


def replay(requests: Iterable[Request], config: ReplayConfig, *, progress: Any = None) -> ReplayResult:
    """Replay ``requests`` through a bookkeeping-only ``TieredPool`` (see the module docstring).

    ``progress``: an object with ``update(n)`` called once per request (e.g. a tqdm bar), or None.
    """
    from kvtier.tiers.pool import PoolSpec, TieredPool

    t0 = time.perf_counter()
    pool = TieredPool(PoolSpec("replay", config.block_size, config.block_bytes), cpu_blocks=config.cpu_blocks,
                      policy=config.policy, transfer=None, data=False, clean_ahead_blocks=0)
    pool.attach_gpu(num_blocks=config.gpu_blocks)
    res = ReplayResult(config)
    g, bs = config.gpu_blocks, config.block_size
    allocate, free, lookup = pool.allocate, pool.free, pool.lookup
    rid = "r"  # one request at a time: the id can be reused once freed
    for req in requests:
        keys = req.keys
        n = len(keys)
        res.requests += 1
        res.input_tokens += req.input_length
        hints = request_hints(req, config)
        if n <= g:
            allocate(rid, keys, n * bs, count=True, hints=hints)
        else:
            lookup(keys, count=True, hints=hints)
            allocate(rid, keys[:g], g * bs, count=False)
            res.truncated_requests += 1
            res.truncated_blocks += n - g
        free(rid)
        if progress is not None:
            progress.update(1)
    s = pool.stats()
    res.looked_up_blocks = s["looked_up_blocks"]
    res.hit_blocks_gpu = s["hit_blocks_gpu"]
    res.hit_blocks_cpu = s["hit_blocks_cpu"]
    res.miss_blocks = s["miss_blocks"]
    res.demotions = s["demotions"]
    res.demotions_not_admitted = s["demotions_not_admitted"]
    res.demotions_dropped_full = s["demotions_dropped_full"]
    res.restores = s["restores"]
    res.cpu_evictions = s["cpu_evictions"]
    res.seconds = time.perf_counter() - t0
    assert res.hit_blocks + res.miss_blocks == res.looked_up_blocks
    return res


# ---- sweep -------------------------------------------------------------------------------

_WORKER_REQUESTS: Sequence[Request] = ()


def _init_worker(requests: Sequence[Request]) -> None:
    global _WORKER_REQUESTS
    _WORKER_REQUESTS = requests


def _run_point(task: tuple[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    kind, arg = task
    if kind == "replay":
        return kind, arg, replay(_WORKER_REQUESTS, arg).to_dict()
    from kvtier.tools.belady import belady

    return kind, arg, belady(_WORKER_REQUESTS, arg[0], arg[1]).to_dict()


def sweep(requests: Sequence[Request], *, gpu_blocks: int, cpu_blocks: Sequence[int], policies: Sequence[str],
          block_size: int = DEFAULT_BLOCK_SIZE, block_bytes: int | None = None, jobs: int = 1,
          progress: bool | None = None, hint_sets: Sequence[str] = ("none",),
          retain_s: float = 0.0) -> dict[str, Any]:
    """Replay every (policy, hint set, CPU capacity) triple plus Belady at each total capacity: the
    miss-ratio curves."""
    from kvtier.tools.belady import infinite_cache

    if block_bytes is None:
        block_bytes = block_size * DEFAULT_BYTES_PER_TOKEN
    configs = [ReplayConfig(gpu_blocks, m, p, block_size, block_bytes, h, retain_s)
               for p in policies for h in hint_sets for m in cpu_blocks]
    tasks: list[tuple[str, Any]] = [("belady", (gpu_blocks + m, block_size)) for m in cpu_blocks]
    tasks += [("replay", c) for c in configs]
    results: dict[tuple[str, Any], dict[str, Any]] = {}
    bar = progress_bar(len(tasks), "sweep", progress)
    try:
        if jobs > 1 and len(tasks) > 1:
            import concurrent.futures as cf
            import multiprocessing as mp

            ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
            with cf.ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=ctx, initializer=_init_worker,
                                        initargs=(requests,)) as ex:
                for kind, arg, out in ex.map(_run_point, tasks):
                    results[kind, arg] = out
                    bar.update(1)
        else:
            _init_worker(requests)
            for task in tasks:
                kind, arg, out = _run_point(task)
                results[kind, arg] = out
                bar.update(1)
    finally:
        bar.close()
    inf = infinite_cache(requests, block_size).to_dict()
    points = []
    for c in configs:
        d = results["replay", c]
        d["bounds"] = {"belady": results["belady", (gpu_blocks + c.cpu_blocks, block_size)], "infinite": inf}
        points.append(d)
    return {
        "gpu_blocks": gpu_blocks,
        "cpu_blocks": list(cpu_blocks),
        "policies": list(policies),
        "hint_sets": list(hint_sets),
        "retain_s": retain_s,
        "block_size": block_size,
        "points": points,
        "belady": [results["belady", (gpu_blocks + m, block_size)] for m in cpu_blocks],
        "infinite": inf,
    }
