"""What bench/protocol.py's measurements share: the block layouts, the targets, the interleaving clock.

Measures nothing on its own. ``interleaved`` is the clock every comparison
uses: each iteration calls every variant once, in a fresh random order, so
load drift on a shared machine (and the after-effects of the previous call)
hits every variant alike. ``PoolClient`` is one kvtier ``Client`` on one
pool of one daemon with its blocks stored, an arena and two KV
registrations (a block-major slab and vLLM-style per-layer tensors): the
set-up both the restore and the profile measurements restore into.
The layout is Llama-3-8B-like: 32 layers, 16 tokens, head_dim 128, bf16;
1 KV head per rank (TP8) gives 256 KiB blocks, 8 (TP1) 2 MiB blocks.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from report import progress

if TYPE_CHECKING:
    from kvtier.testing.daemon import KvtierDaemon

# Targets (issue 3), evaluated on the GPU-tier runs.
TARGET_LOOKUP_VS_REDIS = 0.25  # kvtier p50 / Redis MGET p50, at most
TARGET_LOOKUP_VS_ECHO = 2.0  # kvtier p50 / raw ZMQ echo p50, at most
TARGET_SHM_VS_MEMCPY = 0.7  # shm restore bandwidth / memcpy bandwidth, at least
TARGET_INLINE_VS_ZMQ = 0.8  # inline restore bandwidth / raw ZMQ bandwidth, at least
# Issue 36 (typed wire messages): the tighter lookup target, reported beside issue 3's.
TARGET_LOOKUP_VS_ECHO_TYPED = 1.5  # kvtier p50 / raw ZMQ echo p50, at most

LOOKUP_HASHES = 256
NUM_LAYERS, BLOCK_TOKENS, HEAD_DIM = 32, 16, 128
Spec = tuple[str, int, int, int]  # name, block bytes, blocks per call, KV heads per rank
SPECS: tuple[Spec, ...] = (
    ("256KiB", 256 << 10, 64, 1),
    ("2MiB", 2 << 20, 16, 8),
)
STORE_CHUNK_BYTES = 64 << 20  # at most this much per store request


def interleaved(fns: dict[str, Callable[[], Any]], n: int, warm: int, *, label: str,
                check: dict[str, Callable[[Any], None]] | None = None) -> dict[str, list[float]]:
    """Call every fn once per iteration, in a fresh random order each time (so no variant always
    follows the same one and pays for its after-effects: a freed 32 MiB reply, a woken thread);
    seconds per call after ``warm`` iterations. ``check[name](result)`` runs after the clock stopped."""
    names = list(fns)
    rng = random.Random(len(names) * 1_000_003 + n)
    times: dict[str, list[float]] = {k: [] for k in names}
    check = check or {}
    clock = time.perf_counter
    step = max(1, (n + warm) // 10)
    for i in range(warm + n):
        rng.shuffle(names)
        for name in names:
            fn = fns[name]
            t0 = clock()
            res = fn()
            t1 = clock()
            if i >= warm:
                times[name].append(t1 - t0)
            c = check.get(name)
            if c is not None:
                c(res)
            # Release the result here, untimed: a 32 MiB reply freed inside the next call's
            # timing would bill its munmap to whichever variant comes next.
            res = None
        if (i + 1) % step == 0:
            progress(f"{label}: {i + 1}/{warm + n}")
    return times


def per_rep_ratio(num: list[float], den: list[float]) -> float:
    """Median over repetitions of num[i] / den[i] (paired: same repetition)."""
    return statistics.median(a / b for a, b in zip(num, den))


# ---------------------------------------------------------------------------
# Setup: layouts, pools, data
# ---------------------------------------------------------------------------


def layout_for(block_bytes: int, kv_heads: int) -> dict[str, Any]:
    """The pool layout a client registers for ``block_bytes`` blocks with ``kv_heads`` KV heads per rank."""
    assert 2 * BLOCK_TOKENS * kv_heads * HEAD_DIM * 2 * NUM_LAYERS == block_bytes
    return dict(model="bench/llama-3-8b-like", block_size=BLOCK_TOKENS, block_bytes=block_bytes, dtype="bfloat16",
                num_layers=NUM_LAYERS, kv_heads=kv_heads, head_dim=HEAD_DIM, tp_rank=0, tp_size=1,
                hash_algo="xxh3_128", mode="store")


class PoolClient:
    """A Client on one pool of one daemon, with an arena and two KV registrations of ``batch`` blocks."""

    def __init__(self, daemon: KvtierDaemon, spec: Spec, hashes: list[bytes], data: Any, *, store_n: int) -> None:
        import torch

        from kvtier.client import kv_share
        from kvtier.client.client import Client

        name, bb, batch, heads = spec
        self.bb, self.batch, self.heads = bb, batch, heads
        self.client = Client(daemon.endpoint, f"bench-{name}", layout_for(bb, heads), timeout_s=30.0,
                             client_name="bench/protocol.py")
        # Store in chunks: one request for hundreds of MiB would hold the daemon's loop that long.
        per = max(1, STORE_CHUNK_BYTES // bb)
        for i in range(0, store_n, per):
            j = min(store_n, i + per)
            self.client.store(hashes[i:j], data[i * bb: j * bb])
        self.arena = self.client.open_arena(batch)
        # kv: one block-major slab [batch, bb/2] bf16 (a 2-D tensor: the daemon sees one slab).
        self.kv_slab, _ = kv_share.allocate_shared_kv([batch, bb // 2], torch.bfloat16, 0)
        self.client.register_kv("slab", [self.kv_slab], 0)
        # kv-vllm: per-layer [2, batch, 16, heads, 128] views of one shared tensor, block_dim 1.
        self.kv_all, _ = kv_share.allocate_shared_kv([NUM_LAYERS, 2, batch, BLOCK_TOKENS, heads, HEAD_DIM],
                                                     torch.bfloat16, 2)
        self.client.register_kv("vllm", [self.kv_all[layer] for layer in range(NUM_LAYERS)], 1)
        self.slots = list(range(batch))

    def arena_layout(self) -> Any:
        """The arena as a BlockLayout (a lent restore's destination)."""
        from kvtier.blocks.layout import BlockLayout

        return BlockLayout.from_buffer(self.arena.buffer, self.batch, self.bb)

    def vllm_layout(self) -> Any:
        """The vLLM-style per-layer tensors as a BlockLayout (block dim 1)."""
        from kvtier.blocks.layout import BlockLayout

        return BlockLayout([self.kv_all[layer] for layer in range(NUM_LAYERS)], [1] * NUM_LAYERS)

    def slab_bytes(self) -> Any:
        """The kv slab's bytes as a uint8 numpy view (to compare with what was stored)."""
        import torch

        return self.kv_slab.view(-1).view(torch.uint8).numpy()

    def vllm_canonical(self) -> Any:
        """The per-layer tensors' bytes rearranged block by block, as the blocks were stored."""
        import torch

        # block s = concat over layers of kv_all[l][:, s] (C order): [batch, L, 2, 16, H, 128]
        return self.kv_all.permute(2, 0, 1, 3, 4, 5).contiguous().view(torch.uint8).reshape(-1).numpy()

    def close(self) -> None:
        """Close the client; errors ignored (clean-up after a daemon that may already be gone)."""
        try:
            self.client.close()
        except Exception:
            pass


def request_counters(client: Any, op: str) -> tuple[float, float]:
    """The daemon's own count and seconds (``request_seconds_total``: receipt to reply handed to ZMQ)
    of ``op`` requests so far, from its stats."""
    d = client.stats()["daemon"]
    key = f"op={op}"
    return float(d.get("requests_total", {}).get(key, 0)), float(d.get("request_seconds_total", {}).get(key, 0.0))
