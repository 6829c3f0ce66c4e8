"""A client process for the fault tests to SIGKILL: it acquires things, reports them, then waits to die.

``python -m tests.stress.crash_client MODE ENDPOINT BLOCK_BYTES GPU_BLOCKS CPU_BLOCKS`` (from the
repository root) prints one JSON line once everything is held, then sleeps until killed.

- ``hold``: on store-mode pool ``crash``, stores chains until every GPU- and
  CPU-tier block holds one of its blocks, and pins all of them; opens a
  shared-memory arena and registers a shared KV tensor there too. On
  engine-mode pool ``crash-engine`` registers a KV tensor of ``GPU_BLOCKS``
  blocks (the pool's GPU tier) and allocates a request over all of them.
  Prints ``{"arena": path, "kv_files": [...], "pinned": n}``.
- ``inflight``: on pool ``crash``, opens an arena, fills it, and sends a
  ``store`` from the arena without waiting for the reply (the daemon is run
  with a copy delay, so the copy is in flight when this process dies).
  Prints ``{"arena": path, "hashes": [hex...]}``.
"""

from __future__ import annotations

import json
import sys
import time

import zmq

from kvtier.client.client import Client
from kvtier.client.kv_share import allocate_shared_kv
from kvtier.client.protocol import encode, request_header
from tests.stress.stresslib import block_content, chain_content, chain_hashes, store_layout


def hold(endpoint: str, block_bytes: int, gpu_blocks: int, cpu_blocks: int) -> dict[str, object]:
    c = Client(endpoint, "crash", store_layout(block_bytes))
    total = gpu_blocks + cpu_blocks
    hashes = chain_hashes("crash-hold", total)
    # Batches of at most the GPU tier: the earlier ones are demoted to the CPU tier.
    for i in range(0, total, gpu_blocks):
        batch = hashes[i:i + gpu_blocks]
        c.store(batch, chain_content(batch, block_bytes))
    # One block at a time: each is pinned where it is, whichever tier holds it.
    pinned = sum(len(c.pin([h])) for h in hashes)
    arena = c.open_arena(4)
    kv, kv_handle = allocate_shared_kv((4, block_bytes // 2), "float16", 0)
    c.register_kv("kv", [kv], 0)
    engine = Client(endpoint, "crash-engine", store_layout(block_bytes, mode="engine"))
    engine_kv, engine_handle = allocate_shared_kv((gpu_blocks, block_bytes // 2), "float16", 0)
    engine.register_kv("kv", [engine_kv], 0)
    block_size = int(engine.layout["block_size"])
    engine.allocate_tokens("r", list(range(gpu_blocks * block_size)))
    # Keep the tensors (their mappings) alive until the process dies.
    globals()["_keep"] = (c, engine, kv, engine_kv)
    return {"arena": str(arena.path), "kv_files": [kv_handle["name"], engine_handle["name"]], "pinned": pinned}


def inflight(endpoint: str, block_bytes: int, gpu_blocks: int) -> dict[str, object]:
    c = Client(endpoint, "crash", store_layout(block_bytes), heartbeat=False)
    n = min(4, gpu_blocks)
    arena = c.open_arena(n)
    hashes = chain_hashes("crash-inflight", n)
    for slot, h in enumerate(hashes):
        arena.slot_view(slot)[:] = block_content(h, block_bytes)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(encode(request_header("store", 1, c.sid, hashes=hashes, plane="shm", slots=list(range(n)))))
    time.sleep(0.2)  # let the request reach the daemon before we report (and die)
    globals()["_keep"] = (c, arena, ctx, sock)
    return {"arena": str(arena.path), "hashes": [h.hex() for h in hashes]}


def main() -> None:
    mode, endpoint, block_bytes, gpu_blocks, cpu_blocks = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    if mode == "hold":
        report = hold(endpoint, block_bytes, gpu_blocks, cpu_blocks)
    elif mode == "inflight":
        report = inflight(endpoint, block_bytes, gpu_blocks)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(report), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
