"""The GPU data path: copy-plan executors, pacing, chunked pinning, IPC events.

Two halves:

- CPU-side logic, run everywhere: the kernel's index arithmetic mirrored in
  Python (every byte written exactly once, every vector access aligned), the
  token bucket, chunked pinning and NUMA lookups with fake CUDA registration
  and a fake sysfs, and CudaTransferEngine's wiring (routing, pacing,
  failures, fallbacks) with CUDA streams/events replaced by fakes and the
  executor replaced by one that moves the planned runs on the CPU.
- ``@pytest.mark.cuda`` tests (skipped without a GPU): every executor method,
  every engine layout, both directions, random data into poisoned
  destinations, byte-exact; the engine end to end; chunk-pinned slabs;
  an IPC event waited on from another process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.testing import cuda_emulation
from kvtier.tiers import cuda_copy, host_memory
from kvtier.blocks.copy_plan import execute_plan_cpu, plan_block_copy
from kvtier.blocks.layout import BlockLayout, copy_blocks
from kvtier.tiers.transfer import CopyKind, TransferError

CUDA = torch.cuda.is_available()


def cuda_test(fn):  # noqa: ANN001, ANN201 - a decorator
    """Marked ``cuda`` (deselect with -m 'not cuda') and skipped without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(fn))

ENGINE_KINDS = ("kv_first", "block_first", "all_layers", "layer_views", "padded", "heads_outer")


# ---- layouts over one arena (so whole arenas can be compared) ----------------------------------


def arena_bytes(kind: str, nb: int, layers: int, frag: int, item: int, offset: int) -> int:
    pad = 3 * item if kind == "padded" else 0
    if kind in ("slab", "all_layers", "layer_views"):
        return offset + nb * layers * 2 * frag + 16
    return offset + layers * 2 * nb * (frag + pad) + 16


def make_layout(kind: str, arena: torch.Tensor, nb: int, layers: int, frag: int, dtype: torch.dtype,
                offset: int = 0) -> BlockLayout:
    """A layout of ``kind`` with ``layers * 2 * frag``-byte blocks over ``arena`` (uint8, any device)."""
    item = torch.empty(0, dtype=dtype).element_size()
    e = frag // item
    block_bytes = layers * 2 * frag
    if kind == "slab":
        return BlockLayout([arena[offset : offset + nb * block_bytes].view(nb, block_bytes)], [0])
    if kind in ("all_layers", "layer_views"):
        whole = arena[offset : offset + nb * block_bytes].view(dtype).view(layers, 2, nb, e)
        if kind == "all_layers":
            return BlockLayout([whole], [2])
        return BlockLayout([whole[i] for i in range(layers)], [1] * layers)
    pad = 3 if kind == "padded" else 0
    per = 2 * nb * (e + pad) * item
    tensors = []
    for i in range(layers):
        flat = arena[offset + i * per : offset + (i + 1) * per].view(dtype)
        tensors.append({
            "kv_first": lambda: flat.view(2, nb, e),
            "block_first": lambda: flat.view(nb, 2, e),
            "padded": lambda: flat.view(2, nb, e + pad)[..., :e],
            "heads_outer": lambda: flat.view(nb, 2, e).transpose(0, 1),
        }[kind]())
    return BlockLayout(tensors, [0 if kind == "block_first" else 1] * layers)


def new_arena(kind: str, nb: int, layers: int, frag: int, dtype: torch.dtype, offset: int = 0, *,
              device: str = "cpu", pin: bool = False, fill: int | None = None, seed: int = 0) -> torch.Tensor:
    n = arena_bytes(kind, nb, layers, frag, torch.empty(0, dtype=dtype).element_size(), offset)
    if fill is None:
        arena = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    else:
        arena = torch.full((n,), fill, dtype=torch.uint8)
    if pin:
        arena = arena.pin_memory()
    return arena.to(device)


# ---- the kernel's arithmetic -------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(src=st.integers(0, 1 << 12), dst=st.integers(0, 1 << 12), n=st.integers(0, 600),
       threads=st.sampled_from([32, 64, 96]))
def test_kernel_arithmetic_writes_every_byte_once_with_aligned_vectors(src: int, dst: int, n: int,
                                                                       threads: int) -> None:
    width, head, vectors, tail = cuda_emulation.kernel_run_split(src, dst, n)
    assert head + vectors * width + tail == n and 0 <= tail < width
    assert head < width
    if vectors:
        assert (src + head) % width == 0 and (dst + head) % width == 0
    assert (cuda_emulation.kernel_thread_writes(src, dst, n, threads) == 1).all()


