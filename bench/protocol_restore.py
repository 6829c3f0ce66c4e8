"""bench/protocol.py section 2: restore bandwidth through a live kvtierd's planes, against copy floors.

256 KiB blocks x 64 per call and 2 MiB blocks x 16 per call (the layouts of
``protocol_common.SPECS``). Blocks are stored first; daemon ``gpu`` has a GPU
tier big enough that every restore comes from it (store mode: the "GPU"
tier is host memory standing in for device memory on a CPU-only machine);
daemon ``cpu`` has no GPU tier (``--gpu-bytes 0``), so every restore comes
from its CPU tier. Every restore's reply is checked to name the expected
tier. Planes:

- ``inline``: the bytes come back as a ZMQ frame (zero-copy on the client);
- ``shm``: into this client's shared-memory arena (``open_arena``);
- ``kv``: into registered shared-memory KV tensors (``register_kv``), one
  block-major slab tensor [blocks, ...] (like for like with memcpy);
- ``kv-vllm``: the same into vLLM-style per-layer tensors
  [2, blocks, 16, heads, 128] (32 tensors, block_dim 1): 64 fragments per
  block, which is what an engine actually registers;
- ``shm lent`` / ``kv-vllm lent`` (CPU tier): ``restore(..., lend=True)``:
  kvtierd lends its CPU-tier rows and this process copies them into the
  arena / the vLLM-style tensors from its read-only mapping of the tier's
  file (``kvtier.client.arena_map``; memmove plans); the lend ends with
  the next lent restore (its ``release``), as the vLLM connector's worker does.

Baselines on the same bytes: ``memcpy numpy`` (``np.copyto`` of a same-size
buffer), ``memcpy torch`` (``Tensor.copy_``), ``zmq raw`` (the echo server
sends a preallocated buffer of the same bytes as one zero-copy frame in
reply to a small request, same ipc:// transport), ``redis GET`` (one
redis-py pipeline of GETs of the same blocks, unix socket and TCP), and
``zmq + memcpy in another process`` (the echo server copies the same number
of bytes into this process's shared-memory file on a raw ZMQ request: the
floor of the shm and kv planes, whose copy runs in the daemon). All kvtier
planes' bytes are verified once against what was stored. Every variant runs
once per repetition, interleaved. Reported: median ms per call, GB/s at the
median, best GB/s, and ratios = median over repetitions of (baseline time /
variant time). Targets, on the GPU tier (the CPU tier's beside them):
shm >= 0.7x memcpy (the faster of numpy and torch), inline >= 0.8x raw ZMQ.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from collections.abc import Callable
from typing import Any

from protocol_common import (
    TARGET_INLINE_VS_ZMQ,
    TARGET_SHM_VS_MEMCPY,
    PoolClient,
    Spec,
    interleaved,
    per_rep_ratio,
)
from report import percentile, progress, table, yes


def restore_fns(pcs: dict[str, PoolClient], hashes: list[bytes]
                ) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[Any], None]]]:
    """The kvtier variants (tier x plane) and their reply checks."""
    fns: dict[str, Callable[[], Any]] = {}
    check: dict[str, Callable[[Any], None]] = {}
    for tier, pc in pcs.items():
        c, slots, n = pc.client, pc.slots, pc.batch

        def want(res: Any, tier: str = tier, n: int = n) -> None:
            t = res.tiers
            if len(t) != n or t[0] != tier or t[-1] != tier:
                raise AssertionError(f"restore came back with {len(t)} blocks from {set(t)}, expected {n} from {tier}")

        fns[f"kvtier {tier}-tier inline"] = lambda c=c: c.restore(hashes)
        fns[f"kvtier {tier}-tier shm"] = lambda c=c, s=slots: c.restore(hashes, slots=s)
        fns[f"kvtier {tier}-tier kv"] = lambda c=c, s=slots: c.restore(hashes, slots=s, reg="slab")
        fns[f"kvtier {tier}-tier kv-vllm"] = lambda c=c, s=slots: c.restore(hashes, slots=s, reg="vllm")
        for plane in ("inline", "shm", "kv", "kv-vllm"):
            check[f"kvtier {tier}-tier {plane}"] = want
        if tier == "cpu":
            fns["kvtier cpu-tier shm lent"] = lambda pc=pc: lent_restore(pc, hashes, pc.arena_layout())
            fns["kvtier cpu-tier kv-vllm lent"] = lambda pc=pc: lent_restore(pc, hashes, pc.vllm_layout())
            check["kvtier cpu-tier shm lent"] = check["kvtier cpu-tier kv-vllm lent"] = want
    return fns, check


_lent_maps: Any = None
_pending: dict[int, list[int]] = {}  # id(client) -> lends copied, ended by its next lent restore


def lent_restore(pc: PoolClient, hashes: list[bytes], dst: Any) -> Any:
    """One lent restore (see the module docstring); raises if the daemon did not lend."""
    from kvtier.client.arena_map import ArenaMaps
    from kvtier.blocks.layout import BlockLayout
    from kvtier.blocks.copy_plan import copy_host_blocks

    global _lent_maps
    if _lent_maps is None:
        _lent_maps = ArenaMaps(BlockLayout.from_buffer)
    done = _pending.pop(id(pc.client), [])
    res = pc.client.restore(hashes, slots=pc.slots, lend=True, release=done)
    if res.lent is None:
        raise AssertionError("kvtierd did not lend the CPU-tier blocks")
    copy_host_blocks(_lent_maps.layout(res.lent), res.lent.slots, dst, pc.slots[:len(res.lent.slots)])
    if not res.lent.intact():
        raise AssertionError("the lent copy ended past its lease")
    _pending[id(pc.client)] = [res.lent.id]
    return res


def verify_planes(pcs: dict[str, PoolClient], hashes: list[bytes], expected: Any) -> None:
    """Every plane of every tier returns exactly the stored bytes (untimed)."""
    import numpy as np

    for tier, pc in pcs.items():
        c, slots = pc.client, pc.slots
        res = c.restore(hashes)
        assert np.array_equal(np.frombuffer(res.data, dtype=np.uint8), expected), f"{tier} inline bytes differ"
        pc.arena.as_numpy()[:] = 0
        c.restore(hashes, slots=slots)
        assert np.array_equal(pc.arena.as_numpy().reshape(-1), expected), f"{tier} shm bytes differ"
        pc.kv_slab.zero_()
        c.restore(hashes, slots=slots, reg="slab")
        assert np.array_equal(pc.slab_bytes(), expected), f"{tier} kv bytes differ"
        pc.kv_all.zero_()
        c.restore(hashes, slots=slots, reg="vllm")
        assert np.array_equal(pc.vllm_canonical(), expected), f"{tier} kv-vllm bytes differ"
        if tier == "cpu":
            pc.arena.as_numpy()[:] = 0
            lent_restore(pc, hashes, pc.arena_layout())
            assert np.array_equal(pc.arena.as_numpy().reshape(-1), expected), "cpu shm lent bytes differ"
            pc.kv_all.zero_()
            lent_restore(pc, hashes, pc.vllm_layout())
            assert np.array_equal(pc.vllm_canonical(), expected), "cpu kv-vllm lent bytes differ"


def bench_restore(args: argparse.Namespace, env: dict[str, Any], spec: Spec) -> dict[str, Any]:
    """Section 2 for one block size on the set-up in ``env``; the JSON object under ``res["restore"][name]``."""
    import numpy as np
    import torch
    import zmq

    name, bb, batch, heads = spec
    nbytes = bb * batch
    st = env["specs"][name]
    hashes = st["hashes"][:batch]
    expected = st["data"][:nbytes]
    pcs: dict[str, PoolClient] = st["clients"]
    progress(f"restore {name}: verifying every plane's bytes")
    verify_planes(pcs, hashes, expected)

    fns, check = restore_fns(pcs, hashes)
    # Baselines on the same bytes.
    src_np = np.array(expected, copy=True)
    dst_np = np.empty_like(src_np)
    np.copyto(dst_np, src_np)
    src_t = torch.from_numpy(np.array(expected, copy=True))
    dst_t = torch.empty_like(src_t)
    dst_t.copy_(src_t)
    fns["memcpy numpy"] = lambda: np.copyto(dst_np, src_np)
    fns["memcpy torch"] = lambda: dst_t.copy_(src_t)

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(env["echo"].endpoint)
    bw_req = b"BW" + nbytes.to_bytes(8, "little")

    def zmq_raw() -> Any:
        sock.send(bw_req)
        return sock.recv_multipart(copy=False)

    def want_zmq(frames: Any) -> None:
        if len(frames) != 2 or frames[1].buffer.nbytes != nbytes:
            raise AssertionError("raw ZMQ reply has the wrong size")

    fns["zmq raw"] = zmq_raw
    check["zmq raw"] = want_zmq

    # The floor of any plane whose copy runs in another process: one raw ZMQ
    # request, a memcpy there into this process's shared memory, the reply.
    from kvtier.client.shm_arena import ShmArena

    floor_arena = ShmArena.create(1, nbytes, name_prefix="kvtier-bench-floor")
    floor_view = np.frombuffer(floor_arena.buffer, dtype=np.uint8)
    cp_req = b"CP" + floor_arena.name.encode()

    def zmq_memcpy_elsewhere() -> Any:
        sock.send(cp_req)
        return sock.recv_multipart(copy=False)

    def want_copied(_frames: Any) -> None:
        if floor_view[0] != 7 or floor_view[-1] != 7:
            raise AssertionError("the echo server did not copy into the arena")

    fns["zmq + memcpy in another process"] = zmq_memcpy_elsewhere
    check["zmq + memcpy in another process"] = want_copied
    keys = [b"blk:" + h for h in hashes]

    def redis_get(r: Any) -> Callable[[], Any]:
        def run() -> Any:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            return pipe.execute()
        return run

    def want_redis(vals: list) -> None:
        if len(vals) != batch or any(v is None or len(v) != bb for v in vals):
            raise AssertionError("redis GET missed blocks")

    fns["redis GET (unix)"] = redis_get(env["redis_unix"])
    fns["redis GET (tcp)"] = redis_get(env["redis_tcp"])
    check["redis GET (unix)"] = want_redis
    check["redis GET (tcp)"] = want_redis
    assert b"".join(fns["redis GET (unix)"]()) == expected.tobytes(), "redis bytes differ"

    stats_before = {t: pc.client.stats()["pools"][f"bench-{name}"] for t, pc in pcs.items()}
    gc.collect()
    warm = max(2, args.reps // 10)
    times = interleaved(fns, args.reps, warm, label=f"restore {name}", check=check)
    stats_after = {t: pc.client.stats()["pools"][f"bench-{name}"] for t, pc in pcs.items()}
    sock.close(0)
    del floor_view
    floor_arena.close()
    floor_arena.unlink()

    out: dict = {"block_bytes": bb, "blocks_per_call": batch, "bytes_per_call": nbytes, "reps": args.reps,
                 "warmup": warm, "variants": {}}
    memcpy_ref = min(("memcpy numpy", "memcpy torch"), key=lambda k: statistics.median(times[k]))
    out["memcpy_reference"] = memcpy_ref
    for vname, ts in times.items():
        med = statistics.median(ts)
        row = dict(median_ms=med * 1e3, p10_ms=percentile(ts, 0.1) * 1e3, p90_ms=percentile(ts, 0.9) * 1e3,
                   gb_s=nbytes / med / 1e9, best_gb_s=nbytes / min(ts) / 1e9,
                   vs_memcpy=per_rep_ratio(times[memcpy_ref], ts), vs_zmq_raw=per_rep_ratio(times["zmq raw"], ts))
        if vname.startswith("kvtier"):
            row["tier"] = vname.split()[1].split("-")[0]
            row["plane"] = " ".join(vname.split()[2:])
        out["variants"][vname] = row
    out["pool_stats_delta"] = {
        t: {k: stats_after[t][k] - stats_before[t].get(k, 0) for k in
            ("demotions", "loads", "stores", "restores", "hit_blocks_gpu", "hit_blocks_cpu", "miss_blocks")
            if isinstance(stats_after[t].get(k), (int, float))}
        for t in stats_after
    }
    # The shm target's floor: a copy done by another process, with one raw ZMQ
    # round trip around it (no daemon logic at all).
    out["shm_floor_vs_memcpy"] = out["variants"]["zmq + memcpy in another process"]["vs_memcpy"]
    out["targets"] = {}
    for tier in pcs:
        shm = out["variants"][f"kvtier {tier}-tier shm"]["vs_memcpy"]
        inline = out["variants"][f"kvtier {tier}-tier inline"]["vs_zmq_raw"]
        out["targets"][tier] = dict(shm_vs_memcpy=shm, shm_met=shm >= TARGET_SHM_VS_MEMCPY,
                                    inline_vs_zmq=inline, inline_met=inline >= TARGET_INLINE_VS_ZMQ)
        lent = out["variants"].get(f"kvtier {tier}-tier shm lent")
        if lent is not None:  # for information beside the shm target: the same restore, lent
            out["targets"][tier]["shm_lent_vs_memcpy"] = lent["vs_memcpy"]
    return out




def report_restore(name: str, r: dict[str, Any]) -> str:
    """Section 2's table for one block size, as printed."""
    rows = [[vname, f"{v['median_ms']:.2f}", f"{v['p90_ms']:.2f}", f"{v['gb_s']:.2f}", f"{v['best_gb_s']:.2f}",
             f"{v['vs_memcpy']:.2f}x", f"{v['vs_zmq_raw']:.2f}x"] for vname, v in r["variants"].items()]
    return table(["variant", "median ms", "p90 ms", "GB/s", "best GB/s", "vs memcpy", "vs zmq raw"], rows,
                 f"\n2. Restore {name} blocks x {r['blocks_per_call']} per call ({r['bytes_per_call'] >> 20} MiB), "
                 f"{r['reps']} reps, interleaved; 'vs' = median over reps of baseline time / variant time "
                 f"(memcpy = {r['memcpy_reference']})")


def restore_target_rows(name: str, r: dict[str, Any]) -> list[list[str]]:
    """Section 2's rows of the targets table for one block size: the floor, then each tier's two
    targets (the CPU tier's in parentheses: reported, not judged)."""
    rows = [[f"  {name} floor: zmq + memcpy in another process vs memcpy (info)",
             f"{r['shm_floor_vs_memcpy']:.2f}x", "-"]]
    for tier, t in r["targets"].items():
        info = "" if tier == "gpu" else " (info)"
        rows.append([f"{name} shm restore >= 0.7x memcpy, {tier} tier{info}", f"{t['shm_vs_memcpy']:.2f}x",
                     yes(t["shm_met"]) if tier == "gpu" else f"({yes(t['shm_met'])})"])
        rows.append([f"{name} inline restore >= 0.8x raw zmq, {tier} tier{info}", f"{t['inline_vs_zmq']:.2f}x",
                     yes(t["inline_met"]) if tier == "gpu" else f"({yes(t['inline_met'])})"])
    return rows
