"""The ``Plane`` interface, the call a plane serves, and the checks every client-memory plane shares.

Contract: see ``kvtier.daemon.planes`` (the package docstring). Here:

- ``PlaneCall``: one store or restore as the handler checked it: the
  session's pool keys (``hashes``), its pool (``entry``), the request.
- ``Plane``: ``store(call)`` / ``restore(call) -> Reply | Pending``.
- ``ClientMemoryPlane``: a plane whose bytes lie in memory the client mapped
  for the daemon (an arena, registered tensors): ``target(call)`` checks the
  fields and resolves that memory into a ``ClientTarget`` (layout, one slot
  per hash, the ``/dev/shm`` files behind it) before anything is copied;
  ``store_at`` / ``restore_at`` copy.
- ``store_into_pool(call, src, slots, ...)``: the pool's store of ``src``,
  replied with the pool's result when its copy is done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.client.protocol import ErrorCode, ProtocolError, Request
from kvtier.client.shm_arena import ShmArena
from kvtier.daemon.handling.handler_context import HandlerContext, Reply, Result, done_or_pending
from kvtier.daemon.clients.hints import request_hints
from kvtier.daemon.pooling.pools import PoolEntry
from kvtier.daemon.clients.sessions import Session
from kvtier.blocks.layout import BlockLayout

__all__ = ["ClientMemoryPlane", "ClientTarget", "Plane", "PlaneCall", "checked_target", "request_slots", "store_into_pool"]


@dataclass(slots=True)
class PlaneCall:
    """One ``store`` or ``restore`` handed to a plane (see the package docstring)."""

    ctx: HandlerContext
    req: Request
    session: Session
    entry: PoolEntry
    hashes: list[bytes]  # the session's pool keys (its tenant's namespace), one per block

    @property
    def plane(self) -> str:
        """The wire plane name, as errors name it."""
        return self.req.msg.plane

    @property
    def deadline_ns(self) -> int | None:
        return self.req.msg.deadline_ns

    def check_store(self) -> None:
        """The tenant's quota for this store: refused (QUOTA) before anything is copied."""
        self.ctx.tenants.check_store(self.session.tenant, self.entry.pool, self.hashes, self.entry.block_bytes)


@dataclass(slots=True)
class ClientTarget:
    """Client memory a store reads or a restore writes, checked."""

    layout: BlockLayout
    slots: list[int]  # one per hash, each in range, none twice
    # The /dev/shm files behind ``layout``, for client_copy's truncation check. Held, not looked
    # up again: a restore copies out later, when the session may have dropped them.
    files: list[ShmArena]


class Plane(ABC):
    """One way block bytes travel between a client and a pool (see the package docstring)."""

    @abstractmethod
    def store(self, call: PlaneCall) -> Result:
        """Store ``call.hashes``' blocks from the client into the pool."""

    @abstractmethod
    def restore(self, call: PlaneCall) -> Result:
        """Restore the held prefix of ``call.hashes`` to the client; reply its ``tiers``."""


class ClientMemoryPlane(Plane):
    """A plane whose bytes lie in client memory the daemon mapped: targets resolved, then copied."""

    def store(self, call: PlaneCall) -> Result:
        if call.req.payload:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"plane {call.plane!r} takes no payload frame")
        return self.store_at(call, self.target(call))

    def restore(self, call: PlaneCall) -> Result:
        target = self.target(call)
        if call.req.msg.lend:
            # The client copies the blocks itself from its mapping of the CPU tier's file (daemon.clients.lends);
            # where they cannot be lent, the restore goes on as if it had not asked.
            lent = call.ctx.lends.offer(call.session, call.entry, call.hashes,
                                        allowed=call.ctx.lend_restore_max_bytes > 0)
            if lent is not None:
                return Reply({"tiers": ["cpu"] * len(lent["slots"]), "lent": lent})
        return self.restore_at(call, target)

    @abstractmethod
    def target(self, call: PlaneCall) -> ClientTarget:
        """The memory the request names, its fields checked; raises ``ProtocolError`` and changes nothing."""

    @abstractmethod
    def store_at(self, call: PlaneCall, target: ClientTarget) -> Result:
        """``store`` once ``target`` is resolved."""

    @abstractmethod
    def restore_at(self, call: PlaneCall, target: ClientTarget) -> Result:
        """``restore`` once ``target`` is resolved."""


def request_slots(call: PlaneCall) -> Sequence[int]:
    """The request's ``slots``: one per hash (checked first, before the plane's memory is looked up)."""
    slots = call.req.msg.slots
    if slots is None or len(slots) != len(call.hashes):
        raise ProtocolError(ErrorCode.INVALID_FIELD,
                            f"plane {call.plane!r} needs 'slots', one per hash ({len(call.hashes)})")
    return slots


def checked_target(call: PlaneCall, slots: Sequence[int], layout: BlockLayout, files: list[ShmArena]) -> ClientTarget:
    """``slots`` in ``layout``'s range and none twice, or ``ProtocolError``."""
    bad = [s for s in slots if s >= layout.num_blocks]
    if bad:
        raise ProtocolError(ErrorCode.INVALID_FIELD,
                            f"slot {bad[0]} out of range (the {call.plane} layout has {layout.num_blocks} slots)")
    if len(set(slots)) != len(slots):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "'slots' names a slot twice")
    return ClientTarget(layout, list(slots), files)


def store_into_pool(call: PlaneCall, src: BlockLayout, slots: list[int], *, keep: Any = None,
                    read_by_ns: int | None = None) -> Result:
    """The pool's store of ``src[slots]``; ``keep`` lives until its copy is done, which ends by ``read_by_ns``."""
    entry, session = call.entry, call.session
    hints = request_hints(call.req.msg.hints, session, entry, len(call.hashes), call.ctx.metrics)
    op = entry.pool.store(call.hashes, src, slots, hints=hints, read_by_ns=read_by_ns)
    return done_or_pending(op, lambda o: Reply(dict(o.result)), keep=keep)
