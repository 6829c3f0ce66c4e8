"""Copies between the pool and client host memory in ``/dev/shm`` (shm arena, KV by shm), that never fault the daemon.

Contract: ``HostMemoryPlane`` is the copying half of the planes whose client
memory is host memory the daemon mapped from the client's files
(``ShmArenaPlane``, ``KvShmPlane``); they supply ``target``. The client's
file may shrink under the daemon at any time, so the pool never reads or
writes it: the loop copies between it and a staging buffer of the daemon's
own with calls that fail instead of faulting (``session_memory.client_copy``).

- ``store_at``: the tenant's quota, then the client's blocks into staging,
  then (before the deadline: ``check_read``) the pool's store of staging.
- ``restore_at``: lent in place where it can (``lent.lend_in_place``), else
  the pool writes staging and the finished op's blocks go to the client
  (before the deadline: ``check_write``); a miss replies ``tiers`` [] and is
  counted as a lookup.
"""

from __future__ import annotations

from kvtier.daemon.shared_memory import client_memory, deadlines
from kvtier.daemon.handling.handler_context import Reply, Result, done_or_pending
from kvtier.daemon.planes.base import ClientMemoryPlane, ClientTarget, PlaneCall, store_into_pool
from kvtier.daemon.planes.lent import lend_in_place
from kvtier.daemon.handling.session_memory import client_copy
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import Op

__all__ = ["HostMemoryPlane"]


class HostMemoryPlane(ClientMemoryPlane):
    """See the module docstring."""

    def store_at(self, call: PlaneCall, target: ClientTarget) -> Result:
        call.check_store()
        n = len(call.hashes)
        staging = BlockLayout.contiguous(n, call.entry.block_bytes, "cpu")
        client_copy(call.ctx, call.session, lambda: client_memory.read_blocks(target.layout, target.slots, staging),
                    target.files)
        deadlines.check_read(call.deadline_ns, "store")
        return store_into_pool(call, staging, list(range(n)), keep=staging)

    def restore_at(self, call: PlaneCall, target: ClientTarget) -> Result:
        lent = lend_in_place(call, target)
        if lent is not None:
            return lent
        hashes, pool, block_bytes = call.hashes, call.entry.pool, call.entry.block_bytes
        n = len(hashes)
        k = len(pool.lookup(hashes, count=False))
        if k == 0:
            pool.lookup(hashes)
            return Reply({"tiers": []})
        staging = BlockLayout.contiguous(k, block_bytes, "cpu")
        op = pool.restore(hashes, staging, list(range(k)) + [0] * (n - k))

        def finish_client(o: Op) -> Reply:
            got = len(o.result["tiers"])
            deadlines.check_write(call.deadline_ns, got * block_bytes, "restore")
            client_copy(call.ctx, call.session,
                        lambda: client_memory.write_blocks(staging, got, target.layout, target.slots), target.files)
            return Reply({"tiers": list(o.result["tiers"])})

        return done_or_pending(op, finish_client, keep=staging)
