"""Copy plans are byte-exact against layout.copy_blocks for every engine layout (CPU executor).

Every layout here is built over one uint8 "arena" tensor, and the checks
compare whole arenas: bytes a copy must not touch (other blocks, padding
between fragments) are compared too. Each case runs twice with the
destination poisoned to 0x00 and to 0xFF, so a byte the plan failed to write
cannot pass by matching the source by chance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.blocks.copy_plan import NotPlannable, execute_plan_cpu, plan_block_copy
from kvtier.blocks.layout import BlockLayout, copy_blocks

KINDS = (
    "slab",  # [nb, block_bytes] uint8: kvtier's own tiers
    "block_first",  # per layer [nb, 2, E]: one fragment per layer
    "kv_first",  # per layer [2, nb, E] (vLLM / flash-attention): two fragments per layer
    "all_layers",  # one [L, 2, nb, E] tensor, block_dim 2: 2L fragments
    "all_layers_block_first",  # one [nb, L, 2, E] tensor: the whole block is one fragment
    "layer_views",  # per-layer views t[l] of one [L, 2, nb, E] allocation (adjacent in memory)
    "padded",  # per layer [2, nb, E + pad][..., :E]: fragments with gaps between them
    "heads_outer",  # per layer [2, nb, E] stored as [nb, 2, E] and transposed: fragments strided by 2E
)
DTYPES = (torch.uint8, torch.float16, torch.float32, torch.int64)


@dataclass
class Built:
    layout: BlockLayout
    arena: torch.Tensor  # every byte any tensor of the layout can reach


def build(kind: str, nb: int, layers: int, frag_bytes: int, dtype: torch.dtype, offset: int = 0) -> Built:
    """A layout of ``kind`` whose blocks are ``layers * 2 * frag_bytes`` bytes, over a fresh arena.

    ``offset`` shifts the tensors inside the arena (odd offsets exercise
    unaligned addresses; they need a 1-byte dtype).
    """
    item = torch.empty(0, dtype=dtype).element_size()
    assert frag_bytes % item == 0 and offset % item == 0
    e = frag_bytes // item
    block_bytes = layers * 2 * frag_bytes
    pad = 3 if kind == "padded" else 0
    per_tensor = 2 * nb * (e + pad) * item
    one_tensor = kind in ("slab", "all_layers", "all_layers_block_first", "layer_views")
    total = offset + (block_bytes * nb if one_tensor else per_tensor * layers)
    arena = torch.randint(0, 256, (total + 8,), dtype=torch.uint8)

    def region(start: int, nbytes: int) -> torch.Tensor:
        return arena[offset + start : offset + start + nbytes].view(dtype)

    if kind == "slab":
        return Built(BlockLayout([arena[offset : offset + nb * block_bytes].view(nb, block_bytes)], [0]), arena)
    if kind == "all_layers":
        return Built(BlockLayout([region(0, block_bytes * nb).view(layers, 2, nb, e)], [2]), arena)
    if kind == "all_layers_block_first":
        return Built(BlockLayout([region(0, block_bytes * nb).view(nb, layers, 2, e)], [0]), arena)
    if kind == "layer_views":
        whole = region(0, block_bytes * nb).view(layers, 2, nb, e)
        return Built(BlockLayout([whole[i] for i in range(layers)], [1] * layers), arena)
    tensors = []
    for i in range(layers):
        flat = region(i * per_tensor, per_tensor)
        if kind == "block_first":
            tensors.append(flat.view(nb, 2, e))
        elif kind == "kv_first":
            tensors.append(flat.view(2, nb, e))
        elif kind == "padded":
            tensors.append(flat.view(2, nb, e + pad)[..., :e])
        elif kind == "heads_outer":
            tensors.append(flat.view(nb, 2, e).transpose(0, 1))
        else:
            raise AssertionError(kind)
    dim = 0 if kind == "block_first" else 1
    return Built(BlockLayout(tensors, [dim] * layers), arena)


@st.composite
def layout_specs(draw: st.DrawFn, layers: int, frag_bytes: int) -> tuple[str, int, torch.dtype, int]:
    kind = draw(st.sampled_from(KINDS))
    nb = draw(st.integers(1, 9))
    dtypes = [d for d in DTYPES if frag_bytes % torch.empty(0, dtype=d).element_size() == 0]
    dtype = draw(st.sampled_from(dtypes))
    item = torch.empty(0, dtype=dtype).element_size()
    offset = draw(st.sampled_from([0, item, 8 * item, 1 if item == 1 else item]))
    return kind, nb, dtype, offset


def run_both(src: Built, src_slots: list[int], make_dst, dst_slots: list[int], **plan_kw) -> int:
    """Plan+execute vs copy_blocks into identically poisoned destinations; returns the run count."""
    plan_kw.setdefault("min_fragment_bytes", 1)
    runs = -1
    for poison in (0x00, 0xFF):
        got, want = make_dst(), make_dst()
        got.arena.fill_(poison)
        want.arena.fill_(poison)
        src_before = src.arena.clone()
        plan = plan_block_copy(src.layout, src_slots, got.layout, dst_slots, **plan_kw)
        assert plan.nbytes == len(src_slots) * src.layout.block_bytes
        assert execute_plan_cpu(plan) == plan.nbytes
        copy_blocks(src.layout, src_slots, want.layout, dst_slots)
        assert torch.equal(got.arena, want.arena), "plan and copy_blocks disagree"
        assert torch.equal(src.arena, src_before), "the source was written"
        runs = plan.num_runs
    return runs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_plan_is_byte_exact_for_every_layout_pair(data: st.DataObject) -> None:
    layers = data.draw(st.integers(1, 4), label="layers")
    frag_bytes = data.draw(st.sampled_from([1, 3, 8, 16, 24, 40, 64, 136]), label="frag_bytes")
    s_kind, s_nb, s_dtype, s_off = data.draw(layout_specs(layers, frag_bytes), label="src")
    d_kind, d_nb, d_dtype, d_off = data.draw(layout_specs(layers, frag_bytes), label="dst")
    n = data.draw(st.integers(0, min(s_nb, d_nb)), label="n")
    dst_slots = data.draw(st.permutations(range(d_nb)), label="dst_perm")[:n]
    if data.draw(st.booleans(), label="consecutive"):
        start = data.draw(st.integers(0, s_nb - n), label="start")
        src_slots = list(range(start, start + n))
        dst_slots = sorted(dst_slots) if data.draw(st.booleans(), label="sorted_dst") else dst_slots
    else:  # duplicates allowed on the source side
        src_slots = data.draw(st.lists(st.integers(0, s_nb - 1), min_size=n, max_size=n), label="src_slots")
    src = build(s_kind, s_nb, layers, frag_bytes, s_dtype, s_off)
    run_both(src, src_slots, lambda: build(d_kind, d_nb, layers, frag_bytes, d_dtype, d_off), dst_slots,
             min_fragment_bytes=1)


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    nb=st.integers(2, 10),
    data=st.data(),
)
def test_copies_within_one_layout_between_disjoint_slots(kind: str, nb: int, data: st.DataObject) -> None:
    slots = data.draw(st.permutations(range(nb)))
    k = data.draw(st.integers(1, nb // 2))
    src_slots, dst_slots = slots[:k], slots[k : 2 * k]
    built = build(kind, nb, 2, 64, torch.float16)
    want = build(kind, nb, 2, 64, torch.float16)
    want.arena.copy_(built.arena)
    copy_blocks(want.layout, src_slots, want.layout, dst_slots)
    execute_plan_cpu(plan_block_copy(built.layout, src_slots, built.layout, dst_slots, min_fragment_bytes=1))
    assert torch.equal(built.arena, want.arena)


@settings(max_examples=100, deadline=None)
@given(
    s_kind=st.sampled_from(KINDS),
    d_kind=st.sampled_from(KINDS),
    piece=st.sampled_from([1, 7, 16, 100, 128, 4096]),
    reverse=st.booleans(),
)
def test_chunked_and_split_plans_copy_the_same_bytes(s_kind: str, d_kind: str, piece: int, reverse: bool) -> None:
    src = build(s_kind, 6, 3, 48, torch.float32)
    src_slots, dst_slots = [5, 0, 1, 2], [3, 4, 5, 0]
    for poison in (0x00, 0xFF):
        want = build(d_kind, 6, 3, 48, torch.float32)
        want.arena.fill_(poison)
        copy_blocks(src.layout, src_slots, want.layout, dst_slots)
        plan = plan_block_copy(src.layout, src_slots, want.layout, dst_slots, min_fragment_bytes=1)
        for variant in ("chunked", "split"):
            got = build(d_kind, 6, 3, 48, torch.float32)
            got.arena.fill_(poison)
            p = plan_block_copy(src.layout, src_slots, got.layout, dst_slots, min_fragment_bytes=1)
            if variant == "chunked":
                c = p.chunked(piece)
                assert int(c.sizes.max()) <= piece and c.nbytes == p.nbytes
                parts = [c]
            else:
                parts = p.split(piece)
                assert sum(x.nbytes for x in parts) == p.nbytes
                # Parts are exactly piece bytes each; only the last may be short.
                assert all(x.nbytes == piece for x in parts[:-1]) and 0 < parts[-1].nbytes <= piece
            for part in reversed(parts) if reverse else parts:
                execute_plan_cpu(part)
            assert torch.equal(got.arena, want.arena), variant
        assert plan.nbytes == 4 * src.layout.block_bytes


def test_consecutive_slab_slots_merge_into_one_run() -> None:
    src = build("slab", 8, 2, 64, torch.uint8)
    runs = run_both(src, [2, 3, 4, 5], lambda: build("slab", 8, 2, 64, torch.uint8), [0, 1, 2, 3])
    assert runs == 1


def test_fragmented_layout_plans_one_run_per_fragment_and_merges_adjacent_blocks() -> None:
    layers, nb = 4, 8
    eng = build("kv_first", nb, layers, 64, torch.float16)
    # Scattered slots: nothing is adjacent, so 2 x layers runs per block.
    runs = run_both(eng, [0, 2, 4], lambda: build("slab", nb, layers, 64, torch.uint8), [7, 3, 5])
    assert runs == 3 * 2 * layers
    # Consecutive on both sides of two kv_first layouts: each (layer, K/V) is one run.
    runs = run_both(eng, [1, 2, 3], lambda: build("kv_first", nb, layers, 64, torch.float16), [4, 5, 6])
    assert runs == 2 * layers
    # Per-layer views of one allocation with the block dim first are one run per block.
    whole = build("all_layers_block_first", nb, layers, 64, torch.float16)
    runs = run_both(whole, [6, 1], lambda: build("slab", nb, layers, 64, torch.uint8), [0, 5])
    assert runs == 2


def test_unaligned_addresses_and_odd_sizes() -> None:
    src = build("kv_first", 5, 2, 3, torch.uint8, offset=1)
    assert run_both(src, [4, 0, 2], lambda: build("slab", 5, 2, 3, torch.uint8, offset=5), [0, 4, 3],
                    min_fragment_bytes=1) > 0
    assert (plan_block_copy(src.layout, [1], src.layout, [2], min_fragment_bytes=1).src_ptrs % 2).any()


def test_slots_as_tensors_and_empty_plans() -> None:
    src = build("kv_first", 4, 2, 64, torch.float16)
    run_both(src, torch.tensor([3, 1]), lambda: build("slab", 4, 2, 64, torch.uint8), torch.tensor([0, 2]))
    empty = plan_block_copy(src.layout, [], build("slab", 4, 2, 64, torch.uint8).layout, [])
    assert empty.num_runs == 0 and empty.nbytes == 0 and execute_plan_cpu(empty) == 0


def test_descriptors_are_a_uint64_3_by_runs_array() -> None:
    src = build("kv_first", 4, 2, 64, torch.float16)
    dst = build("slab", 4, 2, 64, torch.uint8)
    plan = plan_block_copy(src.layout, [0, 2], dst.layout, [1, 3], min_fragment_bytes=64)
    desc = plan.descriptors()
    assert plan.num_runs == 2 * 2 * 2
    assert desc.dtype == np.uint64 and desc.shape == (3, plan.num_runs) and desc.flags.c_contiguous
    assert (desc[2] == plan.sizes).all() and (desc[0] == plan.src_ptrs.astype(np.uint64)).all()


def test_bad_inputs_raise_before_anything_is_written() -> None:
    src = build("kv_first", 4, 2, 64, torch.float16)
    dst = build("slab", 4, 2, 64, torch.uint8)
    with pytest.raises(ValueError, match="duplicate"):
        plan_block_copy(src.layout, [0, 1], dst.layout, [2, 2])
    with pytest.raises(IndexError):
        plan_block_copy(src.layout, [4], dst.layout, [0])
    with pytest.raises(IndexError):
        plan_block_copy(src.layout, [0], dst.layout, [-1])
    with pytest.raises(ValueError, match="source slots"):
        plan_block_copy(src.layout, [0, 1], dst.layout, [0])
    with pytest.raises(ValueError, match="block sizes"):
        plan_block_copy(src.layout, [0], build("slab", 4, 1, 64, torch.uint8).layout, [0])


def test_unplannable_layouts_raise_not_plannable() -> None:
    # Tiny fragments: the default threshold refuses them (copy_blocks is better there).
    src = build("kv_first", 4, 2, 16, torch.float16)
    dst = build("slab", 4, 2, 16, torch.uint8)
    with pytest.raises(NotPlannable, match="fragments of 16 bytes"):
        plan_block_copy(src.layout, [0], dst.layout, [0])
    assert plan_block_copy(src.layout, [0], dst.layout, [0], min_fragment_bytes=16).num_runs == 2 * 2
    # A destination that aliases itself (stride 0) cannot be written run by run.
    aliased = BlockLayout([torch.zeros(64, dtype=torch.uint8).expand(4, 2, 64)], [0])
    with pytest.raises(NotPlannable):
        plan_block_copy(build("slab", 4, 1, 64, torch.uint8).layout, [0], aliased, [1], min_fragment_bytes=1)
    # Two layouts over the same memory: copying between overlapping blocks needs staging.
    base = torch.zeros(4 * 256, dtype=torch.uint8)
    a = BlockLayout([base.view(4, 256)], [0])
    b = BlockLayout([base[128 : 128 + 3 * 256].view(3, 256)], [0])
    with pytest.raises(NotPlannable, match="overlap"):
        plan_block_copy(a, [0], b, [0], min_fragment_bytes=1)
    with pytest.raises(NotPlannable, match="overlap"):
        plan_block_copy(a, [1], a, [1], min_fragment_bytes=1)
    # ...but disjoint blocks of those layouts plan fine.
    assert plan_block_copy(a, [3], b, [0], min_fragment_bytes=1).num_runs == 1


def test_execute_plan_cpu_refuses_device_layouts() -> None:
    meta = BlockLayout([torch.empty(4, 128, dtype=torch.uint8, device="meta")], [0])
    plan = plan_block_copy(meta, [0], meta, [1], min_fragment_bytes=1)
    with pytest.raises(ValueError, match="host layouts"):
        execute_plan_cpu(plan)


def test_slab_to_slab_plans_are_cached_per_layout_but_follow_new_slots() -> None:
    src = build("layer_views", 6, 3, 64, torch.float16)
    for slots in ([0, 1], [5, 4], [2]):
        run_both(src, slots, lambda: build("padded", 6, 3, 64, torch.float16), list(range(len(slots))))
