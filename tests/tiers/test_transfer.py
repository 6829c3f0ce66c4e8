"""Transfer engines (tiers/copy_types.py, tiers/transfer.py): completion, order per priority class, failures, close.

ThreadTransferEngine runs everywhere; the CUDA engine test is marked ``cuda``
and skips on a machine without a GPU.
"""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from kvtier.testing.transfer_hooks import HookedTransferEngine
from kvtier.tiers.host_memory import allocate_host_slab
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.transfer import (
    CopyKind,
    ThreadTransferEngine,
    Transfer,
    TransferError,
    make_transfer_engine,
    warm_up,
)

BB = 256
POISON = 0x5A
GEN = torch.Generator().manual_seed(99)


def rand_slab(nb: int, bb: int = BB) -> BlockLayout:
    layout = BlockLayout.contiguous(nb, bb)
    layout.slab().copy_(torch.randint(0, 256, (nb, bb), dtype=torch.uint8, generator=GEN))
    return layout


def poisoned_slab(nb: int, bb: int = BB) -> BlockLayout:
    layout = BlockLayout.contiguous(nb, bb)
    layout.slab().fill_(POISON)
    return layout


def drain(engine: ThreadTransferEngine, transfers: list[Transfer], timeout_s: float = 10.0) -> list[Transfer]:
    """Poll until every transfer came back; returns them in poll order."""
    got: list[Transfer] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < len(transfers):
        assert time.monotonic() < deadline, f"only {len(got)} of {len(transfers)} transfers came back"
        got.extend(engine.poll())
        time.sleep(0.001)
    return got


@pytest.fixture
def engine():
    eng = ThreadTransferEngine()
    yield eng
    eng.close()


def test_completion_copies_every_byte(engine: ThreadTransferEngine) -> None:
    src, dst = rand_slab(8), poisoned_slab(10)
    woken = threading.Event()
    engine.set_wakeup(woken.set)
    t = engine.submit(CopyKind.DEMOTE, src, [7, 0, 3], dst, [1, 9, 4])
    assert isinstance(t, Transfer) and t.num_blocks == 3 and t.nbytes == 3 * BB
    assert t.wait(10) and t.done()
    assert t.error is None and t.finished_s is not None and t.finished_s >= t.submitted_s
    assert woken.wait(10)
    (polled,) = drain(engine, [t])
    assert polled is t
    expected = src.slab()[[7, 0, 3]]
    assert torch.equal(dst.slab()[[1, 9, 4]], expected)
    others = [s for s in range(10) if s not in (1, 9, 4)]
    assert bool((dst.slab()[others] == POISON).all())
    assert engine.bytes_by_kind[CopyKind.DEMOTE] == 3 * BB
    assert engine.bytes_by_kind[CopyKind.RESTORE] == 0


def test_copy_between_different_layout_shapes(engine: ThreadTransferEngine) -> None:
    # An engine-style per-layer layout and a host slab with the same block bytes.
    layers = [
        torch.randint(0, 256, (2, 5, 4, 2, 8), dtype=torch.uint8, generator=GEN).view(torch.float16) for _ in range(2)
    ]
    gpu = BlockLayout(layers, [1, 1])
    host = poisoned_slab(6, gpu.block_bytes)
    t = engine.submit(CopyKind.DEMOTE, gpu, [4, 2], host, [0, 5])
    drain(engine, [t])
    assert t.error is None
    assert torch.equal(host.slab()[0], gpu.block_view(4)) and torch.equal(host.slab()[5], gpu.block_view(2))
    back = BlockLayout([torch.zeros_like(x) for x in layers], [1, 1])
    for x in back.tensors:
        x.view(torch.uint8).fill_(POISON)
    t = engine.submit(CopyKind.RESTORE, host, [0, 5], back, [1, 3])
    drain(engine, [t])
    assert t.error is None
    assert torch.equal(back.block_view(1), gpu.block_view(4)) and torch.equal(back.block_view(3), gpu.block_view(2))
    for s in (0, 2, 4):
        assert bool((back.block_view(s) == POISON).all())


