"""Lent restores: the worker copies CPU-tier blocks kvtierd lends it, in its own process.

Contract
========

``LentRestore(engines, always=False)`` serves ``RegisteredPlane`` on KV tensors in host
memory (``engines``: the engine's KV-cache group id -> the ``BlockLayout`` of its tensors).

- ``ask(client) -> bool``: whether a restore should ask for a lend: the
  daemon lists feature ``"lend"`` (it does for clients of its own user), no
  lent file failed to map before, and (unless ``always``: setting ``lend =
  true``) every group's tensors take a block in runs of at least ``MIN_RUN_BYTES`` (vLLM's CPU backend: one run per layer;
  a layout of many small runs per block copies slower here, a memmove call
  from Python each, than kvtierd's one kernel copy of them all).
- ``copy(client, lent, block_ids, group) -> int | None``: copies the lent
  blocks (``kvtier.client.arena_map.Lent``) from the worker's read-only
  mapping of kvtierd's CPU-tier file into ``block_ids`` of the group's
  tensors (memmove plans: ``copy_host_blocks``). Returns the blocks restored: all of them, or 0 when the copy ended past
  the lend's lease (the daemon may have reused the slots: vLLM recomputes
  them). None where the file cannot be mapped (another user's, replaced):
  lends are not asked for again; the caller restores the usual way.
- The lend is not ended at once (a round trip the forward would wait for,
  or a thread hand-off that costs as much on a busy host): its id waits in
  ``take_pending()``, which the plane sends along with its next restore
  (``restore``'s ``release``), or ``flush(client)`` ends them (the plane's
  store, on the store thread). A worker that goes quiet leaves its last
  lend to end with its lease (``lend_lease_s``, 2 s by default).
- ``close()`` unmaps the files (the session's end ends its lends).

Why: kvtierd copying into vLLM's tensors is a copy by another process,
~0.4-0.6x of a memcpy on a loaded host (bench/vllm_restore.py); here the
copy runs in the process that owns the destination.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from kvtier.client.arena_map import ArenaMaps, Lent, LendUnavailable
from kvtier.client.client import Client
from kvtier.client.protocol import FEATURE_LEND, KvtierError
from kvtier.blocks.copy_plan import plan_block_copy
from kvtier.blocks.layout import BlockLayout
from kvtier.blocks.copy_plan import copy_host_blocks

log = logging.getLogger("kvtier.integrations")

RELEASE_TIMEOUT_S = 5.0
# A memmove call from Python costs ~1-2 us on the 2-core VM. bench/protocol.py's vLLM layout (64 runs per
# block) ran lent at 0.16x memcpy against kvtierd's 0.24x with 4 KiB runs, at 0.41x against 0.35x with 32 KiB.
MIN_RUN_BYTES = 16 * 1024


class LentRestore:
    """See the module docstring."""

    def __init__(self, engines: Mapping[int, BlockLayout], *, always: bool = False) -> None:
        self._engines = dict(engines)
        self.min_run_bytes = min(_smallest_run(e) for e in self._engines.values())
        self._runs_ok = always or self.min_run_bytes >= MIN_RUN_BYTES
        self._maps = ArenaMaps(BlockLayout.from_buffer)
        self._pending: list[int] = []  # lends copied, not yet ended
        self._pending_lock = threading.Lock()  # the loads thread and the forward's thread both restore
        self._off = False
        self.lent_blocks = 0
        self.late_copies = 0

    def ask(self, client: Client) -> bool:
        return not self._off and self._runs_ok and FEATURE_LEND in client.features

    def copy(self, client: Client, lent: Lent, block_ids: list[int], group: int) -> int | None:
        try:
            src = self._maps.layout(lent)
        except LendUnavailable as exc:
            self._off = True
            log.warning("kvtier: cannot read the CPU-tier blocks kvtierd lends (%s); kvtierd copies them from now on",
                        exc)
            self._done(lent.id)
            return None
        n = len(lent.slots)
        copy_host_blocks(src, lent.slots, self._engines[group], block_ids[:n])
        intact = lent.intact()
        self._done(lent.id)
        if not intact:
            # The lease ran out during the copy: kvtierd may have reused a slot under it.
            self.late_copies += 1
            log.info("kvtier: a lent restore of %d blocks ended past its lease; the engine recomputes them", n)
            return 0
        self.lent_blocks += n
        return n

    def _done(self, lend_id: int) -> None:
        with self._pending_lock:
            self._pending.append(lend_id)

    def take_pending(self) -> list[int]:
        with self._pending_lock:
            ids, self._pending = self._pending, []
        return ids

    def flush(self, client: Client) -> None:
        ids = self.take_pending()
        if ids:
            try:
                client.release_lends(ids, timeout_s=RELEASE_TIMEOUT_S)
            except KvtierError:
                pass  # the daemon ends them at their lease's end, or with the session

    def close(self) -> None:
        self._maps.close()


def _smallest_run(engine: BlockLayout) -> int:
    """The smallest memmove a block of a contiguous slab copied into ``engine`` takes."""
    one = BlockLayout.contiguous(1, engine.block_bytes)
    return int(plan_block_copy(one, [0], engine, [0], merge=False).sizes.min())
