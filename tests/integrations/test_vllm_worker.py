"""The connector's worker half against a real kvtierd, on KV tensors shaped like vLLM's.

No vLLM engine runs here (tests/integrations/test_vllm.py does that): the
worker half is driven directly with the metadata its scheduler half would
send, so every byte can be checked, on each layout vLLM's attention backends
use and on both data planes. The same tests run on CUDA tensors where a GPU
is present (CUDA IPC registration, in place). The worker half imports no
vLLM (``transfers.StepTransfers`` is what vLLM's metadata carries), so these
tests need none: they also run on a GPU machine without vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

import torch

from kvtier.client.client import PoolLayout
from kvtier.client.hashing import hash_token_blocks
from kvtier.integrations.adapter.transfers import BlockTransfer, StepTransfers
from kvtier.integrations.vllm.pool import PoolChoice, block_dim_of
from kvtier.integrations.vllm.settings import ConnectorSettings
from kvtier.integrations.vllm.worker import WorkerSide

NUM_BLOCKS, BS, HEADS, HEAD_DIM, LAYERS = 12, 32, 2, 16, 3

# vLLM's KV cache shapes per layer, by backend (block dimension in brackets).
LAYOUTS: dict[str, Callable[[], tuple[int, ...]]] = {
    "cpu_attn [0]": lambda: (NUM_BLOCKS, 2, HEADS, BS, HEAD_DIM),
    "flash_attn [1]": lambda: (2, NUM_BLOCKS, BS, HEADS, HEAD_DIM),
    "flashinfer [0]": lambda: (NUM_BLOCKS, 2, BS, HEADS, HEAD_DIM),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _pool(dtype: torch.dtype) -> PoolChoice:
    page_bytes = 2 * BS * HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()
    layout = PoolLayout(model="test-worker", block_size=BS, block_bytes=page_bytes * LAYERS, dtype=str(dtype).removeprefix("torch."),
                        num_layers=LAYERS, kv_heads=HEADS, head_dim=HEAD_DIM, mode="store")
    return PoolChoice.single("vllm/test-worker", layout, tuple(f"layer.{i}" for i in range(LAYERS)), BS)


def _kv(shape: tuple[int, ...], device: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).to(device) for i in range(LAYERS)}


def _block(kv: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t.select(block_dim_of(t, NUM_BLOCKS), block).clone() for t in kv.values()]


def _worker(endpoint: str, plane: str) -> WorkerSide:
    settings = ConnectorSettings.from_extra_config({"socket": endpoint, "data_plane": plane, "staging_blocks": 2,
                                                    "timeout_s": 2.0, "retry_s": 0.2})
    return WorkerSide(settings, _pool(torch.bfloat16), NUM_BLOCKS)


@pytest.fixture
def daemon(kvtierd_factory: Callable[..., Any]) -> Any:
    return kvtierd_factory(gpu_bytes=1 << 20, cpu_bytes=4 << 20)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plane", ["registered", "staged"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_then_restore_into_other_slots_is_byte_exact(daemon: Any, layout: str, plane: str, device: str) -> None:
    shape = LAYOUTS[layout]()
    engine1 = _kv(shape, device, torch.bfloat16, seed=1)
    keys = hash_token_blocks(list(range(5 * BS)), BS)
    src_blocks = [3, 5, 7, 8, 10]
    want = [_block(engine1, b) for b in src_blocks]

    w1 = _worker(daemon.endpoint, plane)
    w1.register_kv_caches(engine1)
    w1.wait_for_save(StepTransfers(stores=[BlockTransfer(keys[:3], src_blocks[:3], "r"),
                                            BlockTransfer(keys[3:], src_blocks[3:], "r")]))
    w1.wait_for_stores()
    w1.shutdown()

    # Another engine process with other bytes in its slots restores them.
    engine2 = _kv(shape, device, torch.bfloat16, seed=2)
    before = {n: t.clone() for n, t in engine2.items()}
    w2 = _worker(daemon.endpoint, plane)
    w2.register_kv_caches(engine2)
    dst_blocks = [0, 1, 2, 6, 11]
    w2.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, dst_blocks, "r2")]))
    assert w2.get_block_ids_with_load_errors() == set()
    assert w2.take_loaded() == {"r2"} and w2.take_loaded() == set()
    for b, expected in zip(dst_blocks, want):
        got = _block(engine2, b)
        for layer_got, layer_want in zip(got, expected):
            assert torch.equal(layer_got.view(torch.int16), layer_want.view(torch.int16))
    # Nothing outside the destination slots changed.
    for name, t in engine2.items():
        dim = block_dim_of(t, NUM_BLOCKS)
        for b in set(range(NUM_BLOCKS)) - set(dst_blocks):
            assert torch.equal(t.select(dim, b), before[name].select(dim, b))
    w2.shutdown()


@pytest.mark.parametrize("plane", ["registered", "staged"])
def test_blocks_kvtierd_lacks_are_load_errors(daemon: Any, plane: str) -> None:
    kv = _kv(LAYOUTS["cpu_attn [0]"](), "cpu", torch.bfloat16, seed=3)
    keys = hash_token_blocks(list(range(4 * BS)), BS)
    w = _worker(daemon.endpoint, plane)
    w.register_kv_caches(kv)
    w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys[:2], [0, 1], "r")]))
    w.wait_for_stores()
    # Blocks 2 and 3 were never stored: the restore stops at the held prefix.
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [4, 5, 6, 7], "r")]))
    assert w.get_block_ids_with_load_errors() == {6, 7}
    assert w.get_block_ids_with_load_errors() == set()  # reported once
    # The scheduler's load mode hears of the 2 blocks restored and the time it took, once.
    blocks, seconds = w.take_load_timing()
    assert blocks == 2 and seconds > 0 and w.take_load_timing() == (0, 0.0)
    w.shutdown()


def _wait_finished(w: WorkerSide, timeout_s: float = 20.0) -> tuple[set[str], set[int]]:
    """Collect like vLLM: each step get_finished, then the load errors (errors may come a step early)."""
    import time

    finished: set[str] = set()
    errors: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while not finished and time.monotonic() < deadline:
        finished = w.get_finished()
        errors |= w.get_block_ids_with_load_errors()
        time.sleep(0.02)
    return finished, errors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plane", ["registered", "staged"])
def test_a_background_load_waits_for_the_stores_before_it_and_reports_when_it_ran(daemon: Any, plane: str,
                                                                                  device: str) -> None:
    import threading

    kv = _kv(LAYOUTS["flash_attn [1]"](), device, torch.bfloat16, seed=5)
    keys = hash_token_blocks(list(range(6 * BS)), BS)
    w = _worker(daemon.endpoint, plane)
    w.register_kv_caches(kv)
    w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys[3:6], [3, 4, 5], "b")]))
    w.wait_for_stores()
    b_blocks = [_block(kv, b) for b in (3, 4, 5)]
    a_blocks = [_block(kv, b) for b in (0, 1, 2)]
    # A store of blocks 0-2 (a finished request's) is still queued when vLLM hands those block ids to a request
    # that loads in the background: its load must not overwrite them before the store read them.
    gate = threading.Event()
    w._stores.submit(lambda: gate.wait(20))  # the store thread is busy
    w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys[:3], [0, 1, 2], "a")]))
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys[3:6], [0, 1, 2], "b2", background=True)]))
    import time

    time.sleep(0.3)
    assert w.get_finished() == set() and w.take_loaded() == set()
    assert all(torch.equal(_block(kv, b)[0], a_blocks[b][0]) for b in (0, 1, 2)), "loaded before the store read"
    gate.set()
    finished, errors = _wait_finished(w)
    assert finished == {"b2"} and errors == set() and w.take_loaded() == {"b2"}
    assert w.get_finished() == set()  # reported once
    for b in (0, 1, 2):
        for got, want in zip(_block(kv, b), b_blocks[b]):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # The store read blocks 0-2 before the load overwrote them: kvtierd holds request a's bytes.
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys[:3], [6, 7, 8], "a2")]))
    assert w.get_block_ids_with_load_errors() == set()
    for i, b in enumerate((6, 7, 8)):
        for got, want in zip(_block(kv, b), a_blocks[i]):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    w.shutdown()


def test_a_background_load_kvtierd_cannot_serve_is_reported_with_its_errors(daemon: Any) -> None:
    kv = _kv(LAYOUTS["cpu_attn [0]"](), "cpu", torch.bfloat16, seed=6)
    keys = hash_token_blocks(list(range(4 * BS)), BS)
    w = _worker(daemon.endpoint, "registered")
    w.register_kv_caches(kv)
    w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys[:2], [0, 1], "r")]))
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [4, 5, 6, 7], "r2", background=True)]))
    finished, errors = _wait_finished(w)
    assert finished == {"r2"} and errors == {6, 7}
    daemon.proc.kill()
    daemon.proc.wait(10)
    # A dead daemon: the request is still reported, with every block an error (vLLM recomputes them).
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys[:2], [8, 9], "r3", background=True)]))
    finished, errors = _wait_finished(w)
    assert finished == {"r3"} and errors == {8, 9}
    w.shutdown()


def test_a_dead_daemon_turns_loads_into_errors_and_stores_into_nothing(daemon: Any) -> None:
    kv = _kv(LAYOUTS["cpu_attn [0]"](), "cpu", torch.bfloat16, seed=4)
    keys = hash_token_blocks(list(range(3 * BS)), BS)
    w = _worker(daemon.endpoint, "registered")
    w.register_kv_caches(kv)
    daemon.proc.kill()
    daemon.proc.wait(10)
    w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys, [0, 1, 2], "r")]))
    w.wait_for_stores()  # a failed store is a future miss, not an error
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [3, 4, 5], "r")]))
    assert w.get_block_ids_with_load_errors() == {3, 4, 5}
    assert w.take_load_timing() == (0, 0.0)  # nothing restored says nothing about a restore's time
    # The daemon comes back: the next calls reconnect and re-register.
    daemon.restart()
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys, [0, 1, 2], "r")]))
        w.wait_for_stores()
        w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [6, 7, 8], "r")]))
        if not w.get_block_ids_with_load_errors():
            break
        time.sleep(0.3)
    else:
        pytest.fail("the worker did not reconnect to the restarted daemon")
    for src, dst in zip([0, 1, 2], [6, 7, 8]):
        assert torch.equal(kv["layer.0"][src], kv["layer.0"][dst])
    w.shutdown()


def test_cpu_kv_moves_into_shared_memory_in_place() -> None:
    # vLLM keeps views of one storage per layer; every one must follow the move.
    raw = torch.zeros(LAYERS * NUM_BLOCKS * 64, dtype=torch.bfloat16)
    views = {f"layer.{i}": raw[i * NUM_BLOCKS * 64:(i + 1) * NUM_BLOCKS * 64].view(NUM_BLOCKS, 64) for i in range(LAYERS)}
    from kvtier.client.kv_share import export_kv, share_kv_in_place

    names = share_kv_in_place(list(views.values()))
    assert len(names) == 1 and os.path.exists(f"/dev/shm/{names[0]}")
    raw.fill_(3)
    assert all(bool((v == 3).all()) for v in views.values())
    desc = export_kv(list(views.values()), [0] * LAYERS)
    assert {t["handle"]["name"] for t in desc["tensors"]} == set(names)
    assert share_kv_in_place(list(views.values())) == []  # already shared: nothing new


def test_transfer_counters_are_taken_as_growth_since_the_last_take(daemon: Any) -> None:
    from kvtier.integrations.adapter.stats import STAT_NAMES

    kv = _kv(LAYOUTS["cpu_attn [0]"](), "cpu", torch.bfloat16, seed=7)
    keys = hash_token_blocks(list(range(4 * BS)), BS)
    w = _worker(daemon.endpoint, "registered")
    w.register_kv_caches(kv)
    assert w.take_stats() == dict.fromkeys(STAT_NAMES, 0.0)
    w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys[:3], [0, 1, 2], "r")]))
    w.wait_for_stores()
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [4, 5, 6, 7], "r2")]))
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys[:2], [8, 9], "r3", background=True)]))
    assert _wait_finished(w)[0] == {"r3"}
    got = w.take_stats()
    assert {k: got[k] for k in STAT_NAMES if k != "load_s"} == {
        "blocks_loaded": 5, "blocks_load_failed": 1, "loads_background": 1, "blocks_stored": 3,
        "blocks_loaded_by_layer": 0}
    assert got["load_s"] > 0
    assert w.take_stats() == dict.fromkeys(STAT_NAMES, 0.0)
    w.shutdown()
