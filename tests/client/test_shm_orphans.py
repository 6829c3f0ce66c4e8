"""A crashed client's shared-memory files are removed by the next client of its user; a live one's never.

Each file ShmArena.create makes is flock'ed (shared) by its creator while mapped
(client/shm_orphans.py). Real processes: a child that creates and dies, a child
that creates and lives.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvtier.client.shm_arena import SHM_DIR, ShmArena
from kvtier.client.shm_orphans import remove_orphaned_arenas

# This process's own prefix: with xdist, a sweep with min_age_s=0 would take
# another worker's files (a child's arena between its exit and the attach).
PREFIX = f"kvtier-orphantest_{os.getpid()}"

CHILD = (
    "import os, sys, time\n"
    "from kvtier.client.shm_arena import ShmArena\n"
    f"a = ShmArena.create(2, 4096, name_prefix={PREFIX!r})\n"
    "a.buffer[:5] = b'hello'\n"
    "print(a.name, flush=True)\n"
    "if sys.argv[1] == 'crash':\n"
    "    os._exit(0)  # no close, no unlink, no atexit: as SIGKILL would\n"
    "sys.stdin.readline()  # alive until told\n"
)


@pytest.fixture
def names() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:
        try:
            os.unlink(SHM_DIR / name)
        except FileNotFoundError:
            pass


def _child(mode: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name.startswith(PREFIX + "-"), name
    return proc, name


def test_a_crashed_creators_arena_is_removed(names: list[str]) -> None:
    proc, name = _child("crash")
    names.append(name)
    proc.wait(timeout=60)
    assert (SHM_DIR / name).exists()
    assert name not in remove_orphaned_arenas(min_age_s=60.0, name_prefix=PREFIX)
    assert (SHM_DIR / name).exists()  # too young to judge
    assert name in remove_orphaned_arenas(min_age_s=0.0, name_prefix=PREFIX)
    assert not (SHM_DIR / name).exists()


def test_a_live_creators_arena_and_this_process_own_are_kept(names: list[str]) -> None:
    proc, name = _child("live")
    names.append(name)
    mine = ShmArena.create(1, 4096, name_prefix=PREFIX)
    names.append(mine.name)
    try:
        removed = remove_orphaned_arenas(min_age_s=0.0, name_prefix=PREFIX)
        assert name not in removed and mine.name not in removed
        assert (SHM_DIR / name).exists() and mine.path.exists()
        # Another process mapping it (the daemon's attach) takes no lock: once
        # the creator is gone the file is an orphan, and the mapping stays valid.
        attached = ShmArena.attach(name, 2, 4096)
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
        assert name in remove_orphaned_arenas(min_age_s=0.0, name_prefix=PREFIX)
        assert bytes(attached.buffer[:5]) == b"hello"
        attached.close()
    finally:
        mine.close()


def test_a_closed_arena_whose_views_live_keeps_its_lock(names: list[str]) -> None:
    # allocate_shared_kv closes the arena object at once and keeps only the view.
    arena = ShmArena.create(1, 4096, name_prefix=PREFIX)
    names.append(arena.name)
    view = arena.buffer
    arena.close()
    assert arena.name not in remove_orphaned_arenas(min_age_s=0.0, name_prefix=PREFIX)
    view.release()
    assert arena.name in remove_orphaned_arenas(min_age_s=0.0, name_prefix=PREFIX)


def test_other_files_are_never_touched(names: list[str]) -> None:
    # share_kv_in_place's links (12 hex digits), other tails, foreign prefixes: no lock, never removed.
    for name in (f"{PREFIX}-kv-123-0123456789ab", f"{PREFIX}-0123456789abcdeX", f"psm_{PREFIX}-0123456789abcdef"):
        path = SHM_DIR / name
        path.write_bytes(b"x")
        names.append(name)
    removed = remove_orphaned_arenas(min_age_s=0.0, name_prefix=PREFIX)
    assert not set(removed) & set(names)
    assert all((SHM_DIR / n).exists() for n in names)
    if os.geteuid() == 0:
        # Another user's orphan: never ours to judge (sticky /dev/shm would refuse anyway).
        arena = ShmArena.create(1, 4096, name_prefix=PREFIX)
        names.append(arena.name)
        arena.close()
        os.chown(arena.path, 65534, -1)
        assert arena.name not in remove_orphaned_arenas(min_age_s=0.0, name_prefix=PREFIX)


def test_a_sweep_keeps_to_its_prefix(names: list[str]) -> None:
    proc, name = _child("crash")
    names.append(name)
    proc.wait(timeout=60)
    assert name not in remove_orphaned_arenas(min_age_s=0.0, name_prefix=PREFIX + "x")
    assert name not in remove_orphaned_arenas(min_age_s=0.0, name_prefix="kvtier-orphantest")  # a prefix of it, not its prefix
    assert (SHM_DIR / name).exists()
    assert name in remove_orphaned_arenas(min_age_s=0.0, name_prefix=PREFIX)
