"""The shm plane: block bytes in the session's shared-memory arena (``attach_arena``), one slot per block.

Contract (see ``kvtier.daemon.planes``): needs ``slots`` (one per hash, in
the arena's range, none twice) and no ``reg``; INVALID_STATE before the
session attached an arena. Copies as ``HostMemoryPlane`` does.
"""

from __future__ import annotations

from kvtier.client.protocol import ErrorCode, ProtocolError
from kvtier.daemon.planes.base import ClientTarget, PlaneCall, checked_target, request_slots
from kvtier.daemon.planes.host import HostMemoryPlane

__all__ = ["ShmArenaPlane"]


class ShmArenaPlane(HostMemoryPlane):
    """See the module docstring."""

    def target(self, call: PlaneCall) -> ClientTarget:
        slots = request_slots(call)
        if call.req.msg.reg is not None:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "plane 'shm' takes no 'reg'")
        arena = call.session.arena
        if arena is None:
            raise ProtocolError(ErrorCode.INVALID_STATE, "plane 'shm' needs an arena: send attach_arena first")
        shm, layout = arena
        return checked_target(call, slots, layout, [shm])
