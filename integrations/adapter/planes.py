"""How block bytes move between an engine's KV tensors and kvtierd.

Contract
========

A plane has ``connect(client)`` (run on every new session: register or
attach), ``restore(client, keys, block_ids, group) -> int`` (blocks written
into the engine's slots, a prefix of ``keys``) and ``store(client, keys,
block_ids, hints, group)``. Both raise the client's errors; ``DaemonLink``
turns those into misses.

A plane is made over the engine's KV tensors group by group (``tensors``
maps the engine's KV-cache group id to its layers' tensors, in block byte
order): a block id names memory in one group's layers at a time (vLLM's
groups overlay one allocation), so each group is a registration of its own
(``registration``, e.g. vLLM's ``vllm-kv``, for an engine of one group;
``vllm-kv-g<id>`` otherwise), or a block layout of its own in the staged
arena.

- ``RegisteredPlane``: the engine's KV tensors are registered with kvtierd once
  (CUDA IPC on a GPU; on a CPU-only machine their storage is first moved
  into ``/dev/shm`` in place), and kvtierd gathers and scatters blocks
  straight between them and its tiers: no copy in the engine's process at all.
  On KV in host memory (``lend``) a restore asks for a lend: blocks in
  kvtierd's CPU tier are copied by the worker itself, from its read-only
  mapping of the tier's file (``lent_restore.py``), faster than a copy by
  kvtierd's process; others kvtierd copies as before. With ``layers`` (a
  ``LayerCopies``) such a copy may finish beside the forward, layer by layer.
- ``StagedPlane``: for KV memory that cannot be shared (CUDA's expandable
  segments, a backend whose storage cannot move): the worker copies blocks
  through a shared-memory arena, ``staging_blocks`` at a time. One call at a
  time uses the arena (the worker's store and background-load threads take
  turns). An arena ``/dev/shm`` cannot hold when the plane is made (the
  engine's start-up) is a ``ValueError`` naming ``staging_blocks`` (after
  ``setting_prefix``, where the engine's settings keep it): it would fail
  every connect.

``make_plane`` picks one per ``data_plane`` (``auto``: registered, falling
back to staged with a log line that says why).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias

from kvtier.blocks.copy_plan import copy_host_blocks
from kvtier.blocks.layout import BlockLayout
from kvtier.client.client import Client
from kvtier.client.kv_share import KvShareError, export_kv, share_kv_in_place
from kvtier.client.protocol import Hints
from kvtier.client.shm_arena import SHM_DIR
from kvtier.integrations.adapter.layer_copies import LayerCopies
from kvtier.integrations.adapter.lent_restore import LentRestore

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtier.integrations")

# A copy's deadline grows with its size at this rate, so a large restore on a
# busy host is not declared failed (and recomputed) while kvtierd still writes
# into the engine's slots; a daemon that is gone is still noticed within timeout_s.
MIN_COPY_BYTES_PER_S = 200 * 1024 * 1024


class CopyDeadline:
    """The timeout of one store or restore call: the link's ``timeout_s`` plus the copy at the slowest rate."""

    def __init__(self, timeout_s: float, block_bytes: int) -> None:
        self._timeout_s = timeout_s
        self._block_bytes = block_bytes

    def __call__(self, num_blocks: int) -> float:
        return self._timeout_s + num_blocks * self._block_bytes / MIN_COPY_BYTES_PER_S


class Plane(Protocol):
    name: str

    def connect(self, client: Client) -> None: ...

    def restore(self, client: Client, keys: list[bytes], block_ids: list[int], group: int = 0) -> int: ...

    def store(self, client: Client, keys: list[bytes], block_ids: list[int], hints: Hints | None = None,
              group: int = 0) -> None: ...


GroupTensors: TypeAlias = "Mapping[int, Sequence[torch.Tensor]]"  # the engine's group id -> its layers' KV tensors
GroupDims = Mapping[int, Sequence[int]]  # the engine's group id -> the block dimension of each tensor


def registration_name(registration: str, group: int, groups: int) -> str:
    """The registration of one group's tensors in kvtierd."""
    return registration if groups == 1 else f"{registration}-g{group}"


