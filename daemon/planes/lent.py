"""Lent restores: blocks served from the tiers' own memory, without a copy engine.

Contract (called by the planes, never by handlers):

- ``lend_frame(call) -> Reply | None``: for an ``"inline"`` restore, the
  held prefix as the reply's one frame, read by ZMQ straight from the tier's
  slots, when it lies in one run of one tier (``TieredPool.borrow`` with one
  view). The tier holds the blocks until the reply has left
  (``Reply.on_sent``). None: the prefix is scattered (the plane gathers it
  into a staging buffer).
- ``lend_in_place(call, target) -> Reply | None``: for a restore into client
  host memory (shm arena, KV by shm) of at most
  ``HandlerContext.lend_restore_max_bytes``, the loop copies the borrowed
  blocks straight into ``target`` with fault-safe calls
  (``session_memory.client_copy``): one copy, and no hand-off to a copy
  worker, which costs more than the copy up to ``LOOP_COPY_MAX_BYTES``
  (32 MiB: 13-88 ms through a worker and a staging buffer, 5-9 ms here).
  The blocks go back to the tier before it returns. None: too large, or the
  pool cannot lend them now (a remote tier to consult, a write still in
  flight into a block): the plane restores through a staging buffer.
  Raises as ``client_copy`` does, and DEADLINE_EXCEEDED past the deadline
  (nothing written).
"""

from __future__ import annotations

from kvtier.daemon.handling.handler_context import Reply, tier_names
from kvtier.daemon.handling.session_memory import client_copy
from kvtier.daemon.planes.base import ClientTarget, PlaneCall
from kvtier.daemon.shared_memory import client_memory, deadlines

__all__ = ["lend_frame", "lend_in_place"]


def lend_frame(call: PlaneCall) -> Reply | None:
    """See the module docstring."""
    borrowed = call.entry.pool.borrow(call.hashes, max_views=1)
    if borrowed is None:
        return None
    return Reply({"tiers": tier_names(borrowed.tiers)}, borrowed.views, on_sent=borrowed.release)


def lend_in_place(call: PlaneCall, target: ClientTarget) -> Reply | None:
    """See the module docstring."""
    block_bytes = call.entry.block_bytes
    if len(call.hashes) * block_bytes > call.ctx.lend_restore_max_bytes:
        return None
    borrowed = call.entry.pool.borrow(call.hashes)
    if borrowed is None:
        return None
    try:
        got = len(borrowed.tiers)
        deadlines.check_write(call.deadline_ns, got * block_bytes, "restore")
        client_copy(call.ctx, call.session,
                    lambda: client_memory.write_views(borrowed.views, target.layout, target.slots[:got]), target.files)
    finally:
        borrowed.release()
    return Reply({"tiers": tier_names(borrowed.tiers)})
