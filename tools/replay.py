"""`kvtier replay`: drive the real tiers code with a request trace and report hit rates.

The replay builds a ``TieredPool`` in bookkeeping-only mode (``data=False``,
no transfer engine, no bytes: every copy completes at once), with the same
block manager (GPU tier) and CPU tier the daemon uses, and clean-ahead off
(a block is demoted when the GPU tier evicts it). It is not a second
implementation of the tiers.

Accounting (also written into the JSON report, ``ACCOUNTING``):

1. Requests are processed one at a time, in trace (arrival) order; nothing
   overlaps. Timestamps are carried but not used by the pool.
2. Only full blocks count: block i of a request is full when
   (i+1)·block_size ≤ input_length. These are the request's looked-up blocks.
3. A request's blocks hit in order until the first block that is in no tier
   (prefix-stop); that block and every later one are misses. A hit counts for
   the first tier that holds it, GPU then CPU. (The pool's exact rule: the run
   of GPU-held blocks, then the run of CPU-held blocks; a GPU-held block after
   the CPU run began counts only if the CPU tier holds it too. On the shipped
   traces this never differs from the plain rule.)
4. The request's full blocks are then allocated in the GPU tier as the engine
   would (``pool.allocate(request, keys, len(keys)·block_size)``: GPU hits are
   touched, CPU hits restored into new slots, the rest allocated, evicting the
   least recently freed blocks, each evicted block demoted to the CPU tier
   if the CPU tier's policy admits it and does not hold it already), and freed
   last-to-first (vLLM order, ``pool.free``), so they stay cached.
5. A request with more full blocks than the GPU tier has (an engine could not
   hold its prompt): all its blocks are looked up and counted as in 3; then
   only its first ``gpu_blocks`` blocks are allocated and freed, the rest are
   not cached. Counted as ``truncated_requests`` / ``truncated_blocks``.
6. Block hit rate = hit blocks / looked-up blocks (per tier and total).
   Token-weighted hit rate = hit blocks · block_size / input tokens of all
   requests (the share of prompt tokens whose prefill is skipped; partial
   trailing blocks are in the denominator and never hit).
7. Bytes moved: demotions · block_bytes (GPU→CPU) and restores · block_bytes
   (CPU→GPU). ``block_bytes`` is a figure given on the command line (default
   512 tokens × 128 KiB per token, e.g. Llama-3.1-8B in bf16).
8. Bounds with the same accounting (``kvtier.tools.belady``): the infinite
   cache (a block hits iff it and every block before it were seen in an
   earlier request) and Belady's MIN for ONE cache of gpu_blocks + cpu_blocks.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.tiers.policies import DEFAULT_POLICY
from kvtier.tools.traces import Request, load_trace

__all__ = [
    "ACCOUNTING",
    "DEFAULT_POLICY",
    "ReplayConfig",
    "ReplayResult",
    "replay",
    "sweep",
    "parse_size",
    "register",
]

DEFAULT_BLOCK_SIZE = 512
DEFAULT_GPU_TOKENS = 100_000
DEFAULT_CPU_TOKENS = 3_000_000
DEFAULT_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V · layers · KV heads · head dim · bf16 (Llama-3.1-8B)
DEFAULT_SWEEP_CPU_TOKENS = (0, 250_000, 500_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000, 10_000_000,
                            20_000_000)
DEFAULT_SWEEP_POLICIES = ("lru", "arc", "s3fifo", "lru+admit2", "chain")

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

    def __post_init__(self) -> None:
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
        if n <= g:
            allocate(rid, keys, n * bs, count=True)
        else:
            lookup(keys, count=True)
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
          progress: bool | None = None) -> dict[str, Any]:
    """Replay every (policy, CPU capacity) pair plus Belady at each total capacity: the miss-ratio curve."""
    from kvtier.tools.belady import infinite_cache

    if block_bytes is None:
        block_bytes = block_size * DEFAULT_BYTES_PER_TOKEN
    configs = [ReplayConfig(gpu_blocks, m, p, block_size, block_bytes) for p in policies for m in cpu_blocks]
    tasks: list[tuple[str, Any]] = [("belady", (gpu_blocks + m, block_size)) for m in cpu_blocks]
    tasks += [("replay", c) for c in configs]
    results: dict[tuple[str, Any], dict[str, Any]] = {}
    bar = _progress_bar(len(tasks), "sweep", progress)
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
        "block_size": block_size,
        "points": points,
        "belady": [results["belady", (gpu_blocks + m, block_size)] for m in cpu_blocks],
        "infinite": inf,
    }


# ---- command line --------------------------------------------------------------------------

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_size(text: str) -> int:
    """``"3M"`` -> 3_000_000, ``"100k"`` -> 100_000, ``"1.5M"``, ``"64Ki"``; plain integers too."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kKmMgG]i?)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 195, 100k, 3M, 1.5M)")
    value = float(m.group(1)) * _SUFFIX[(m.group(2) or "").lower()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def _size_list(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``replay`` subcommand to ``kvtier``'s subparsers."""
    p = subparsers.add_parser(
        "replay",
        help="replay a request trace through the tiers and report hit rates",
        description="Replay a Mooncake-style (hash_ids) or token-id JSONL trace, plain or gzip, through the "
        "real GPU block manager and CPU tier in bookkeeping-only mode, and report hit rates by tier, "
        "demotions, restores, CPU evictions, bytes moved, and the infinite-cache and Belady bounds. "
        "Sizes accept k/M/G suffixes (decimal) and, with --sweep, comma-separated lists.",
        epilog="Accounting: " + " ".join(ACCOUNTING),
    )
    p.add_argument("trace", help="JSONL trace (plain or gzip): hash_ids (Mooncake) or token_ids per request")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu-blocks", type=parse_size, metavar="N", help="GPU tier size in blocks")
    gpu.add_argument("--gpu-tokens", type=parse_size, metavar="N",
                     help=f"GPU tier size in tokens (default {DEFAULT_GPU_TOKENS:,}; blocks = N // block-size)")
    cpu = p.add_mutually_exclusive_group()
    cpu.add_argument("--cpu-blocks", type=_size_list, metavar="M", help="CPU tier size in blocks (list with --sweep)")
    cpu.add_argument("--cpu-tokens", type=_size_list, metavar="M",
                     help=f"CPU tier size in tokens (default {DEFAULT_CPU_TOKENS:,}; list with --sweep)")
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"CPU-tier policy name (default {DEFAULT_POLICY})")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="TOKENS",
                   help=f"tokens per block (default {DEFAULT_BLOCK_SIZE}; for hash_ids traces: the trace's)")
    p.add_argument("--block-bytes", type=parse_size, metavar="B",
                   help=f"bytes per block for the bytes-moved figures (default block-size × "
                        f"{DEFAULT_BYTES_PER_TOKEN} B/token, Llama-3.1-8B bf16)")
    p.add_argument("--hash-algo", default="xxh3_128", help="hash for token_ids traces (xxh3_128 or sha256)")
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument("--no-belady", action="store_true", help="skip the Belady bound")
    p.add_argument("--sweep", action="store_true",
                   help="sweep CPU capacities (--cpu-tokens/--cpu-blocks lists; default 0..20M tokens) and "
                        "policies (--policies): the miss-ratio curve")
    p.add_argument("--policies", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help=f"policies for --sweep (default {','.join(DEFAULT_SWEEP_POLICIES)})")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes for --sweep")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON ('-' for stdout)")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG (with --sweep: the miss-ratio curve)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    from kvtier.tools import replay_nodes

    replay_nodes.add_arguments(p)  # --nodes, --remote-tokens/--remote-blocks, --assign
    p.set_defaults(func=main)
    return p