class RegisteredPlane:
    name = "registered"

    def __init__(self, tensors: GroupTensors, block_dims: GroupDims, deadline: CopyDeadline, registration: str, *,
                 lend: bool | str = False, layers: LayerCopies | None = None) -> None:
        self._deadline = deadline
        self._tensors = {g: list(ts) for g, ts in tensors.items()}
        self._dims = {g: list(block_dims[g]) for g in tensors}
        self._names = {g: registration_name(registration, g, len(tensors)) for g in tensors}
        every = [t for ts in self._tensors.values() for t in ts]
        if every[0].device.type == "cpu":
            share_kv_in_place(every)  # a storage the groups share moves once; every view follows
        for g, ts in self._tensors.items():
            export_kv(ts, self._dims[g])  # refuses what cannot be shared, before any daemon sees it
        self._lent: LentRestore | None = None
        if lend and every[0].device.type == "cpu":
            # Device KV: a copy from host memory by this process would not beat kvtierd's (pinned, CUDA IPC).
            self._lent = LentRestore({g: BlockLayout(ts, self._dims[g]) for g, ts in self._tensors.items()},
                                     always=lend is True)
            self._lent.layers = layers

    def connect(self, client: Client) -> None:
        for g, ts in self._tensors.items():
            client.register_kv(self._names[g], ts, self._dims[g])

    def restore(self, client: Client, keys: list[bytes], block_ids: list[int], group: int = 0) -> int:
        lent = self._lent
        ask = lent is not None and lent.ask(client)
        done_ids = lent.take_pending() if ask and lent is not None else []  # lends copied before: ended first
        got = client.restore(keys, slots=block_ids, reg=self._names[group], timeout_s=self._deadline(len(keys)),
                             lend=ask, release=done_ids)
        if got.lent is None:
            return len(got)
        assert lent is not None
        done = lent.copy(client, got.lent, block_ids, group)
        if done is None:  # the lent file cannot be mapped here: kvtierd copies instead
            return len(client.restore(keys, slots=block_ids, reg=self._names[group],
                                      timeout_s=self._deadline(len(keys))))
        return done

    def close(self) -> None:
        if self._lent is not None:
            self._lent.close()

    def store(self, client: Client, keys: list[bytes], block_ids: list[int], hints: Hints | None = None,
              group: int = 0) -> None:
        if self._lent is not None:
            self._lent.flush(client)  # lends copied and not yet ended (no restore since): end them here
        client.store(keys, slots=block_ids, reg=self._names[group], hints=hints, timeout_s=self._deadline(len(keys)))


class StagedPlane:
    name = "staged"

    def __init__(self, tensors: GroupTensors, block_dims: GroupDims, staging_blocks: int,
                 deadline: CopyDeadline, setting_prefix: str = "") -> None:
        self._deadline = deadline
        self._engines = {g: BlockLayout(list(ts), list(block_dims[g])) for g, ts in tensors.items()}
        self._slots = staging_blocks
        _check_arena_fits(staging_blocks, max(e.block_bytes for e in self._engines.values()), setting_prefix)
        self._arena: BlockLayout | None = None
        # A restore and a store must not share the arena's slots, nor a reconnect swap the arena under them.
        self._arena_lock = threading.RLock()

    def connect(self, client: Client) -> None:
        with self._arena_lock:
            self._arena = None
            self._arena_of(client)

    def _arena_of(self, client: Client) -> BlockLayout:
        arena = client.arena
        if arena is None:  # first session, or the daemon dropped it with a lost session
            arena = client.open_arena(self._slots)
            self._arena = None
        if self._arena is None:
            self._arena = BlockLayout.from_buffer(arena.buffer, arena.num_slots, arena.slot_bytes)
        return self._arena

    def restore(self, client: Client, keys: list[bytes], block_ids: list[int], group: int = 0) -> int:
        with self._arena_lock:
            return self._restore(client, keys, block_ids, self._engines[group])

    def _restore(self, client: Client, keys: list[bytes], block_ids: list[int], engine: BlockLayout) -> int:
        arena = self._arena_of(client)
        done = 0
        for lo in range(0, len(keys), self._slots):
            chunk = keys[lo: lo + self._slots]
            got = len(client.restore(chunk, slots=list(range(len(chunk))), timeout_s=self._deadline(len(chunk))))
            copy_host_blocks(arena, list(range(got)), engine, block_ids[lo: lo + got])
            done += got
            if got < len(chunk):
                break
        return done

    def store(self, client: Client, keys: list[bytes], block_ids: list[int], hints: Hints | None = None,
              group: int = 0) -> None:
        with self._arena_lock:
            self._store(client, keys, block_ids, hints, self._engines[group])

    def _store(self, client: Client, keys: list[bytes], block_ids: list[int], hints: Hints | None,
               engine: BlockLayout) -> None:
        arena = self._arena_of(client)
        for lo in range(0, len(keys), self._slots):
            chunk = keys[lo: lo + self._slots]
            slots = list(range(len(chunk)))
            copy_host_blocks(engine, block_ids[lo: lo + len(chunk)], arena, slots)
            client.store(chunk, slots=slots, hints=hints, timeout_s=self._deadline(len(chunk)))


def _check_arena_fits(staging_blocks: int, block_bytes: int, setting_prefix: str) -> None:
    """Refuse (ValueError naming staging_blocks) an arena ``/dev/shm`` cannot hold now: every connect would fail."""
    need = staging_blocks * block_bytes
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise ValueError(f"{setting_prefix}staging_blocks: the staged plane's arena of {staging_blocks} "
                         f"blocks x {block_bytes} bytes ({need / 2**30:.1f} GiB) does not fit the {free / 2**30:.1f} GiB "
                         f"free in {SHM_DIR}: lower staging_blocks (loads and stores go in chunks of that many)")


def make_plane(choice: str, tensors: GroupTensors, block_dims: GroupDims, staging_blocks: int,
               deadline: CopyDeadline, *, registration: str, setting_prefix: str = "",
               lend: bool | str = False, layers: LayerCopies | None = None) -> Plane:
    """The plane ``choice`` names (``auto``, ``registered``, ``staged``; see the contract)."""
    if choice in ("auto", "registered"):
        try:
            return RegisteredPlane(tensors, block_dims, deadline, registration, lend=lend, layers=layers)
        except KvShareError as exc:
            if choice == "registered":
                raise
            log.warning("kvtier: the engine's KV tensors cannot be registered with kvtierd (%s); "
                        "staging copies through a shared-memory arena instead", exc)
    return StagedPlane(tensors, block_dims, staging_blocks, deadline, setting_prefix)
