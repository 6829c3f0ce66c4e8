"""Arena files by name: which persistent CPU tier a file in ``arena_dir`` is, listing, removing (no torch).

Contract
========

- Names: ``kvtierd-<uid>-<instance>-<pool>.index`` and ``.data``:
  ``instance_id(endpoint)`` is a digest of the daemon's endpoint (its
  socket), the last part one of the pool's key. ``arena_stem(uid, endpoint,
  pool_key)`` spells a pool's. Not ``kvtier-...``: clients sweep their own
  orphaned ``kvtier-...`` files (client/shm_orphans.py).
- ``list_arenas(path, uid=None)`` lists every arena in a directory (or one
  user's), each an ``ArenaInfo``: its identity (the pool, its layout, the
  endpoint and kvtier version that wrote it) or why it cannot be read, the
  memory its files hold, and whether a live daemon holds it (its index's
  lock). A missing directory lists nothing.
- ``remove_arena(info)`` deletes an arena's files; it refuses
  (``RuntimeError``) one a live daemon holds.
- ``kvtier arenas`` (tools/arenas.py) and the daemon's start-up report use
  this; ``kvtier.tiers.persistent_arena`` opens and adopts the files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.tiers.slot_index import SlotIndexFormatError, is_held, read_identity

DEFAULT_ARENA_DIR = Path("/dev/shm")
PREFIX = "kvtierd-"  # not "kvtier-": clients sweep their own orphaned "kvtier-..." files (client/shm_orphans.py)
INDEX_SUFFIX = ".index"
DATA_SUFFIX = ".data"
def instance_id(endpoint: str) -> str:
    """The daemon instance's part of its arenas' names: a digest of its endpoint."""
    return hashlib.sha256(endpoint.encode()).hexdigest()[:12]


def arena_stem(uid: int, endpoint: str, pool_key: str) -> str:
    return f"{PREFIX}{uid}-{instance_id(endpoint)}-{hashlib.sha256(pool_key.encode()).hexdigest()[:16]}"


@dataclass
class ArenaInfo:
    """One arena in a directory, as ``list_arenas`` sees it."""

    stem: str
    index_path: Path
    data_path: Path
    uid: int | None
    instance: str
    memory_bytes: int  # what its files hold in memory (allocated blocks)
    held: bool  # a live daemon holds it
    identity: dict[str, Any] | None = None
    slots: int = 0
    block_bytes: int = 0
    problem: str = ""  # why it is unreadable (another format, damaged, no index)


def allocated_bytes(path: Path) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _parse_stem(stem: str) -> tuple[int | None, str]:
    parts = stem[len(PREFIX):].split("-")
    if len(parts) != 3:
        return None, ""
    try:
        return int(parts[0]), parts[1]
    except ValueError:
        return None, parts[1]


def list_arenas(path: Path, *, uid: int | None = None) -> list[ArenaInfo]:
    """See the module docstring (``uid``: only that user's). A missing directory lists nothing; an arena
    this user cannot read counts as held, with its problem said."""
    path = Path(path)
    stems: dict[str, None] = {}
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(PREFIX) and (name.endswith(INDEX_SUFFIX) or name.endswith(DATA_SUFFIX)):
            stems[name.rsplit(".", 1)[0]] = None
    found = []
    for stem in stems:
        index_path, data_path = path / (stem + INDEX_SUFFIX), path / (stem + DATA_SUFFIX)
        owner, instance = _parse_stem(stem)
        if uid is not None and owner != uid:
            continue
        info = ArenaInfo(stem, index_path, data_path, owner, instance,
                         allocated_bytes(index_path) + allocated_bytes(data_path), held=True)
        try:
            info.held = is_held(index_path)
        except PermissionError:
            info.problem = "not readable by this user"
            found.append(info)
            continue
        if not index_path.exists():
            info.problem = "no index (a creation was interrupted)"
        else:
            try:
                info.slots, info.block_bytes, info.identity = read_identity(index_path)
            except SlotIndexFormatError as exc:
                info.identity = exc.identity
                info.problem = str(exc)
            except OSError as exc:
                info.problem = f"unreadable: {exc}"
        found.append(info)
    return found


def remove_arena(info: ArenaInfo) -> None:
    """Delete an arena's files; refuses (``RuntimeError``) one a live daemon holds."""
    if is_held(info.index_path):
        raise RuntimeError(f"{info.stem} is held by a running kvtierd: stop it first")
    for p in (info.index_path, info.data_path):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


