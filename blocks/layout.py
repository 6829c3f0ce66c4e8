"""Where a block's bytes live: a set of tensors, each with a dimension that indexes blocks.

Engines keep KV caches in many shapes: one tensor per layer with the block
index in dimension 1 (``[2, num_blocks, block_size, heads, dim]``), in
dimension 0 (``[num_blocks, 2, ...]``), or one tensor for all layers. kvtier's
own tiers are the simplest case: one ``[num_blocks, block_bytes]`` uint8 slab.
``BlockLayout`` describes all of them the same way, so every copy is
"gather these slots of layout A, scatter into those slots of layout B".

Contract:

- The canonical bytes of block ``s`` are, tensor by tensor in order, the bytes
  of ``t.select(block_dim, s)`` in C (row-major) order. ``block_bytes`` is
  their total length. Two layouts with the same ``block_bytes`` exchange
  blocks byte-exactly whatever their shapes.
- ``gather(slots)`` returns a new ``[len(slots), block_bytes]`` uint8 tensor
  on the layout's device; ``scatter(slots, data)`` writes such a tensor into
  the slots. Both are batched: one indexing op per tensor, never a loop over
  blocks. Slots out of range raise IndexError before anything is written.
- ``copy_blocks(src, src_slots, dst, dst_slots)`` copies between any two
  layouts, across devices, synchronously on the calling thread (transfer
  engines call it from their workers or streams).

A layout never owns the engine's memory: it holds views. It may own memory it
allocated itself (``contiguous``).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence
from typing import Any

import torch

HUGE_PAGE_BYTES = 2 << 20  # x86-64's and arm64's (4 KiB granule) transparent huge page


def _as_index(slots: Sequence[int] | torch.Tensor, num_blocks: int, device: torch.device) -> torch.Tensor:
    idx = slots if isinstance(slots, torch.Tensor) else torch.as_tensor(list(slots), dtype=torch.int64)
    idx = idx.to(dtype=torch.int64)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_blocks):
        raise IndexError(f"block slots must be in [0, {num_blocks}), got {idx.min().item()}..{idx.max().item()}")
    return idx.to(device, non_blocking=True)


def _block_major_bytes(t: torch.Tensor, block_dim: int) -> torch.Tensor:
    """A uint8 view of ``t`` as [num_blocks, ..., element bytes] with the block dim first."""
    moved = t.movedim(block_dim, 0)
    # view(uint8) needs the last dim contiguous; append a unit dim for 0-d rows.
    if moved.dim() == 1:
        moved = moved.unsqueeze(1)
    if moved.stride(-1) != 1:
        raise ValueError(
            f"tensor with shape {tuple(t.shape)} and strides {t.stride()} has a non-contiguous last dimension; "
            "kvtier needs the innermost dimension contiguous"
        )
    return moved.view(torch.uint8)


class BlockLayout:
    """Tensors with one block-indexing dimension each. See the module docstring."""

    def __init__(self, tensors: Sequence[torch.Tensor], block_dims: Sequence[int]) -> None:
        if not tensors:
            raise ValueError("a layout needs at least one tensor")
        if len(tensors) != len(block_dims):
            raise ValueError(f"{len(tensors)} tensors but {len(block_dims)} block dims")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"all tensors of a layout must be on one device, got {sorted(map(str, devices))}")
        counts = set()
        for t, d in zip(tensors, block_dims):
            if not -t.dim() <= d < t.dim():
                raise ValueError(f"block_dim {d} out of range for a {t.dim()}-d tensor")
            counts.add(t.shape[d])
        if len(counts) != 1:
            raise ValueError(f"tensors disagree on the number of blocks: {sorted(counts)}")
        self.tensors = tuple(tensors)
        self.block_dims = tuple(d % t.dim() for t, d in zip(tensors, block_dims))
        self.num_blocks = counts.pop()
        self.device = tensors[0].device
        self._views = [_block_major_bytes(t, d) for t, d in zip(self.tensors, self.block_dims)]
        self._part_bytes = [v[0].numel() if self.num_blocks else 0 for v in self._views]
        self.block_bytes = sum(self._part_bytes)
        # How the memory was obtained, when its allocator says (kvtier.tiers.host_memory sets
        # ``pinned``, ``numa_node``, ``chunks``, ``seconds``); None when nobody recorded it.
        self.host_info: dict[str, Any] | None = None
        # Objects that own the memory behind the tensors and must live as long as the layout
        # (e.g. host_memory's page-locked mapping, unregistered when its owner goes).
        self.owners: list[object] = []

    @classmethod
    def contiguous(
        cls, num_blocks: int, block_bytes: int, device: str | torch.device = "cpu", *, pin: bool = False,
        hugepages: bool = False,
    ) -> BlockLayout:
        """A new ``[num_blocks, block_bytes]`` slab. ``hugepages``: on the CPU, unpinned, a
        mapping of its own advised for transparent huge pages (long-lived tier memory: the
        kernel pins a 2 MiB page per step where it pins 512 small ones, which is what makes
        ``kvtier.daemon.shared_memory.client_memory``'s copies run at memcpy speed). Best effort: where the
        kernel gives no huge pages the slab is the same memory in small pages."""
        if num_blocks < 0 or block_bytes < 1:
            raise ValueError(f"need num_blocks >= 0 and block_bytes >= 1, got {num_blocks}, {block_bytes}")
        nbytes = num_blocks * block_bytes
        if hugepages and not pin and torch.device(device).type == "cpu" and nbytes >= HUGE_PAGE_BYTES:
            buf = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                with contextlib.suppress(OSError):
                    buf.madvise(mmap.MADV_HUGEPAGE)
            # torch.frombuffer keeps a reference to the mapping for the tensor's lifetime.
            flat = torch.frombuffer(buf, dtype=torch.uint8)
            skip = -flat.data_ptr() % HUGE_PAGE_BYTES  # huge pages need 2 MiB-aligned ranges
            return cls([flat[skip: skip + nbytes].view(num_blocks, block_bytes)], [0])
        slab = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device=device, pin_memory=pin)
        return cls([slab], [0])

    @classmethod
    def from_buffer(cls, buffer: object, num_blocks: int, block_bytes: int) -> BlockLayout:
        """A host slab over existing writable memory (a shm arena, a ZMQ frame), no copy."""
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=num_blocks * block_bytes)
        return cls([flat.view(num_blocks, block_bytes)], [0])

    @property
    def is_slab(self) -> bool:
        """One [num_blocks, block_bytes] uint8 tensor: rows can be indexed directly."""
        return len(self._views) == 1 and self._views[0].dim() == 2

    def slab(self) -> torch.Tensor:
        if not self.is_slab:
            raise ValueError("layout is not a single contiguous slab")
        return self._views[0]

    def gather(self, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        idx = _as_index(slots, self.num_blocks, self.device)
        parts = [v.index_select(0, idx).reshape(idx.numel(), n) for v, n in zip(self._views, self._part_bytes)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def scatter(self, slots: Sequence[int] | torch.Tensor, data: torch.Tensor) -> None:
        idx = _as_index(slots, self.num_blocks, self.device)
        if data.dtype != torch.uint8 or tuple(data.shape) != (idx.numel(), self.block_bytes):
            raise ValueError(f"scatter needs uint8 [{idx.numel()}, {self.block_bytes}], got {data.dtype} {tuple(data.shape)}")
        # Non-blocking only towards a GPU: a non-blocking device-to-host copy
        # returns before the bytes land, and the CPU would read them below.
        data = data.to(self.device, non_blocking=self.device.type == "cuda")
        offset = 0
        for view, nbytes in zip(self._views, self._part_bytes):
            part = data[:, offset : offset + nbytes].reshape((idx.numel(),) + tuple(view.shape[1:]))
            view.index_copy_(0, idx, part)
            offset += nbytes

    def block_view(self, slot: int) -> torch.Tensor:
        """The canonical bytes of one block, as a new tensor (tests and debugging)."""
        return self.gather([slot])[0]


def copy_blocks(
    src: BlockLayout,
    src_slots: Sequence[int] | torch.Tensor,
    dst: BlockLayout,
    dst_slots: Sequence[int] | torch.Tensor,
) -> int:
    """Copy blocks between two layouts; returns the bytes copied."""
    n = len(src_slots)
    if n != len(dst_slots):
        raise ValueError(f"{n} source slots but {len(dst_slots)} destination slots")
    if src.block_bytes != dst.block_bytes:
        raise ValueError(f"block sizes differ: {src.block_bytes} != {dst.block_bytes} bytes")
    if n == 0:
        return 0
    if src.device == dst.device and src.is_slab and dst.is_slab:
        # Same device, both slabs: one index_select/index_copy pair, no staging.
        src_idx = _as_index(src_slots, src.num_blocks, src.device)
        dst_idx = _as_index(dst_slots, dst.num_blocks, dst.device)
        dst.slab().index_copy_(0, dst_idx, src.slab().index_select(0, src_idx))
    else:
        dst.scatter(dst_slots, src.gather(src_slots))
    return n * src.block_bytes