def test_each_priority_class_completes_in_submission_order(engine: ThreadTransferEngine) -> None:
    src = rand_slab(64)
    transfers, checks = [], []
    for i in range(40):
        kind = CopyKind.RESTORE if i % 3 == 0 else CopyKind.DEMOTE
        n = 1 + (i * 7) % 16  # uneven sizes
        slots = [(i + j) % 64 for j in range(n)]
        dst = poisoned_slab(64)
        transfers.append(engine.submit(kind, src, slots, dst, slots))
        checks.append((dst, slots))
    done = drain(engine, transfers)
    assert sorted(t.transfer_id for t in done) == sorted(t.transfer_id for t in transfers)
    for high in (True, False):
        ids = [t.transfer_id for t in done if t.high_priority is high]
        assert ids == sorted(ids), f"{'high' if high else 'low'}-priority transfers finished out of order"
        finished = [t.finished_s for t in done if t.high_priority is high]
        assert finished == sorted(finished)
    assert all(t.error is None for t in done)
    for dst, slots in checks:
        assert torch.equal(dst.slab()[slots], src.slab()[slots])
        rest = [s for s in range(64) if s not in slots]
        assert bool((dst.slab()[rest] == POISON).all())


def test_high_priority_does_not_wait_behind_low_priority() -> None:
    gate = threading.Event()

    def hold_low(t: Transfer) -> None:
        if not t.high_priority:
            assert gate.wait(10)

    eng = HookedTransferEngine(fault_hook=hold_low)
    try:
        src, dst = rand_slab(4), poisoned_slab(4)
        low = eng.submit(CopyKind.DEMOTE, src, [0], dst, [0])
        low2 = eng.submit(CopyKind.STORE, src, [1], dst, [1])
        high = eng.submit(CopyKind.RESTORE, src, [2], dst, [2])
        # A demotion can be promoted (an eviction an allocation waits for).
        urgent = eng.submit(CopyKind.DEMOTE, src, [3], dst, [3], high_priority=True)
        assert high.high_priority and urgent.high_priority and not low.high_priority
        assert high.wait(10) and urgent.wait(10)
        assert not low.done() and not low2.done()
        assert torch.equal(dst.slab()[2:4], src.slab()[2:4])
        assert bool((dst.slab()[0:2] == POISON).all())
        gate.set()
        drain(eng, [low, low2, high, urgent])
        assert torch.equal(dst.slab(), src.slab())
    finally:
        gate.set()
        eng.close()


def test_poll_returns_each_transfer_once(engine: ThreadTransferEngine) -> None:
    src = rand_slab(16)
    transfers = [engine.submit(CopyKind.STORE, src, [i], poisoned_slab(16), [i]) for i in range(16)]
    for t in transfers:
        assert t.wait(10)
    got = drain(engine, transfers)
    assert len(got) == len(transfers)
    assert {id(t) for t in got} == {id(t) for t in transfers}
    time.sleep(0.01)
    assert engine.poll() == []
    assert engine.poll() == []


def test_an_idle_engine_holds_no_finished_copy_s_buffers(engine: ThreadTransferEngine) -> None:
    """A worker waiting for its next job keeps none of its last: the pool frees a detached GPU tier's
    memory (or a client's buffer) by dropping its references, and a worker that still held the last
    job's layouts would keep those alive until the next copy of its priority class, maybe never."""
    refs: list[weakref.ref[BlockLayout]] = []
    transfers: list[Transfer] = []
    for kind in (CopyKind.RESTORE, CopyKind.DEMOTE):  # one per worker: high and low priority
        src, dst = rand_slab(4), poisoned_slab(4)
        transfers.append(engine.submit(kind, src, [0, 1, 2, 3], dst, [3, 2, 1, 0]))
        assert transfers[-1].wait(10) and transfers[-1].error is None
        assert torch.equal(dst.slab()[[3, 2, 1, 0]], src.slab())
        refs += [weakref.ref(src), weakref.ref(dst)]
        del src, dst
    assert drain(engine, transfers) == transfers
    deadline = time.monotonic() + 10
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker drops its job right after it completed the transfer
    assert [r() is None for r in refs] == [True] * 4


