"""The worker half's lent restores (integrations/adapter/lent_restore.py) against a real kvtierd, every byte checked.

The test model's blocks are small (4 KiB runs), so ``lend = true`` makes
the worker ask for lends all the same. kvtierd here has no GPU tier, so every stored block lies in its CPU tier and
the registered plane's restores come back lent: the worker copies them from
its read-only mapping of the tier's file. A copy that ends past the lend's
lease is not trusted: its blocks are load errors (vLLM recomputes them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.client.hashing import hash_token_blocks
from kvtier.integrations.adapter.planes import RegisteredPlane
from kvtier.integrations.vllm.pool import block_dim_of
from kvtier.integrations.vllm.settings import ConnectorSettings
from kvtier.integrations.adapter.transfers import BlockTransfer, StepTransfers
from kvtier.integrations.vllm.worker import WorkerSide
from tests.integrations.test_vllm_worker import BS, HEAD_DIM, HEADS, LAYERS, LAYOUTS, NUM_BLOCKS, _block, _kv, _pool


def _worker(endpoint: str, *, lend: bool | str = True) -> WorkerSide:
    settings = ConnectorSettings.from_extra_config({"socket": endpoint, "data_plane": "registered", "lend": lend,
                                                    "timeout_s": 5.0, "retry_s": 0.2})
    return WorkerSide(settings, _pool(torch.bfloat16), NUM_BLOCKS)


def _lent_blocks(w: WorkerSide) -> int:
    plane = w._plane
    assert isinstance(plane, RegisteredPlane) and plane._lent is not None
    return plane._lent.lent_blocks


def _store(endpoint: str, shape: tuple[int, ...], keys: list[bytes], src_blocks: list[int]) -> list[list[torch.Tensor]]:
    engine = _kv(shape, "cpu", torch.bfloat16, seed=1)
    w = _worker(endpoint)
    w.register_kv_caches(engine)
    w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys, src_blocks, "r")]))
    w.wait_for_stores()
    w.shutdown()
    return [_block(engine, b) for b in src_blocks]


def _stored(kvtierd_factory: Callable[..., Any], layout: str, **daemon_flags: Any
            ) -> tuple[Any, tuple[int, ...], list[bytes], list[list[torch.Tensor]]]:
    """A daemon without a GPU tier (every block lent) holding 5 blocks of ``layout``: (daemon, shape, keys,
    each block's layers as stored)."""
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=4 << 20, **daemon_flags)
    shape = LAYOUTS[layout]()
    keys = hash_token_blocks(list(range(5 * BS)), BS)
    return daemon, shape, keys, _store(daemon.endpoint, shape, keys, [3, 5, 7, 8, 10])


@pytest.mark.parametrize("copy_engine", ["strided", "memmove"])
@pytest.mark.parametrize("copy_threads", [1, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_lent_restore_is_byte_exact(kvtierd_factory: Callable[..., Any], layout: str, copy_threads: int,
                                      copy_engine: str) -> None:
    daemon, shape, keys, want = _stored(kvtierd_factory, layout)
    engine = _kv(shape, "cpu", torch.bfloat16, seed=2)
    before = {n: t.clone() for n, t in engine.items()}
    w = _worker(daemon.endpoint)
    w.register_kv_caches(engine)
    plane = w._plane
    assert isinstance(plane, RegisteredPlane) and plane._lent is not None
    plane._lent.copy_threads = copy_threads
    plane._lent.copy_engine = copy_engine
    dst_blocks = [0, 1, 2, 6, 11]
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, dst_blocks, "r2")]))
    assert w.get_block_ids_with_load_errors() == set()
    assert _lent_blocks(w) == 5  # copied here, from the lent slots
    for b, expected in zip(dst_blocks, want):
        for layer_got, layer_want in zip(_block(engine, b), expected):
            assert torch.equal(layer_got.view(torch.int16), layer_want.view(torch.int16))
    for name, t in engine.items():
        dim = block_dim_of(t, NUM_BLOCKS)
        for b in set(range(NUM_BLOCKS)) - set(dst_blocks):
            assert torch.equal(t.select(dim, b), before[name].select(dim, b))
    w.shutdown()
    # The worker released its lend: nothing holds the blocks.
    from kvtier.client.client import Client

    with Client(daemon.endpoint, "vllm/test-worker", _pool(torch.bfloat16).layout) as c:
        assert c.clear() == 5


