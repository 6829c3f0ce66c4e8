#!/usr/bin/env python3
"""A 32 MiB restore into vLLM's KV, from the worker's request to the last byte, against a memcpy in one process.

Usage:
    python bench/vllm_restore.py [--reps 60] [--blocks 32] [--json PATH] [--quick]

What is timed is what vLLM's worker waits for when a synchronous load runs:
``WorkerSide.start_load_kv`` (``kvtier.integrations.vllm.worker``) with one
load of ``--blocks`` blocks, on KV tensors shaped as vLLM's CPU backend
allocates them for bench/vllm.py's model (4 layers of ``[num_blocks, 2, 2
KV heads, 128 tokens, 128]`` float32: 1 MiB a block, 32 MiB for its
4,096-token prefix), registered with kvtierd the way the connector does
(moved into ``/dev/shm`` in place; kvtierd copies straight into them).
No vLLM engine runs: the worker half imports no vLLM, so this is its
whole data path (bench/vllm.py times it inside real engines, beside
their forward).

The bench starts two kvtierd (``--device cpu``): ``gpu`` restores from its
GPU tier (host memory standing in for device memory on a CPU-only machine),
``cpu`` from its CPU tier (no GPU tier). Variants, each once per
repetition in a fresh random order (``bench/protocol_common.interleaved``):

- ``kvtier <tier>-tier, contiguous slots``: the load's vLLM block ids
  follow each other (a fresh engine's free list);
- ``kvtier <tier>-tier, scattered slots``: a random set of block ids;
  a CPU-tier restore comes back lent (``lend``: the worker copies from its
  read-only mapping of kvtierd's CPU-tier file, integrations/adapter/lent_restore.py);
  GPU-tier blocks kvtierd copies;
- ``kvtier cpu-tier, contiguous slots, kvtierd copies (lend off)``: the
  same restore with the worker's ``lend`` off, from a CPU-tier kvtierd of its
  own (before lends; leave out with ``--no-lend-variant``);
- ``kvtier cpu-tier, contiguous slots, plan per copy (before run tables)``:
  the same worker's lent restore (same tensors, same lends) planning each
  copy anew (``LentRestore.run_tables`` off for the call: the copy as it was
  before run tables; left out with ``--no-lend-variant``);
- ``kvtier cpu-tier, <contiguous|scattered> slots, memmove per run (before
  strided copies)``: the same, copied by a memmove per run and block
  (``LentRestore.copy_engine = "memmove"`` for the call), as before the
  strided copies (``strided_copy.py``: one ``np.copyto`` per run of a block
  and group of slots);
- ``kvtier cpu-tier, contiguous slots, 2 copy threads``: the same, its copy
  shared with a helper thread (``LentRestore.copy_threads = 2`` for the call;
  left out with ``--no-lend-variant``);
- ``kvtier gpu-tier, staged plane (info)``: the worker copies from a
  shared arena (``data_plane="staged"``);
- ``memcpy torch`` / ``memcpy numpy``: ``Tensor.copy_`` / ``np.copyto`` of
  the same number of bytes in this process (the reference: the faster);
- ``memcpy into /dev/shm (info)``: ``np.copyto`` into a ``/dev/shm``-backed
  buffer like vLLM's registered KV (4 KiB pages: what the destination
  itself costs a memcpy);
- ``in-process copy into vLLM's slots (info)``: ``copy_host_blocks`` (the
  memmove plans kvtier's own copies use) of the same blocks from a host slab
  into vLLM-shaped tensors (what a cache inside vLLM's process would do);
- ``round trip (heartbeat, info)``: the transport's floor.

Every variant's bytes are checked against what was stored (untimed, after
each timed call), and a heartbeat to its kvtierd waits for the daemon's
loop to finish with it (a 32 MiB staging buffer freed after the reply would
otherwise run beside the next variant). Reported: median ms, GB/s, and ``vs memcpy`` = median
over repetitions of memcpy time / variant time. Target (issue 35): the
contiguous restore >= 0.7x memcpy, both tiers. ``--baseline-pythonpath``
runs the same daemons from another checkout beside them (before/after in
one run: ``(baseline daemon)`` variants; the client side is this
checkout's). Beside it, the daemon's own
seconds per restore (``request_seconds_total``: receipt to reply handed to
ZMQ; one daemon per kind of restore) split the time between the daemon and
the rest (client, transport, worker); for each lent variant, the worker's
copy and its client's restore call (the lend's round trip) per restore. JSON: ``bench/results/vllm-restore-cpu.json``.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from protocol_common import interleaved, per_rep_ratio, request_counters
from protocol_servers import REPO, bench_daemon
from report import loadavg, loadavg_text, machine_info, memory_facts, progress, table, write_json, yes

TARGET_VS_MEMCPY = 0.7
LAYERS, KV_HEADS, BLOCK_TOKENS, HEAD_DIM = 4, 2, 128, 128  # bench/vllm.py's model, float32
NUM_BLOCKS = 133  # bench/vllm.py's engines: 4 requests' worth of 33 blocks, + 1
DEFAULT_JSON = REPO / "bench" / "results" / "vllm-restore-cpu.json"
PER_COPY = ", plan per copy (before run tables)"
TWO_THREADS = ", 2 copy threads"
MEMMOVES = ", memmove per run (before strided copies)"


def kv_tensors(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn((NUM_BLOCKS, 2, KV_HEADS, BLOCK_TOKENS, HEAD_DIM),
                                                            generator=g) for i in range(LAYERS)}


def pool_choice(name: str) -> Any:
    from kvtier.client.client import PoolLayout
    from kvtier.integrations.vllm.pool import PoolChoice

    block_bytes = LAYERS * 2 * KV_HEADS * BLOCK_TOKENS * HEAD_DIM * 4
    layout = PoolLayout(model=f"bench/{name}", block_size=BLOCK_TOKENS, block_bytes=block_bytes, dtype="float32",
                        num_layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, mode="store")
    return PoolChoice.single(f"vllm/bench/{name}", layout, tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)),
                      BLOCK_TOKENS)


def worker(endpoint: str, name: str, plane: str, kv: dict[str, Any], lend: bool = True) -> Any:
    from kvtier.integrations.vllm.settings import ConnectorSettings
    from kvtier.integrations.vllm.worker import WorkerSide

    settings = ConnectorSettings.from_extra_config({"socket": endpoint, "data_plane": plane, "timeout_s": 30.0,
                                                    "staging_blocks": 64, "lend": "auto" if lend else False})
    w = WorkerSide(settings, pool_choice(name), NUM_BLOCKS)
    w.register_kv_caches(kv)
    assert w._link is not None and w._link.is_up(), f"the worker did not connect to {endpoint}"
    return w


def run(args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    from kvtier.client.hashing import hash_token_blocks
    from kvtier.integrations.adapter.transfers import BlockTransfer, StepTransfers
    from kvtier.blocks.layout import BlockLayout
    from kvtier.blocks.copy_plan import copy_host_blocks

    n = args.blocks
    block_bytes = LAYERS * 2 * KV_HEADS * BLOCK_TOKENS * HEAD_DIM * 4
    nbytes = n * block_bytes
    workdir = env["workdir"]
    progress("starting kvtierd 'gpu' (restores from its GPU tier) and 'cpu' (gpu_bytes 0: from its CPU tier)")
    tier_bytes = (n + 8) * block_bytes
    dg = env["daemons"]["gpu"] = bench_daemon(workdir, "gpu", gpu_bytes=tier_bytes, cpu_bytes=tier_bytes)
    dg.spawn()
    dc = env["daemons"]["cpu"] = bench_daemon(workdir, "cpu", gpu_bytes=0, cpu_bytes=tier_bytes)
    dc.spawn()
    daemons = [("gpu", dg, ""), ("cpu", dc, "")]
    if args.baseline_pythonpath:
        # The same daemons running other code (an older checkout), side by side in this run.
        for tier, gpu in (("gpu", tier_bytes), ("cpu", 0)):
            d = env["daemons"][f"{tier}-baseline"] = bench_daemon(workdir, f"{tier}-baseline", gpu_bytes=gpu,
                                                                   cpu_bytes=tier_bytes)
            d.env["PYTHONPATH"] = args.baseline_pythonpath
            d.spawn()
            daemons.append((tier, d, " (baseline daemon)"))

    keys = hash_token_blocks(list(range(n * BLOCK_TOKENS)), BLOCK_TOKENS)
    src_slots = list(range(n))
    rng = random.Random(args.seed)
    contiguous = list(range(NUM_BLOCKS - n, NUM_BLOCKS))
    scattered = rng.sample(range(n, NUM_BLOCKS), n)
    fns: dict[str, Any] = {}
    check: dict[str, Any] = {}
    by_daemon: dict[str, Any] = {}  # daemon label -> its registered-plane worker
    want_by_tier: dict[str, Any] = {}
    lent_copy: dict[str, list[float]] = {}  # lent variant -> [seconds its worker copied, copies]
    lent_trip: dict[str, list[float]] = {}  # lent variant -> [seconds in the client's restore call, calls]
    if not args.no_lend_variant:
        # A CPU-tier daemon of its own with the worker's lend off: kvtierd copies into vLLM's tensors (before
        # lends). Its own daemon, so each daemon's time per restore is one kind of restore's.
        dl = env["daemons"]["cpu-lend-off"] = bench_daemon(workdir, "cpu-lend-off", gpu_bytes=0, cpu_bytes=tier_bytes)
        dl.spawn()
        daemons.append(("cpu", dl, ", kvtierd copies (lend off)"))
    for tier, d, which in daemons:
        kv = kv_tensors(seed=1 if tier == "gpu" else 2)
        w = worker(d.endpoint, f"restore-{tier}", "registered", kv, lend="lend off" not in which)
        env["workers"].append(w)
        by_daemon[f"{tier} tier{which}"] = w
        w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys, src_slots, "store")]))
        w.wait_for_stores()
        layout = BlockLayout(list(kv.values()), [0] * LAYERS)
        want = layout.gather(src_slots).clone()
        want_by_tier[tier] = want
        tiers = w._link.client.lookup(keys)
        assert list(tiers) == [tier] * n, f"{tier} daemon holds the blocks in {set(tiers)}"
        lender = w._plane._lent if tier == "cpu" and "lend off" not in which else None
        trip = [0.0, 0]  # this worker's client restore calls (the lend's round trip): seconds, calls
        if lender is not None:
            client, plain = w._link.client, w._link.client.restore

            def timed_restore(*a: Any, plain: Any = plain, trip: list[float] = trip, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return plain(*a, **k)
                finally:
                    trip[0] += time.perf_counter() - t0
                    trip[1] += 1

            client.restore = timed_restore
        variants = [("contiguous", contiguous, "", {}), ("scattered", scattered, "", {})]
        if lender is not None and not which and not args.no_lend_variant:
            # The same worker, memory and lends with the copy done the other ways (before/after, in one run).
            variants += [("contiguous", contiguous, PER_COPY, {"run_tables": False}),
                         ("contiguous", contiguous, MEMMOVES, {"copy_engine": "memmove"}),
                         ("scattered", scattered, MEMMOVES, {"copy_engine": "memmove"}),
                         ("contiguous", contiguous, TWO_THREADS, {"copy_threads": 2})]
        for label, slots, how, flags in variants:
            if which and label == "scattered":
                continue
            name = f"kvtier {tier}-tier, {label} slots{which}{how}"

            def restore(w: Any = w, slots: list[int] = slots, lender: Any = lender, flags: dict[str, Any] = flags,
                        name: str = name, trip: list[float] = trip) -> Any:
                if lender is None:
                    return w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, slots, "r")]))
                saved = {k: getattr(lender, k) for k in flags}
                for k, v in flags.items():
                    setattr(lender, k, v)
                seconds, copies = lender.copy_seconds_total, lender.copies
                trip_s, trips = trip[0], trip[1]
                try:
                    return w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, slots, "r")]))
                finally:
                    spent = lent_copy.setdefault(name, [0.0, 0])
                    spent[0] += lender.copy_seconds_total - seconds
                    spent[1] += lender.copies - copies
                    rt = lent_trip.setdefault(name, [0.0, 0])
                    rt[0] += trip[0] - trip_s
                    rt[1] += trip[1] - trips
                    for k, v in saved.items():
                        setattr(lender, k, v)

            fns[name] = restore

            def verify(_res: Any, w: Any = w, layout: Any = layout, slots: list[int] = slots, want: Any = want) -> None:
                errors = w.get_block_ids_with_load_errors()
                w.take_loaded()
                if errors:
                    raise AssertionError(f"{len(errors)} blocks were not restored")
                if not torch.equal(layout.gather(slots), want):
                    raise AssertionError("restored bytes differ from the stored ones")
                layout.scatter(slots, torch.zeros_like(want))  # the next restore must write them again
                # Untimed: kvtierd's loop done with this restore's after-work (a 32 MiB staging buffer freed) before
                # the next variant runs, which would otherwise share the 2 cores with it.
                w._link.client.heartbeat()

            check[name] = verify
            verify(fns[name]())  # once untimed: bytes checked, pages mapped
        if tier == "gpu" and not which:
            fns["round trip (heartbeat, info)"] = lambda c=w._link.client: c.heartbeat()
            env["rt_client"] = w._link.client
    # The staged plane, for information: the worker copies from its arena into vLLM's tensors.
    kv_staged = kv_tensors(seed=3)
    ws = worker(dg.endpoint, "restore-gpu", "staged", kv_staged)
    env["workers"].append(ws)
    staged_layout = BlockLayout(list(kv_staged.values()), [0] * LAYERS)
    fns["kvtier gpu-tier, staged plane (info)"] = lambda: ws.start_load_kv(
        StepTransfers(loads=[BlockTransfer(keys, contiguous, "r")]))

    def verify_staged(_res: Any) -> None:
        if ws.get_block_ids_with_load_errors():
            raise AssertionError("staged restore missed blocks")
        ws.take_loaded()
        if not torch.equal(staged_layout.gather(contiguous), want_by_tier["gpu"]):
            raise AssertionError("staged bytes differ")
        staged_layout.scatter(contiguous, torch.zeros_like(want_by_tier["gpu"]))
        ws._link.client.heartbeat()

    check["kvtier gpu-tier, staged plane (info)"] = verify_staged
    verify_staged(fns["kvtier gpu-tier, staged plane (info)"]())

    # Baselines on the same bytes, in this process.
    src_np = np.frombuffer(np.random.default_rng(args.seed).bytes(nbytes), dtype=np.uint8).copy()
    dst_np = np.empty_like(src_np)
    np.copyto(dst_np, src_np)
    src_t = torch.from_numpy(src_np.copy())
    dst_t = torch.empty_like(src_t)
    dst_t.copy_(src_t)
    fns["memcpy torch"] = lambda: dst_t.copy_(src_t)
    fns["memcpy numpy"] = lambda: np.copyto(dst_np, src_np)
    # The same memcpy into /dev/shm memory as vLLM's registered KV is (4 KiB pages: tmpfs has no huge
    # pages unless mounted with huge=), for information: what the destination itself costs.
    from kvtier.client.kv_share import share_kv_in_place

    dst_shm = torch.empty(nbytes, dtype=torch.uint8)
    share_kv_in_place([dst_shm])
    dst_shm_np = dst_shm.numpy()
    np.copyto(dst_shm_np, src_np)
    fns["memcpy into /dev/shm (info)"] = lambda: np.copyto(dst_shm_np, src_np)
    kv_local = kv_tensors(seed=4)
    local_layout = BlockLayout(list(kv_local.values()), [0] * LAYERS)
    rows = BlockLayout.contiguous(n, block_bytes)
    rows.slab().copy_(want_by_tier["gpu"])
    fns["in-process copy into vLLM's slots (info)"] = lambda: copy_host_blocks(rows, src_slots, local_layout, contiguous)

    untimed = {k: list(v) for k, v in lent_copy.items()}
    untimed_trip = {k: list(v) for k, v in lent_trip.items()}
    before = {t: request_counters(w._link.client, "restore") for t, w in by_daemon.items()}
    warm = max(2, args.reps // 10)
    load_start = loadavg()
    times = interleaved(fns, args.reps, warm, label="restore", check=check)
    load_end = loadavg()
    after = {t: request_counters(w._link.client, "restore") for t, w in by_daemon.items()}

    memcpy_ref = min(("memcpy torch", "memcpy numpy"), key=lambda k: statistics.median(times[k]))
    out: dict[str, Any] = {"blocks": n, "block_bytes": block_bytes, "bytes": nbytes, "reps": args.reps, "warmup": warm,
                           "kv_shape_per_layer": [NUM_BLOCKS, 2, KV_HEADS, BLOCK_TOKENS, HEAD_DIM], "layers": LAYERS,
                           "memcpy_reference": memcpy_ref, "loadavg_start": load_start, "loadavg_end": load_end,
                           "variants": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        out["variants"][name] = {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3, "p10_ms": sorted(ts)[len(ts) // 10] * 1e3,
                                 "p90_ms": sorted(ts)[len(ts) * 9 // 10] * 1e3, "gb_s": nbytes / med / 1e9,
                                 "vs_memcpy": per_rep_ratio(times[memcpy_ref], ts)}
    # The daemon's own share of a restore (both kinds of slots and the untimed warm-ups and checks).
    out["daemon_ms_per_restore"] = {t: 1e3 * (after[t][1] - before[t][1]) / max(1.0, after[t][0] - before[t][0])
                                    for t in after}
    # The worker's own lent copies (mapping lookup to lease check; timed repetitions and warm-ups): the rest of a
    # lent restore is the round trip.
    out["lent_copy_ms_per_restore"] = {
        t: 1e3 * (x[0] - untimed.get(t, [0.0, 0])[0]) / max(1, x[1] - untimed.get(t, [0.0, 0])[1])
        for t, x in lent_copy.items()}
    # The same workers' restore calls (request to reply decoded: the lend's round trip, kvtierd's time within).
    out["lent_round_trip_ms_per_restore"] = {
        t: 1e3 * (x[0] - untimed_trip.get(t, [0.0, 0])[0]) / max(1, x[1] - untimed_trip.get(t, [0.0, 0])[1])
        for t, x in lent_trip.items()}
    out["targets"] = {t: {"vs_memcpy": out["variants"][f"kvtier {t}-tier, contiguous slots"]["vs_memcpy"]}
                      for t in ("gpu", "cpu")}
    for t in out["targets"].values():
        t["met"] = t["vs_memcpy"] >= TARGET_VS_MEMCPY
    return out


def report(r: dict[str, Any]) -> str:
    rows = [[name, f"{v['median_ms']:.2f}", f"{v['p10_ms']:.2f}", f"{v['p90_ms']:.2f}", f"{v['gb_s']:.2f}",
             f"{v['vs_memcpy']:.2f}x"] for name, v in r["variants"].items()]
    parts = [table(["variant", "median ms", "p10 ms", "p90 ms", "GB/s", "vs memcpy"], rows,
                   f"Restore of {r['blocks']} blocks ({r['bytes'] >> 20} MiB) into vLLM-shaped KV, {r['reps']} reps, "
                   f"interleaved; vs memcpy = median over reps of memcpy time / variant time ({r['memcpy_reference']})")]
    parts.append("\nkvtierd's own time per restore (receipt to reply handed to ZMQ): "
                 + ", ".join(f"{t} {ms:.2f} ms" for t, ms in r["daemon_ms_per_restore"].items()))
    if r.get("lent_copy_ms_per_restore"):
        parts.append("the worker's lent copy per restore (mapping lookup to lease check): "
                     + ", ".join(f"{t} {ms:.2f} ms" for t, ms in r["lent_copy_ms_per_restore"].items()))
    if r.get("lent_round_trip_ms_per_restore"):
        parts.append("the worker's restore call per lent restore (request to reply, kvtierd's time within): "
                     + ", ".join(f"{t} {ms:.2f} ms" for t, ms in r["lent_round_trip_ms_per_restore"].items()))
    parts.append(table(["target", "measured", "met"],
                       [[f"contiguous restore >= {TARGET_VS_MEMCPY}x memcpy, {t} tier", f"{v['vs_memcpy']:.2f}x",
                         yes(v["met"])] for t, v in r["targets"].items()], "\nTarget (issue 35)"))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/vllm_restore.py", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default 60, 8 with --quick)")
    p.add_argument("--blocks", type=int, default=32, help="blocks per restore, 1 MiB each (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None,
                   help="results (default bench/results/vllm-restore-cpu.json; --quick writes only with --json)")
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument("--no-lend-variant", action="store_true",
                   help="leave out the CPU-tier variants with the worker's lend off (kvtierd copies), with "
                        "each lent copy planned anew (before run tables), by memmoves (before strided copies) and "
                        "on 2 threads")
    p.add_argument("--baseline-pythonpath", default=None, metavar="PATH",
                   help="also run the daemons with this PYTHONPATH (an older kvtier), side by side: before/after")
    args = p.parse_args(argv)
    args.reps = args.reps if args.reps is not None else (8 if args.quick else 60)
    if not 1 <= args.blocks <= NUM_BLOCKS // 2:
        p.error(f"--blocks must be in [1, {NUM_BLOCKS // 2}]")

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"machine": machine_info() | memory_facts(),
                           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    env: dict[str, Any] = {"workdir": Path(tempfile.mkdtemp(prefix="kvtier-bench-restore-")), "daemons": {},
                           "workers": []}
    rc = 0
    try:
        res["restore"] = run(args, env)
    finally:
        for w in env["workers"]:
            w.shutdown()
        res["exit_status"] = {name: d.stop() for name, d in env["daemons"].items()}
        shutil.rmtree(env["workdir"], ignore_errors=True)
        if any(code != 0 for code in res["exit_status"].values()):
            rc = 1
    res["machine"]["loadavg_at_end"] = loadavg()
    print(report(res["restore"]))
    print(f"\nload average: {loadavg_text(res['machine']['loadavg_at_start'])} at start, "
          f"{loadavg_text(res['machine']['loadavg_at_end'])} at end ({res['machine']['cpu_count']} CPUs); "
          f"daemons exited with {res['exit_status']}")
    path = args.json if args.json is not None else (None if args.quick else DEFAULT_JSON)
    if path is not None:
        write_json(res, path, wall_s=time.perf_counter() - t0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
