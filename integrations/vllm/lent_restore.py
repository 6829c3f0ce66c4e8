"""Lent restores: the worker copies CPU-tier blocks kvtierd lends it, in its own process.

Contract
========

``LentRestore(engines)`` serves ``RegisteredPlane`` on KV tensors in host
memory (``engines``: vLLM group id -> the ``BlockLayout`` of its tensors).

- ``ask(client) -> bool``: whether a restore should ask for a lend: the
  daemon lists feature ``"lend"`` (it does for clients of its own user) and
  no lent file failed to map before.
- ``copy(client, lent, block_ids, group) -> int | None``: copies the lent
  blocks (``kvtier.client.arena_map.Lent``) from the worker's read-only
  mapping of kvtierd's CPU-tier file into ``block_ids`` of the group's
  tensors (memmove plans: ``copy_host_blocks``), then ends the lend on a
  thread of its own (the forward does not wait for that round trip).
  Returns the blocks restored: all of them, or 0 when the copy ended past
  the lend's lease (the daemon may have reused the slots: vLLM recomputes
  them). None where the file cannot be mapped (another user's, replaced):
  the lend is ended and lends are not asked for again; the caller restores
  the usual way.
- ``close()``: ends the release thread and unmaps the files.

Why: kvtierd copying into vLLM's tensors is a copy by another process,
~0.4-0.6x of a memcpy on a loaded host (bench/vllm_restore.py); here the
copy runs in the process that owns the destination.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvtier.client.arena_map import ArenaMaps, Lent, LendUnavailable
from kvtier.client.client import Client
from kvtier.client.protocol import FEATURE_LEND, KvtierError
from kvtier.integrations.vllm.background import Background
from kvtier.tiers.layout import BlockLayout
from kvtier.tiers.transfer import copy_host_blocks

log = logging.getLogger("kvtier.integrations.vllm")

RELEASE_TIMEOUT_S = 5.0


class LentRestore:
    """See the module docstring."""

    def __init__(self, engines: Mapping[int, BlockLayout]) -> None:
        self._engines = dict(engines)
        self._maps = ArenaMaps(BlockLayout.from_buffer)
        self._releases = Background("kvtier-lends")
        self._off = False
        self.lent_blocks = 0
        self.late_copies = 0

    def ask(self, client: Client) -> bool:
        return not self._off and FEATURE_LEND in client.features

    def copy(self, client: Client, lent: Lent, block_ids: list[int], group: int) -> int | None:
        try:
            src = self._maps.layout(lent)
        except LendUnavailable as exc:
            self._off = True
            log.warning("kvtier: cannot read the CPU-tier blocks kvtierd lends (%s); kvtierd copies them from now on",
                        exc)
            self._release(client, lent.id)
            return None
        n = len(lent.slots)
        copy_host_blocks(src, lent.slots, self._engines[group], block_ids[:n])
        intact = lent.intact()
        self._release(client, lent.id)
        if not intact:
            # The lease ran out during the copy: kvtierd may have reused a slot under it.
            self.late_copies += 1
            log.info("kvtier: a lent restore of %d blocks ended past its lease; vLLM recomputes them", n)
            return 0
        self.lent_blocks += n
        return n

    def _release(self, client: Client, lend_id: int) -> None:
        def release() -> None:
            try:
                client.release_lends([lend_id], timeout_s=RELEASE_TIMEOUT_S)
            except KvtierError:
                pass  # the daemon ends it at the lease's end, or with the session

        self._releases.submit(release)

    def close(self) -> None:
        self._releases.wait_idle(RELEASE_TIMEOUT_S)
        self._releases.close(timeout_s=1.0)
        self._maps.close()
