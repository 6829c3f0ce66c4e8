"""``kvtier replay``: the command line (arguments, checks, output) over ``core`` and ``nodes``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvtier.tools.replay.core import (
    ACCOUNTING,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BYTES_PER_TOKEN,
    DEFAULT_CPU_TOKENS,
    DEFAULT_GPU_TOKENS,
    DEFAULT_POLICY,
    DEFAULT_SWEEP_CPU_TOKENS,
    DEFAULT_SWEEP_POLICIES,
    HINT_SETS,
    ReplayConfig,
    replay,
    sweep,
)
from kvtier.tools.replay.nodes import ASSIGN_RULES, DEFAULT_ASSIGN, NodesConfig, compare
from kvtier.tools.replay.progress import progress_bar
from kvtier.tools.replay.report import format_nodes, format_result, format_sweep
from kvtier.tiers.units import parse_byte_size, parse_count
from kvtier.tools.traces import Request, load_trace

__all__ = ["SIZES_HELP", "byte_size_arg", "count_arg", "main", "register"]

# ---- the single-node command --------------------------------------------------------------

# Two grammars (kvtier.tiers.units): token and block counts are decimal ("128k" = 128,000 tokens),
# byte sizes are kvtierd's ("128K" = 131,072 bytes, "128KB" = 128,000).
SIZES_HELP = ("Token and block counts (--*-tokens, --*-blocks) take k/M/G (powers of 1000, 128k = 128,000) or "
              "Ki/Mi/Gi (powers of 1024) and, with --sweep, comma-separated lists. Byte sizes (--block-bytes) are "
              "read as kvtierd reads them: K/M/G, Ki/Mi/Gi and KiB/MiB/GiB are powers of 1024 (128K = 131,072), "
              "KB/MB/GB powers of 1000.")


def count_arg(text: str) -> int:
    """An argparse type for token and block counts: ``parse_count`` (``"128k"`` -> 128,000)."""
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def byte_size_arg(text: str) -> int:
    """An argparse type for byte sizes: ``parse_byte_size``, kvtierd's grammar (``"128K"`` -> 131,072)."""
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _count_list(text: str) -> list[int]:
    return [count_arg(part) for part in text.split(",") if part.strip()]