def test_fault_hook_failure_fails_only_that_transfer() -> None:
    bad: set[int] = set()

    def hook(t: Transfer) -> None:
        if t.transfer_id in bad:
            raise RuntimeError("injected copy failure")

    eng = HookedTransferEngine(fault_hook=hook)
    try:
        src = rand_slab(8)
        dsts = [poisoned_slab(8) for _ in range(4)]
        bad.add(2)  # ids start at 1: the second transfer fails
        ts = [eng.submit(CopyKind.DEMOTE if i % 2 else CopyKind.RESTORE, src, [i, i + 4], d, [i, i + 4])
              for i, d in enumerate(dsts)]
        assert ts[1].transfer_id == 2
        drain(eng, ts)
        assert isinstance(ts[1].error, TransferError) and "injected" in str(ts[1].error)
        assert bool((dsts[1].slab() == POISON).all())  # nothing written
        for i in (0, 2, 3):
            assert ts[i].error is None
            assert torch.equal(dsts[i].slab()[[i, i + 4]], src.slab()[[i, i + 4]])
        # Failed bytes are not counted; the engine keeps serving.
        assert eng.bytes_by_kind[CopyKind.DEMOTE] + eng.bytes_by_kind[CopyKind.RESTORE] == 3 * 2 * BB
        later = eng.submit(CopyKind.DEMOTE, src, [0], dsts[1], [0])
        drain(eng, [later])
        assert later.error is None and torch.equal(dsts[1].slab()[0], src.slab()[0])
    finally:
        eng.close()


def test_bad_slots_fail_the_transfer_not_the_engine(engine: ThreadTransferEngine) -> None:
    src, dst = rand_slab(4), poisoned_slab(4)
    t = engine.submit(CopyKind.RESTORE, src, [0, 1], dst, [0, 99])
    drain(engine, [t])
    assert isinstance(t.error, TransferError)
    assert bool((dst.slab() == POISON).all())
    ok = engine.submit(CopyKind.RESTORE, src, [3], dst, [3])
    drain(engine, [ok])
    assert ok.error is None and torch.equal(dst.slab()[3], src.slab()[3])


def test_submit_validates_at_once(engine: ThreadTransferEngine) -> None:
    src = rand_slab(4)
    with pytest.raises(ValueError):
        engine.submit(CopyKind.DEMOTE, src, [0, 1], poisoned_slab(4), [0])
    with pytest.raises(ValueError):
        engine.submit(CopyKind.DEMOTE, src, [0], poisoned_slab(4, BB * 2), [0])
    assert engine.poll() == []


def test_close_finishes_queued_copies_then_refuses_submit() -> None:
    eng = ThreadTransferEngine()
    src = rand_slab(32)
    dst = poisoned_slab(32)
    ts = [eng.submit(CopyKind.DEMOTE if i % 2 else CopyKind.RESTORE, src, [i], dst, [i]) for i in range(32)]
    eng.close(10)
    assert all(t.done() and t.error is None for t in ts)
    assert torch.equal(dst.slab(), src.slab())
    with pytest.raises(TransferError):
        eng.submit(CopyKind.DEMOTE, src, [0], dst, [0])
    with pytest.raises(TransferError):
        eng.submit(CopyKind.RESTORE, src, [0], dst, [0])
    eng.close()  # idempotent
    assert len(eng.poll()) == 32


def test_make_transfer_engine_without_cuda_uses_threads() -> None:
    eng = make_transfer_engine("cpu")
    try:
        assert isinstance(eng, ThreadTransferEngine)
    finally:
        eng.close()