def test_kernel_picks_the_widest_congruent_vector() -> None:
    assert cuda_emulation.kernel_run_split(0x1000, 0x2000, 4096)[:3] == (16, 0, 256)
    assert cuda_emulation.kernel_run_split(0x1001, 0x2001, 4096)[:2] == (16, 15)
    assert cuda_emulation.kernel_run_split(0x1000, 0x2008, 64)[0] == 8
    assert cuda_emulation.kernel_run_split(0x1002, 0x2006, 64)[0] == 4
    assert cuda_emulation.kernel_run_split(0x1001, 0x2003, 64)[0] == 2
    assert cuda_emulation.kernel_run_split(0x1000, 0x2001, 64)[0] == 1
    assert cuda_emulation.kernel_run_split(0x1001, 0x2001, 5) == (16, 5, 0, 0)  # all head
    assert "kvtier_copy_runs" in cuda_copy.KERNEL_SOURCE


@settings(max_examples=60, deadline=None)
@given(s_kind=st.sampled_from(ENGINE_KINDS + ("slab",)), d_kind=st.sampled_from(ENGINE_KINDS + ("slab",)),
       frag=st.sampled_from([1, 3, 40, 64, 1000, 4096 + 24]), s_off=st.integers(0, 17), d_off=st.integers(0, 17),
       piece=st.sampled_from([16, 64, 1024, 65536]), data=st.data())
def test_emulated_kernel_is_byte_exact(s_kind: str, d_kind: str, frag: int, s_off: int, d_off: int, piece: int,
                                       data: st.DataObject) -> None:
    nb, layers = 5, 2
    src = make_layout(s_kind, new_arena(s_kind, nb, layers, frag, torch.uint8, s_off, seed=1), nb, layers, frag,
                      torch.uint8, s_off)
    n = data.draw(st.integers(1, nb))
    src_slots = data.draw(st.lists(st.integers(0, nb - 1), min_size=n, max_size=n))
    dst_slots = data.draw(st.permutations(range(nb)))[:n]
    for poison in (0x00, 0xFF):
        got_arena = new_arena(d_kind, nb, layers, frag, torch.uint8, d_off, fill=poison)
        want_arena = got_arena.clone()
        got = make_layout(d_kind, got_arena, nb, layers, frag, torch.uint8, d_off)
        plan = plan_block_copy(src, src_slots, got, dst_slots, min_fragment_bytes=1)
        cuda_emulation.execute_plan_emulated(plan, piece_bytes=piece)
        copy_blocks(src, src_slots, make_layout(d_kind, want_arena, nb, layers, frag, torch.uint8, d_off), dst_slots)
        assert torch.equal(got_arena, want_arena)


# ---- pacing ------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pacer_without_a_cap_never_waits() -> None:
    for rate in (None, 0, -5):
        pacer = cuda_copy.BandwidthPacer(rate)
        assert pacer.rate_bytes_per_s is None
        assert all(pacer.wait_s(1 << 30) == 0.0 for _ in range(5))


def test_pacer_spends_the_burst_then_holds_the_rate() -> None:
    clock = FakeClock()
    pacer = cuda_copy.BandwidthPacer(1e9, burst_bytes=10**8, clock=clock)
    assert pacer.wait_s(10**8) == 0.0  # the burst
    assert pacer.wait_s(10**8) == 0.0  # tokens at 0: goes into debt
    assert pacer.wait_s(10**8) == pytest.approx(0.1)  # repay 1e8 bytes at 1 GB/s
    # Simulate a sender that sleeps as told: the long-run rate is the cap.
    sent, start = 0, clock.now
    for _ in range(100):
        clock.now += pacer.wait_s(5 * 10**7)
        sent += 5 * 10**7
    assert sent / (clock.now - start) == pytest.approx(1e9, rel=0.05)
    # Idle time refills at most the burst.
    clock.now += 1000.0
    assert pacer.wait_s(10**8) == 0.0
    assert pacer.wait_s(10**8) == 0.0
    assert pacer.wait_s(1) == pytest.approx(0.1)


def test_pacer_pace_sleeps_what_wait_s_says() -> None:
    clock = FakeClock()
    pacer = cuda_copy.BandwidthPacer(1e6, burst_bytes=0, clock=clock)
    slept: list[float] = []
    assert pacer.pace(1000, sleep=slept.append) == 0.0
    assert pacer.pace(1000, sleep=slept.append) == pytest.approx(1e-3)
    assert slept == [pytest.approx(1e-3)]


# ---- module surface without CUDA ---------------------------------------------------------------


def test_module_is_usable_without_cupy_or_a_gpu() -> None:
    if not CUDA:
        assert cuda_copy.available_methods() == []
    with pytest.raises(ValueError, match="method"):
        cuda_copy.CudaPlanExecutor("cuda:0", method="warp-drive")
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_copy.CudaPlanExecutor("cpu")
    if cuda_copy.cupy_module() is None:
        assert cuda_copy.device_pointer(0x1000) is None
        with pytest.raises(RuntimeError, match="CuPy"):
            cuda_copy.CudaPlanExecutor("cuda:0", method="kernel")


