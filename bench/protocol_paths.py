"""bench/protocol.py section 3, in-process part: the lookup path and the daemon's host copy path, piece by piece.

No daemon and no profiler: each piece of what the client and kvtierd's loop
thread run per request is called directly in this process and timed alone,
interleaved with the others (``protocol_common.interleaved``), so the pieces'
sizes can be compared with one another and with a round trip.

- Lookup path (256 hashes): the client's checks and encoding, the daemon's
  decoding, validation, pool lookup (policies ``chain`` and ``lru``) and
  reply encoding, in the array form (hashes as 256 bins, tiers as 256
  strings) and the packed form (one bin each way) side by side; the
  ``total`` rows add up each form's protocol pieces (the pool lookup aside).
- Host copy path (``kvtier.blocks.copy_plan.copy_host_blocks``: a copy plan
  of merged byte runs executed with ``ctypes.memmove``) into an arena, a new
  staging buffer and vLLM's per-layer tensors, and its parts, beside one
  ``memmove`` of all the bytes and ``np.copyto``: GB/s at the median.

Run by ``protocol_profile.run_profiles`` (only when profiles are taken).
"""

from __future__ import annotations

import statistics
from typing import Any

from protocol_common import BLOCK_TOKENS, HEAD_DIM, NUM_LAYERS, SPECS, Spec, interleaved
from report import percentile, table


def copy_path_breakdown(spec: Spec, reps: int) -> dict[str, dict[str, Any]]:
    """The daemon's host copy path (``blocks.copy_plan.copy_host_blocks``: a copy plan of merged
    byte runs executed with ctypes.memmove) and its parts, timed in this process."""
    import ctypes

    import numpy as np
    import torch

    from kvtier.blocks.copy_plan import execute_plan_cpu, plan_block_copy
    from kvtier.blocks.layout import BlockLayout
    from kvtier.blocks.copy_plan import copy_host_blocks

    name, bb, batch, heads = spec
    src = BlockLayout.contiguous(batch * 2, bb, "cpu")  # the store-mode "GPU" tier: a host slab
    src.slab().fill_(3)
    arena = np.zeros(batch * bb, dtype=np.uint8)
    dst = BlockLayout.from_buffer(arena, batch, bb)
    kv_all = torch.zeros([NUM_LAYERS, 2, batch, BLOCK_TOKENS, heads, HEAD_DIM], dtype=torch.bfloat16)
    vllm = BlockLayout([kv_all[layer] for layer in range(NUM_LAYERS)], [1] * NUM_LAYERS)
    slots = list(range(batch))
    plan = plan_block_copy(src, slots, dst, slots)
    s_np = src.slab()[:batch].numpy().reshape(-1)
    d_np = dst.slab().numpy().reshape(-1)
    nbytes = batch * bb

    def staging_inline() -> None:
        st = BlockLayout.contiguous(batch, bb, "cpu")
        copy_host_blocks(src, slots, st, slots)

    cases = {
        "copy_host_blocks slab -> arena (shm/kv planes)": lambda: copy_host_blocks(src, slots, dst, slots),
        "  plan_block_copy alone": lambda: plan_block_copy(src, slots, dst, slots),
        "  execute_plan_cpu alone (memmoves)": lambda: execute_plan_cpu(plan),
        "new staging + copy_host_blocks (inline plane)": staging_inline,
        "copy_host_blocks slab -> vLLM per-layer (kv-vllm)": lambda: copy_host_blocks(src, slots, vllm, slots),
        "one ctypes.memmove of all bytes": lambda: ctypes.memmove(d_np.ctypes.data, s_np.ctypes.data, nbytes),
        "memcpy numpy (reference)": lambda: np.copyto(d_np, s_np),
    }
    times = interleaved(cases, reps, 2, label=f"copy path {name}")
    return {k: dict(median_ms=statistics.median(v) * 1e3, gb_s=nbytes / statistics.median(v) / 1e9,
                    plan_runs=plan.num_runs if "arena" in k else None)
            for k, v in times.items()}


