"""Memory a client owns (its arena, its /dev/shm KV files) can never crash the daemon.

The client truncates the file under the daemon's mapping: the request that
touches it fails with TRANSFER_FAILED, the session's arena and registrations
are dropped, and the daemon goes on serving that client inline and every
other client (issue 15, item 1).
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from kvtier.client.client import Client, DaemonError, PoolLayout
from kvtier.client.protocol import ErrorCode

BLOCK_BYTES = 4096


def layout(**kw: object) -> PoolLayout:
    base = dict(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=2,
                kv_heads=2, head_dim=64, mode="store")
    base.update(kw)
    return PoolLayout(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    return kvtierd_module_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)


def hashes(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(n)]


def still_serving(daemon, pool: str) -> None:  # type: ignore[no-untyped-def]
    assert daemon.alive, daemon.log()[-3000:]
    rng = random.Random(pool)
    with Client(daemon.endpoint, pool, layout()) as other:
        hs, data = hashes(rng, 2), rng.randbytes(2 * BLOCK_BYTES)
        assert other.store(hs, data) == (2, 0)
        assert bytes(other.restore(hs).data) == data


def test_truncated_arena_fails_the_store_and_the_restore_not_the_daemon(daemon) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(1)
    with Client(daemon.endpoint, "trunc-arena", layout()) as c:
        arena = c.open_arena(4)
        hs = hashes(rng, 2)
        data = rng.randbytes(2 * BLOCK_BYTES)
        arena.buffer[: 2 * BLOCK_BYTES] = data
        assert c.store(hs, slots=[0, 1]) == (2, 0)
        os.truncate(arena.path, 0)
        with pytest.raises(DaemonError) as err:
            c.store(hashes(rng, 2), slots=[2, 3])
        assert err.value.code == ErrorCode.TRANSFER_FAILED
        assert "dropped" in str(err.value)
        # The session lives on without its arena; inline still works.
        with pytest.raises(DaemonError) as err:
            c.restore(hs, slots=[0, 1])
        assert err.value.code == ErrorCode.INVALID_STATE
        assert bytes(c.restore(hs).data) == data
        assert c.stats()["daemon"]["client_memory_faults_total"] >= 1
    with Client(daemon.endpoint, "trunc-arena", layout()) as c:
        arena = c.open_arena(4)
        os.truncate(arena.path, BLOCK_BYTES)  # slot 0 left, slots 1.. gone
        with pytest.raises(DaemonError) as err:
            c.restore(hs, slots=[0, 1])
        assert err.value.code == ErrorCode.TRANSFER_FAILED
    still_serving(daemon, "trunc-arena-other")


def test_truncated_kv_registration_fails_the_copy_not_the_daemon(daemon) -> None:  # type: ignore[no-untyped-def]
    from kvtier.client.kv_share import allocate_shared_kv

    rng = random.Random(2)
    kv, handle = allocate_shared_kv([8, 2, BLOCK_BYTES // 4], "bfloat16", 0)
    path = f"/dev/shm/{handle['name']}"
    with Client(daemon.endpoint, "trunc-kv", layout()) as c:
        assert c.register_kv("kv", [kv], 0) == 8
        hs = hashes(rng, 2)
        assert c.store(hs, slots=[0, 1], reg="kv") == (2, 0)
        os.truncate(path, 0)
        with pytest.raises(DaemonError) as err:
            c.store(hashes(rng, 2), slots=[2, 3], reg="kv")
        assert err.value.code == ErrorCode.TRANSFER_FAILED
        with pytest.raises(DaemonError) as err:
            c.restore(hs, slots=[4, 5], reg="kv")
        assert err.value.code == ErrorCode.NOT_FOUND  # the registration was dropped
        assert len(c.restore(hs).data) == 2 * BLOCK_BYTES
    del kv
    still_serving(daemon, "trunc-kv-other")


def test_an_arena_truncated_and_regrown_under_copies_never_crashes_the_daemon(daemon) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    stop = threading.Event()
    with Client(daemon.endpoint, "trunc-race", layout()) as c:
        arena = c.open_arena(8)
        path, size = arena.path, arena.size_bytes

        def flap() -> None:
            while not stop.is_set():
                os.truncate(path, random.choice([0, BLOCK_BYTES, 3 * BLOCK_BYTES]))
                time.sleep(0.0005)
                os.truncate(path, size)
                time.sleep(0.0005)

        t = threading.Thread(target=flap, daemon=True)
        t.start()
        outcomes: dict[str, int] = {}
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                hs = hashes(rng, 8)
                try:
                    c.store(hs, slots=list(range(8)))
                    c.restore(hs, slots=list(reversed(range(8))))
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                except DaemonError as exc:
                    assert exc.code in (ErrorCode.TRANSFER_FAILED, ErrorCode.INVALID_STATE), exc
                    outcomes[exc.code.name] = outcomes.get(exc.code.name, 0) + 1
                    try:  # the arena was dropped: announce it again (fails while it is short, or sparse once regrown)
                        c._call("attach_arena", c._arena_fields())
                    except DaemonError as again:
                        assert again.code in (ErrorCode.NOT_FOUND, ErrorCode.INVALID_STATE, ErrorCode.SPARSE_FILE), again
        finally:
            stop.set()
            t.join()
        assert daemon.alive, daemon.log()[-3000:]
        assert outcomes.get("TRANSFER_FAILED", 0) > 0, outcomes
    still_serving(daemon, "trunc-race-other")


@pytest.mark.parametrize("shape,block_dim", [((2, 10, 4, 3, 8), 1), ((10, 2, 4, 8), 0), ((5, 10, 6), 1)])
def test_fault_safe_copies_move_canonical_block_bytes_of_any_layout(shape, block_dim) -> None:  # type: ignore[no-untyped-def]
    import torch

    from kvtier.daemon.shared_memory import client_memory
    from kvtier.blocks.layout import BlockLayout

    src = BlockLayout([torch.randn(shape).to(torch.bfloat16) for _ in range(3)], [block_dim] * 3)
    staging = BlockLayout.contiguous(4, src.block_bytes)
    client_memory.read_blocks(src, [7, 2, 9, 0], staging)
    assert torch.equal(staging.slab(), src.gather([7, 2, 9, 0]))
    dst = BlockLayout([torch.zeros(shape).to(torch.bfloat16) for _ in range(3)], [block_dim] * 3)
    client_memory.write_blocks(staging, 3, dst, [1, 5, 3, 8])
    assert torch.equal(dst.gather([1, 5, 3]), staging.slab()[:3])
    assert not dst.gather([8]).any()  # only `count` blocks are written


@pytest.mark.parametrize("available", [True, False])
def test_lent_views_land_byte_exact_in_any_layout(available, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """write_views: several lent runs of tier slots (as borrow hands them out) into scattered client slots."""
    import torch

    from kvtier.daemon.shared_memory import client_memory
    from kvtier.blocks.layout import BlockLayout

    monkeypatch.setattr(client_memory, "_available", available)
    shape, block_dim = (2, 40, 4, 3, 8), 1
    dst = BlockLayout([torch.zeros(shape).to(torch.bfloat16) for _ in range(3)], [block_dim] * 3)
    tier = BlockLayout.contiguous(30, dst.block_bytes)
    tier.slab().copy_(torch.randint(0, 256, tier.slab().shape, dtype=torch.uint8))
    runs = [(3, 5), (20, 1), (9, 4)]  # (first slot, count): 10 blocks in three views
    views = [tier.slab()[a: a + n].numpy() for a, n in runs]
    expected = torch.cat([tier.slab()[a: a + n] for a, n in runs])
    slots = [39, 0, 17, 5, 6, 7, 30, 2, 11, 25]
    client_memory.write_views(views, dst, slots)
    assert torch.equal(dst.gather(slots), expected)
    untouched = [s for s in range(40) if s not in slots]
    assert not dst.gather(untouched).any()


def test_moves_split_at_the_iovec_limit() -> None:
    """More pieces than one process_vm_writev takes (IOV_MAX): every byte still lands, in order."""
    import torch

    from kvtier.daemon.shared_memory import client_memory
    from kvtier.blocks.layout import BlockLayout

    if not client_memory.available():
        pytest.skip("process_vm_writev is not permitted here")
    # Per block 2 x 4 runs (the block dim is not outermost): 300 blocks make 2,400 client runs.
    dst = BlockLayout([torch.zeros(2, 300, 4, 16) for _ in range(2)], [1, 1])
    tier = BlockLayout.contiguous(300, dst.block_bytes)
    tier.slab().copy_(torch.randint(0, 256, tier.slab().shape, dtype=torch.uint8))
    order = list(range(299, -1, -1))
    views = [tier.slab()[i: i + 1].numpy() for i in range(300)]  # 300 local runs too
    client_memory.write_views(views, dst, order)
    assert torch.equal(dst.gather(order), tier.slab())


def test_a_large_move_from_a_hugepage_tier_lands_byte_exact() -> None:
    """A restore's worth (~11 MiB) from a huge-page tier in two lent views into scattered slots and back."""
    import torch

    from kvtier.daemon.shared_memory import client_memory
    from kvtier.blocks.layout import BlockLayout

    if not client_memory.available():
        pytest.skip("process_vm_writev is not permitted here")
    dst = BlockLayout([torch.zeros(2, 32, 64, 1024, dtype=torch.uint8) for _ in range(3)], [1] * 3)  # 384 KiB a block
    n = 30
    tier = BlockLayout.contiguous(n, dst.block_bytes, hugepages=True)
    tier.slab().copy_(torch.randint(0, 256, tier.slab().shape, dtype=torch.uint8))
    slots = list(range(n - 1, -1, -1))
    client_memory.write_views([tier.slab()[: n // 2].numpy(), tier.slab()[n // 2:].numpy()], dst, slots)
    assert torch.equal(dst.gather(slots), tier.slab())
    staging = BlockLayout.contiguous(n, dst.block_bytes)
    client_memory.read_blocks(dst, slots, staging)
    assert torch.equal(staging.slab(), tier.slab())


_TRUNCATED_COPIES = r'''
import mmap, os, sys, torch
from kvtier.daemon.shared_memory import client_memory
from kvtier.blocks.layout import BlockLayout
assert client_memory.available()
bb, n = 64 << 10, 64  # 4 MiB of client memory in a /dev/shm file, 2 MiB left after the truncation
path = f"/dev/shm/kvtier-test-trunc-{os.getpid()}"
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
try:
    os.posix_fallocate(fd, 0, n * bb)
    client = BlockLayout.from_buffer(mmap.mmap(fd, n * bb), n, bb)
    tier = BlockLayout.contiguous(n, bb, hugepages=True)  # the daemon's side: huge pages where it can
    os.ftruncate(fd, n * bb // 2)
    outcomes = []
    for name, copy in (("write_views", lambda: client_memory.write_views([tier.slab().numpy()], client, list(range(n)))),
                       ("write_blocks", lambda: client_memory.write_blocks(tier, n, client, list(range(n)))),
                       ("read_blocks", lambda: client_memory.read_blocks(client, list(range(n)), tier))):
        try:
            copy()
            outcomes.append(f"{name}: no error")
        except client_memory.ClientMemoryFault:
            outcomes.append(f"{name}: fault")
    # The half still there is still written: the copy stops at the hole, it does not crash.
    client_memory.write_views([tier.slab()[: n // 2].numpy()], client, list(range(n // 2)))
    print(";".join(outcomes))
finally:
    os.close(fd)
    os.unlink(path)
'''


def test_copies_into_a_truncated_file_fail_with_a_fault_not_a_signal() -> None:
    """The client's memory is the side the kernel copies with fault handling (not the pinned side), in
    both directions: a file truncated under the mapping makes each copy raise ClientMemoryFault.
    Run in a child: a SIGBUS there fails this test instead of killing pytest."""
    import subprocess
    import sys

    from kvtier.daemon.shared_memory import client_memory

    if not client_memory.available():
        pytest.skip("process_vm_readv is not permitted here")
    proc = subprocess.run([sys.executable, "-c", _TRUNCATED_COPIES], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: killed by that signal)\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip() == "write_views: fault;write_blocks: fault;read_blocks: fault", proc.stdout


def test_runs_and_pieces_match_a_block_by_block_model() -> None:
    """client_runs and the cutting of the daemon's runs against them (numpy, whatever the fragments)
    move exactly the bytes a per-block gather/scatter would, for lent views split anywhere."""
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvtier.daemon.shared_memory import client_memory
    from kvtier.blocks.layout import BlockLayout

    shapes = [((2, 9, 4, 3, 8), 1), ((9, 2, 4, 8), 0), ((5, 9, 6), 1), ((9, 64), 0)]

    @settings(max_examples=60, deadline=None)
    @given(which=st.integers(0, len(shapes) - 1), data=st.data())
    def check(which: int, data: st.DataObject) -> None:
        shape, block_dim = shapes[which]
        tensors = 1 if len(shape) == 2 else 3
        dst = BlockLayout([torch.zeros(shape).to(torch.bfloat16) for _ in range(tensors)], [block_dim] * tensors)
        slots = data.draw(st.lists(st.integers(0, 8), min_size=1, max_size=9, unique=True))
        n = len(slots)
        tier = BlockLayout.contiguous(n, dst.block_bytes)
        tier.slab().copy_(torch.randint(0, 256, tier.slab().shape, dtype=torch.uint8))
        flat = tier.slab().view(-1).numpy()
        # The daemon's side as several views, cut at arbitrary byte offsets (borrow lends runs of slots;
        # the cutting must not care where they end).
        cuts = sorted(set(data.draw(st.lists(st.integers(1, flat.size - 1), max_size=6))))
        views = [flat[a:b] for a, b in zip([0, *cuts], [*cuts, flat.size])]
        client_memory.write_views(views, dst, slots)
        assert torch.equal(dst.gather(slots), tier.slab())
        untouched = [s for s in range(9) if s not in slots]
        if untouched:
            assert not dst.gather(untouched).any()
        back = BlockLayout.contiguous(n, dst.block_bytes)
        client_memory.read_blocks(dst, slots, back)
        assert torch.equal(back.slab(), tier.slab())

    if not client_memory.available():
        pytest.skip("process_vm_readv is not permitted here")
    check()
