"""A lent copy as a few strided array copies: one ``np.copyto`` per run of a block and group of slots.

Contract
========

``StridedCopy.build(table) -> StridedCopy | None`` from a ``RunTable``
(``lent_restore``: one block's runs from the mapped CPU-tier slab into the
engine's tensors, shifted per slot). Each run becomes two 2-D views made
once: the slab's rows and the engine's blocks of that run. None where the
engine's layout aliases its own memory (two blocks' runs overlap: checked
once here, over every block), a stride is negative or a run lies outside
its tensor's storage; the caller copies by memmoves.

- ``copy(src_slots, dst_slots) -> int``: the bytes copied. The slot pairs
  are cut into groups where both sides advance by one (a fresh engine's free
  list and a tier that stored the blocks in order: one group); each group is
  one ``np.copyto`` per run (a C loop of row memmoves, the GIL let go).
  Raises ``ValueError`` (lengths that differ, duplicate engine blocks) or
  ``IndexError`` (a slot out of range) before any byte moves:
  ``RunTable.copy``'s contract, byte for byte its result.
- ``arrays(src_slots, dst_slots, max_piece_bytes=None)``: those pieces as
  (engine view, slab view) pairs, for sharing between threads.
- ``tensor_arrays(src_slots, dst_slots)``: the same pieces as (engine tensor
  index, engine view, slab view): which of the group's tensors (a layer's
  KV) each writes, for copying layer by layer (``layer_copies``).
- ``pieces(src_slots, dst_slots) -> int``: how many copies ``copy`` makes
  (the caller's choice between this and memmoves).
- ``block_bytes``: one block's bytes.

Why: ``RunTable.copy`` is a memmove per run from Python plus a numpy plan per
copy (~0.2 ms): 128 calls for bench/vllm_restore.py's 32 MiB restore, whose
copy took 2.8-3.7 ms against 2.3-2.7 ms for one numpy memcpy of the same bytes
on the 2-core VM; here it is 4 calls. Not ``Tensor.copy_``: torch copies on its
OpenMP threads, and on a host with more busy threads than cores (this VM
under load) a restore's 4 parallel regions each waited for a descheduled
thread: 30 ms medians where one thread took 2-3 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

if TYPE_CHECKING:
    from kvtier.integrations.adapter.lent_restore import RunTable

__all__ = ["StridedCopy"]



@dataclass(frozen=True, slots=True)
class StridedCopy:
    """See the module docstring."""

    src_runs: tuple[np.ndarray, ...]  # per run: [slab rows, run elements], a view of the mapped slab
    dst_runs: tuple[np.ndarray, ...]  # per run: [engine blocks, run elements], a view of its engine tensor
    block_bytes: int
    run_tensors: tuple[int, ...] = ()  # per run: the index of the engine tensor it writes

    @classmethod
    def build(cls, table: RunTable) -> StridedCopy | None:
        slab = table.src.slab()
        if slab.device.type != "cpu" or table.dst.device.type != "cpu" or not table.sizes.size:
            return None
        n_blocks, rows = table.dst.num_blocks, table.src.num_blocks
        src_storage = slab.untyped_storage()
        src_off = table.src_off + (slab.data_ptr() - src_storage.data_ptr())
        # Each run's engine tensor: the storage that holds every block's bytes of it.
        storages = [t.untyped_storage() for t in table.dst.tensors]
        # And the tensor (a layer's KV) whose bytes it writes: vLLM's layers may all be views of one storage.
        spans = [(t.data_ptr(), t.data_ptr() + _extent_bytes(t)) for t in table.dst.tensors]
        owner, tensor = [], []
        for addr, size, stride in zip(table.dst_addr.tolist(), table.sizes.tolist(), table.dst_stride.tolist()):
            if stride < 0:
                return None  # not a layout vLLM makes; memmoves copy it
            last = addr + (n_blocks - 1) * stride + size
            hit = [i for i, s in enumerate(storages) if s.data_ptr() <= addr and last <= s.data_ptr() + s.nbytes()]
            if not hit:
                return None
            owner.append(hit[0])
            tensor.append(next((i for i, (lo, hi) in enumerate(spans) if lo <= addr < hi), hit[0]))
        if _aliases(table.dst_addr, table.dst_stride, table.sizes, n_blocks):
            return None
        dst_off = table.dst_addr - np.array([storages[i].data_ptr() for i in owner], np.int64)
        # Merged where one run continues the one before in both memories, with the same stride per block.
        runs = [[int(s), int(d), int(k), int(z), i, t] for s, d, k, z, i, t in
                zip(src_off, dst_off, table.dst_stride, table.sizes, owner, tensor)]
        merged = [runs[0]]
        for r in runs[1:]:
            p = merged[-1]
            if r[4:] == p[4:] and r[2] == p[2] and r[0] == p[0] + p[3] and r[1] == p[1] + p[3]:
                p[3] += r[3]
            else:
                merged.append(r)
        # The widest element every offset, stride and size is a multiple of (numpy copies rows of them).
        everything = [table.row_bytes, src_storage.data_ptr()] + [x for r in merged for x in r[:4]]
        everything += [s.data_ptr() for s in storages]
        element = 8
        while element > 1 and any(x % element for x in everything):
            element //= 2
        dtype = np.dtype(f"u{element}")
        src_flat = _flat(src_storage, dtype)
        dst_flat = [_flat(s, dtype) for s in storages]
        src_runs = tuple(as_strided(src_flat[so // element:], (rows, z // element), (table.row_bytes, element),
                                    writeable=False) for so, _, _, z, _, _ in merged)
        dst_runs = tuple(as_strided(dst_flat[i][do // element:], (n_blocks, z // element), (ds, element))
                         for _, do, ds, z, i, _ in merged)
        return cls(src_runs, dst_runs, table.row_bytes, tuple(t for *_, t in merged))

    def pieces(self, src_slots: Sequence[int], dst_slots: Sequence[int]) -> int:
        return len(_groups(src_slots, dst_slots)) * len(self.src_runs)

    def arrays(self, src_slots: Sequence[int], dst_slots: Sequence[int], *,
               max_piece_bytes: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """The copy's pieces, (engine view, slab view) pairs: ``copy``'s checks and errors. ``max_piece_bytes``:
        a group's rows cut so that no piece is much larger (for sharing between threads)."""
        return [(dst, src) for _, dst, src in self.tensor_arrays(src_slots, dst_slots, max_piece_bytes=max_piece_bytes)]

    def tensor_arrays(self, src_slots: Sequence[int], dst_slots: Sequence[int], *,
                      max_piece_bytes: int | None = None) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``arrays``' pieces, each with the index of the engine tensor it writes."""
        n = len(src_slots)
        if n != len(dst_slots):
            raise ValueError(f"{n} source slots but {len(dst_slots)} engine blocks")
        if not n:
            return []
        rows, blocks = self.src_runs[0].shape[0], self.dst_runs[0].shape[0]
        if min(src_slots) < 0 or max(src_slots) >= rows:
            raise IndexError(f"slab slots must be in [0, {rows})")
        if min(dst_slots) < 0 or max(dst_slots) >= blocks:
            raise IndexError(f"engine blocks must be in [0, {blocks})")
        if len(set(dst_slots)) != n:
            raise ValueError("duplicate engine blocks: the copy would write one block twice")
        tensors = self.run_tensors or (0,) * len(self.src_runs)
        out = []
        for s0, d0, k in _groups(src_slots, dst_slots):
            for src, dst, t in zip(self.src_runs, self.dst_runs, tensors):
                step = k if max_piece_bytes is None else max(1, max_piece_bytes // (src.shape[1] * src.itemsize))
                for a in range(0, k, step):
                    b = min(k, a + step)
                    out.append((t, dst[d0 + a: d0 + b], src[s0 + a: s0 + b]))
        return out

    def copy(self, src_slots: Sequence[int], dst_slots: Sequence[int]) -> int:
        copyto = np.copyto
        for dst, src in self.arrays(src_slots, dst_slots):
            copyto(dst, src)  # one C loop of row memmoves, the GIL let go
        return len(src_slots) * self.block_bytes


def _groups(src_slots: Sequence[int], dst_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first slab slot, first engine block, count) of each stretch where both advance by one."""
    groups: list[tuple[int, int, int]] = []
    s0 = d0 = ps = pd = -2
    k = 0
    for s, d in zip(src_slots, dst_slots):
        if s == ps + 1 and d == pd + 1:
            k += 1
        else:
            if k:
                groups.append((s0, d0, k))
            s0, d0, k = s, d, 1
        ps, pd = s, d
    if k:
        groups.append((s0, d0, k))
    return groups


def _aliases(addr: np.ndarray, stride: np.ndarray, sizes: np.ndarray, n_blocks: int) -> bool:
    """Whether any two of every block's runs (run r of block d at ``addr[r] + d * stride[r]``, strides >= 0)
    overlap. Cheap where the layout shows it at once (each run's span apart from the others': a tensor per
    layer, K and V halves; or one stride whose block window holds every run apart), else checked block by block."""
    if n_blocks > 1 and np.any(stride < sizes):
        return True  # a run overlaps itself in the next block
    order = np.argsort(addr, kind="stable")
    span_end = (addr + (n_blocks - 1) * stride + sizes)[order]
    if not np.any(addr[order[1:]] < span_end[:-1]):
        return False
    if stride[0] > 0 and np.all(stride == stride[0]):
        off = addr % stride[0]
        order = np.argsort(off, kind="stable")
        end = off[order] + sizes[order]
        if not np.any(off[order[1:]] < end[:-1]) and end[-1] <= off[order[0]] + stride[0]:
            return False  # apart on the circle of one block's stride: apart in every block
    starts = (addr[None, :] + np.arange(n_blocks, dtype=np.int64)[:, None] * stride[None, :]).reshape(-1)
    lengths = np.broadcast_to(sizes, (n_blocks, sizes.size)).reshape(-1)
    order = np.argsort(starts, kind="stable")
    return bool(np.any(starts[order[1:]] < starts[order[:-1]] + lengths[order[:-1]]))


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (strides >= 0)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _flat(storage: torch.UntypedStorage, dtype: np.dtype) -> np.ndarray:
    """A one-dimensional array of ``dtype`` over the whole of ``storage`` (no copy; it keeps the storage alive)."""
    count = storage.nbytes() // dtype.itemsize
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (count * dtype.itemsize,), (1,))
    return flat.numpy().view(dtype)
