#!/usr/bin/env python3
"""Disk-tier benchmark: its read bandwidth against the same directory's sequential direct-I/O reads.

Usage:
    python bench/disk.py [--dir DIR] [--block-mib 2] [--blocks 512] [--fetch-blocks 64]
                         [--rounds 7] [--json PATH] [--quick]

A ``DiskTier`` (kvtier.tiers.disk_tier) is made in ``--dir`` (default: a new
directory under /var/tmp, on the disk, not a tmpfs) and filled with
``--blocks`` random blocks through ``write_back`` (timed: the write-back
rate). Then ``--rounds`` rounds, each running these back to back in a
rotating order (so a shared machine's drift hits all alike):

- ``dd``: ``dd if=<the tier's data file> of=/dev/null bs=<block> iflag=direct``
  over the same blocks: the directory's sequential read bandwidth, one
  request at a time (dd's own seconds, not its start-up);
- ``tier shuffled``: ``DiskTier.read_into`` of every block in a random order
  (a restore's blocks sit anywhere on disk), ``--fetch-blocks`` per call,
  into a page-aligned buffer (a CPU tier's slots on a CUDA host or in a
  persistent arena): parallel direct reads, every block's xxh3 checked;
- ``tier sequential``: the same in slot order;
- ``tier unaligned``: shuffled, into a buffer 64 bytes past a page boundary
  (an unpinned torch allocation: the CPU tier without CUDA), which direct
  I/O cannot read into: through a per-thread bounce buffer and a copy.

Every read is asserted complete (checksums verified by the tier), and some
blocks are compared byte for byte with what was written. Reported: median
GB/s of each, and per round each tier read's ratio to that round's dd
(median, min, max). Target: the shuffled tier read >= 70% of dd's (issue 34).

Results are printed as a table and written as JSON (default
``bench/results/disk-cpu.json``; ``--quick`` writes JSON only with ``--json``).
"""

from __future__ import annotations

import argparse
import mmap
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.tiers.disk_settings import DiskTierSettings
from kvtier.tiers.disk_tier import DATA_NAME, DiskTier

from report import git, loadavg, loadavg_text, machine_info, memory_facts, cpu_model_facts, table, write_json, yes

REPO = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.70
READS = ("tier shuffled", "tier sequential", "tier unaligned")


def block_of(i: int, block_bytes: int) -> bytes:
    """Block ``i``'s bytes: random, reproducible (to compare what comes back)."""
    return random.Random(i).randbytes(block_bytes)


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "big")


def fill(tier: DiskTier, n: int, block_bytes: int) -> float:
    """Write ``n`` blocks through write_back; seconds until all are durable."""
    blocks = [block_of(i, block_bytes) for i in range(min(n, 16))]  # 16 distinct blocks, reused: fast to make
    t0 = time.perf_counter()
    for i in range(n):
        while not tier.write_back(key_of(i), blocks[i % len(blocks)]):
            time.sleep(0.001)  # the queue is full: let the writer catch up
    assert tier.flush(600.0)
    took = time.perf_counter() - t0
    s = tier.stats()
    assert s["writes_done"] == n and s["write_errors"] == 0, s
    return took


def dd_read(path: Path, block_bytes: int, n: int) -> float:
    """dd's own seconds to read ``n`` blocks of ``path`` sequentially with direct I/O."""
    out = subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={block_bytes}", f"count={n}", "iflag=direct"],
                         capture_output=True, text=True, check=True)
    match = re.search(r"(\d+) bytes .* copied, ([0-9.e+-]+) s", out.stderr)
    assert match is not None, out.stderr
    assert int(match.group(1)) == n * block_bytes, out.stderr
    return float(match.group(2))


