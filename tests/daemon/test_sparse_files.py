"""A client's sparse or shrunk shared-memory file is refused with an error, never a daemon crash (issue 15).

A tmpfs file sized with ftruncate alone has no pages: a copy into it that
/dev/shm cannot back is SIGBUS. The daemon refuses such a file when it is
attached or registered (SPARSE_FILE), and checks before a copy that a file
was not truncated since; either way the daemon goes on serving everyone.
"""

from __future__ import annotations

import os
import random
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.client.client import Client, DaemonError, PoolLayout
from kvtier.client.protocol import ErrorCode
from kvtier.client.shm_arena import SHM_DIR

BLOCK_BYTES = 4096


def layout() -> PoolLayout:
    return PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=2,
                      kv_heads=2, head_dim=64, mode="store")


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    return kvtierd_module_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)


@pytest.fixture
def sparse_file() -> Iterator[Any]:
    """Makes ``kvtier-...`` files in /dev/shm sized by ftruncate only (no page allocated); removes them after."""
    paths: list[Path] = []

    def make(size_bytes: int) -> Path:
        path = SHM_DIR / f"kvtier-sparse-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
        finally:
            os.close(fd)
        paths.append(path)
        return path

    yield make
    for path in paths:
        path.unlink(missing_ok=True)


def still_serving(daemon: Any, pool: str) -> None:
    """The daemon process lives, answers health, and stores and restores for another client."""
    assert daemon.alive, daemon.log()[-3000:]
    rng = random.Random(pool)
    with Client(daemon.endpoint, pool, layout()) as other:
        assert other.health()
        hs, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
        assert other.store(hs, data) == (2, 0)
        assert other.lookup(hs)
        assert bytes(other.restore(hs).data) == data


def test_a_sparse_arena_is_refused_and_the_daemon_serves_on(daemon, sparse_file) -> None:  # type: ignore[no-untyped-def]
    path = sparse_file(4 * BLOCK_BYTES)
    with Client(daemon.endpoint, "sparse-arena", layout()) as c:
        with pytest.raises(DaemonError) as err:
            c._call("attach_arena", {"name": path.name, "num_slots": 4, "slot_bytes": BLOCK_BYTES})
        assert err.value.code == ErrorCode.SPARSE_FILE
        message = str(err.value)
        assert "sparse" in message and "posix_fallocate" in message and str(4 * BLOCK_BYTES) in message
        # The same session goes on: a proper arena attaches and carries blocks.
        arena = c.open_arena(2)
        rng = random.Random(7)
        hs, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
        arena.buffer[:] = data
        assert c.store(hs, slots=[0, 1]) == (2, 0)
    still_serving(daemon, "sparse-arena-other")


def test_a_half_sparse_kv_file_is_refused(daemon, sparse_file) -> None:  # type: ignore[no-untyped-def]
    from kvtier.client import data_planes
    from kvtier.client.kv_share import allocate_shared_kv

    kv, handle = allocate_shared_kv([8, 2, BLOCK_BYTES // 4], "bfloat16", 0)
    wire = data_planes.kv_tensor_fields([kv], 0)
    path = sparse_file(handle["size_bytes"])
    with open(path, "r+b") as f:  # the first page allocated, the rest still holes
        f.write(b"x")
    wire[0]["desc"]["handle"]["name"] = path.name
    with Client(daemon.endpoint, "sparse-kv", layout()) as c:
        with pytest.raises(DaemonError) as err:
            c._call("register_kv", {"name": "kv", "tensors": wire})
        assert err.value.code == ErrorCode.SPARSE_FILE
        assert "sparse" in str(err.value) and str(handle["size_bytes"] - os.sysconf("SC_PAGE_SIZE")) in str(err.value)
        # The real (allocated) file registers in the same session.
        assert c.register_kv("kv", [kv], 0) == 8
    del kv
    still_serving(daemon, "sparse-kv-other")


def test_an_arena_truncated_after_attach_fails_the_restore_with_both_sizes(daemon) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(8)
    with Client(daemon.endpoint, "shrunk-arena", layout()) as c:
        arena = c.open_arena(4)
        hs, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
        assert c.store(hs, data) == (2, 0)
        os.truncate(arena.path, BLOCK_BYTES)
        with pytest.raises(DaemonError) as err:
            c.restore(hs, slots=[2, 3])
        assert err.value.code == ErrorCode.TRANSFER_FAILED
        message = str(err.value)
        assert "shrank" in message and str(BLOCK_BYTES) in message and str(4 * BLOCK_BYTES) in message
        assert c.health()
        assert bytes(c.restore(hs).data) == data
    still_serving(daemon, "shrunk-arena-other")


def test_a_many_file_registration_truncated_fails_the_restore_naming_the_file(daemon) -> None:  # type: ignore[no-untyped-def]
    # 16 files, more than the daemon checks before every copy: the fault-safe
    # copy fails, and the check after it names the file.
    from kvtier.client.kv_share import allocate_shared_kv

    rng = random.Random(9)
    parts = [allocate_shared_kv([8, 128], "bfloat16", 0) for _ in range(16)]
    tensors = [t for t, _ in parts]
    with Client(daemon.endpoint, "shrunk-kv", layout()) as c:
        assert c.register_kv("kv", tensors, 0) == 8
        hs, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
        assert c.store(hs, data) == (2, 0)
        victim = parts[5][1]["name"]
        os.truncate(SHM_DIR / victim, 0)
        with pytest.raises(DaemonError) as err:
            c.restore(hs, slots=[0, 1], reg="kv")
        assert err.value.code == ErrorCode.TRANSFER_FAILED
        assert victim in str(err.value) and "shrank" in str(err.value)
        assert bytes(c.restore(hs).data) == data
    del tensors, parts
    still_serving(daemon, "shrunk-kv-other")