def test_warm_up_off_cuda_does_nothing() -> None:
    assert warm_up("cpu") == {}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warm_up_on_cuda_names_the_methods_a_pool_engine_gets_without_retesting() -> None:
    from kvtier.tiers import transfer

    methods = warm_up("cuda:0")
    assert set(methods) == {"high", "low"} and set(methods.values()) <= {"kernel", "memcpy", "batch", "staging"}
    # The self-tests passed once for the process: the first pool's engine does not run them again.
    assert {m for _, m in transfer._SELF_TESTED} >= set(methods.values()) - {"staging"}
    engine = make_transfer_engine("cuda:0")
    try:
        assert engine.copy_methods == methods
    finally:
        engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_round_trip_device_and_pinned_host_every_byte() -> None:
    from kvtier.tiers.transfer import CudaTransferEngine

    nb, bs, heads, dim, layers = 16, 16, 4, 64, 3

    def device_layout() -> BlockLayout:
        ts = [
            torch.randint(0, 256, (2, nb, bs, heads, dim * 2), dtype=torch.uint8, device="cuda").view(torch.float16)
            for _ in range(layers)
        ]
        return BlockLayout(ts, [1] * layers)

    gpu = device_layout()
    gpu_back = device_layout()
    for t in gpu_back.tensors:
        t.view(torch.uint8).fill_(POISON)
    host = allocate_host_slab(nb, gpu.block_bytes, pin=True)
    host.slab().fill_(POISON)
    eng = CudaTransferEngine("cuda")
    try:
        src_slots = [3, 0, 15, 7, 8]
        host_slots = [10, 2, 5, 0, 15]
        back_slots = [1, 14, 6, 9, 2]
        down = eng.submit(CopyKind.DEMOTE, gpu, src_slots, host, host_slots)
        assert down.wait(30) and down.error is None
        expected = gpu.gather(src_slots).cpu()
        assert torch.equal(host.slab()[host_slots], expected)
        others = [s for s in range(nb) if s not in host_slots]
        assert bool((host.slab()[others] == POISON).all())
        up = eng.submit(CopyKind.RESTORE, host, host_slots, gpu_back, back_slots)
        assert up.wait(30) and up.error is None
        assert torch.equal(gpu_back.gather(back_slots).cpu(), expected)
        others = [s for s in range(nb) if s not in back_slots]
        assert bool((gpu_back.gather(others).cpu() == POISON).all())
        # Device to device, and host to host through the same engine.
        d2d_dst = device_layout()
        d2d = eng.submit(CopyKind.RESTORE, gpu, [4, 5], d2d_dst, [0, 1])
        h2h_dst = poisoned_slab(nb, gpu.block_bytes)
        h2h = eng.submit(CopyKind.STORE, host, [10], h2h_dst, [3])
        assert d2d.wait(30) and h2h.wait(30) and d2d.error is None and h2h.error is None
        assert torch.equal(d2d_dst.gather([0, 1]), gpu.gather([4, 5]))
        assert torch.equal(h2h_dst.slab()[3], host.slab()[10])
        deadline = time.monotonic() + 10
        seen: list[Transfer] = []
        while len(seen) < 4 and time.monotonic() < deadline:
            seen.extend(eng.poll())
            time.sleep(0.001)
        assert {id(t) for t in seen} == {id(down), id(up), id(d2d), id(h2h)}
        # Every copy counts in the engine's totals (the pool's copy_bytes), the
        # host-to-host one too, though a host worker ran it (seen missing on an H100).
        bb = gpu.block_bytes
        assert eng.bytes_by_kind == {CopyKind.DEMOTE: 5 * bb, CopyKind.RESTORE: 7 * bb, CopyKind.STORE: bb,
                                     CopyKind.LOAD: 0}
    finally:
        eng.close()
