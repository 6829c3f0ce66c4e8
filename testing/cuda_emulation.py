"""The CUDA copy kernel's arithmetic, mirrored on the CPU: a test helper (tests/tiers/test_cuda_copy.py).

``kvtier.tiers.cuda_copy``'s kernel (``KERNEL_SOURCE``, ``kvtier_copy_runs``)
cuts each run into a byte head, W-byte words and a byte tail. These functions
do the same in Python, so the CPU tests prove the arithmetic (every byte
written exactly once, vector accesses aligned) and the CUDA tests prove the
kernel. Nothing of kvtier's runtime imports it (an import-linter contract).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvtier.blocks.copy_plan import CopyPlan
from kvtier.tiers.cuda_copy import PIECE_BYTES

__all__ = ["execute_plan_emulated", "kernel_run_split", "kernel_thread_writes"]


def kernel_run_split(src: int, dst: int, nbytes: int) -> tuple[int, int, int, int]:
    """What ``kvtier_copy_runs`` does with one run: (vector bytes W, head bytes, vectors, tail bytes).

    Mirrors the kernel line by line: W is the widest of 16/8/4/2/1 for which
    source and destination are congruent; the head copies bytes until the
    source is W-aligned (and hence the destination), then whole W-words, then
    the tail.
    """
    mis = src ^ dst
    width = 16 if mis & 15 == 0 else 8 if mis & 7 == 0 else 4 if mis & 3 == 0 else 2 if mis & 1 == 0 else 1
    head = min((width - (src & (width - 1))) & (width - 1), nbytes)
    vectors = (nbytes - head) // width
    return width, head, vectors, nbytes - head - vectors * width


def kernel_thread_writes(src: int, dst: int, nbytes: int, threads: int) -> np.ndarray:
    """How many times each destination byte of one run is written, thread by thread, as the kernel loops.

    A test helper: every entry must be 1 (each byte written exactly once).
    """
    width, head, vectors, _tail = kernel_run_split(src, dst, nbytes)
    writes = np.zeros(nbytes, np.int64)
    for tid in range(threads):
        if tid < head:
            writes[tid] += 1
        i = tid
        while i + 3 * threads < vectors:  # the unrolled-by-4 loop
            for k in range(4):
                v = i + k * threads
                writes[head + v * width : head + (v + 1) * width] += 1
            i += 4 * threads
        while i < vectors:
            writes[head + i * width : head + (i + 1) * width] += 1
            i += threads
        j = head + vectors * width + tid
        while j < nbytes:
            writes[j] += 1
            j += threads
    return writes


def execute_plan_emulated(plan: CopyPlan, piece_bytes: int = PIECE_BYTES) -> int:
    """Run a host plan the way the kernel would: pieces, then head / W-words / tail per piece.

    Checks the kernel's alignment precondition on every vector access. The
    CPU stand-in for the kernel in tests; bytes move with ``memmove``.
    """
    if plan.src.device.type != "cpu" or plan.dst.device.type != "cpu":
        raise ValueError("execute_plan_emulated needs host layouts")
    pieces = plan.chunked(piece_bytes)
    for s, d, n in zip(pieces.src_ptrs.tolist(), pieces.dst_ptrs.tolist(), pieces.sizes.tolist()):
        width, head, vectors, tail = kernel_run_split(s, d, n)
        if vectors and ((s + head) % width or (d + head) % width):
            raise AssertionError(f"misaligned {width}-byte access at {s + head:#x} -> {d + head:#x}")
        ctypes.memmove(d, s, head)
        ctypes.memmove(d + head, s + head, vectors * width)
        ctypes.memmove(d + head + vectors * width, s + head + vectors * width, tail)
    return plan.nbytes