def test_byte_span_covers_strided_views() -> None:
    base = torch.zeros(1000, dtype=torch.float32)
    v = base[10:].view(2, 5, 99)[:, 1:4, :7]
    lo, hi = cuda_copy._byte_span(v)
    assert lo == v.data_ptr()
    assert hi == v[-1, -1, -1].data_ptr() + 4


# ---- CudaTransferEngine wiring with fake streams/events and a CPU executor ----------------------


class FakeStream:
    def __init__(self, device: object = None, priority: int = 0) -> None:
        self.priority = priority
        self.cuda_stream = id(self)
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


class FakeEvent:
    # stream -> threading.Event: events recorded on that stream complete only once it is set
    gates: dict[object, threading.Event] = {}

    def __init__(self, enable_timing: bool = False, **_kw: object) -> None:
        self.t: float | None = None
        self.stream: object = None

    def record(self, stream: object = None) -> None:
        self.t = time.monotonic()
        self.stream = stream

    def synchronize(self) -> None:
        gate = FakeEvent.gates.get(self.stream)
        if gate is not None:
            assert gate.wait(30)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1e3 + 1e-3  # never 0, like a real event pair


class CpuExecutor:
    """Stands in for CudaPlanExecutor: moves the planned runs at launch, on the CPU, and logs launches."""

    log: list[dict] = []
    self_tests = 0
    fail_self_test: set[str] = set()
    fail_launch: list[int] = []  # launch numbers (0-based, global) that raise

    def __init__(self, device: object, *, method: str = "kernel") -> None:
        self.method = method

    def self_test(self) -> None:
        CpuExecutor.self_tests += 1
        if self.method in CpuExecutor.fail_self_test:
            raise RuntimeError("self-test mismatch")

    def plannable(self, src: BlockLayout, dst: BlockLayout) -> bool:
        return True

    def launch(self, plan, stream: FakeStream, *, max_blocks: int | None = None) -> list:
        n = len(CpuExecutor.log)
        CpuExecutor.log.append({"thread": threading.current_thread().name, "t": time.monotonic(),
                                "nbytes": plan.nbytes, "max_blocks": max_blocks, "stream": stream,
                                "method": self.method})
        if n in CpuExecutor.fail_launch:
            raise RuntimeError("launch failed")
        for s, d, k in zip(plan.src_ptrs.tolist(), plan.dst_ptrs.tolist(), plan.sizes.tolist()):
            ctypes.memmove(d, s, k)
        return [plan]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    CpuExecutor.log = []
    CpuExecutor.self_tests = 0
    CpuExecutor.fail_self_test = set()
    CpuExecutor.fail_launch = []
    FakeEvent.gates = {}
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda *_a, **_k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda *_a, **_k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_copy, "available_methods", lambda: ["kernel", "memcpy"])
    monkeypatch.setattr(cuda_copy, "CudaPlanExecutor", CpuExecutor)
    from kvtier.tiers import transfer
    from kvtier.tiers.transfer import CudaTransferEngine

    monkeypatch.setattr(transfer, "_SELF_TESTED", set())  # each test sees its executors' self-tests

    engines = []

    def make(**kw: object) -> CudaTransferEngine:
        eng = CudaTransferEngine("cuda:0", **kw)
        engines.append(eng)
        return eng

    yield make
    for gate in FakeEvent.gates.values():
        gate.set()
    for eng in engines:
        eng.close()


def gpu_labelled(kind: str, nb: int, layers: int, frag: int, *, fill: int | None = None, seed: int = 0):
    """(layout, arena, twin): a host layout the engine takes for a device layout (its device says
    cuda:0), its memory, and an ordinary host layout over the same memory (for references)."""
    arena = new_arena(kind, nb, layers, frag, torch.float16, fill=fill, seed=seed)
    layout = make_layout(kind, arena, nb, layers, frag, torch.float16)
    layout.device = torch.device("cuda", 0)
    return layout, arena, make_layout(kind, arena, nb, layers, frag, torch.float16)


