"""The inline plane: block bytes travel in the message itself, one payload frame.

Contract (see ``kvtier.daemon.planes``): takes no ``slots`` or ``reg``.
``store``: exactly one frame of ``len(hashes) * block_bytes`` bytes (none
for no hashes), read by the pool straight from the ZMQ frame (no copy
before the pool's). ``restore``: the held prefix's bytes as one reply frame,
at most ``max_payload_bytes`` (TOO_LARGE, before anything is read); lent
from the tier without a copy where the prefix lies in one run of one tier's
slots (``lent.lend_frame``), else gathered into a staging buffer by a copy
worker.
"""

from __future__ import annotations

from kvtier.client.protocol import ErrorCode, ProtocolError, frame_nbytes
from kvtier.daemon.handling.handler_context import Reply, Result, done_or_pending
from kvtier.daemon.planes.base import Plane, PlaneCall, store_into_pool
from kvtier.daemon.planes.lent import lend_frame
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import Op

__all__ = ["InlinePlane"]


def _no_slots_or_reg(call: PlaneCall) -> None:
    f = call.req.msg
    if f.slots is not None or f.reg is not None:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "plane 'inline' takes no 'slots' or 'reg'")


class InlinePlane(Plane):
    """See the module docstring."""

    def store(self, call: PlaneCall) -> Result:
        _no_slots_or_reg(call)
        payload, n, block_bytes = call.req.payload, len(call.hashes), call.entry.block_bytes
        nbytes = sum(frame_nbytes(fr) for fr in payload)
        if nbytes != n * block_bytes or (n and len(payload) != 1):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"inline store of {n} blocks needs one payload frame of {n * block_bytes} bytes, got {nbytes} in {len(payload)} frames",
            )
        if n == 0:
            return Reply({"stored": 0, "present": 0})
        frame = payload[0]
        # Zero-copy: the pool reads the block bytes straight out of the ZMQ frame.
        src = BlockLayout.from_buffer(getattr(frame, "buffer", frame), n, block_bytes)
        call.check_store()
        return store_into_pool(call, src, list(range(n)), keep=frame)

    def restore(self, call: PlaneCall) -> Result:
        _no_slots_or_reg(call)
        hashes, pool, block_bytes = call.hashes, call.entry.pool, call.entry.block_bytes
        n = len(hashes)
        # Size the staging buffer to what will come back, so a long miss
        # costs no memory. Nothing runs on the loop between this probe and the
        # restore, but a remote tier may hold more by then (a write-back
        # landed): the restore stops at k blocks.
        k = len(pool.lookup(hashes, count=False))
        if k * block_bytes > call.ctx.max_payload_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"restoring {k} blocks makes a {k * block_bytes}-byte reply, limit {call.ctx.max_payload_bytes}; ask for fewer",
            )
        if k == 0:
            pool.lookup(hashes)  # counted like any restore of a miss
            return Reply({"tiers": []})
        lent = lend_frame(call)
        if lent is not None:
            return lent
        staging = BlockLayout.contiguous(k, block_bytes, "cpu")
        # Slots past the held prefix are never written; they only satisfy the
        # pool's "one slot per hash" check so its lookup counters see every hash.
        op = pool.restore(hashes, staging, list(range(k)) + [0] * (n - k), max_blocks=k)

        def finish(o: Op) -> Reply:
            got = len(o.result["tiers"])
            frames = [staging.slab()[:got].numpy()] if got else []
            return Reply({"tiers": list(o.result["tiers"])}, frames)

        return done_or_pending(op, finish, keep=staging, reply_bytes=k * block_bytes)
