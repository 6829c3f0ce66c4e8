"""A client's read-only mappings of kvtierd's CPU-tier files, for lent restores (feature ``"lend"``).

Contract
========

A restore that asked for a lend (``Client.restore(..., lend=True)``) may
come back with a ``Lent``: the daemon did not copy; it holds the blocks in
its CPU tier (``kvtier.daemon.clients.lends``) and says where they lie: the tier's
file (``path``, ``inode``), its ``block_bytes`` and one slot per block. The
caller copies them itself, then ends the lend (``Client.release_lends``).

- ``ArenaMaps(wrap)``: ``wrap(buffer, rows, block_bytes)`` makes the
  caller's view of one mapped file (``BlockLayout.from_buffer`` for the
  vLLM connector: ``client/`` imports no torch). ``ArenaMaps.layout(lent)``
  returns it: a read-only ``[rows, block_bytes]`` view of the file, mapped once and kept (a later lend of
  the same file reuses it; a file of another inode under that path, one
  re-created by a restarted daemon, or one grown past the mapping is mapped
  again). Raises ``LendUnavailable`` where the file cannot be used: it
  cannot be opened (another user's), it is not that inode any more, or it
  is shorter than the slots need. ``close()`` unmaps every file.
- ``Lent.intact(now_ns=None) -> bool``: whether a copy that ended at
  ``now_ns`` (CLOCK_MONOTONIC, the daemon's clock on the same host) read
  bytes the daemon still held for it: before ``expires_ns``, less
  ``LEASE_MARGIN_NS``. A copy that ended later may have read blocks the
  daemon had reused: the caller treats them as not restored.

Only reading the mapping's rows is safe: the pages are ``PROT_READ`` (a
write faults).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from kvtier.client.protocol import KvtierError

__all__ = ["ArenaMaps", "LEASE_MARGIN_NS", "Lent", "LendUnavailable"]

# A copy must end this long before the lend's expiry to count: the daemon's sweep and this
# process read one clock, so this only covers the time between reading it and the copy's end.
LEASE_MARGIN_NS = 1_000_000


class LendUnavailable(KvtierError):
    """A lent restore whose file this process cannot map (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Lent:
    """A restore's ``lent`` map: where the daemon holds the blocks for this client to copy."""

    id: int
    path: str
    inode: int
    block_bytes: int
    slots: list[int]
    expires_ns: int

    @classmethod
    def from_wire(cls, m: Mapping[str, Any]) -> Lent:
        return cls(int(m["id"]), str(m["path"]), int(m["inode"]), int(m["block_bytes"]),
                   [int(s) for s in m["slots"]], int(m["expires_ns"]))

    def intact(self, now_ns: int | None = None) -> bool:
        now = time.monotonic_ns() if now_ns is None else now_ns
        return now + LEASE_MARGIN_NS < self.expires_ns


@dataclass(slots=True)
class _Mapping:
    inode: int
    size: int
    block_bytes: int
    mm: mmap.mmap
    layout: Any  # the caller's view over mm (wrap's)


class ArenaMaps:
    """See the module docstring."""

    def __init__(self, wrap: Callable[[Any, int, int], Any]) -> None:
        self._wrap = wrap
        self._maps: dict[str, _Mapping] = {}
        self._lock = threading.Lock()

    def layout(self, lent: Lent) -> Any:
        need = (max(lent.slots) + 1) * lent.block_bytes if lent.slots else 0
        with self._lock:
            m = self._maps.get(lent.path)
            if m is not None and m.inode == lent.inode and m.size >= need and m.block_bytes == lent.block_bytes:
                return m.layout
            m = self._map(lent, need)
            old = self._maps.pop(lent.path, None)
            self._maps[lent.path] = m
        if old is not None:
            _unmap(old)
        return m.layout

    def _map(self, lent: Lent, need: int) -> _Mapping:
        try:
            fd = os.open(lent.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise LendUnavailable(f"cannot open kvtierd's CPU tier {lent.path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_ino != lent.inode:
                raise LendUnavailable(f"{lent.path} is another file than the daemon's (inode {st.st_ino}, "
                                      f"not {lent.inode})")
            if st.st_size < need:
                raise LendUnavailable(f"{lent.path} holds {st.st_size} bytes, the lent slots need {need}")
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        rows = st.st_size // lent.block_bytes
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable: only reads happen (see the module docstring).
            warnings.simplefilter("ignore", UserWarning)
            layout = self._wrap(mm, rows, lent.block_bytes)
        return _Mapping(st.st_ino, st.st_size, lent.block_bytes, mm, layout)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for m in maps:
            _unmap(m)


def _unmap(m: _Mapping) -> None:
    m.layout = None
    try:
        m.mm.close()
    except BufferError:
        pass  # a view still exports it (a copy in flight on another thread): the mapping goes with its last view