def test_engine_sends_batches_through_the_executor_on_the_right_threads(fake_cuda) -> None:
    eng = fake_cuda(low_priority_max_blocks=8)
    assert eng.copy_methods == {"high": "kernel", "low": "kernel"}
    nb, layers, frag = 8, 3, 1024
    gpu, gpu_arena, _ = gpu_labelled("kv_first", nb, layers, frag, seed=3)
    for poison in (0x00, 0xFF):
        host = BlockLayout([torch.full((nb, gpu.block_bytes), poison, dtype=torch.uint8)], [0])
        want = host.slab().clone()
        cpu_twin = make_layout("kv_first", gpu_arena, nb, layers, frag, torch.float16)
        copy_blocks(cpu_twin, [1, 2, 7], BlockLayout([want], [0]), [5, 0, 3])
        down = eng.submit(CopyKind.DEMOTE, gpu, [1, 2, 7], host, [5, 0, 3])
        assert down.wait(10) and down.error is None
        assert torch.equal(host.slab(), want)
        back, back_arena, _ = gpu_labelled("kv_first", nb, layers, frag, fill=poison)
        want_back = back_arena.clone()
        copy_blocks(host, [5, 0, 3], make_layout("kv_first", want_back, nb, layers, frag, torch.float16), [0, 4, 6])
        up = eng.submit(CopyKind.RESTORE, host, [5, 0, 3], back, [0, 4, 6])
        assert up.wait(10) and up.error is None
        assert torch.equal(back_arena, want_back)
    demotes = [e for e in CpuExecutor.log if e["stream"] is eng.stream(False)]
    restores = [e for e in CpuExecutor.log if e["stream"] is eng.stream(True)]
    assert len(demotes) == 2 and len(restores) == 2
    assert all(e["thread"] == "kvtier-cuda-launch-lo" and e["max_blocks"] == 8 for e in demotes)
    assert all(e["thread"] == threading.current_thread().name and e["max_blocks"] is None for e in restores)
    stats = eng.device_stats()
    assert stats["d2h"]["bytes"] == 2 * 3 * gpu.block_bytes and stats["d2h"]["transfers"] == 2
    assert stats["h2d"]["bytes"] == 2 * 3 * gpu.block_bytes and stats["h2d"]["gbps"] > 0
    assert stats["d2d"]["transfers"] == 0 and stats["d2d"]["gbps"] == 0.0
    assert eng.stream(True).priority < eng.stream(False).priority


def test_capped_demotions_are_cut_into_chunks_and_paced_off_the_caller(fake_cuda) -> None:
    chunk = 256 * 1024
    rate = 40e6
    eng = fake_cuda(demote_bandwidth_cap_bytes_per_s=rate, demote_chunk_bytes=chunk)
    nb, layers, frag = 8, 4, 32 * 1024  # 256 KiB blocks
    gpu, _, twin = gpu_labelled("kv_first", nb, layers, frag, seed=5)
    host = BlockLayout.contiguous(nb, gpu.block_bytes)
    t0 = time.monotonic()
    down = eng.submit(CopyKind.DEMOTE, gpu, list(range(nb)), host, list(range(nb)))
    assert time.monotonic() - t0 < 0.02  # submit never waits for the pacer
    assert down.wait(10) and down.error is None
    launches = [e for e in CpuExecutor.log if e["stream"] is eng.stream(False)]
    assert [e["nbytes"] for e in launches] == [chunk] * nb
    span = launches[-1]["t"] - launches[0]["t"]
    # The burst (one chunk) and one chunk of debt go at once; the rest at the rate.
    assert span >= 0.9 * (nb - 2) * chunk / rate
    assert torch.equal(host.slab(), twin.gather(list(range(nb))))
    # Restores are never paced or cut, even with the cap.
    CpuExecutor.log.clear()
    up = eng.submit(CopyKind.RESTORE, host, list(range(nb)), gpu, list(range(nb)))
    assert up.wait(10) and up.error is None
    assert [e["nbytes"] for e in CpuExecutor.log] == [nb * gpu.block_bytes]


def test_demotions_are_cut_into_pieces_that_wait_while_a_restore_is_in_flight(fake_cuda) -> None:
    chunk = 256 * 1024
    eng = fake_cuda(demote_chunk_bytes=chunk, restore_yield_max_s=5.0)  # no cap
    nb, layers, frag = 8, 4, 32 * 1024  # 256 KiB blocks: one piece each
    gpu, _, twin = gpu_labelled("kv_first", nb, layers, frag, seed=4)
    host = BlockLayout.contiguous(nb, gpu.block_bytes)
    gate = FakeEvent.gates[eng.stream(True)] = threading.Event()
    up = eng.submit(CopyKind.RESTORE, host, [7], gpu, [7])  # on the device until the gate opens
    down = eng.submit(CopyKind.DEMOTE, gpu, list(range(4)), host, list(range(4)))
    time.sleep(0.2)

    def pieces() -> list[dict]:
        return [e for e in CpuExecutor.log if e["stream"] is eng.stream(False)]

    assert pieces() == [] and not down.done()  # the link is the restore's
    gate.set()
    assert up.wait(10) and down.wait(10) and up.error is None and down.error is None
    assert [e["nbytes"] for e in pieces()] == [chunk] * 4
    assert torch.equal(host.slab()[:4], twin.gather(list(range(4))))


