"""BlockLayout gather/scatter and copy_blocks: byte-exact across every engine layout.

Each check compares against an independent reference: the canonical bytes of
block ``s`` are, tensor by tensor, ``t.select(block_dim, s)`` in C order.
Destinations are poisoned first so every byte is checked as written, and
every slot that was not a destination must keep its poison.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from kvtier.blocks.layout import BlockLayout, copy_blocks

LAYERS, BS, HEADS, DIM = 4, 4, 2, 8
PER_LAYER = 2 * BS * HEADS * DIM * 2  # K and V, float16
BLOCK_BYTES = LAYERS * PER_LAYER
POISON = 0xCD

GEN = torch.Generator().manual_seed(20240601)


def rand_bytes(*shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=GEN)


def f16(shape: tuple[int, ...]) -> torch.Tensor:
    """A float16 tensor of the given shape holding random bits."""
    return rand_bytes(*shape[:-1], shape[-1] * 2).view(torch.float16)


def per_layer_block_dim1(nb: int) -> BlockLayout:
    return BlockLayout([f16((2, nb, BS, HEADS, DIM)) for _ in range(LAYERS)], [1] * LAYERS)


def per_layer_block_dim0(nb: int) -> BlockLayout:
    return BlockLayout([f16((nb, 2, BS, HEADS, DIM)) for _ in range(LAYERS)], [0] * LAYERS)


def all_layers_block_dim2(nb: int) -> BlockLayout:
    return BlockLayout([f16((LAYERS, 2, nb, BS, HEADS, DIM))], [2])


def slab(nb: int) -> BlockLayout:
    layout = BlockLayout.contiguous(nb, BLOCK_BYTES)
    layout.slab().copy_(rand_bytes(nb, BLOCK_BYTES))
    return layout


def float32_negative_block_dim(nb: int) -> BlockLayout:
    # float32 over half the head dim, block dim given as a negative index: same bytes per block.
    return BlockLayout([rand_bytes(LAYERS, 2, nb, BS, HEADS, DIM * 2).view(torch.float32)], [-4])


LAYOUTS: dict[str, Callable[[int], BlockLayout]] = {
    "per_layer_dim1": per_layer_block_dim1,
    "per_layer_dim0": per_layer_block_dim0,
    "all_layers_dim2": all_layers_block_dim2,
    "slab": slab,
    "f32_dim-4": float32_negative_block_dim,
}


def canonical(layout: BlockLayout, s: int) -> torch.Tensor:
    """Independent reference for the bytes of block ``s``."""
    parts = [t.select(d, s).contiguous().view(torch.uint8).reshape(-1) for t, d in zip(layout.tensors, layout.block_dims)]
    return torch.cat(parts)


def all_blocks(layout: BlockLayout) -> list[torch.Tensor]:
    return [canonical(layout, s) for s in range(layout.num_blocks)]


def poison(layout: BlockLayout) -> None:
    for t in layout.tensors:
        assert t.is_contiguous()
        t.view(torch.uint8).fill_(POISON)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_block_bytes_and_num_blocks(name: str) -> None:
    layout = LAYOUTS[name](5)
    assert layout.block_bytes == BLOCK_BYTES
    assert layout.num_blocks == 5
    assert layout.is_slab == (name == "slab")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gather_matches_canonical_bytes(name: str) -> None:
    layout = LAYOUTS[name](7)
    slots = [6, 0, 3, 3, 1]
    got = layout.gather(slots)
    assert got.dtype == torch.uint8 and tuple(got.shape) == (len(slots), BLOCK_BYTES)
    for i, s in enumerate(slots):
        assert torch.equal(got[i], canonical(layout, s)), f"slot {s}"
    assert torch.equal(layout.block_view(4), canonical(layout, 4))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gather_and_scatter_of_no_slots(name: str) -> None:
    # Contract: gather returns [len(slots), block_bytes], also for no slots.
    layout = LAYOUTS[name](3)
    before = all_blocks(layout)
    empty = layout.gather([])
    assert empty.dtype == torch.uint8 and tuple(empty.shape) == (0, BLOCK_BYTES)
    layout.scatter([], empty)
    assert all(torch.equal(a, b) for a, b in zip(all_blocks(layout), before))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_scatter_gather_round_trip_byte_exact(name: str) -> None:
    layout = LAYOUTS[name](8)
    poison(layout)
    untouched = torch.full((BLOCK_BYTES,), POISON, dtype=torch.uint8)
    slots = [5, 0, 7, 2]
    data = rand_bytes(len(slots), BLOCK_BYTES)
    layout.scatter(slots, data)
    for s in range(8):
        expected = data[slots.index(s)] if s in slots else untouched
        assert torch.equal(canonical(layout, s), expected), f"slot {s}"
    assert torch.equal(layout.gather(slots), data)
    # Overwrite a subset with new data via a tensor index: only those change.
    data2 = rand_bytes(2, BLOCK_BYTES)
    layout.scatter(torch.tensor([7, 1]), data2)
    assert torch.equal(layout.gather([7, 1, 5, 0, 2]), torch.cat([data2, data[[0, 1, 3]]]))
    for s in (3, 4, 6):
        assert torch.equal(canonical(layout, s), untouched)


@pytest.mark.parametrize(("src_name", "dst_name"), list(itertools.product(LAYOUTS, LAYOUTS)))
def test_copy_blocks_between_every_pair_of_layouts(src_name: str, dst_name: str) -> None:
    src = LAYOUTS[src_name](6)
    dst = LAYOUTS[dst_name](9)
    poison(dst)
    src_before = all_blocks(src)
    dst_before = all_blocks(dst)
    src_slots = [4, 1, 5, 0]
    dst_slots = [8, 2, 0, 5]
    n = copy_blocks(src, src_slots, dst, dst_slots)
    assert n == len(src_slots) * BLOCK_BYTES
    after = all_blocks(dst)
    for s in range(9):
        if s in dst_slots:
            assert torch.equal(after[s], src_before[src_slots[dst_slots.index(s)]]), f"dst slot {s}"
        else:
            assert torch.equal(after[s], dst_before[s]), f"untouched dst slot {s} changed"
    # The source is only read.
    assert all(torch.equal(a, b) for a, b in zip(all_blocks(src), src_before))


def test_copy_blocks_within_one_layout() -> None:
    layout = per_layer_block_dim1(6)
    before = all_blocks(layout)
    copy_blocks(layout, [0, 1], layout, [4, 5])
    after = all_blocks(layout)
    assert torch.equal(after[4], before[0]) and torch.equal(after[5], before[1])
    for s in range(4):
        assert torch.equal(after[s], before[s])


def test_copy_blocks_refuses_mismatched_sizes() -> None:
    a = slab(4)
    b = BlockLayout.contiguous(4, BLOCK_BYTES + 2)
    with pytest.raises(ValueError):
        copy_blocks(a, [0], b, [0])
    with pytest.raises(ValueError):
        copy_blocks(a, [0, 1], slab(4), [0])
    assert copy_blocks(a, [], slab(4), []) == 0


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("bad", [[0, 8], [-1], [3, 100, 1]])
def test_out_of_range_slots_raise_before_writing(name: str, bad: list[int]) -> None:
    layout = LAYOUTS[name](8)
    before = all_blocks(layout)
    with pytest.raises(IndexError):
        layout.scatter(bad, rand_bytes(len(bad), BLOCK_BYTES))
    with pytest.raises(IndexError):
        layout.gather(bad)
    # copy_blocks: a bad destination or a bad source leaves the destination as it was.
    src = slab(8)
    with pytest.raises(IndexError):
        copy_blocks(src, list(range(len(bad))), layout, bad)
    with pytest.raises(IndexError):
        copy_blocks(layout, bad, src, list(range(len(bad))))
    src_before = all_blocks(src)
    with pytest.raises(IndexError):
        copy_blocks(src, bad, layout, list(range(len(bad))))
    assert all(torch.equal(a, b) for a, b in zip(all_blocks(layout), before))
    assert all(torch.equal(a, b) for a, b in zip(all_blocks(src), src_before))


def test_scatter_rejects_wrong_shape_or_dtype() -> None:
    layout = per_layer_block_dim0(4)
    before = all_blocks(layout)
    with pytest.raises(ValueError):
        layout.scatter([0], rand_bytes(1, BLOCK_BYTES - 1))
    with pytest.raises(ValueError):
        layout.scatter([0, 1], rand_bytes(1, BLOCK_BYTES))
    with pytest.raises(ValueError):
        layout.scatter([0], rand_bytes(1, BLOCK_BYTES).view(torch.float16))
    assert all(torch.equal(a, b) for a, b in zip(all_blocks(layout), before))


def test_non_contiguous_innermost_dim_is_rejected() -> None:
    t = f16((2, 4, BS, DIM, HEADS)).transpose(-1, -2)  # [2, 4, BS, HEADS, DIM], last stride != 1
    assert t.stride(-1) != 1
    with pytest.raises(ValueError, match="innermost"):
        BlockLayout([t], [1])
    strided = f16((4, 2, BS, HEADS, DIM * 2))[..., ::2]
    with pytest.raises(ValueError, match="innermost"):
        BlockLayout([strided], [0])


def test_layout_construction_errors() -> None:
    with pytest.raises(ValueError):
        BlockLayout([], [])
    with pytest.raises(ValueError):
        BlockLayout([f16((2, 4, BS, HEADS, DIM))], [1, 0])
    with pytest.raises(ValueError):
        BlockLayout([f16((2, 4, BS, HEADS, DIM))], [5])
    with pytest.raises(ValueError):  # layers disagree on the number of blocks
        BlockLayout([f16((2, 4, BS, HEADS, DIM)), f16((2, 5, BS, HEADS, DIM))], [1, 1])
    with pytest.raises(ValueError):
        per_layer_block_dim1(2).slab()  # not a single slab


def test_from_buffer_writes_through_to_the_buffer() -> None:
    buf = bytearray([POISON]) * (3 * BLOCK_BYTES)
    layout = BlockLayout.from_buffer(buf, 3, BLOCK_BYTES)
    assert layout.is_slab
    data = rand_bytes(1, BLOCK_BYTES)
    layout.scatter([1], data)
    assert bytes(buf[BLOCK_BYTES : 2 * BLOCK_BYTES]) == bytes(data[0].tolist())
    assert bytes(buf[:BLOCK_BYTES]) == bytes([POISON]) * BLOCK_BYTES
    assert bytes(buf[2 * BLOCK_BYTES :]) == bytes([POISON]) * BLOCK_BYTES


def test_a_hugepage_slab_is_aligned_sized_and_usable_like_any_other() -> None:
    from kvtier.blocks.layout import HUGE_PAGE_BYTES

    n, bb = 3, HUGE_PAGE_BYTES + 4096  # not a multiple of the huge page: the tail is in small pages
    layout = BlockLayout.contiguous(n, bb, hugepages=True)
    assert layout.is_slab and tuple(layout.slab().shape) == (n, bb) and layout.block_bytes == bb
    assert layout.slab().data_ptr() % HUGE_PAGE_BYTES == 0  # huge pages back only aligned 2 MiB ranges
    data = rand_bytes(n, bb)
    layout.scatter([2, 0, 1], data)
    assert torch.equal(layout.gather([2, 0, 1]), data)
    # Small slabs, pinned ones and other devices are allocated as before.
    small = BlockLayout.contiguous(2, 4096, hugepages=True)
    assert tuple(small.slab().shape) == (2, 4096)
