"""Opening a disk tier's directory: adopt what a previous process left there, or start it empty.

``DiskTier`` calls ``open_directory`` on its own thread when it starts; this
module knows the directory's files and when to trust them, nothing of keys
in memory or of writing.

Contract:

- ``open_directory(root, pool_name, directory, identity, capacity_blocks=,
  block_bytes=, direct=) -> Opened``: removes the pool's directories of
  other layouts under ``root`` (``disk_files.stale_dirs``) that no live
  process holds; makes ``directory`` (mode 0700); opens its index
  (``INDEX_NAME``, a ``kvtier.tiers.slot_index.SlotIndex``, locked while
  open) or, when there is none, it is of another format, identity or block
  size, or the data file (``DATA_NAME``) is missing, creates an empty one
  (one log line says why); resizes it to ``capacity_blocks`` (the records
  of slots that still fit are kept); gives the index file all its blocks
  (``posix_fallocate``: it is written through a shared mapping, where a
  page the filesystem cannot back on a full disk would be a SIGBUS, not an
  error); opens the data file (``disk_files.BlockFile``); scans the records.
  ``Opened`` holds the index, the file, the complete records (oldest
  first) and how many were torn. Raises ``DirectoryBusy`` when a live
  process holds the index, ``OSError`` for a directory it cannot use (a
  full disk, permissions); on a raise nothing stays open.
- ``identity`` is compared as JSON (tuples read back as lists).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.tiers.disk_files import BlockFile, slot_bytes_for, stale_dirs
from kvtier.tiers.slot_index import SlotIndex, SlotIndexBusy, SlotIndexFormatError, SlotRecord, is_held

__all__ = ["DATA_NAME", "DISK_FORMAT", "INDEX_NAME", "DirectoryBusy", "Opened", "open_directory"]

log = logging.getLogger("kvtier.tiers.disk_tier")  # one logger for the whole disk tier

# What the directory's files mean; another value in an index starts the tier empty.
DISK_FORMAT = 1
INDEX_NAME = "index"
DATA_NAME = "blocks"


class DirectoryBusy(RuntimeError):
    """A live process holds the directory's index."""


@dataclass(slots=True)
class Opened:
    index: SlotIndex
    file: BlockFile
    records: list[SlotRecord]  # complete records, oldest first
    torn: int  # records found torn (a kill while one was written)


def open_directory(root: Path, pool_name: str, directory: Path, identity: dict[str, Any], *,
                   capacity_blocks: int, block_bytes: int, direct: bool) -> Opened:
    _remove_stale(root, pool_name, directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    index_path, data_path = directory / INDEX_NAME, directory / DATA_NAME
    index = _open_index(directory, index_path, data_path, identity, capacity_blocks, block_bytes)
    try:
        if index.slots != capacity_blocks:
            log.info("disk tier %s: capacity %d -> %d blocks (records of slots that still fit are kept)",
                     directory, index.slots, capacity_blocks)
            index = index.resized(capacity_blocks)
        _allocate_fully(index.path)
        file = BlockFile.open(data_path, slots=capacity_blocks, slot_bytes=slot_bytes_for(block_bytes),
                              block_bytes=block_bytes, direct=direct)
    except BaseException:
        index.close()
        raise
    records, torn = index.scan()
    return Opened(index, file, records, torn)


def _open_index(directory: Path, index_path: Path, data_path: Path, identity: dict[str, Any], slots: int,
                block_bytes: int) -> SlotIndex:
    try:
        index: SlotIndex | None = SlotIndex.open(index_path)
    except FileNotFoundError:
        index = None
    except SlotIndexBusy:
        raise DirectoryBusy("held by another live process") from None
    except SlotIndexFormatError as exc:
        log.warning("disk tier %s: %s; starting empty", directory, exc)
        index = None
    if index is not None:
        why = ""
        if _normal(index.identity) != _normal(identity):
            why = f"it holds blocks of another format or layout ({index.identity.get('format')!r})"
        elif index.block_bytes != block_bytes:
            why = f"its blocks are {index.block_bytes} bytes"
        elif not data_path.is_file():
            why = "its data file is missing"
        if not why:
            return index
        log.warning("disk tier %s: %s; starting empty", directory, why)
        index.close()
    return SlotIndex.create(index_path, slots=slots, block_bytes=block_bytes, identity=identity)


def _remove_stale(root: Path, pool_name: str, directory: Path) -> None:
    for old in stale_dirs(root, pool_name, directory.name):
        if is_held(old / INDEX_NAME):
            continue
        shutil.rmtree(old, ignore_errors=True)
        log.info("disk tier %s: removed %s, this pool's blocks under another layout", directory, old)


def _allocate_fully(path: Path) -> None:
    """Give the index file all its blocks now (see the module docstring): a full disk refuses the tier."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem that cannot: nothing to reserve
            raise
    finally:
        os.close(fd)


def _normal(identity: Any) -> Any:
    """An identity as the index stores it (JSON: tuples read back as lists)."""
    return json.loads(json.dumps(identity, sort_keys=True))