def test_restores_in_flight_hold_each_demotion_piece_back_for_a_bounded_time(fake_cuda) -> None:
    chunk = 256 * 1024
    eng = fake_cuda(demote_chunk_bytes=chunk, restore_yield_max_s=0.05)
    gpu, _, twin = gpu_labelled("kv_first", 4, 4, 32 * 1024, seed=6)
    host = BlockLayout.contiguous(4, gpu.block_bytes)
    FakeEvent.gates[eng.stream(True)] = threading.Event()  # the restore never completes in this test
    eng.submit(CopyKind.RESTORE, host, [3], gpu, [3])
    t0 = time.monotonic()
    down = eng.submit(CopyKind.DEMOTE, gpu, [0, 1], host, [0, 1])
    assert down.wait(10) and down.error is None  # not starved
    assert 0.09 <= time.monotonic() - t0 < 5  # each of the two pieces waited its 50 ms
    assert torch.equal(host.slab()[:2], twin.gather([0, 1]))


def test_a_failed_launch_fails_its_transfer_only(fake_cuda) -> None:
    eng = fake_cuda(demote_bandwidth_cap_bytes_per_s=1e12, demote_chunk_bytes=64 * 1024)
    gpu, _, twin = gpu_labelled("kv_first", 4, 2, 32 * 1024, seed=2)
    host = BlockLayout.contiguous(4, gpu.block_bytes)
    CpuExecutor.fail_launch = [1]  # the second chunk of the first demotion
    bad = eng.submit(CopyKind.DEMOTE, gpu, [0, 1], host, [0, 1])
    good = eng.submit(CopyKind.DEMOTE, gpu, [2], host, [2])
    assert bad.wait(10) and good.wait(10)
    assert isinstance(bad.error, TransferError) and "launch failed" in str(bad.error)
    assert good.error is None and torch.equal(host.slab()[2], twin.gather([2])[0])
    CpuExecutor.fail_launch = [len(CpuExecutor.log)]
    bad_up = eng.submit(CopyKind.RESTORE, host, [2], gpu, [3])
    assert bad_up.wait(10) and isinstance(bad_up.error, TransferError)
    assert eng.device_stats()["d2h"]["transfers"] == 1  # failed transfers are not counted
    done = []
    deadline = time.monotonic() + 5
    while len(done) < 3 and time.monotonic() < deadline:
        done += eng.poll()
        time.sleep(0.001)
    assert {id(t) for t in done} == {id(bad), id(good), id(bad_up)}


def test_methods_that_fail_their_self_test_are_never_used(fake_cuda) -> None:
    from kvtier.tiers import transfer

    CpuExecutor.fail_self_test = {"kernel"}
    assert fake_cuda().copy_methods == {"high": "memcpy", "low": "memcpy"}
    transfer._SELF_TESTED.clear()  # as in a new process: memcpy's pass above is remembered otherwise
    CpuExecutor.fail_self_test = {"kernel", "memcpy"}
    assert fake_cuda().copy_methods == {"high": "staging", "low": "staging"}
    assert fake_cuda(copy_method="kernel").copy_methods == {"high": "staging", "low": "staging"}
    CpuExecutor.fail_self_test = set()
    assert fake_cuda(copy_method="kernel", demote_method="memcpy").copy_methods == {"high": "kernel", "low": "memcpy"}
    assert fake_cuda(copy_method="staging").copy_methods == {"high": "staging", "low": "staging"}
    with pytest.raises(ValueError, match="copy method"):
        fake_cuda(copy_method="dma-please")


def test_a_method_is_self_tested_once_per_process_until_it_passes(fake_cuda) -> None:
    # A daemon makes an engine per pool: a hello must not wait for the self-tests again.
    CpuExecutor.fail_self_test = {"kernel"}
    assert fake_cuda(copy_method="kernel").copy_methods["high"] == "staging"
    assert fake_cuda(copy_method="kernel").copy_methods["high"] == "staging"
    assert CpuExecutor.self_tests == 2  # a failure is not remembered: tried again
    CpuExecutor.fail_self_test = set()
    for _ in range(3):
        assert fake_cuda(copy_method="kernel").copy_methods["high"] == "kernel"
    assert CpuExecutor.self_tests == 3


def test_background_copies_prefer_the_copy_engines_and_fall_back_to_the_kernel(fake_cuda) -> None:
    from kvtier.tiers import transfer
    from kvtier.tiers.transfer import BACKGROUND

    # No "batch" here (available_methods is kernel and memcpy): memcpy is the first copy-engine method.
    assert fake_cuda(demote_method=BACKGROUND).copy_methods == {"high": "kernel", "low": "memcpy"}
    transfer._SELF_TESTED.clear()  # as in a new process
    CpuExecutor.fail_self_test = {"memcpy"}
    assert fake_cuda(demote_method=BACKGROUND).copy_methods == {"high": "kernel", "low": "kernel"}


