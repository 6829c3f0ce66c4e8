"""KV by shm: the kv plane over registered host tensors in the engine's ``/dev/shm`` files.

Contract (see ``kvtier.daemon.planes`` and ``engine_kv``): the registration
as ``registration_target`` resolves it; copies as ``HostMemoryPlane`` does
(fault-safe, through a staging buffer, restores lent in place where they can).
"""

from __future__ import annotations

from kvtier.daemon.planes.base import ClientTarget, PlaneCall
from kvtier.daemon.planes.engine_kv import registration_target
from kvtier.daemon.planes.host import HostMemoryPlane

__all__ = ["KvShmPlane"]


class KvShmPlane(HostMemoryPlane):
    """See the module docstring."""

    def target(self, call: PlaneCall) -> ClientTarget:
        return registration_target(call)
