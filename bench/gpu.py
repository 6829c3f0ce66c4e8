#!/usr/bin/env python3
"""kvtier's GPU data path, measured: demote/restore GB/s against the copy peak, and interference.

Usage (from the repository root, kvtier installed or not):
    python3 bench/gpu.py [--out DIR] [--quick] [--cap-gbps 8] [--reps 8]

One command, a few minutes on an H100. Without CUDA it prints
"no CUDA device: nothing measured" and exits 0.

Sections
1. Pinning: the CPU tier's slabs come from ``host_memory.allocate_host_slab``
   (one mapping, ``cudaHostRegister`` in 1 GiB chunks, NUMA-bound first
   touch): seconds, chunks, NUMA node, and whether the copy kernel can
   address them.
2. Bandwidth: demotions (device -> pinned CPU slab, D2H) and restores (H2D)
   through ``CudaTransferEngine.submit`` for every copy method on this
   machine (kernel, memcpy, batch, staging), for
   - ``contig-2MiB``: a device ``[N, 2 MiB]`` slab (one 2 MiB run per block),
   - ``layers32-kv32KiB``: 32 per-layer ``[2, N, 32 KiB]`` tensors (2 MiB
     blocks in 64 fragments of 32 KiB, vLLM's layout),
   - ``layers32-kv64KiB``: the same with 64 KiB fragments (4 MiB blocks),
   with random distinct slots on both sides (as a pool's are), batches of 16
   and 128 blocks. GB/s = bytes / device seconds from the engine's timing
   events (``device_stats``); wall GB/s (submit to completion seen) beside it.
   In the same run, the peak: one ``copy_(non_blocking=True)`` (one
   cudaMemcpyAsync) of the batch's bytes between a contiguous device buffer
   and pinned memory (both the kvtier slab and a torch ``pin_memory`` buffer;
   the faster counts). Ratio = kvtier / peak.
3. Interference: a bf16 matmul loop on the default stream, alone and while
   demotions of the fragmented layout run back to back on the engine's
   low-priority stream, per method, with and without ``--cap-gbps`` (and the
   kernel also with its grid capped): matmul slowdown and demotion GB/s.

Targets (issue 7): restore and demote at >= 80% of peak for 2 MiB contiguous
blocks and >= 50% for the fragmented layout, at batch 128, best method per
direction. Results: a table on stdout, JSON in ``--out`` as
``gpu-<device name>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import random
import re
import statistics
import sys
import threading
import time
import types
from pathlib import Path

from report import loadavg, loadavg_text, progress, utc_now, write_json

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"contig-2MiB": 0.80, "layers32-kv32KiB": 0.50, "layers32-kv64KiB": 0.50}
TARGET_BATCH = 128
MiB = 1 << 20


def _import_kvtier() -> None:
    """Make ``kvtier.tiers`` importable from a plain checkout (the device machine has no install)."""
    try:
        import kvtier.tiers  # noqa: F401, PLC0415

        return
    except ImportError:
        pass
    pkg = types.ModuleType("kvtier")
    pkg.__path__ = []  # a namespace: subpackages are mapped below
    sys.modules["kvtier"] = pkg
    spec = importlib.util.spec_from_file_location(
        "kvtier.tiers", REPO / "tiers" / "__init__.py", submodule_search_locations=[str(REPO / "tiers")]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvtier.tiers"] = mod
    spec.loader.exec_module(mod)
    pkg.tiers = mod


def say(msg: str) -> None:
    """A progress line on stderr (stdout carries the tables)."""
    progress(msg, tag="bench/gpu")


# ---- layouts -----------------------------------------------------------------------------------


def device_layout(name: str, num_blocks: int):  # -> BlockLayout
    import torch  # noqa: PLC0415

    from kvtier.blocks.layout import BlockLayout  # noqa: PLC0415

    if name == "contig-2MiB":
        layout = BlockLayout.contiguous(num_blocks, 2 * MiB, "cuda")
        layout.slab().random_(0, 256)
        return layout
    frag = {"layers32-kv32KiB": 32 * 1024, "layers32-kv64KiB": 64 * 1024}[name]
    tensors = [torch.randint(0, 256, (2, num_blocks, frag), dtype=torch.uint8, device="cuda").view(torch.bfloat16)
               for _ in range(32)]
    return BlockLayout(tensors, [1] * 32)


# ---- measurements ------------------------------------------------------------------------------


def peak_gbps(nbytes: int, host_flat, reps: int) -> dict:  # host_flat: pinned uint8 tensor >= nbytes
    """One cudaMemcpyAsync of ``nbytes`` each way, event-timed; best of ``reps``."""
    import torch  # noqa: PLC0415

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = host_flat[:nbytes]
    stream = torch.cuda.Stream()
    out = {}
    for direction, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        times = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[direction] = nbytes / min(times[1:]) / 1e9
    del dev
    return out


def engine_gbps(engine, gpu, host, batch: int, reps: int, rng: random.Random) -> dict:
    """Demote then restore ``batch`` random blocks, ``reps`` times; GB/s per direction (device and wall)."""
    from kvtier.tiers.transfer import CopyKind  # noqa: PLC0415

    out = {}
    for direction, kind in (("d2h", CopyKind.DEMOTE), ("h2d", CopyKind.RESTORE)):
        walls = []
        before = engine.device_stats()[direction]
        for i in range(reps + 2):
            g = rng.sample(range(gpu.num_blocks), batch)
            h = rng.sample(range(host.num_blocks), batch)
            if i == 2:  # the first two are warm-up
                before = engine.device_stats()[direction]
            t0 = time.perf_counter()
            if kind is CopyKind.DEMOTE:
                tr = engine.submit(kind, gpu, g, host, h)
            else:
                tr = engine.submit(kind, host, h, gpu, g)
            if not tr.wait(120) or tr.error is not None:
                raise RuntimeError(f"{direction} transfer failed: {tr.error}")
            if i >= 2:
                walls.append(time.perf_counter() - t0)
        after = engine.device_stats()[direction]
        nbytes = batch * gpu.block_bytes
        out[direction] = {
            "gbps": (after["bytes"] - before["bytes"]) / (after["seconds"] - before["seconds"]) / 1e9,
            "wall_gbps": nbytes / statistics.median(walls) / 1e9,
            "bytes_per_transfer": nbytes,
        }
    return out


def matmul_ms(a, b, iters: int) -> float:
    import torch  # noqa: PLC0415

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.matmul(a, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def interference(make_engine, gpu, host, configs: list[dict], iters: int, batch: int) -> list[dict]:
    """Matmul ms/iter alone and while demotions run back to back; slowdown per config."""
    import torch  # noqa: PLC0415

    from kvtier.tiers.transfer import CopyKind  # noqa: PLC0415

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        matmul_ms(a, b, 5)
    results = []
    rng = random.Random(1)
    for cfg in configs:
        base = statistics.median(matmul_ms(a, b, iters) for _ in range(3))
        engine = make_engine(cfg)
        stop = threading.Event()
        moved = [0]

        def demote_loop() -> None:
            inflight = []
            while not stop.is_set():
                g = rng.sample(range(gpu.num_blocks), batch)
                h = rng.sample(range(host.num_blocks), batch)
                inflight.append(engine.submit(CopyKind.DEMOTE, gpu, g, host, h))
                if len(inflight) >= 2:  # keep two in flight: the stream never idles
                    t = inflight.pop(0)
                    t.wait(120)
                    moved[0] += t.nbytes if t.error is None else 0
            for t in inflight:
                t.wait(120)
                moved[0] += t.nbytes if t.error is None else 0

        worker = threading.Thread(target=demote_loop, daemon=True)
        worker.start()
        time.sleep(0.2)  # traffic is flowing
        t0, m0 = time.perf_counter(), moved[0]
        loaded = statistics.median(matmul_ms(a, b, iters) for _ in range(3))
        t1, m1 = time.perf_counter(), moved[0]
        stop.set()
        worker.join()
        engine.close()
        results.append({
            **cfg,
            "matmul_ms_alone": base,
            "matmul_ms_with_demotion": loaded,
            "slowdown_pct": (loaded / base - 1) * 100,
            "demote_gbps_during": (m1 - m0) / (t1 - t0) / 1e9,
        })
        say(f"interference {cfg}: {results[-1]['slowdown_pct']:+.1f}% at {results[-1]['demote_gbps_during']:.1f} GB/s")
    return results


# ---- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON")
    ap.add_argument("--reps", type=int, default=8, help="timed transfers per configuration")
    ap.add_argument("--quick", action="store_true", help="fewer configurations (a smoke run)")
    ap.add_argument("--cap-gbps", type=float, default=8.0, help="demotion cap for the interference runs")
    ap.add_argument("--blocks", type=int, default=256, help="blocks per tier (>= 2 x the largest batch)")
    args = ap.parse_args(argv)

    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    _import_kvtier()
    from kvtier.tiers import cuda_copy  # noqa: PLC0415
    from kvtier.tiers.host_memory import allocate_host_slab  # noqa: PLC0415
    from kvtier.tiers.transfer import CudaTransferEngine  # noqa: PLC0415

    props = torch.cuda.get_device_properties(0)
    cp = cuda_copy.cupy_module()
    methods = cuda_copy.available_methods() + ["staging"]
    batches = [TARGET_BATCH] if args.quick else [16, TARGET_BATCH]
    layouts = ["contig-2MiB", "layers32-kv32KiB"] if args.quick else list(TARGETS)
    result: dict = {
        "when": utc_now(),
        # The second H100 run measured the copy kernel at half the first's on
        # fragments, same code, on a busier host: record how busy.
        "loadavg_at_start": loadavg(),
        "device": props.name, "sms": props.multi_processor_count, "host": platform.node(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cupy": getattr(cp, "__version__", None),
        "methods": methods, "blocks": args.blocks, "reps": args.reps,
        "pinning": {}, "bandwidth": [], "peak": {}, "interference": [], "targets": {},
    }
    rng = random.Random(0)

    engines: dict[str, CudaTransferEngine] = {}
    for m in methods:
        t0 = time.perf_counter()
        engines[m] = CudaTransferEngine("cuda", copy_method=m)
        say(f"engine {m}: runs {engines[m].copy_methods} (start-up incl. self-test {time.perf_counter() - t0:.2f} s)")
        if engines[m].copy_methods["high"] != m:
            say(f"  method {m} unusable here; its rows measure {engines[m].copy_methods['high']}")

    for name in layouts:
        gpu = device_layout(name, args.blocks)
        t0 = time.perf_counter()
        host = allocate_host_slab(args.blocks, gpu.block_bytes, pin=True)
        info = dict(host.host_info, wall_s=time.perf_counter() - t0, bytes=args.blocks * gpu.block_bytes)
        if "kernel" in methods:
            info["kernel_addressable"] = cuda_copy.CudaPlanExecutor("cuda", method="kernel").accessible(host)
        result["pinning"][name] = info
        say(f"{name}: pinned {info['bytes'] / 2**30:.2f} GiB: {info}")
        flat = host.slab().view(-1)
        torch_pinned = torch.empty(flat.numel(), dtype=torch.uint8).pin_memory()
        for batch in batches:
            nbytes = batch * gpu.block_bytes
            pk_slab = peak_gbps(nbytes, flat, args.reps)
            pk_torch = peak_gbps(nbytes, torch_pinned, args.reps)
            peak = {d: max(pk_slab[d], pk_torch[d]) for d in ("h2d", "d2h")}
            result["peak"][f"{name}/{batch}"] = {"kvtier_slab": pk_slab, "torch_pinned": pk_torch, "peak": peak}
            for m in methods:
                r = engine_gbps(engines[m], gpu, host, batch, args.reps, rng)
                for d in ("d2h", "h2d"):
                    row = {"layout": name, "batch": batch, "method": engines[m].copy_methods["high"],
                           "direction": d, **r[d], "peak_gbps": peak[d], "ratio": r[d]["gbps"] / peak[d]}
                    result["bandwidth"].append(row)
                    say(f"{name} b={batch} {m} {d}: {row['gbps']:.1f} GB/s ({row['ratio']:.0%} of {peak[d]:.1f})")
        del torch_pinned, flat, host, gpu
        torch.cuda.empty_cache()

    for e in engines.values():
        e.close()

    # Interference: the fragmented layout, 32 blocks per demotion.
    gpu = device_layout("layers32-kv32KiB", args.blocks)
    host = allocate_host_slab(args.blocks, gpu.block_bytes, pin=True)
    cap = args.cap_gbps * 1e9
    configs = []
    # staging: a gather kernel into a device buffer, then one copy-engine memcpy; it
    # moved 2x batch's bytes on 32 KiB fragments, so what its kernel costs the model counts.
    for m in [x for x in ("kernel", "memcpy", "batch") if x in methods] + ["staging"]:
        configs.append({"method": m, "cap_gbps": None, "max_blocks": None})
        configs.append({"method": m, "cap_gbps": args.cap_gbps, "max_blocks": None})
    if "kernel" in methods:
        configs.append({"method": "kernel", "cap_gbps": args.cap_gbps, "max_blocks": max(1, props.multi_processor_count // 8)})

    def make_engine(cfg: dict) -> CudaTransferEngine:
        return CudaTransferEngine("cuda", copy_method=cfg["method"],
                                  demote_bandwidth_cap_bytes_per_s=cap if cfg["cap_gbps"] else None,
                                  demote_chunk_bytes=4 * MiB, low_priority_max_blocks=cfg["max_blocks"])

    result["interference"] = interference(make_engine, gpu, host, configs, iters=10 if args.quick else 20, batch=32)

    # Targets: best method per (layout, direction) at the target batch.
    for name in layouts:
        for d in ("d2h", "h2d"):
            rows = [r for r in result["bandwidth"] if r["layout"] == name and r["batch"] == TARGET_BATCH
                    and r["direction"] == d]
            best = max(rows, key=lambda r: r["ratio"])
            result["targets"][f"{name}/{d}"] = {"target": TARGETS[name], "best_method": best["method"],
                                                "ratio": best["ratio"], "met": best["ratio"] >= TARGETS[name]}

    print_tables(result)
    path = args.out / f"gpu-{re.sub(r'[^A-Za-z0-9._-]+', '-', props.name).strip('-')}.json"
    write_json(result, path, indent=1)
    return 0


def print_tables(result: dict) -> None:
    print(f"\n{result['device']} ({result['sms']} SMs), torch {result['torch']}, CUDA {result['cuda']}, "
          f"CuPy {result['cupy']}, methods {result['methods']}; load average at start "
          f"{loadavg_text(result.get('loadavg_at_start'))}")
    print("\nPinning (allocate_host_slab):")
    for name, info in result["pinning"].items():
        print(f"  {name:18s} {info['bytes'] / 2**30:6.2f} GiB  {info['pinned']!s:8s} chunks={info['chunks']:<3d} "
              f"{info['wall_s']:6.2f} s  NUMA node={info['numa_node']}  kernel-addressable={info.get('kernel_addressable')}")
    print("\nBandwidth (GB/s from events; wall = submit to completion seen; peak = one cudaMemcpyAsync):")
    print(f"  {'layout':18s} {'batch':>5s} {'method':8s} {'dir':4s} {'GB/s':>7s} {'wall':>7s} {'peak':>7s} {'ratio':>6s}")
    for r in result["bandwidth"]:
        print(f"  {r['layout']:18s} {r['batch']:5d} {r['method']:8s} {r['direction']:4s} {r['gbps']:7.1f} "
              f"{r['wall_gbps']:7.1f} {r['peak_gbps']:7.1f} {r['ratio']:6.0%}")
    print("\nInterference (bf16 8192^3 matmul loop on the default stream while demotions run):")
    print(f"  {'method':8s} {'cap GB/s':>8s} {'grid cap':>8s} {'alone ms':>9s} {'with ms':>9s} {'slowdown':>9s} {'demote GB/s':>11s}")
    for r in result["interference"]:
        print(f"  {r['method']:8s} {r['cap_gbps'] or '-':>8} {r['max_blocks'] or '-':>8} {r['matmul_ms_alone']:9.3f} "
              f"{r['matmul_ms_with_demotion']:9.3f} {r['slowdown_pct']:+8.1f}% {r['demote_gbps_during']:11.1f}")
    print("\nTargets (batch %d, best method per direction):" % TARGET_BATCH)
    for key, t in result["targets"].items():
        print(f"  {key:26s} {t['ratio']:6.0%} of peak (target {t['target']:.0%}, {t['best_method']}): "
              f"{'MET' if t['met'] else 'NOT MET'}")


if __name__ == "__main__":
    sys.exit(main())