def test_auto_sends_long_runs_to_the_copy_engines_and_fragments_to_the_kernel(fake_cuda) -> None:
    eng = fake_cuda()
    assert eng.copy_methods["high"] == "kernel" and eng.bulk_method == "memcpy"
    nb = 4
    big = BlockLayout.contiguous(nb, 1 << 20)  # 1 MiB runs
    big.device = torch.device("cuda", 0)
    big.slab().random_(0, 256)
    host = BlockLayout.contiguous(nb, 1 << 20)
    up = eng.submit(CopyKind.RESTORE, host, [0, 1], big, [2, 3])
    frag, _, _ = gpu_labelled("kv_first", nb, 4, 32 * 1024, seed=8)  # 32 KiB runs
    frag_host = BlockLayout.contiguous(nb, frag.block_bytes)
    up2 = eng.submit(CopyKind.RESTORE, frag_host, [0], frag, [1])
    assert up.wait(10) and up2.wait(10) and up.error is None and up2.error is None
    assert [e["method"] for e in CpuExecutor.log] == ["memcpy", "kernel"]
    assert torch.equal(big.slab()[2:4], host.slab()[0:2])
    assert fake_cuda(copy_method="kernel").bulk_method is None  # a method named is a method used


def test_wait_event_goes_on_the_stream_of_its_class(fake_cuda) -> None:
    eng = fake_cuda()
    ev = FakeEvent()
    eng.wait_event(ev, high_priority=False)
    assert eng.stream(False).waited == [ev] and eng.stream(True).waited == []


def test_close_launches_queued_demotions_without_pacing(fake_cuda) -> None:
    eng = fake_cuda(demote_bandwidth_cap_bytes_per_s=1e6, demote_chunk_bytes=64 * 1024)
    gpu, _, twin = gpu_labelled("kv_first", 8, 2, 32 * 1024, seed=9)  # 128 KiB blocks: 1 MiB takes 1 s
    host = BlockLayout.contiguous(8, gpu.block_bytes)
    down = eng.submit(CopyKind.DEMOTE, gpu, list(range(8)), host, list(range(8)))
    time.sleep(0.05)
    t0 = time.monotonic()
    eng.close(timeout_s=5)
    assert time.monotonic() - t0 < 1.0
    assert down.done() and down.error is None
    assert torch.equal(host.slab(), twin.gather(list(range(8))))


def test_row_runs_group_consecutive_slots() -> None:
    from kvtier.tiers.transfer import _row_runs

    assert _row_runs([]) == []
    assert _row_runs([3, 4, 5, 9, 10, 2, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1), (6, 2, 1)]


# ---- chunked pinning and NUMA (fake registration, fake sysfs) ----------------------------------


class FakeRegistry:
    def __init__(self, fail_at: int | None = None) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple[int, int]] = []
        self.affinity: list[set[int]] = []
        self.fail_at = fail_at

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.calls.append((ptr, nbytes))
        self.live[ptr] = nbytes
        self.affinity.append(os.sched_getaffinity(0))

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]


@pytest.mark.parametrize("block_bytes,chunk_bytes", [(4096 * 3, 1 << 16), (5000, 1 << 16), (1 << 20, 1 << 18)])
def test_chunks_are_page_aligned_cover_the_slab_and_follow_block_boundaries(block_bytes: int,
                                                                            chunk_bytes: int) -> None:
    import gc
    import math
    import mmap

    reg = FakeRegistry()
    progress: list[tuple[int, int]] = []
    nb = 37
    layout = host_memory.allocate_pinned_in_chunks(nb, block_bytes, chunk_bytes, register=reg.register,
                                                   unregister=reg.unregister,
                                                   progress=lambda d, t: progress.append((d, t)))
    slab = layout.slab()
    assert tuple(slab.shape) == (nb, block_bytes) and layout.host_info["pinned"] == "chunked"
    base = slab.data_ptr()
    page = mmap.PAGESIZE
    covered = 0
    for ptr, n in reg.calls:
        assert ptr == base + covered and ptr % page == 0
        covered += n
    assert covered >= nb * block_bytes and covered - nb * block_bytes < page
    unit = math.lcm(block_bytes, page)
    if unit <= chunk_bytes:  # no row straddles two registrations
        assert all(n % block_bytes == 0 for _, n in reg.calls[:-1])
    assert [d for d, _ in progress] == list(np.cumsum([n for _, n in reg.calls]))
    assert layout.host_info["chunks"] == len(reg.calls) and len(reg.live) == len(reg.calls)
    # The memory works as a slab.
    slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8))
    other = BlockLayout.contiguous(nb, block_bytes)
    execute_plan_cpu(plan_block_copy(layout, [3, 4], other, [0, 1]))
    assert torch.equal(other.slab()[:2], slab[3:5])
    del layout, slab, other
    gc.collect()
    assert reg.live == {}  # unregistered with the layout