def _hint_sets(text: str) -> list[str]:
    sets = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [h for h in sets if h not in HINT_SETS]
    if bad or not sets:
        raise argparse.ArgumentTypeError(f"unknown hint set {','.join(bad) or text!r} (choose from "
                                         f"{', '.join(HINT_SETS)}, comma-separated)")
    return sets


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"--retain-s must be a finite number >= 0, got {text!r}")
    return value


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``replay`` subcommand to ``kvtier``'s subparsers."""
    p = subparsers.add_parser(
        "replay",
        help="replay a request trace through the tiers and report hit rates",
        description="Replay a Mooncake-style (hash_ids) or token-id JSONL trace, plain or gzip, through the "
        "real GPU block manager and CPU tier in bookkeeping-only mode, and report hit rates by tier, "
        "demotions, restores, CPU evictions, bytes moved, and the infinite-cache and Belady bounds. "
        + SIZES_HELP,
        epilog="Accounting: " + " ".join(ACCOUNTING),
    )
    p.add_argument("trace", help="JSONL trace (plain or gzip): hash_ids (Mooncake) or token_ids per request")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu-blocks", type=count_arg, metavar="N", help="GPU tier size in blocks (a count)")
    gpu.add_argument("--gpu-tokens", type=count_arg, metavar="N",
                     help=f"GPU tier size in tokens (default {DEFAULT_GPU_TOKENS:,}; blocks = N // block-size)")
    cpu = p.add_mutually_exclusive_group()
    cpu.add_argument("--cpu-blocks", type=_count_list, metavar="M",
                     help="CPU tier size in blocks (a count; list with --sweep)")
    cpu.add_argument("--cpu-tokens", type=_count_list, metavar="M",
                     help=f"CPU tier size in tokens (default {DEFAULT_CPU_TOKENS:,}; list with --sweep)")
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"CPU-tier policy name (default {DEFAULT_POLICY})")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="TOKENS",
                   help=f"tokens per block (default {DEFAULT_BLOCK_SIZE}; for hash_ids traces: the trace's)")
    p.add_argument("--block-bytes", type=byte_size_arg, metavar="B",
                   help=f"bytes per block for the bytes-moved figures, a byte size (64KiB, 128K = 131,072; default "
                        f"block-size × {DEFAULT_BYTES_PER_TOKEN} B/token, Llama-3.1-8B bf16)")
    p.add_argument("--hash-algo", default="xxh3_128", help="hash for token_ids traces (xxh3_128 or sha256)")
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument("--no-belady", action="store_true", help="skip the Belady bound")
    p.add_argument("--sweep", action="store_true",
                   help="sweep CPU capacities (--cpu-tokens/--cpu-blocks lists; default 0..20M tokens) and "
                        "policies (--policies): the miss-ratio curve")
    p.add_argument("--policies", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help=f"policies for --sweep, comma-separated (default {','.join(DEFAULT_SWEEP_POLICIES)}); "
                        "refused without --sweep (one replay: --policy)")
    p.add_argument("--hints", type=_hint_sets, default=["none"], metavar="SET[,SET]",
                   help="which request hints to replay with; a comma-separated list needs --sweep (one curve per "
                        "policy and set): 'none' (default) passes nothing; 'session' passes the trace's session "
                        "field as RequestHints(session, at_s=timestamp), for policies that use it (e.g. "
                        "chain+session); 'session+output' adds each request's output length (output_tokens, "
                        "which an engine reports as it generates); a trace without session fields then "
                        "replays as with 'none'")
    p.add_argument("--retain-s", type=_seconds, default=0.0, metavar="S",
                   help="TTL what-if: every request also carries retain_s=S (a soft TTL in seconds, honoured by "
                        "+session policies; default 0: none)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes for --sweep")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON ('-' for stdout)")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG (with --sweep: the miss-ratio curve)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    add_nodes_arguments(p)  # --nodes, --remote-tokens/--remote-blocks, --assign
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    check_args(args)
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

    if args.policies is not None and not args.sweep:
        # Once ignored without a word: the replay ran --policy's default instead.
        raise SystemExit("kvtier replay: --policies lists the policies of a --sweep; for one replay use "
                         f"--policy NAME (add --sweep to compare {','.join(args.policies) or 'them'})")
    policies = (args.policies or list(DEFAULT_SWEEP_POLICIES)) if args.sweep else [args.policy]
    for name in policies:
        try:
            make_policy(name, 1)
        except ValueError as exc:
            raise SystemExit(f"kvtier replay: {exc}") from None
    hint_sets = args.hints
    if len(hint_sets) > 1 and not args.sweep:
        raise SystemExit("kvtier replay: several hint sets need --sweep (one curve each; a single CPU capacity "
                         "is fine: --sweep --cpu-tokens 4M)")
    if args.nodes is not None and (hint_sets != ["none"] or args.retain_s):
        raise SystemExit("kvtier replay: --nodes does not take --hints or --retain-s")
    try:
        config = ReplayConfig(gpu_blocks, cpu_list[0], policies[0], bs, block_bytes, hint_sets[0], args.retain_s)
    except ValueError as exc:
        raise SystemExit(f"kvtier replay: {exc}") from None
    try:
        requests = load_trace(args.trace, bs, hash_algo=args.hash_algo, limit=args.limit)
    except (OSError, TraceError, ValueError) as exc:
        raise SystemExit(f"kvtier replay: {exc}") from None
    if args.nodes is not None:
        return main_nodes(args, requests, config)

    t0 = time.perf_counter()
    if args.sweep:
        report = sweep(requests, gpu_blocks=gpu_blocks, cpu_blocks=cpu_list, policies=policies, block_size=bs,
                       block_bytes=block_bytes, jobs=max(1, args.jobs), progress=quiet_bar, hint_sets=hint_sets,
                       retain_s=args.retain_s)
        report.update(trace=str(args.trace), seconds=round(time.perf_counter() - t0, 3), accounting=ACCOUNTING)
        text = format_sweep(report)
    else:
        from kvtier.tools.belady import belady, infinite_cache

        bar = progress_bar(len(requests), "replay", quiet_bar)
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