def lookup_path_breakdown(hashes: list[bytes], n: int) -> dict[str, dict[str, float]]:
    """The pieces of one lookup of 256 hashes, each timed alone in this process (no profiler):
    what the client and the daemon's loop thread run per lookup, on a bookkeeping-only pool.
    Array form (hashes as 256 bins, tiers as 256 strings) and packed form (one bin each way)
    side by side; the ``total`` rows add up each form's protocol pieces (the pool lookup aside)."""
    from kvtier.client.client import _check_hashes, _pack_hashes
    from kvtier.client.protocol import (
        PROTOCOL_VERSION,
        LookupReply,
        TierList,
        decode,
        decode_reply,
        encode_reply,
        decode_header,
        encode,
        ok_reply,
        pack_tiers,
        request_header,
        decode_request,
        unpack_hashes,
    )
    from kvtier.daemon.handling.handler_context import tier_names
    from kvtier.tiers.pool import PoolSpec, TieredPool
    from kvtier.tiers.pool_defaults import DEFAULT_POLICY

    pools = {}
    for policy in dict.fromkeys((DEFAULT_POLICY, "chain", "lru")):
        pool = TieredPool(PoolSpec("bench", BLOCK_TOKENS, SPECS[0][1]), cpu_blocks=4096, policy=policy, data=False)
        pool.attach_gpu(num_blocks=4096)
        pool.store(hashes, None, list(range(len(hashes))))
        assert len(pool.lookup(hashes)) == len(hashes)
        pools[policy] = pool
    sid = "0" * 32
    req = encode(request_header("lookup", 1 << 40, sid, hashes=hashes, pin=False))
    tiers = pools["lru"].lookup(hashes)
    tier_strs = tier_names(tiers)
    reply = encode(ok_reply(1 << 40, tiers=tier_strs, pinned=0))
    reply_list = decode(reply)["tiers"]
    preq = encode(request_header("lookup", 1 << 40, sid, packed_hashes=True, hashes=hashes, pin=False))
    pheader = decode_header(preq)  # for its packed bin
    codes = pack_tiers(tiers)
    preply = encode(ok_reply(1 << 40, tiers=codes, pinned=0))
    preply_codes = decode(preply)["tiers"]
    assert decode_request(preq).msg.hashes == decode_request(req).msg.hashes == hashes and TierList(codes) == tier_strs
    chain = pools["chain"]
    array_pieces = {
        "client: _check_hashes": lambda: _check_hashes(hashes),
        "client: request_header + msgpack encode": lambda: encode(request_header("lookup", 1 << 40, sid, hashes=hashes, pin=False)),
        "daemon: decode_request (msgspec: decode + validate, 256 hashes)": lambda: decode_request(req),
        "daemon: tier_names (enum -> str)": lambda: tier_names(tiers),
        "daemon: ok_reply + msgpack encode (tiers as str)": lambda: encode(ok_reply(1 << 40, tiers=tier_strs, pinned=0)),
        "client: msgpack decode of the reply": lambda: decode(reply),
        "client: list() of the reply's tiers": lambda: list(reply_list),
    }
    packed_hashes = _pack_hashes(hashes)
    packed_pieces = {
        "packed: client _pack_hashes (join + len pass)": lambda: _pack_hashes(hashes),
        "  of which b''.join": lambda: b"".join(hashes),
        "packed: client request_header + msgpack encode (one bin)":
            lambda: encode(request_header("lookup", 1 << 40, sid, packed_hashes=True, hashes=packed_hashes, pin=False)),
        "packed: daemon decode_request (msgspec: decode + validate, split)": lambda: decode_request(preq),
        "  of which unpack_hashes (cached struct)": lambda: unpack_hashes(pheader["hashes"]),
        "packed: daemon pack_tiers (enum -> codes)": lambda: pack_tiers(tiers),
        "packed: daemon LookupReply + encode_reply (typed, as sent)":
            lambda: encode_reply(LookupReply(v=PROTOCOL_VERSION, id=1 << 40, ok=True, tiers=codes, pinned=0)),
        "  (before: ok_reply + msgpack encode, a map)": lambda: encode(ok_reply(1 << 40, tiers=codes, pinned=0)),
        "packed: client decode_reply (msgspec: decode + validate, typed)": lambda: decode_reply("lookup", preply),
        "packed: client TierList of the reply's codes": lambda: TierList(preply_codes),
    }
    cases = {
        **array_pieces,
        **packed_pieces,
        f"daemon: TieredPool.lookup, policy {DEFAULT_POLICY} (default)": lambda: pools[DEFAULT_POLICY].lookup(hashes),
        "daemon: TieredPool.lookup, policy chain": lambda: chain.lookup(hashes),
        "  of which chain learn (every 2nd lookup)": lambda: chain.cpu.policy.record(hashes),
        "daemon: TieredPool.lookup, policy lru": lambda: pools["lru"].lookup(hashes),
        "  of which _held_prefix": lambda: pools["lru"]._held_prefix(hashes),
    }
    times = interleaved(cases, n, max(10, n // 10), label="lookup path")
    out = {k: dict(mean_us=statistics.fmean(v) * 1e6, p50_us=percentile(v, 0.5) * 1e6) for k, v in times.items()}
    for form, pieces in (("array", array_pieces), ("packed", packed_pieces)):
        names = [k for k in pieces if not k.startswith("  ")]
        out[f"total, {form} form (protocol pieces)"] = {
            stat: sum(out[k][stat] for k in names) for stat in ("mean_us", "p50_us")}
    return out



def report_paths(prof: dict[str, Any]) -> list[str]:
    """Tables 3e (lookup path) and 3f (copy path, per block size), as printed; none when not measured."""
    parts = []
    lp = prof.get("lookup_path")
    if lp:
        rows = [[k, f"{v['p50_us']:.1f}", f"{v['mean_us']:.1f}"] for k, v in lp.items()]
        parts.append(table(["piece of one lookup (256 hashes)", "p50 us", "mean us"], rows,
                           "\n3e. Lookup path, each piece timed alone in this process (no profiler)"))
    for name, cases in prof.get("copy_path", {}).items():
        rows = [[k, f"{v['median_ms']:.2f}", f"{v['gb_s']:.2f}"] for k, v in cases.items()]
        parts.append(table(["operation", "median ms", "GB/s"], rows,
                           f"\n3f. Daemon host copy path, {name} blocks, timed alone in this process"))
    return parts
