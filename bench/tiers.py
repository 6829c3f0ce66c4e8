#!/usr/bin/env python3
"""kvtier.tiers benchmarks: block-manager throughput, metadata bytes per block, GPU transfer bandwidth.

Usage:
    python bench/tiers.py [--blocks 100000] [--ops N] [--reps 5] [--json PATH] [--quick] [--profile]

Sections
1. Block-manager ops/s on a ``--blocks`` pool, driving a realistic request mix
   through ``BlockManager`` and, in the same run, through ``RefPrefixCache``
   (below): the obvious OrderedDict-based LRU prefix cache with the same
   semantics. Each request is ``longest_cached_prefix`` (a probe, as the pool's
   lookup does) -> ``allocate`` -> ``free`` once ``--window`` newer requests are
   in flight. Half the requests reuse the first k (1..R) blocks of one of the
   last ``--history`` requests; the pool is pre-filled (untimed) so that the
   timed region evicts cached blocks. Both implementations are first run in
   lockstep over the whole workload and must agree on every block table, hit
   count, new block, eviction and lookup result (assert), so the comparison is
   like for like.
   block-ops = blocks allocated + touched (hits) + freed (refs dropped)
               + looked up (hashes probed by the lookup: hits + first miss).
2. Metadata bytes per block: RSS growth of a fresh subprocess that builds a
   manager with ``--mem-blocks`` blocks and commits a 16-byte hash to every
   block (all free, all cached, all in the index), divided by the block count.
   Baseline = RSS after imports. The hash ``bytes`` objects (49 B each, 64 B in
   pymalloc's size class) are included: the store has to hold them. A second
   subprocess reports the same from tracemalloc (exact Python allocations) on a
   smaller pool.
3. With CUDA: demotion (GPU -> pinned CPU) and restore (pinned CPU -> GPU)
   bandwidth through ``CudaTransferEngine.submit`` between a device
   ``BlockLayout.contiguous`` and a pinned host ``BlockLayout.contiguous``
   (random slot permutations, as a real pool's slots are), for 64 KiB and 2 MiB
   blocks, next to one big ``copy_(non_blocking=True)`` of the same bytes.

Results are printed as tables and written as JSON (default
``bench/results/tiers-<hostname>.json``; ``--quick`` writes JSON only with
``--json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path

from report import git, loadavg, machine_info, memory_facts, progress, table, write_json, yes

REPO = Path(__file__).resolve().parent.parent

TARGET_OPS_PER_S = 500_000
TARGET_REF_RATIO = 1.0
TARGET_BYTES_PER_BLOCK = 250
TARGET_TRANSFER_RATIO = 0.80  # for 2 MiB blocks


# ---------------------------------------------------------------------------
# Reference implementation: the straightforward OrderedDict LRU prefix cache.
# ---------------------------------------------------------------------------


class RefNoFreeBlocks(RuntimeError):
    pass


class RefPrefixCache:
    """vLLM-v1 prefix-caching semantics, written the obvious way.

    hash -> block id dict (first-inserted live copy; later copies kept in a
    side dict of lists), an OrderedDict of free block ids as the LRU queue
    (``popitem(last=False)`` evicts, re-insertion appends), ref counts and
    hashes in plain lists. Same contract as ``BlockManager.allocate`` /
    ``free`` / ``longest_cached_prefix`` / ``commit``; returns block ids.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_q: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.index: dict[bytes, int] = {}
        self.dups: dict[bytes, list[int]] = {}
        self.requests: dict[str, list[int]] = {}

    def longest_cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        index = self.index
        hits = []
        for h in hashes:
            b = index.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def commit(self, block_id: int, block_hash: bytes) -> None:
        if self.block_hash[block_id] is not None:
            raise ValueError(f"block {block_id} is already committed")
        self.block_hash[block_id] = block_hash
        if block_hash in self.index:
            self.dups.setdefault(block_hash, []).append(block_id)
        else:
            self.index[block_hash] = block_id

    def _drop_hash(self, block_id: int) -> bytes:
        h = self.block_hash[block_id]
        self.block_hash[block_id] = None
        dups = self.dups.get(h)
        if self.index.get(h) == block_id:
            if dups:
                self.index[h] = dups.pop(0)
                if not dups:
                    del self.dups[h]
            else:
                del self.index[h]
        elif dups is not None:
            dups.remove(block_id)
            if not dups:
                del self.dups[h]
        return h

    def allocate(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int):
        """Returns (block_ids, num_hit_blocks, new_block_ids, evicted[(block_id, hash)])."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already has blocks")
        num_full = num_tokens // self.block_size
        if len(block_hashes) != num_full:
            raise ValueError(f"{num_tokens} tokens make {num_full} full blocks, got {len(block_hashes)} hashes")
        hits = self.longest_cached_prefix(block_hashes)
        ref_cnt, free_q, block_hash = self.ref_cnt, self.free_q, self.block_hash
        num_needed = -(-num_tokens // self.block_size) - len(hits)
        available = len(free_q) - sum(1 for b in hits if ref_cnt[b] == 0)
        if num_needed > available:
            raise RefNoFreeBlocks(f"request {request_id!r} needs {num_needed} new blocks, {available} available")
        for b in hits:  # touch
            if ref_cnt[b] == 0:
                del free_q[b]
            ref_cnt[b] += 1
        new = []
        evicted = []
        for _ in range(num_needed):
            b, _ = free_q.popitem(last=False)
            if block_hash[b] is not None:
                evicted.append((b, self._drop_hash(b)))
            ref_cnt[b] = 1
            new.append(b)
        for pos in range(len(hits), num_full):  # commit the new full blocks
            self.commit(new[pos - len(hits)], block_hashes[pos])
        table = hits + new
        self.requests[request_id] = table
        return table, len(hits), new, evicted

    def free(self, request_id: str) -> None:
        table = self.requests.pop(request_id)
        ref_cnt, free_q = self.ref_cnt, self.free_q
        for b in reversed(table):
            if ref_cnt[b] <= 0:
                raise ValueError(f"block {b} released more often than referenced")
            ref_cnt[b] -= 1
            if ref_cnt[b] == 0:
                free_q[b] = None


# ---------------------------------------------------------------------------
# Section 1: block-manager throughput
# ---------------------------------------------------------------------------


def make_workload(
    n_requests: int, *, blocks_per_req: int, block_size: int, p_share: float, history: int, seed: int
) -> list[tuple[str, list[bytes], int]]:
    """Requests (request_id, full-block hashes, num_tokens); chained-hash semantics:
    a shared prefix of k blocks is followed by hashes never seen before."""
    rng = random.Random(seed)
    reqs: list[tuple[str, list[bytes], int]] = []
    for i in range(n_requests):
        if reqs and rng.random() < p_share:
            lo = max(0, len(reqs) - history)
            parent = reqs[rng.randrange(lo, len(reqs))][1]
            k = rng.randint(1, blocks_per_req)
            hashes = parent[:k] + [rng.randbytes(16) for _ in range(blocks_per_req - k)]
        else:
            hashes = [rng.randbytes(16) for _ in range(blocks_per_req)]
        # Half the requests carry a partial last block (no hash) for decode room.
        extra = rng.randrange(1, block_size) if rng.random() < 0.5 else 0
        reqs.append((f"req-{i}", hashes, blocks_per_req * block_size + extra))
    return reqs


def drive(mgr, reqs, start: int, stop: int, window: int, inflight: deque) -> None:
    """The timed loop, identical for both implementations."""
    alloc = mgr.allocate
    free = mgr.free
    lookup = mgr.longest_cached_prefix
    push = inflight.append
    pop = inflight.popleft
    for i in range(start, stop):
        rid, hashes, ntok = reqs[i]
        lookup(hashes)
        alloc(rid, hashes, ntok)
        push(rid)
        if len(inflight) > window:
            free(pop())


def verify_and_count(kv_cls, reqs, prefill: int, window: int, num_blocks: int, block_size: int) -> dict:
    """Run both implementations in lockstep, assert identical decisions, count block-ops
    in the timed region [prefill, len(reqs))."""
    bm = kv_cls(num_blocks, block_size)
    ref = RefPrefixCache(num_blocks, block_size)
    inflight: deque[str] = deque()
    counts = dict(allocated=0, touched=0, freed=0, looked_up=0, evicted=0, requests=0)
    timed_counts = dict(counts)
    for i, (rid, hashes, ntok) in enumerate(reqs):
        c = counts if i < prefill else timed_counts
        if i == prefill:
            # the timed region starts with an LRU queue in the same state
            assert [b.block_id for b in bm.iter_free()] == list(ref.free_q), "free queues differ after prefill"
        hk = [b.block_id for b in bm.longest_cached_prefix(hashes)]
        hr = ref.longest_cached_prefix(hashes)
        assert hk == hr, f"lookup differs at request {i}: {hk} != {hr}"
        c["looked_up"] += min(len(hk) + 1, len(hashes))
        a = bm.allocate(rid, hashes, ntok)
        table, nhit, new, evicted = ref.allocate(rid, hashes, ntok)
        assert a.block_ids == table, f"block table differs at request {i}"
        assert a.num_hit_blocks == nhit, f"hit count differs at request {i}: {a.num_hit_blocks} != {nhit}"
        assert a.new_block_ids == new, f"new blocks differ at request {i}"
        assert [(e.block_id, e.block_hash) for e in a.evicted] == evicted, f"evictions differ at request {i}"
        c["touched"] += nhit
        c["allocated"] += len(new)
        c["evicted"] += len(evicted)
        c["requests"] += 1
        inflight.append(rid)
        if len(inflight) > window:
            old = inflight.popleft()
            c["freed"] += len(ref.requests[old])
            bm.free(old)
            ref.free(old)
    assert [b.block_id for b in bm.iter_free()] == list(ref.free_q), "free queues differ at the end"
    assert bm.num_cached_blocks == len(ref.index)
    timed_counts["block_ops"] = sum(timed_counts[k] for k in ("allocated", "touched", "freed", "looked_up"))
    return timed_counts


def bench_ops(args) -> dict:
    from kvtier.tiers.block_manager import BlockManager

    R, bs, window = args.req_blocks, args.block_size, args.window
    if args.blocks < (window + 2) * (R + 1):
        raise SystemExit(f"--blocks must be at least {(window + 2) * (R + 1)} for --window {window}")
    # Pre-fill: enough requests to cycle the whole pool once, so the timed region evicts.
    prefill = int(args.blocks / (R * (1 - args.p_share / 2))) + window + 1
    n_total = prefill + args.ops
    progress(f"generating workload: {n_total} requests of {R} blocks")
    reqs = make_workload(n_total, blocks_per_req=R, block_size=bs, p_share=args.p_share, history=args.history, seed=args.seed)

    progress("verifying kvtier == reference in lockstep over the whole workload ...")
    t0 = time.perf_counter()
    counts = verify_and_count(BlockManager, reqs, prefill, window, args.blocks, bs)
    progress(f"verified: identical block tables, hits, evictions, lookups ({time.perf_counter() - t0:.1f}s)")

    impls = {"kvtier": lambda: BlockManager(args.blocks, bs), "reference": lambda: RefPrefixCache(args.blocks, bs)}

    chunk = max(1, args.chunk)

    def one_rep(rep: int) -> tuple[dict[str, float], dict[str, float]]:
        """Both implementations side by side, alternating every ``chunk`` requests (the
        order flips each chunk) so that a change in machine load hits both alike."""
        mgrs = {name: make() for name, make in impls.items()}
        inflight: dict[str, deque[str]] = {name: deque() for name in impls}
        for name, mgr in mgrs.items():
            drive(mgr, reqs, 0, prefill, window, inflight[name])  # untimed pre-fill
        gc.collect()
        wall = dict.fromkeys(impls, 0.0)
        cpu = dict.fromkeys(impls, 0.0)
        names = list(impls)
        for j, start in enumerate(range(prefill, n_total, chunk)):
            stop = min(start + chunk, n_total)
            for name in names if j % 2 == 0 else names[::-1]:
                mgr, q = mgrs[name], inflight[name]
                c0 = time.process_time()
                t0 = time.perf_counter()
                drive(mgr, reqs, start, stop, window, q)
                t1 = time.perf_counter()
                c1 = time.process_time()
                wall[name] += t1 - t0
                cpu[name] += c1 - c0
            if j % 8 == 0:
                progress(f"rep {rep}/{args.reps}: {stop - prefill}/{n_total - prefill} requests", end="")
        return wall, cpu

    times: dict[str, list[float]] = {k: [] for k in impls}
    cpu_times: dict[str, list[float]] = {k: [] for k in impls}
    progress("warm-up", end="")
    one_rep(0)
    for rep in range(1, args.reps + 1):
        wall, cpu = one_rep(rep)
        for name in impls:
            times[name].append(wall[name])
            cpu_times[name].append(cpu[name])
    progress(f"ops: {args.reps} reps x {len(impls)} implementations done")

    out = {
        "workload": dict(
            pool_blocks=args.blocks, block_size=bs, blocks_per_request=R, window=window, p_share=args.p_share,
            history=args.history, prefill_requests=prefill, timed_requests=args.ops, seed=args.seed,
            reps=args.reps, chunk=chunk, counts=counts,
        ),
        "results": {},
    }
    for name, ts in times.items():
        med = statistics.median(ts)
        out["results"][name] = dict(
            seconds=ts, median_s=med, cpu_seconds=cpu_times[name],
            block_ops_per_s_cpu=counts["block_ops"] / statistics.median(cpu_times[name]),
            block_ops_per_s=counts["block_ops"] / med,
            block_ops_per_s_best=counts["block_ops"] / min(ts),
            block_ops_per_s_worst=counts["block_ops"] / max(ts),
            us_per_request=med / counts["requests"] * 1e6,
        )
    k = out["results"]["kvtier"]
    # Paired ratio: within a rep both ran interleaved chunk by chunk under the same load.
    paired = [tr / tk for tk, tr in zip(times["kvtier"], times["reference"])]
    out["ratio_per_rep"] = paired
    out["ratio_kvtier_over_reference"] = statistics.median(paired)
    out["ratio_kvtier_over_reference_cpu"] = statistics.median(
        tr / tk for tk, tr in zip(cpu_times["kvtier"], cpu_times["reference"]))
    out["target_ops_per_s"] = TARGET_OPS_PER_S
    out["met_ops_per_s"] = k["block_ops_per_s"] >= TARGET_OPS_PER_S
    out["met_vs_reference"] = out["ratio_kvtier_over_reference"] >= TARGET_REF_RATIO
    if args.profile:
        out["profile_top"] = profile_kvtier(reqs, prefill, n_total, window, args.blocks, bs)
    return out


def profile_kvtier(reqs, prefill, n_total, window, num_blocks, bs) -> list[dict]:
    import cProfile
    import pstats

    from kvtier.tiers.block_manager import BlockManager

    mgr = BlockManager(num_blocks, bs)
    inflight: deque[str] = deque()
    drive(mgr, reqs, 0, prefill, window, inflight)
    prof = cProfile.Profile()
    prof.enable()
    drive(mgr, reqs, prefill, n_total, window, inflight)
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append(dict(func=f"{Path(file).name}:{line}({fn})", ncalls=nc, tottime_s=tt, cumtime_s=ct))
    rows.sort(key=lambda r: r["tottime_s"], reverse=True)
    total = sum(r["tottime_s"] for r in rows)
    print("\ncProfile of the kvtier timed loop (top by own time):")
    print(f"  {'own s':>8} {'own %':>6} {'cum s':>8} {'calls':>10}  function")
    for r in rows[:15]:
        print(f"  {r['tottime_s']:8.3f} {100 * r['tottime_s'] / total:5.1f}% {r['cumtime_s']:8.3f} {r['ncalls']:10d}  {r['func']}")
    return rows[:25]


# ---------------------------------------------------------------------------
# Section 2: metadata bytes per block (fresh subprocesses)
# ---------------------------------------------------------------------------


def _mem_child(impl: str, n: int, mode: str) -> None:
    """Runs in a fresh interpreter; prints one JSON line."""
    import psutil

    from kvtier.tiers.block_manager import BlockManager

    proc = psutil.Process()
    rng = random.Random(1)
    hashes_iter = (rng.randbytes(16) for _ in range(n))
    gc.collect()
    if mode == "tracemalloc":
        import tracemalloc

        tracemalloc.start()
    rss0 = proc.memory_info().rss
    if impl == "kvtier":
        mgr = BlockManager(n, 16)
        gc.collect()
        rss_empty = proc.memory_info().rss
        tm_empty = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else None
        commit, blocks = mgr.commit, mgr.blocks
        for block, h in zip(blocks, hashes_iter):
            commit(block, h)
        assert mgr.num_cached_blocks == n and mgr.num_free_blocks == n
    else:
        mgr = RefPrefixCache(n, 16)
        gc.collect()
        rss_empty = proc.memory_info().rss
        tm_empty = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else None
        commit = mgr.commit
        for i, h in zip(range(n), hashes_iter):
            commit(i, h)
        assert len(mgr.index) == n and len(mgr.free_q) == n
    gc.collect()
    rss1 = proc.memory_info().rss
    res = dict(impl=impl, blocks=n, mode=mode)
    if mode == "tracemalloc":
        cur = tracemalloc.get_traced_memory()[0]
        res.update(bytes_per_block=cur / n, empty_bytes_per_block=tm_empty / n)
    else:
        res.update(
            rss_baseline=rss0, rss_after=rss1,
            bytes_per_block=(rss1 - rss0) / n, empty_bytes_per_block=(rss_empty - rss0) / n,
        )
    print(json.dumps(res))


def _run_child(impl: str, n: int, mode: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_mem-child", impl, str(n), mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_memory(args) -> dict:
    out: dict = {"blocks": args.mem_blocks, "tracemalloc_blocks": args.tm_blocks, "hash_bytes": 16, "results": {}}
    for impl in ("kvtier", "reference"):
        progress(f"memory: {impl}, {args.mem_blocks:,} blocks (RSS) ...", end="")
        rss = _run_child(impl, args.mem_blocks, "rss")
        progress(f"memory: {impl}, {args.tm_blocks:,} blocks (tracemalloc) ...", end="")
        tm = _run_child(impl, args.tm_blocks, "tracemalloc")
        out["results"][impl] = dict(
            rss_bytes_per_block=rss["bytes_per_block"], rss_empty_bytes_per_block=rss["empty_bytes_per_block"],
            tracemalloc_bytes_per_block=tm["bytes_per_block"], tracemalloc_empty_bytes_per_block=tm["empty_bytes_per_block"],
            rss_baseline=rss["rss_baseline"], rss_after=rss["rss_after"],
        )
    progress("memory: done")
    k = out["results"]["kvtier"]["rss_bytes_per_block"]
    out["target_bytes_per_block"] = TARGET_BYTES_PER_BLOCK
    out["met"] = k <= TARGET_BYTES_PER_BLOCK
    out["ratio_kvtier_over_reference"] = k / out["results"]["reference"]["rss_bytes_per_block"]
    return out


# ---------------------------------------------------------------------------
# Section 3: GPU <-> pinned CPU transfer bandwidth
# ---------------------------------------------------------------------------


def bench_transfer(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        print("GPU transfer section skipped: no CUDA")
        return {"skipped": True, "reason": "no CUDA"}
    from kvtier.blocks.layout import BlockLayout
    from kvtier.tiers.transfer import CopyKind, CudaTransferEngine

    total = args.transfer_mib << 20
    reps = args.reps
    out: dict = {
        "skipped": False, "device": torch.cuda.get_device_name(), "total_bytes": total, "reps": reps,
        "results": [], "target_ratio_2mib": TARGET_TRANSFER_RATIO,
    }

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    # Baseline: one big async copy of the same bytes between pinned host and device.
    big_h = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    big_d = torch.empty(total, dtype=torch.uint8, device="cuda")
    big_d.fill_(1)
    base = {}
    for direction, fn in (
        ("demote", lambda: big_h.copy_(big_d, non_blocking=True)),
        ("restore", lambda: big_d.copy_(big_h, non_blocking=True)),
    ):
        fn()
        ts = [timed(fn) for _ in range(reps)]
        base[direction] = total / statistics.median(ts) / 1e9
    del big_h, big_d

    engine = CudaTransferEngine("cuda")
    try:
        for block_bytes in (64 << 10, 2 << 20):
            n = total // block_bytes
            dev = BlockLayout.contiguous(n, block_bytes, "cuda")
            host = BlockLayout.contiguous(n, block_bytes, "cpu", pin=True)
            dev.slab().fill_(7)
            g = torch.Generator().manual_seed(0)
            dslots = torch.randperm(n, generator=g).tolist()
            hslots = torch.randperm(n, generator=g).tolist()
            for direction, kind, src, ss, dst, ds in (
                ("demote", CopyKind.DEMOTE, dev, dslots, host, hslots),
                ("restore", CopyKind.RESTORE, host, hslots, dev, dslots),
            ):
                def run_once() -> None:
                    tr = engine.submit(kind, src, ss, dst, ds)
                    if not tr.wait(60):
                        raise RuntimeError(f"{direction} timed out")
                    if tr.error is not None:
                        raise tr.error
                    engine.poll()

                progress(f"transfer: {direction} {block_bytes >> 10} KiB blocks x {n}", end="")
                run_once()  # warm-up
                ts = [timed(run_once) for _ in range(reps)]
                gbps = total / statistics.median(ts) / 1e9
                out["results"].append(dict(
                    direction=direction, block_bytes=block_bytes, num_blocks=n, engine_gb_s=gbps,
                    memcpy_gb_s=base[direction], ratio=gbps / base[direction], seconds=ts,
                ))
            # byte-exactness spot check after the round trip
            assert torch.equal(dev.slab()[dslots[0]].cpu(), host.slab()[hslots[0]])
            del dev, host
            torch.cuda.empty_cache()
    finally:
        engine.close()
    progress("transfer: done")
    r2 = [r["ratio"] for r in out["results"] if r["block_bytes"] == 2 << 20]
    out["met"] = bool(r2) and min(r2) >= TARGET_TRANSFER_RATIO
    return out


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def report(res: dict) -> str:
    parts = []
    ops = res.get("ops")
    if ops:
        w = ops["workload"]
        rows = []
        for name in ("kvtier", "reference"):
            r = ops["results"][name]
            rows.append([
                name, f"{r['block_ops_per_s']:,.0f}", f"{r['block_ops_per_s_worst']:,.0f}",
                f"{r['block_ops_per_s_best']:,.0f}", f"{r['block_ops_per_s_cpu']:,.0f}", f"{r['us_per_request']:.1f}",
            ])
        c = w["counts"]
        parts.append(table(
            ["impl", "block-ops/s (median)", "worst", "best", "per CPU-s", "us/request"], rows,
            f"1. Block manager, {w['pool_blocks']:,}-block pool, {w['timed_requests']:,} requests x {w['blocks_per_request']} "
            f"blocks, {w['reps']} reps ({c['block_ops']:,} block-ops/rep: {c['allocated']:,} allocated "
            f"[{c['evicted']:,} evicting], {c['touched']:,} touched, {c['freed']:,} freed, {c['looked_up']:,} looked up)",
        ))
        parts.append(f"   kvtier / reference = {ops['ratio_kvtier_over_reference']:.2f}x wall, "
                     f"{ops['ratio_kvtier_over_reference_cpu']:.2f}x CPU time (median of per-rep ratios; "
                     f"the two alternate every {w['chunk']} requests)")
    mem = res.get("memory")
    if mem:
        rows = []
        for name in ("kvtier", "reference"):
            r = mem["results"][name]
            rows.append([
                name, f"{r['rss_bytes_per_block']:.1f}", f"{r['rss_empty_bytes_per_block']:.1f}",
                f"{r['tracemalloc_bytes_per_block']:.1f}", f"{r['tracemalloc_empty_bytes_per_block']:.1f}",
            ])
        parts.append(table(
            ["impl", "RSS B/block", "RSS B/block (no hashes)", "tracemalloc B/block", "tracemalloc (no hashes)"], rows,
            f"\n2. Metadata per block: {mem['blocks']:,} blocks all cached with 16-byte hashes (RSS), "
            f"{mem['tracemalloc_blocks']:,} (tracemalloc)",
        ))
        parts.append(f"   kvtier / reference = {mem['ratio_kvtier_over_reference']:.2f}x")
    tr = res.get("transfer")
    if tr is not None:
        if tr.get("skipped"):
            parts.append(f"\n3. GPU transfer section skipped: {tr.get('reason')}")
        else:
            rows = [[
                f"{r['block_bytes'] >> 10} KiB", r["direction"], f"{r['num_blocks']:,}", f"{r['engine_gb_s']:.2f}",
                f"{r['memcpy_gb_s']:.2f}", f"{100 * r['ratio']:.0f}%",
            ] for r in tr["results"]]
            parts.append(table(
                ["block", "direction", "blocks", "engine GB/s", "1 memcpy GB/s", "ratio"], rows,
                f"\n3. GPU <-> pinned CPU on {tr['device']}, {tr['total_bytes'] >> 20} MiB per transfer",
            ))
    trows = []
    if ops:
        k = ops["results"]["kvtier"]["block_ops_per_s"]
        trows.append([">= 500k block-ops/s", f"{k:,.0f}", yes(ops["met_ops_per_s"])])
        trows.append([">= reference ops/s", f"{ops['ratio_kvtier_over_reference']:.2f}x", yes(ops["met_vs_reference"])])
    if mem:
        trows.append(["<= 250 B/block", f"{mem['results']['kvtier']['rss_bytes_per_block']:.1f}", yes(mem["met"])])
    if tr is not None:
        if tr.get("skipped"):
            trows.append([">= 80% of memcpy (2 MiB)", "skipped", "n/a"])
        else:
            r2 = [r["ratio"] for r in tr["results"] if r["block_bytes"] == 2 << 20]
            trows.append([">= 80% of memcpy (2 MiB)", f"{100 * min(r2):.0f}% (worst dir)", yes(tr["met"])])
    parts.append(table(["target", "kvtier", "met"], trows, "\nTargets"))
    return "\n".join(parts)


def tiers_machine_info() -> dict:
    """The shared machine facts, the processor and whether the block manager differs from HEAD, then
    torch and its CUDA device (section 3 depends on them)."""
    # others edit concurrently: say whether the measured block manager differs from HEAD
    info = machine_info(processor=True,
                        block_manager_dirty=bool(git("status", "--porcelain", "--", "tiers/block_manager.py")))
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_available"] = torch.cuda.is_available()
        if info["cuda_available"]:
            info["cuda_device"] = torch.cuda.get_device_name()
    except Exception as exc:  # torch missing is not fatal for sections 1 and 2
        info["torch"] = f"unavailable: {exc}"
    info.update(memory_facts())
    return info


def default_json_path() -> Path:
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname() or "") or "cpu"
    return REPO / "bench" / "results" / f"tiers-{host}.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/tiers.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--blocks", type=int, default=100_000, help="GPU-tier pool size for the ops benchmark")
    p.add_argument("--ops", type=int, default=None,
                   help="timed requests per repetition (each: 1 lookup + 1 allocate + 1 free, ~100 block-ops); "
                        "default 30000, 3000 with --quick")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions, median reported (default 5, 3 with --quick)")
    p.add_argument("--req-blocks", type=int, default=32, help="full blocks per request (R)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--window", type=int, default=32, help="requests in flight (freed FIFO)")
    p.add_argument("--p-share", type=float, default=0.5, help="probability a request reuses a previous request's prefix")
    p.add_argument("--history", type=int, default=2000, help="shared prefixes come from the last N requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=1000,
                   help="the two implementations alternate every CHUNK requests within a repetition")
    p.add_argument("--mem-blocks", type=int, default=None, help="blocks for the RSS measurement (default 1000000, 200000 with --quick)")
    p.add_argument("--tm-blocks", type=int, default=None, help="blocks for the tracemalloc measurement (default 200000, 50000 with --quick)")
    p.add_argument("--transfer-mib", type=int, default=None, help="bytes per GPU transfer in MiB (default 1024, 256 with --quick)")
    p.add_argument("--sections", default="ops,memory,transfer", help="comma-separated subset of ops,memory,transfer")
    p.add_argument("--profile", action="store_true", help="also cProfile the kvtier timed loop and print the top functions")
    p.add_argument("--json", type=Path, default=None,
                   help="write results here (default bench/results/tiers-<hostname>.json; --quick writes only with --json)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run (~20 s)")
    p.add_argument("--_mem-child", nargs=3, metavar=("IMPL", "N", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._mem_child:
        impl, n, mode = args._mem_child
        _mem_child(impl, int(n), mode)
        return 0

    q = args.quick
    args.ops = args.ops if args.ops is not None else (3000 if q else 30_000)
    args.reps = args.reps if args.reps is not None else (3 if q else 5)
    args.mem_blocks = args.mem_blocks if args.mem_blocks is not None else (200_000 if q else 1_000_000)
    args.tm_blocks = args.tm_blocks if args.tm_blocks is not None else min(args.mem_blocks, 50_000 if q else 200_000)
    args.transfer_mib = args.transfer_mib if args.transfer_mib is not None else (256 if q else 1024)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - {"ops", "memory", "transfer"}
    if unknown:
        p.error(f"unknown sections: {sorted(unknown)}")

    t_start = time.perf_counter()
    res: dict = {"machine": tiers_machine_info(), "quick": q, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                 for k, v in vars(args).items() if not k.startswith("_")}}
    if "ops" in sections:
        res["ops"] = bench_ops(args)
    if "memory" in sections:
        res["memory"] = bench_memory(args)
    if "transfer" in sections:
        try:
            res["transfer"] = bench_transfer(args)
        except Exception as exc:  # a broken GPU path must not lose sections 1 and 2
            res["transfer"] = {"skipped": True, "reason": f"error: {type(exc).__name__}: {exc}"}
            print(f"GPU transfer section failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    res["wall_s"] = time.perf_counter() - t_start
    res["machine"]["loadavg_at_end"] = loadavg()

    print(report(res))
    path = args.json if args.json is not None else (None if q else default_json_path())
    if path is not None:
        write_json(res, path, wall_s=res["wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
