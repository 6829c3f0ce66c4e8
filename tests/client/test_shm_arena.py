"""Tests for kvtier.client.shm_arena: the /dev/shm staging arena (data plane 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from kvtier.client.shm_arena import SHM_DIR, ShmArena, ShmArenaError, validate_arena_name

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


@pytest.fixture
def arena() -> Iterator[ShmArena]:
    with ShmArena.create(8, 4096, name_prefix="kvtier-test") as a:
        yield a


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_create_names_file_and_sizes_it(arena: ShmArena) -> None:
    assert arena.name.startswith("kvtier-test-")
    assert arena.path == SHM_DIR / arena.name
    st = os.stat(arena.path)
    assert st.st_size == 8 * 4096 == arena.size_bytes
    assert st.st_mode & 0o777 == 0o600
    assert arena.owner and not arena.closed
    assert len(arena.buffer) == arena.size_bytes
    assert not arena.buffer.readonly


def test_names_are_unique() -> None:
    with ShmArena.create(1, 64) as a, ShmArena.create(1, 64) as b:
        assert a.name != b.name
        assert a.name.startswith("kvtier-")


def test_two_processes_see_each_others_bytes(arena: ShmArena) -> None:
    parent_bytes = bytes(range(256)) * 16
    arena.slot_view(3)[:] = parent_bytes
    result = run_python(
        f"""
        from kvtier.client.shm_arena import ShmArena
        a = ShmArena.attach({arena.name!r}, 8, 4096)
        assert bytes(a.slot_view(3)) == bytes(range(256)) * 16, "child does not see the parent's bytes"
        a.slot_view(5)[:] = bytes([0xA5]) * 4096
        a.buffer[8 * 4096 - 1] = 0x7E
        a.close()
        """
    )
    assert result.returncode == 0, result.stderr
    assert bytes(arena.slot_view(5)) == bytes([0xA5]) * 4096
    assert arena.buffer[-1] == 0x7E
    # The attaching process exiting must not take the file with it
    # (multiprocessing's resource tracker would have unlinked it).
    assert arena.path.exists()
    assert "leaked" not in result.stderr


def test_child_creates_parent_attaches_and_unlinks() -> None:
    result = run_python(
        """
        import sys, time
        from kvtier.client.shm_arena import ShmArena
        a = ShmArena.create(2, 1000, name_prefix="kvtier-child")
        a.as_numpy()[1, :] = 9
        print(a.name, flush=True)
        """
    )
    assert result.returncode == 0, result.stderr
    name = result.stdout.strip()
    attached = ShmArena.attach(name, 2, 1000)
    try:
        assert not attached.owner
        assert bytes(attached.slot_view(1)) == bytes([9]) * 1000
        assert bytes(attached.slot_view(0)) == bytes(1000)
    finally:
        attached.close()
        attached.unlink()
    assert not (SHM_DIR / name).exists()


def test_import_does_not_load_torch() -> None:
    result = run_python(
        """
        import sys
        import kvtier.client.shm_arena
        assert "torch" not in sys.modules, "shm_arena imported torch"
        """
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "name",
    [
        "",
        "kvtier-",
        "kvtier",
        "other-1234",
        "../kvtier-1234",
        "kvtier-../../etc/passwd",
        "kvtier-a/b",
        "kvtier-..",
        "kvtier-a.b",
        "/dev/shm/kvtier-abc",
        "kvtier-a\x00b",
        "kvtier-" + "a" * 201,
    ],
)
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ShmArenaError):
        validate_arena_name(name)
    with pytest.raises(ShmArenaError):
        ShmArena.attach(name, 1, 64)


def test_non_string_name_is_refused() -> None:
    with pytest.raises(ShmArenaError):
        ShmArena.attach(b"kvtier-abc", 1, 64)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix", ["", "other", "kvtier-", "kvtier-a/b", "kvtier-..", "kvtier-a-", "kvtier.x"])
def test_bad_name_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(ShmArenaError):
        ShmArena.create(1, 64, name_prefix=prefix)


def test_symlink_is_refused(arena: ShmArena) -> None:
    link = SHM_DIR / f"kvtier-link{os.getpid()}"
    os.symlink(arena.path, link)
    try:
        with pytest.raises(ShmArenaError):
            ShmArena.attach(link.name, 8, 4096)
    finally:
        os.unlink(link)


def test_directory_is_refused() -> None:
    d = SHM_DIR / f"kvtier-dir{os.getpid()}"
    d.mkdir()
    try:
        with pytest.raises(ShmArenaError):
            ShmArena.attach(d.name, 1, 64)
    finally:
        d.rmdir()


@pytest.mark.parametrize("num_slots, slot_bytes", [(4, 4096), (16, 4096), (8, 4095), (1, 8 * 4096 + 1)])
def test_attach_with_wrong_size_is_refused(arena: ShmArena, num_slots: int, slot_bytes: int) -> None:
    with pytest.raises(ShmArenaError, match="bytes"):
        ShmArena.attach(arena.name, num_slots, slot_bytes)


def test_attach_with_other_split_of_same_size_is_accepted(arena: ShmArena) -> None:
    # Only the total size can be checked; the slot split is the session's contract.
    other = ShmArena.attach(arena.name, 4, 8192)
    other.close()


@pytest.mark.parametrize("num_slots, slot_bytes", [(0, 64), (1, 0), (-1, 64), (1, -5), (True, 64), (1.0, 64), (2, "64")])
def test_bad_geometry_is_refused(num_slots: object, slot_bytes: object) -> None:
    with pytest.raises(ShmArenaError):
        ShmArena.create(num_slots, slot_bytes)  # type: ignore[arg-type]
    with pytest.raises(ShmArenaError):
        ShmArena.attach("kvtier-whatever", num_slots, slot_bytes)  # type: ignore[arg-type]


def test_attach_missing_arena_fails() -> None:
    with pytest.raises(ShmArenaError, match="does not exist"):
        ShmArena.attach("kvtier-does-not-exist-0000", 1, 64)


@pytest.mark.parametrize("slot", [-1, 8, 100, True, 1.0, "1", None])
def test_slot_bounds_are_checked(arena: ShmArena, slot: object) -> None:
    with pytest.raises(IndexError):
        arena.slot_view(slot)  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        arena.slot_offset(slot)  # type: ignore[arg-type]


def test_slot_views_do_not_overlap(arena: ShmArena) -> None:
    for slot in range(arena.num_slots):
        arena.slot_view(slot)[:] = bytes([slot + 1]) * arena.slot_bytes
    whole = bytes(arena.buffer)
    for slot in range(arena.num_slots):
        off = arena.slot_offset(slot)
        assert off == slot * 4096
        assert whole[off : off + 4096] == bytes([slot + 1]) * 4096
    assert len(arena.slot_view(7)) == 4096


def test_numpy_view_is_zero_copy(arena: ShmArena) -> None:
    array = arena.as_numpy()
    assert array.shape == (8, 4096)
    assert array.dtype.name == "uint8"
    array[2, 10] = 42
    assert arena.slot_view(2)[10] == 42
    arena.slot_view(6)[0] = 17
    assert array[6, 0] == 17


def test_unlink_removes_the_file_and_is_idempotent() -> None:
    a = ShmArena.create(1, 128)
    path = a.path
    assert path.exists()
    a.unlink()
    assert not path.exists()
    a.unlink()
    # The mapping outlives the name.
    a.slot_view(0)[:4] = b"abcd"
    assert bytes(a.buffer[:4]) == b"abcd"
    a.close()
    with pytest.raises(ShmArenaError):
        ShmArena.attach(a.name, 1, 128)


def test_close_is_idempotent_and_blocks_new_views() -> None:
    a = ShmArena.create(2, 64)
    try:
        a.close()
        a.close()
        assert a.closed
        with pytest.raises(ShmArenaError):
            a.buffer
        with pytest.raises(ShmArenaError):
            a.slot_view(0)
        with pytest.raises(ShmArenaError):
            a.as_numpy()
    finally:
        a.unlink()


def test_close_keeps_live_views_valid() -> None:
    a = ShmArena.create(2, 64)
    try:
        whole = a.buffer
        slot = a.slot_view(1)
        array = a.as_numpy()
        a.close()
        # Unmapping now would make these dangle; they must still work.
        slot[0] = 5
        assert whole[64] == 5
        assert array[1, 0] == 5
    finally:
        a.unlink()


def test_context_manager_unlinks_for_creator_only() -> None:
    with ShmArena.create(1, 64) as owner:
        with ShmArena.attach(owner.name, 1, 64) as attached:
            assert not attached.owner
        assert attached.closed
        assert owner.path.exists(), "the attaching side must not unlink on exit"
    assert owner.closed
    assert not owner.path.exists()


def test_create_refuses_what_dev_shm_cannot_hold() -> None:
    free_bytes = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    with pytest.raises(ShmArenaError):
        ShmArena.create(4, free_bytes)
    leftovers = [p for p in SHM_DIR.glob("kvtier-*") if p.stat().st_size == 4 * free_bytes]
    assert not leftovers


def test_unlink_name_removes_by_name_and_refuses_bad_names() -> None:
    a = ShmArena.create(1, 64)
    try:
        ShmArena.unlink_name(a.name)
        assert not a.path.exists()
        ShmArena.unlink_name(a.name)  # idempotent
    finally:
        a.close()
    for bad in ("../etc/passwd", "kvtier-a/../../b", "other-name"):
        with pytest.raises(ShmArenaError):
            ShmArena.unlink_name(bad)