# ---- --nodes (called by main) --------------------------------------------------------------


def parse_assign(text: str) -> tuple[str, ...]:
    """``"hash"``, ``"round-robin"`` or a comma-separated list of rules (each replayed)."""
    rules = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [r for r in rules if r not in ASSIGN_RULES]
    if bad or not rules:
        raise argparse.ArgumentTypeError(f"unknown assignment {','.join(bad) or text!r} "
                                         f"(choose from {', '.join(ASSIGN_RULES)})")
    return rules


UNBOUNDED = -1  # what parse_remote_size returns for "unbounded" (None means "not given" to argparse)


def parse_remote_size(text: str) -> int:
    """A count as ``count_arg`` reads it, or ``unbounded`` (``UNBOUNDED``)."""
    if text.strip().lower() in ("unbounded", "inf"):
        return UNBOUNDED
    return count_arg(text)


def add_nodes_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--nodes`` options of ``kvtier replay``."""
    g = p.add_argument_group("several nodes sharing a remote tier (--nodes)")
    g.add_argument("--nodes", type=int, metavar="N",
                   help="replay on N nodes, each with the GPU and CPU capacities given, and report each node "
                        "alone (local), the nodes sharing one remote tier (global) and one cache of N times the "
                        "capacity")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--remote-tokens", type=parse_remote_size, metavar="T",
                      help="remote tier capacity in tokens, or 'unbounded' (default: N x the CPU tier)")
    size.add_argument("--remote-blocks", type=parse_remote_size, metavar="B",
                      help="remote tier capacity in blocks, or 'unbounded'")
    g.add_argument("--remote-write-through", action="store_true",
                   help="also replay a what-if the pool does not implement: every computed block is written to "
                        "the remote tier at once (the pool writes a block back only when a CPU tier evicts it)")
    g.add_argument("--assign", type=parse_assign, default=(DEFAULT_ASSIGN,), metavar="RULE[,RULE]",
                   help="request-to-node rule: hash (default: xxh3 of the first block that at most 1/N of the "
                        "requests share; sticky per conversation), round-robin, first-block; a list replays each")


def check_args(args: argparse.Namespace) -> None:
    """Reject option combinations ``--nodes`` does not support (before the trace is read)."""
    if args.nodes is None:
        if args.remote_tokens is not None or args.remote_blocks is not None:
            raise SystemExit("kvtier replay: --remote-tokens/--remote-blocks need --nodes N")
        return
    if args.nodes < 1:
        raise SystemExit("kvtier replay: --nodes must be >= 1")
    if args.sweep or args.plot:
        raise SystemExit("kvtier replay: --nodes does not combine with --sweep or --plot")


def main_nodes(args: argparse.Namespace, requests: Sequence[Request], node: ReplayConfig) -> int:
    """``kvtier replay --nodes N``: run ``compare`` and print or write the report."""
    check_args(args)
    nodes = args.nodes
    remote_blocks: int | None
    if args.remote_blocks is not None:
        remote_blocks = args.remote_blocks
    elif args.remote_tokens is not None:
        remote_blocks = args.remote_tokens if args.remote_tokens == UNBOUNDED else args.remote_tokens // node.block_size
    else:
        remote_blocks = nodes * node.cpu_blocks  # default: as much as all the nodes' CPU tiers together
    if remote_blocks == UNBOUNDED:
        remote_blocks = None
    try:
        config = NodesConfig(nodes, node, remote_blocks, args.assign, args.remote_write_through)
    except ValueError as exc:
        raise SystemExit(f"kvtier replay: {exc}") from None
    report = compare(requests, config, progress=False if args.quiet else None)
    report["trace"] = str(args.trace)
    if args.json != "-":
        print(format_nodes(report))
    if args.json:
        data = json.dumps(report, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(data)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(data)
    return 0