def test_a_failed_chunk_unregisters_the_earlier_ones() -> None:
    reg = FakeRegistry(fail_at=3)
    with pytest.raises(RuntimeError, match="AlreadyRegistered"):
        host_memory.allocate_pinned_in_chunks(64, 4096, 4 * 4096, register=reg.register, unregister=reg.unregister)
    assert len(reg.calls) == 3 and reg.live == {}


def test_allocate_host_slab_pins_in_chunks_through_cuda_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = FakeRegistry()
    monkeypatch.setattr(cuda_copy, "host_register", lambda p, n, *a: reg.register(p, n))
    monkeypatch.setattr(cuda_copy, "host_unregister", reg.unregister)
    layout = host_memory.allocate_host_slab(16, 8192, pin=True, chunk_bytes=4 * 8192, numa=False)
    assert layout.host_info["pinned"] == "chunked" and len(reg.calls) == 4
    assert layout.is_slab and layout.num_blocks == 16 and layout.block_bytes == 8192
    unpinned = host_memory.allocate_host_slab(4, 64, pin=False)
    info = dict(unpinned.host_info)
    assert info.pop("seconds") >= 0.0  # the unpinned slab is pre-touched, which takes time
    assert info == {"pinned": False, "numa_node": None, "chunks": 0}


def fake_sysfs(root: Path, bus_id: str, node: str, cpulist: str) -> Path:
    dev = root / "bus/pci/devices" / bus_id
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(node + "\n")
    cpus = root / "devices/system/node/node0"
    cpus.mkdir(parents=True)
    (cpus / "cpulist").write_text(cpulist + "\n")
    return root


def test_numa_lookups_read_sysfs(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, "0000:3b:00.0", "0", "0-3,8,10-11")
    assert host_memory.numa_node_of_pci("0000:3b:00.0", root) == 0
    assert host_memory.numa_node_of_pci("0000:99:00.0", root) is None
    assert host_memory.node_cpus(0, root) == {0, 1, 2, 3, 8, 10, 11}
    assert host_memory.node_cpus(7, root) == set()
    assert host_memory.normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert host_memory.normalize_pci_bus_id("0000:AF:00.0") == "0000:af:00.0"
    unknown = fake_sysfs(tmp_path / "u", "0000:3b:00.0", "-1", "0")
    assert host_memory.numa_node_of_pci("0000:3b:00.0", unknown) is None
    assert host_memory.parse_cpulist("") == set()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity")
