"""Restores beside the forward (``layer_overlap``: integrations/adapter/layer_copies.py), every byte checked.

The worker half runs against a real kvtierd with lent restores (as
test_vllm_lent.py) and is driven as vLLM drives it: ``start_load_kv``, then
``wait_for_layer_load`` per layer as the forward reaches it, then
``wait_for_save`` and ``get_block_ids_with_load_errors``. A layer is checked
right after its wait: it must be whole then, whatever the helper thread is
still copying.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.integrations.adapter.layer_copies import LayerCopies
from kvtier.integrations.adapter.planes import RegisteredPlane
from kvtier.integrations.adapter.transfers import BlockTransfer, StepTransfers
from kvtier.integrations.vllm.settings import ConnectorSettings
from kvtier.integrations.vllm.worker import WorkerSide
from tests.integrations.test_vllm_lent import _lent_blocks, _stored
from tests.integrations.test_vllm_worker import LAYERS, LAYOUTS, NUM_BLOCKS, _block, _kv, _pool

DST = [0, 1, 2, 6, 11]


def _overlapping_worker(endpoint: str) -> WorkerSide:
    settings = ConnectorSettings.from_extra_config({"socket": endpoint, "data_plane": "registered", "lend": True,
                                                    "layer_overlap": True, "timeout_s": 5.0, "retry_s": 0.2})
    w = WorkerSide(settings, _pool(torch.bfloat16), NUM_BLOCKS)
    return w


def _start(w: WorkerSide, engine: dict[str, torch.Tensor], keys: list[bytes]) -> LayerCopies:
    w.register_kv_caches(engine)
    plane = w._plane
    assert isinstance(plane, RegisteredPlane) and plane._lent is not None and plane._lent.layers is not None
    plane._lent.copy_engine = "strided"  # the test's 4 KiB runs would go by memmoves under "auto"
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, DST, "r")]))
    return plane._lent.layers


def _one_storage(engine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same layers as views of one buffer, as vLLM's CPU backend allocates them."""
    whole = torch.stack(list(engine.values()))
    return {name: whole[i] for i, name in enumerate(engine)}


@pytest.mark.parametrize("storage", ["per layer", "one for all layers"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layer_is_whole_once_its_wait_returns(kvtierd_factory: Callable[..., Any], layout: str,
                                                   storage: str) -> None:
    daemon, shape, keys, want = _stored(kvtierd_factory, layout)
    engine = _kv(shape, "cpu", torch.bfloat16, seed=2)
    if storage != "per layer":
        engine = _one_storage(engine)
    w = _overlapping_worker(daemon.endpoint)
    layers = _start(w, engine, keys)
    # Layers 1.. went to the helper thread, each piece tagged with its own layer.
    assert layers.jobs == 1 and layers.pieces > 0 and layers.blocks_landed == 0
    for i in range(LAYERS):
        w.wait_for_layer_load(f"layer.{i}")
        for b, expected in zip(DST, want):
            assert torch.equal(_block(engine, b)[i].view(torch.int16), expected[i].view(torch.int16)), (i, b)
    assert layers.waits == LAYERS - 1  # layer 0 was copied before start_load_kv returned: nothing to wait for
    w.wait_for_save(StepTransfers())
    assert w.get_block_ids_with_load_errors() == set()
    assert _lent_blocks(w) == 5 and w.blocks_loaded == 5 and w.blocks_load_failed == 0
    assert w.take_stats()["blocks_loaded_by_layer"] == 5
    w.shutdown()


def test_a_layer_the_forward_never_waited_for_is_a_load_error_and_ends_the_overlap(
        kvtierd_factory: Callable[..., Any]) -> None:
    # A model whose attention skipped wait_for_layer_load may have read a layer before its bytes landed:
    # its blocks are recomputed, and from then on every restore copies all layers before the forward.
    daemon, shape, keys, want = _stored(kvtierd_factory, "cpu_attn [0]")
    engine = _kv(shape, "cpu", torch.bfloat16, seed=2)
    w = _overlapping_worker(daemon.endpoint)
    layers = _start(w, engine, keys)
    w.wait_for_layer_load("layer.0")  # and no other
    assert w.get_block_ids_with_load_errors() == set(DST)
    assert w.blocks_load_failed == 5 and w.blocks_loaded == 0
    # The next step restores without deferring: every byte is in place when start_load_kv returns.
    jobs = layers.jobs
    for t in engine.values():
        t.zero_()
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, DST, "r2")]))
    assert layers.jobs == jobs and not layers.active()
    for b, expected in zip(DST, want):
        assert all(torch.equal(got.view(torch.int16), exp.view(torch.int16))
                   for got, exp in zip(_block(engine, b), expected))
    assert w.get_block_ids_with_load_errors() == set()
    w.shutdown()


def test_a_deferred_copy_past_the_lease_is_a_load_error(kvtierd_factory: Callable[..., Any]) -> None:
    daemon, shape, keys, _ = _stored(kvtierd_factory, "cpu_attn [0]", lend_lease_s=0.001)
    w = _overlapping_worker(daemon.endpoint)
    _start(w, _kv(shape, "cpu", torch.bfloat16, seed=2), keys)
    for i in range(LAYERS):
        w.wait_for_layer_load(f"layer.{i}")
    w.wait_for_save(StepTransfers())
    assert w.get_block_ids_with_load_errors() == set(DST)
    assert w.blocks_load_failed == 5
    w.shutdown()


def test_layer_overlap_is_a_boolean() -> None:
    with pytest.raises(ValueError, match="layer_overlap"):
        ConnectorSettings.from_extra_config({"socket": "ipc:///tmp/x.sock", "layer_overlap": "yes"})


def test_a_wait_returns_only_once_its_tensors_pieces_are_copied() -> None:
    layers = LayerCopies()
    src = [np.full(1 << 20, i + 1, np.uint8) for i in range(3)]
    dst = [np.zeros(1 << 20, np.uint8) for _ in range(3)]
    gate = threading.Event()

    def finish() -> bool:
        return True

    # A first job that holds the helper until the gate opens: the waits below must block on it.
    layers.defer(0, [9], [(5, np.zeros(1, np.uint8), np.zeros(1, np.uint8))], lambda: gate.wait(10.0))
    layers.defer(0, [1, 2], [(t, dst[t], src[t]) for t in range(3)], finish)
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (layers.wait(0, 2), waited.set()))
    waiter.start()
    assert not waited.wait(0.2)  # tensor 2's piece has not moved yet
    gate.set()
    waiter.join(10.0)
    assert waited.is_set() and np.array_equal(dst[2], src[2])
    for t in (0, 1, 5):
        layers.wait(0, t)
    layers.wait(1, 0)  # nothing deferred for it: at once
    assert layers.settle() == set() and all(np.array_equal(d, s) for d, s in zip(dst, src))
    assert layers.active() is False  # outside deferring()
    with layers.deferring():
        assert layers.active()
    layers.close()


def test_a_piece_that_raises_fails_its_jobs_blocks_and_no_wait_hangs() -> None:
    layers = LayerCopies()
    ok_src, ok_dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    bad = (1, np.zeros(8, np.uint8), np.zeros(9, np.uint8))  # shapes that do not broadcast: copyto raises
    layers.defer(0, [4, 5], [(0, ok_dst, ok_src), bad], lambda: True)
    layers.wait(0, 0)
    layers.wait(0, 1)
    assert layers.settle() == {4, 5}
    layers.close()
