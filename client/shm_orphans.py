"""Shared-memory files of crashed clients: found by their lock, removed by their own user.

Contract:

- Every file ``ShmArena.create`` makes (arenas, ``allocate_shared_kv``'s KV
  files) is locked ``flock(LOCK_SH)`` by its creator for as long as any
  mapping of it lives in that process (client/shm_arena.py). A file whose
  lock nobody holds has no live creator: it crashed, or exited without
  removing it.
- ``remove_orphaned_arenas(min_age_s=60.0, name_prefix="kvtier") -> list[str]`` removes, from
  ``/dev/shm``, the ``ShmArena.create`` files of *this* user (a sticky
  ``/dev/shm`` lets nobody else remove them anyway) that nobody holds
  locked and that have not changed for ``min_age_s`` (a file being created
  is locked a few microseconds after it appears); returns their names.
  Recognised by name: ``kvtier-...-<16 hex digits>``, the random tail
  ``create`` gives; ``share_kv_in_place``'s links end in 12 hex digits and
  are never touched (torch's own file backs them, and they hold no lock).
  ``name_prefix`` narrows it to the files ``create`` named under that prefix
  (a test sweeping with ``min_age_s=0`` must not take another test's files).
  The daemon's own mappings hold no lock: a file only the daemon still maps
  is an orphan too, and removing its name leaves that mapping valid.
- Best effort and quiet: a file that vanishes or changes while looked at is
  skipped; errors other than the lock being held are skipped too.
- Called by ``Client.open_arena`` and ``allocate_shared_kv`` before they
  create a file: a restarted engine clears what its crashed predecessor
  left, which matters when kvtierd runs as another user and may not remove
  an engine's files itself (docs/operating.md, "Clients' shared memory").
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import time

from kvtier.client.shm_arena import SHM_DIR

# What ShmArena.create names its files: a prefix, then 16 random hex digits.
_CREATED_RE = re.compile(r"kvtier(-[A-Za-z0-9_]{1,64})*-[0-9a-f]{16}")


def remove_orphaned_arenas(min_age_s: float = 60.0, name_prefix: str = "kvtier") -> list[str]:
    """See the module docstring."""
    removed: list[str] = []
    start = name_prefix + "-"
    uid = os.geteuid()
    now_s = time.time()
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(start) or not _CREATED_RE.fullmatch(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != uid
                or now_s - max(st.st_mtime, st.st_ctime) < min_age_s):
            continue
        if _remove_if_unlocked(entry.path, (st.st_dev, st.st_ino)):
            removed.append(entry.name)
    return removed


def _remove_if_unlocked(path: str, inode: tuple[int, int]) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != inode:
            return False  # replaced since listed
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its creator is alive
        # Holding the lock, the name still names this file: nobody can take a
        # lock on it from now on, and a creator never re-locks an old file.
        try:
            now = os.lstat(path)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != inode:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