def _progress_bar(total: int, desc: str, enabled: bool | None) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # tools extra not installed: no bar
        enabled = False
    if enabled is False:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="req" if desc == "replay" else "run", file=sys.stderr,
                disable=None if enabled is None else False, leave=False, dynamic_ncols=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def main(args: argparse.Namespace) -> int:
    from kvtier.tools import replay_nodes

    replay_nodes.check_args(args)
    bs = args.block_size
    if bs < 1:
        raise SystemExit("kvtier replay: --block-size must be >= 1")
    gpu_blocks = args.gpu_blocks if args.gpu_blocks is not None else (
        (args.gpu_tokens if args.gpu_tokens is not None else DEFAULT_GPU_TOKENS) // bs)
    if args.cpu_blocks is not None:
        cpu_list = args.cpu_blocks
    elif args.cpu_tokens is not None:
        cpu_list = [t // bs for t in args.cpu_tokens]
    else:
        cpu_list = [t // bs for t in DEFAULT_SWEEP_CPU_TOKENS] if args.sweep else [DEFAULT_CPU_TOKENS // bs]
    if not cpu_list:
        raise SystemExit("kvtier replay: no CPU capacity given")
    if len(cpu_list) > 1 and not args.sweep:
        raise SystemExit("kvtier replay: several CPU capacities need --sweep")
    block_bytes = args.block_bytes if args.block_bytes is not None else bs * DEFAULT_BYTES_PER_TOKEN
    quiet_bar = False if args.quiet else None
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Said now, not after a sweep that may take minutes.
        raise SystemExit("kvtier replay: --plot needs matplotlib: pip install 'kvtier[tools]'")

    from kvtier.tiers.policies import make_policy
    from kvtier.tools.traces import TraceError

    policies = (args.policies or list(DEFAULT_SWEEP_POLICIES)) if args.sweep else [args.policy]
    for name in policies:
        try:
            make_policy(name, 1)
        except ValueError as exc:
            raise SystemExit(f"kvtier replay: {exc}") from None
    try:
        config = ReplayConfig(gpu_blocks, cpu_list[0], policies[0], bs, block_bytes)
    except ValueError as exc:
        raise SystemExit(f"kvtier replay: {exc}") from None
    try:
        requests = load_trace(args.trace, bs, hash_algo=args.hash_algo, limit=args.limit)
    except (OSError, TraceError, ValueError) as exc:
        raise SystemExit(f"kvtier replay: {exc}") from None
    if args.nodes is not None:
        return replay_nodes.main(args, requests, config)

    t0 = time.perf_counter()
    if args.sweep:
        report = sweep(requests, gpu_blocks=gpu_blocks, cpu_blocks=cpu_list, policies=policies, block_size=bs,
                       block_bytes=block_bytes, jobs=max(1, args.jobs), progress=quiet_bar)
        report.update(trace=str(args.trace), seconds=round(time.perf_counter() - t0, 3), accounting=ACCOUNTING)
        text = format_sweep(report)
    else:
        from kvtier.tools.belady import belady, infinite_cache

        bar = _progress_bar(len(requests), "replay", quiet_bar)
        try:
            res = replay(requests, config, progress=bar)
        finally:
            bar.close()
        res.bounds["infinite"] = infinite_cache(requests, bs).to_dict()
        if not args.no_belady:
            res.bounds["belady"] = belady(requests, gpu_blocks + config.cpu_blocks, bs).to_dict()
        report = res.to_dict()
        report.update(trace=str(args.trace), accounting=ACCOUNTING)
        text = format_result(report)
    if args.json != "-":
        print(text)
    if args.json:
        data = json.dumps(report, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(data)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(data)
    if args.plot:
        from kvtier.tools import mrc_plot

        if args.sweep:
            mrc_plot.plot_sweep(report, args.plot)
        else:
            mrc_plot.plot_result(report, args.plot)
    return 0


# ---- text output ----------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def format_result(r: dict[str, Any]) -> str:
    c = r["config"]
    bs = c["block_size"]
    br, tr = r["block_hit_rate"], r["token_hit_rate"]
    lines = [
        f"trace {r.get('trace', '')}: {r['requests']:,} requests, {r['looked_up_blocks']:,} full blocks looked up, "
        f"{r['input_tokens']:,} input tokens",
        f"GPU {c['gpu_blocks']:,} blocks ({c['gpu_blocks'] * bs:,} tokens), CPU {c['cpu_blocks']:,} blocks "
        f"({c['cpu_blocks'] * bs:,} tokens), policy {c['policy']}, block size {bs}",
        "",
        f"{'':14}{'blocks':>12}{'block rate':>12}{'token rate':>12}",
    ]
    for tier in ("gpu", "cpu", "total"):
        lines.append(f"{'hit ' + tier:14}{r['hit_blocks'][tier]:>12,}{br[tier]:>12.4f}{tr[tier]:>12.4f}")
    lines.append(f"{'miss':14}{r['miss_blocks']:>12,}")
    for name in ("belady", "infinite"):
        b = r["bounds"].get(name)
        if b is not None:
            cap = "" if b["capacity_blocks"] is None else f" ({b['capacity_blocks']:,} blocks)"
            lines.append(f"{'bound ' + name:14}{b['hit_blocks']:>12,}{b['block_hit_rate']:>12.4f}"
                         f"{b['token_hit_rate']:>12.4f}{cap}")
    lines += [
        "",
        f"demotions {r['demotions']:,} (not admitted {r['demotions_not_admitted']:,}), restores {r['restores']:,}, "
        f"CPU evictions {r['cpu_evictions']:,}",
        f"bytes GPU->CPU {_gib(r['bytes']['gpu_to_cpu'])}, CPU->GPU {_gib(r['bytes']['cpu_to_gpu'])} "
        f"({c['block_bytes']:,} B/block)",
    ]
    if r["truncated_requests"]:
        lines.append(f"{r['truncated_requests']:,} requests longer than the GPU tier: "
                     f"{r['truncated_blocks']:,} blocks looked up but not cached")
    lines.append(f"replayed in {r['seconds']:.2f} s")
    return "\n".join(lines)


def format_sweep(s: dict[str, Any]) -> str:
    bs = s["block_size"]
    policies = s["policies"]
    by = {(p["config"]["policy"], p["config"]["cpu_blocks"]): p for p in s["points"]}
    width = max(12, *(len(p) + 2 for p in policies))
    lines = [
        f"trace {s.get('trace', '')}: block hit rate, GPU {s['gpu_blocks']:,} blocks "
        f"({s['gpu_blocks'] * bs:,} tokens), block size {bs}",
        f"{'CPU blocks':>11}{'CPU tokens':>13}" + "".join(f"{p:>{width}}" for p in policies) + f"{'belady':>10}",
    ]
    for m, b in zip(s["cpu_blocks"], s["belady"]):
        row = f"{m:>11,}{m * bs:>13,}"
        row += "".join(f"{by[p, m]['block_hit_rate']['total']:>{width}.4f}" for p in policies)
        lines.append(row + f"{b['block_hit_rate']:>10.4f}")
    lines.append(f"infinite cache: {s['infinite']['block_hit_rate']:.4f}   "
                 f"(Belady: one cache of GPU + CPU blocks)   {s.get('seconds', 0):.1f} s")
    return "\n".join(lines)