def test_a_copy_past_the_lease_is_a_load_error(kvtierd_factory: Callable[..., Any]) -> None:
    # A lease shorter than any copy: the worker copies, sees the lease gone, and reports every block.
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=4 << 20, lend_lease_s=0.001)
    shape = LAYOUTS["cpu_attn [0]"]()
    keys = hash_token_blocks(list(range(3 * BS)), BS)
    _store(daemon.endpoint, shape, keys, [1, 2, 3])
    w = _worker(daemon.endpoint)
    w.register_kv_caches(_kv(shape, "cpu", torch.bfloat16, seed=2))
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [4, 5, 6], "r")]))
    assert w.get_block_ids_with_load_errors() == {4, 5, 6}
    assert _lent_blocks(w) == 0
    w.shutdown()


def test_lend_auto_asks_only_for_layouts_of_large_runs() -> None:
    from kvtier.integrations.adapter.lent_restore import MIN_RUN_BYTES, LentRestore
    from kvtier.blocks.layout import BlockLayout

    small = [torch.zeros(LAYOUTS["flash_attn [1]"](), dtype=torch.bfloat16) for _ in range(2)]
    assert LentRestore({0: BlockLayout(small, [1, 1])}).min_run_bytes < MIN_RUN_BYTES
    big = [torch.zeros((4, 2, 2, 128, 128)) for _ in range(2)]  # bench/vllm.py's model: 256 KiB a layer
    assert LentRestore({0: BlockLayout(big, [0, 0])}).min_run_bytes == 256 * 1024


def test_lend_off_copies_in_kvtierd(kvtierd_factory: Callable[..., Any]) -> None:
    daemon = kvtierd_factory(gpu_bytes=0, cpu_bytes=4 << 20)
    shape = LAYOUTS["cpu_attn [0]"]()
    keys = hash_token_blocks(list(range(2 * BS)), BS)
    want = _store(daemon.endpoint, shape, keys, [1, 2])
    engine = _kv(shape, "cpu", torch.bfloat16, seed=2)
    w = _worker(daemon.endpoint, lend=False)
    w.register_kv_caches(engine)
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [7, 8], "r")]))
    assert w.get_block_ids_with_load_errors() == set()
    plane = w._plane
    assert isinstance(plane, RegisteredPlane) and plane._lent is None
    for b, expected in zip([7, 8], want):
        for layer_got, layer_want in zip(_block(engine, b), expected):
            assert torch.equal(layer_got.view(torch.int16), layer_want.view(torch.int16))
    w.shutdown()


_TABLE_LAYOUTS = {**LAYOUTS, "one block-major slab": lambda: (NUM_BLOCKS, LAYERS * 2 * BS * HEADS * HEAD_DIM)}


def _table_case(layout: str) -> tuple[list[torch.Tensor], Any, Any, Any, Any]:
    """Engine tensors of ``layout`` (random), a 20-row contiguous source of random bytes, the run table from
    one to the other, and a clone of the engine's tensors for the plain copy (the model)."""
    from kvtier.blocks.layout import BlockLayout
    from kvtier.integrations.adapter.lent_restore import RunTable

    shape = _TABLE_LAYOUTS[layout]()
    count = 1 if layout == "one block-major slab" else LAYERS
    engine = [torch.randint(-1000, 1000, shape, dtype=torch.int16) for _ in range(count)]
    dims = [block_dim_of(t, NUM_BLOCKS) for t in engine]
    dst = BlockLayout(engine, dims)
    src = BlockLayout.contiguous(20, dst.block_bytes)
    src.slab().copy_(torch.randint(0, 256, (20, dst.block_bytes), dtype=torch.uint8))
    table = RunTable.build(src, dst)
    assert table is not None
    return engine, src, dst, table, BlockLayout([t.clone() for t in engine], dims)


