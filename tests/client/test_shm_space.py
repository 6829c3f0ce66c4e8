"""Shared-memory files are allocated when made, or refused there with the sizes (issue 15).

A client asking for more than /dev/shm holds gets an error at creation that
names the bytes asked and free and how to make room, not SIGBUS later; a
sparse file is refused by the attaching side (the daemon); a truncated one
fails ``check_intact``. The huge sizes asked here exceed the whole of
/dev/shm, which tmpfs refuses before allocating a single page.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client import shm_arena
from kvtier.client.shm_arena import (
    SHM_DIR,
    ShmArena,
    ShmArenaError,
    ShmSpaceError,
    ShmSparseError,
    unallocated_bytes,
)

GIB = 1 << 30


def too_big_bytes() -> int:
    """More than /dev/shm's whole size (so nothing gets allocated) and than its free space plus 1 GiB."""
    st = os.statvfs(SHM_DIR)
    return max(st.f_blocks, st.f_bavail) * st.f_frsize + GIB


# This module's own files: xdist workers beside it create and remove theirs
# at any time, so a before/after comparison of all of /dev/shm could fail.
PREFIX = f"kvtier-spacetest_{os.getpid()}"


def own_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{PREFIX}*")}


def assert_names_sizes_and_fixes(message: str, asked_bytes: int) -> None:
    assert str(asked_bytes) in message, message
    free = re.search(r"has (\d+) bytes \([\d.]+ MiB\) free", message)
    assert free is not None, message
    assert int(free.group(1)) < asked_bytes
    assert "--shm-size" in message and "remount,size=" in message, message


@pytest.fixture
def sparse_path() -> Iterator[Path]:
    path = SHM_DIR / f"kvtier-sparse-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 3 * 4096)
    os.close(fd)
    yield path
    path.unlink(missing_ok=True)


def test_an_arena_larger_than_dev_shm_is_refused_at_creation_with_the_sizes() -> None:
    asked_bytes = too_big_bytes()
    with pytest.raises(ShmSpaceError) as err:
        ShmArena.create(1, asked_bytes, name_prefix=PREFIX)
    assert_names_sizes_and_fixes(str(err.value), asked_bytes)
    assert own_files() == set(), "the refused file must be removed"


def test_a_shared_kv_tensor_larger_than_dev_shm_is_refused_with_the_sizes() -> None:
    from kvtier.client.kv_description import KvShareError
    from kvtier.client.kv_share import allocate_shared_kv

    asked_bytes = too_big_bytes()
    with pytest.raises(KvShareError) as err:
        allocate_shared_kv([asked_bytes], "uint8", 0, name_prefix=PREFIX)
    assert_names_sizes_and_fixes(str(err.value), asked_bytes)
    assert own_files() == set(), "the refused file must be removed"


def test_share_in_place_refuses_a_storage_dev_shm_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kvtier.client import kv_share
    from kvtier.client.kv_description import KvShareError

    t = torch.zeros(64 * 1024, dtype=torch.uint8)
    monkeypatch.setattr(kv_share, "shm_free_bytes", lambda: 4096)
    monkeypatch.setattr(shm_arena, "shm_free_bytes", lambda: 4096)
    with pytest.raises(KvShareError) as err:
        kv_share.share_kv_in_place([t])
    assert_names_sizes_and_fixes(str(err.value), 64 * 1024)
    assert not t.is_shared(), "nothing was moved"


def test_created_files_are_fully_allocated_also_without_fallocate(monkeypatch: pytest.MonkeyPatch) -> None:
    with ShmArena.create(3, 5000) as a:
        assert unallocated_bytes(os.stat(a.path)) == 0

    def no_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    with ShmArena.create(3, 5000) as a:
        st = os.stat(a.path)
        assert st.st_size == 15000 and unallocated_bytes(st) == 0


def test_attach_refuses_a_sparse_file_and_accepts_it_once_allocated(sparse_path: Path) -> None:
    with pytest.raises(ShmSparseError) as err:
        ShmArena.attach(sparse_path.name, 3, 4096)
    assert "sparse" in str(err.value) and "posix_fallocate" in str(err.value)
    fd = os.open(sparse_path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 3 * 4096)
    finally:
        os.close(fd)
    a = ShmArena.attach(sparse_path.name, 3, 4096)
    a.close()


def test_check_intact_refuses_a_file_truncated_after_mapping() -> None:
    with ShmArena.create(4, 4096) as owner:
        attached = ShmArena.attach(owner.name, 4, 4096)
        try:
            attached.check_intact()
            os.truncate(owner.path, 4096)
            with pytest.raises(ShmArenaError, match="shrank to 4096 bytes"):
                attached.check_intact()
            os.truncate(owner.path, 4 * 4096)  # grown back (holes): the size check passes again
            attached.check_intact()
        finally:
            attached.close()
        with pytest.raises(ShmArenaError, match="closed"):
            attached.check_intact()