def test_pages_are_first_touched_on_the_gpus_node(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    root = fake_sysfs(tmp_path, "0000:3b:00.0", "0", str(allowed[0]))
    reg = FakeRegistry()
    before = os.sched_getaffinity(0)
    host_memory.allocate_pinned_in_chunks(8, 4096, 2 * 4096, register=reg.register, unregister=reg.unregister,
                                          numa_node=0, sysfs=root)
    assert reg.affinity and all(a == {allowed[0]} for a in reg.affinity)
    assert os.sched_getaffinity(0) == before  # restored


# ---- on a GPU ----------------------------------------------------------------------------------


def gpu_methods() -> list[str]:
    return cuda_copy.available_methods() if CUDA else []


def _cuda_pairs() -> list[tuple[str, str]]:
    return [(m, k) for m in ("kernel", "memcpy", "batch") for k in ENGINE_KINDS]


def _require(method: str) -> None:
    if method not in gpu_methods():
        pytest.skip(f"copy method {method!r} not available here")


@cuda_test
@pytest.mark.parametrize("method,kind", _cuda_pairs())
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize("offset", [0, 1])
def test_cuda_executor_is_byte_exact(method: str, kind: str, direction: str, offset: int) -> None:
    _require(method)
    nb, layers, frag = 9, 4, 16 * 1024 + (3 if offset else 0)
    dtype = torch.uint8 if offset else torch.float16
    ex = cuda_copy.CudaPlanExecutor("cuda", method=method)
    stream = torch.cuda.Stream()
    src_slots, dst_slots = [0, 1, 2, 7, 3, 3], [8, 0, 1, 2, 4, 6]  # consecutive runs, reorders, a duplicate source

    def side(on_gpu: bool, k: str, fill: int | None, seed: int) -> tuple[torch.Tensor, BlockLayout]:
        arena = new_arena(k, nb, layers, frag, dtype, offset, device="cuda" if on_gpu else "cpu",
                          pin=not on_gpu, fill=fill, seed=seed)
        return arena, make_layout(k, arena, nb, layers, frag, dtype, offset)

    src_gpu, dst_gpu = direction in ("d2h", "d2d"), direction in ("h2d", "d2d")
    src_kind = kind if src_gpu else "slab"
    dst_kind = kind if dst_gpu else "slab"
    src_arena, src = side(src_gpu, src_kind, None, 11)
    for poison in (0x00, 0xFF):
        dst_arena, dst = side(dst_gpu, dst_kind, poison, 0)
        torch.cuda.synchronize()
        assert ex.plannable(src, dst)
        keep = ex.launch(plan_block_copy(src, src_slots, dst, dst_slots), stream, max_blocks=7)
        stream.synchronize()
        del keep
        # Reference on the CPU: copy_blocks between twins of both arenas.
        want = torch.full_like(dst_arena, poison, device="cpu")
        copy_blocks(make_layout(src_kind, src_arena.cpu(), nb, layers, frag, dtype, offset), src_slots,
                    make_layout(dst_kind, want, nb, layers, frag, dtype, offset), dst_slots)
        assert torch.equal(dst_arena.cpu(), want), f"{method} {kind} {direction} poison {poison:#x}"


@cuda_test
@pytest.mark.parametrize("method", ["kernel", "memcpy", "batch"])
def test_cuda_executor_self_test_passes(method: str) -> None:
    _require(method)
    cuda_copy.CudaPlanExecutor("cuda", method=method).self_test()


@cuda_test
def test_cuda_pageable_host_memory_is_not_addressable() -> None:
    _require("kernel")
    ex = cuda_copy.CudaPlanExecutor("cuda", method="kernel")
    assert not ex.accessible(BlockLayout.contiguous(4, 4096, pin=False))
    assert ex.accessible(BlockLayout.contiguous(4, 4096, pin=True))
    assert ex.accessible(BlockLayout.contiguous(4, 4096, device="cuda"))


@cuda_test
@pytest.mark.parametrize("copy_method", ["auto", "kernel", "memcpy", "staging"])
def test_cuda_engine_round_trip_with_a_chunk_pinned_slab(copy_method: str) -> None:
    if copy_method in ("kernel", "memcpy"):
        _require(copy_method)
    from kvtier.tiers.transfer import CudaTransferEngine

    nb, layers, frag = 16, 4, 32 * 1024
    gpu_arena = new_arena("kv_first", nb, layers, frag, torch.float16, device="cuda", seed=4)
    gpu = make_layout("kv_first", gpu_arena, nb, layers, frag, torch.float16)
    host = host_memory.allocate_host_slab(nb, gpu.block_bytes, pin=True, chunk_bytes=3 * gpu.block_bytes)
    assert host.host_info["pinned"] == "chunked" and host.host_info["chunks"] == 6
    eng = CudaTransferEngine("cuda", copy_method=copy_method, demote_bandwidth_cap_bytes_per_s=20e9,
                             demote_chunk_bytes=1 << 20, low_priority_max_blocks=16)
    try:
        if copy_method in ("kernel", "memcpy"):
            assert eng.copy_methods == {"high": copy_method, "low": copy_method}
        for poison in (0x00, 0xFF):
            host.slab().fill_(poison)
            down = eng.submit(CopyKind.DEMOTE, gpu, [3, 4, 5, 9], host, [0, 1, 2, 15])
            assert down.wait(30) and down.error is None
            want = torch.full((nb, gpu.block_bytes), poison, dtype=torch.uint8)
            want[[0, 1, 2, 15]] = gpu.gather([3, 4, 5, 9]).cpu()
            assert torch.equal(host.slab(), want)
            back_arena = torch.full_like(gpu_arena, poison)
            back = make_layout("kv_first", back_arena, nb, layers, frag, torch.float16)
            torch.cuda.synchronize()
            up = eng.submit(CopyKind.RESTORE, host, [15, 0, 1, 2], back, [0, 7, 8, 9])
            assert up.wait(30) and up.error is None
            want_back = torch.full_like(back_arena, poison, device="cpu")
            copy_blocks(BlockLayout([want.clone()], [0]), [15, 0, 1, 2],
                        make_layout("kv_first", want_back, nb, layers, frag, torch.float16), [0, 7, 8, 9])
            assert torch.equal(back_arena.cpu(), want_back)
        stats = eng.device_stats()
        assert stats["d2h"]["transfers"] == 2 and stats["h2d"]["transfers"] == 2
        assert stats["d2h"]["gbps"] > 0 and stats["h2d"]["gbps"] > 0
    finally:
        eng.close()