def _draw_slots(data: st.DataObject, rows: int, *, any_start: bool) -> tuple[list[int], list[int]]:
    """Source rows (a row may repeat) and distinct engine slots; half the time both in order, the source rows
    following each other from 0 (or from any row: ``any_start``), so runs continue and merge."""
    n = data.draw(st.integers(0, NUM_BLOCKS))
    src_slots = data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n))
    dst_slots = data.draw(st.permutations(range(NUM_BLOCKS)))[:n]
    if data.draw(st.booleans()):
        dst_slots = sorted(dst_slots)
        start = data.draw(st.integers(0, max(0, rows - n))) if any_start else 0
        src_slots = list(range(start, start + n)) if n <= rows else src_slots
    return src_slots, dst_slots


def _refuses_bad_slots_before_a_byte_moves(copy: Callable[[list[int], list[int]], int], engine: list[torch.Tensor],
                                           rows: int, *, negative: bool = False) -> None:
    """A destination named twice, lists of two lengths, a slot past either end: each raises, nothing written."""
    before = [t.clone() for t in engine]
    with pytest.raises(ValueError):
        copy([0, 1], [2, 2])
    with pytest.raises(ValueError):
        copy([0, 1], [2])
    with pytest.raises(IndexError):
        copy([rows], [0])
    with pytest.raises(IndexError):
        copy([0, 1], [0, NUM_BLOCKS])
    if negative:
        with pytest.raises(IndexError):
            copy([-1], [0])
    for got, want in zip(engine, before):
        assert torch.equal(got, want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(sorted(_TABLE_LAYOUTS)), data=st.data())
def test_a_run_table_copies_as_copy_blocks_does(layout: str, data: st.DataObject) -> None:
    # The lent copy's runs, shifted per slot from one block's plan, against the plain copy (the model): every
    # byte of the engine's tensors, the blocks written and the others; errors before any byte moves.
    from kvtier.blocks.layout import copy_blocks
    from kvtier.integrations.adapter.lent_restore import TwoThreadCopy

    engine, src, dst, table, model = _table_case(layout)
    rows = src.num_blocks
    for _ in range(data.draw(st.integers(1, 3))):  # one table, several copies
        src_slots, dst_slots = _draw_slots(data, rows, any_start=False)
        n = len(src_slots)
        threads = data.draw(st.sampled_from([1, 2]))
        if threads == 1:
            assert table.copy(src_slots, dst_slots) == n * dst.block_bytes
        else:  # runs cut into pieces, shared with a helper thread
            two = TwoThreadCopy()
            try:
                two.copy(*table.runs(src_slots, dst_slots, max_run_bytes=data.draw(st.sampled_from([512, 4096, 1 << 20]))))
            finally:
                two.close()
        if n:
            copy_blocks(src, src_slots, model, dst_slots)
        for got, want in zip(engine, model.tensors):
            assert torch.equal(got, want)
    _refuses_bad_slots_before_a_byte_moves(table.copy, engine, rows)


def test_a_run_table_refuses_a_layout_that_aliases_itself() -> None:
    # Two block slots over the same bytes (stride 0 in the block dim is refused by planning; here a view whose
    # slots overlap by half): the copy writes nothing.
    from kvtier.blocks.layout import BlockLayout
    from kvtier.integrations.adapter.lent_restore import RunTable

    flat = torch.zeros(4096 * 3, dtype=torch.uint8)
    engine = flat.as_strided((4, 4096), (2048, 1))
    dst = BlockLayout([engine], [0])
    src = BlockLayout.contiguous(4, 4096)
    src.slab().fill_(7)
    table = RunTable.build(src, dst)
    assert table is not None  # one block plans: the overlap is between blocks
    with pytest.raises(ValueError):
        table.copy([0, 1], [0, 1])
    assert not flat.any()
    table.copy([0, 1], [0, 2])  # blocks 0 and 2 do not overlap
    assert flat[:4096].eq(7).all() and flat[4096:8192].eq(7).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(sorted(_TABLE_LAYOUTS)), data=st.data())