def tier_read(tier: DiskTier, order: Sequence[int], fetch: int, dests: list[memoryview]) -> float:
    """Seconds to read every block of ``order`` (``fetch`` per call) into ``dests``; all verified."""
    t0 = time.perf_counter()
    for start in range(0, len(order), fetch):
        keys = [key_of(i) for i in order[start:start + fetch]]
        got = tier.read_into(keys, dests[: len(keys)])
        assert got == len(keys), f"read {got} of {len(keys)}: {tier.stats()}"
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where the tier goes (default: a new dir under /var/tmp)")
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--blocks", type=int, default=512, help="blocks written and read (default 512: 1 GiB of 2 MiB)")
    ap.add_argument("--fetch-blocks", type=int, default=64, help="blocks per read_into call (a restore's run)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reader-threads", type=int, default=DiskTierSettings().reader_threads)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="64 blocks, 2 rounds (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.rounds = 64, 2
    if shutil.which("dd") is None:
        print("bench/disk.py needs dd (coreutils)", file=sys.stderr)
        return 2
    block_bytes = int(args.block_mib * (1 << 20))
    n = args.blocks
    env = machine_info(git_dirty=bool(git("status", "--porcelain", "--", "tiers", "bench/disk.py")))
    json_path = args.json or (None if args.quick else REPO / "bench" / "results" / "disk-cpu.json")
    own_dir = args.dir is None
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir="/var/tmp")) if own_dir else args.dir
    settings = DiskTierSettings(reader_threads=args.reader_threads)
    tier = DiskTier(root, "bench", {"bench": "disk"}, block_bytes=block_bytes, capacity_blocks=n, settings=settings)
    try:
        if not tier.wait_ready(60.0):
            print(f"the disk tier could not open {root}: {tier.last_error}", file=sys.stderr)
            return 2
        stats = tier.stats()
        data_file = Path(stats["path"]) / DATA_NAME
        fs = subprocess.run(["df", "-T", str(root)], capture_output=True, text=True).stdout.splitlines()[-1].split()
        write_s = fill(tier, n, block_bytes)
        fetch = min(args.fetch_blocks, n)
        aligned = mmap.mmap(-1, fetch * block_bytes)
        unaligned = mmap.mmap(-1, fetch * block_bytes + 4096)
        dests = {
            "tier shuffled": [memoryview(aligned)[i * block_bytes:(i + 1) * block_bytes] for i in range(fetch)],
            "tier unaligned": [memoryview(unaligned)[64 + i * block_bytes:64 + (i + 1) * block_bytes]
                               for i in range(fetch)],
        }
        dests["tier sequential"] = dests["tier shuffled"]
        # Slot order: the catalog's (least recent first is write order here, slot i = key i).
        sequential = list(range(n))
        rng = random.Random(34)
        # Spot check: what comes back is what was written.
        probe = rng.sample(range(n), min(8, n))
        got = tier.read_into([key_of(i) for i in probe], dests["tier shuffled"][: len(probe)])
        assert got == len(probe)
        for j, i in enumerate(probe):
            assert bytes(dests["tier shuffled"][j]) == block_of(i % 16, block_bytes), f"block {i} differs"
        runs: list[dict[str, float]] = []
        cases = ("dd", *READS)
        for r in range(args.rounds):
            seconds: dict[str, float] = {}
            order = cases[r % len(cases):] + cases[: r % len(cases)]
            for case in order:
                if case == "dd":
                    seconds[case] = dd_read(data_file, block_bytes, n)
                else:
                    keys = sequential if case == "tier sequential" else rng.sample(range(n), n)
                    seconds[case] = tier_read(tier, keys, fetch, dests[case])
            runs.append({c: n * block_bytes / s / 1e9 for c, s in seconds.items()})
            print(f"[disk] round {r + 1}/{args.rounds}: " + ", ".join(f"{c} {runs[-1][c]:.2f} GB/s" for c in cases),
                  file=sys.stderr)
        final = tier.stats()
        assert final["disk_corrupt"] == 0 and final["read_errors"] == 0, final
    finally:
        tier.close(60.0)
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)

    summary: dict[str, Any] = {}
    for case in cases:
        rates = [run[case] for run in runs]
        summary[case] = {"median_GBps": statistics.median(rates), "min_GBps": min(rates), "max_GBps": max(rates)}
        if case != "dd":
            ratios = [run[case] / run["dd"] for run in runs]
            summary[case].update(ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
    met = summary["tier shuffled"]["ratio_median"] >= TARGET_RATIO
    result: dict[str, Any] = {
        "env": {**env, **cpu_model_facts(), "filesystem": {"device": fs[0], "type": fs[1]}, "direct_io": stats["direct_io"],
                "preallocated": stats["preallocated"], "loadavg_at_end": loadavg(), **memory_facts()},
        "config": {"block_bytes": block_bytes, "blocks": n, "fetch_blocks": fetch, "rounds": args.rounds,
                   "reader_threads": args.reader_threads},
        "write_back": {"seconds": write_s, "GBps": n * block_bytes / write_s / 1e9},
        "reads": summary,
        "rounds": runs,
        "target_ratio": TARGET_RATIO,
        "meets_target": met,
    }
    rows = [[case, f"{summary[case]['median_GBps']:.3f}",
             f"{summary[case]['min_GBps']:.3f}..{summary[case]['max_GBps']:.3f}",
             "-" if case == "dd" else f"{summary[case]['ratio_median']:.0%}",
             "-" if case == "dd" else f"{summary[case]['ratio_min']:.0%}..{summary[case]['ratio_max']:.0%}"]
            for case in cases]
    print(table(["read", "median GB/s", "range GB/s", "vs dd (median)", "vs dd (range)"], rows,
                f"\nDisk tier reads vs dd iflag=direct, {n} blocks of {block_bytes >> 10} KiB "
                f"({n * block_bytes / (1 << 30):.2f} GiB), {fetch} per fetch, {args.rounds} rounds "
                f"({fs[1]} on {fs[0]}, {'direct' if stats['direct_io'] else 'buffered'} I/O, "
                f"{args.reader_threads} reader threads)"))
    print(f"write-back: {result['write_back']['GBps']:.3f} GB/s ({n} blocks durable in {write_s:.2f} s)")
    print(f"target: tier shuffled >= {TARGET_RATIO:.0%} of dd: {yes(met)} "
          f"(load average {loadavg_text(result['env']['loadavg_at_start'])} at start, "
          f"{loadavg_text(result['env']['loadavg_at_end'])} at end)")
    if json_path is not None:
        write_json(result, json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