def test_a_strided_copy_copies_as_copy_blocks_does(layout: str, data: st.DataObject) -> None:
    # The strided copies (one np.copyto per run and group of slots that follow each other) against the plain
    # copy (the model): every byte of the engine's tensors, the blocks written and the others; errors before any
    # byte moves; on one thread and shared with a helper.
    from kvtier.blocks.layout import copy_blocks
    from kvtier.integrations.adapter.lent_restore import TwoThreadCopy
    from kvtier.integrations.adapter.strided_copy import StridedCopy

    engine, src, dst, table, model = _table_case(layout)
    rows = src.num_blocks
    strided = StridedCopy.build(table)
    assert strided is not None and strided.block_bytes == dst.block_bytes
    for _ in range(data.draw(st.integers(1, 3))):  # one table, several copies
        src_slots, dst_slots = _draw_slots(data, rows, any_start=True)
        n = len(src_slots)
        pieces = strided.pieces(src_slots, dst_slots)
        if data.draw(st.booleans()):
            assert strided.copy(src_slots, dst_slots) == n * dst.block_bytes
        else:
            two = TwoThreadCopy()
            try:
                arrays = strided.arrays(src_slots, dst_slots, max_piece_bytes=data.draw(st.sampled_from([512, 4096, 1 << 20])))
                assert len(arrays) >= pieces
                two.copy_arrays(arrays)
            finally:
                two.close()
        assert pieces <= max(1, n) * len(table.sizes)
        if n:
            copy_blocks(src, src_slots, model, dst_slots)
        for got, want in zip(engine, model.tensors):
            assert torch.equal(got, want)
    _refuses_bad_slots_before_a_byte_moves(strided.copy, engine, rows, negative=True)


def test_a_strided_copy_is_not_made_for_a_layout_that_aliases_itself() -> None:
    # The run table's overlapping layout (two slots over half the same bytes): no strided copies (memmoves
    # refuse it per copy); the same memory without the overlap gets them.
    from kvtier.blocks.layout import BlockLayout
    from kvtier.integrations.adapter.lent_restore import RunTable
    from kvtier.integrations.adapter.strided_copy import StridedCopy

    flat = torch.zeros(4096 * 4, dtype=torch.uint8)
    src = BlockLayout.contiguous(4, 4096)
    overlapping = RunTable.build(src, BlockLayout([flat.as_strided((4, 4096), (2048, 1))], [0]))
    assert overlapping is not None and StridedCopy.build(overlapping) is None
    apart = RunTable.build(src, BlockLayout([flat.view(4, 4096)], [0]))
    assert apart is not None and StridedCopy.build(apart) is not None


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 64), st.integers(1, 16), st.integers(0, 48)), min_size=1, max_size=5),
       n_blocks=st.integers(1, 6), one_stride=st.booleans())
def test_alias_check_matches_a_byte_model(runs: list[tuple[int, int, int]], n_blocks: int, one_stride: bool) -> None:
    # strided_copy._aliases (its shortcuts included) against the bytes each block's runs cover.
    import numpy as np

    from kvtier.integrations.adapter.strided_copy import _aliases

    if one_stride:
        runs = [(a, z, runs[0][2]) for a, z, _ in runs]
    addr = np.array([a for a, _, _ in runs], np.int64)
    sizes = np.array([z for _, z, _ in runs], np.int64)
    stride = np.array([k for _, _, k in runs], np.int64)
    covered: list[int] = []
    for d in range(n_blocks):
        for a, z, k in runs:
            covered += range(a + d * k, a + d * k + z)
    assert _aliases(addr, stride, sizes, n_blocks) == (len(covered) != len(set(covered)))
