"""The kv plane: block bytes in the engine's own KV tensors, registered with ``register_kv``.

Contract (see ``kvtier.daemon.planes``): needs ``reg`` (a registration of
this session: NOT_FOUND otherwise) and ``slots`` (block indices into the
registered tensors, in range, none twice). A registration's tensors are
either host memory in ``/dev/shm`` files (``KvShmPlane``) or device memory
shared by CUDA IPC (``KvCudaIpcPlane``); ``EngineKvPlane`` resolves the
registration and hands the call to the one its memory names.
``registration_target`` is that resolution, shared by both.
"""

from __future__ import annotations

from kvtier.client.protocol import ErrorCode, ProtocolError
from kvtier.daemon.handling.handler_context import Result
from kvtier.daemon.planes.base import ClientMemoryPlane, ClientTarget, PlaneCall, checked_target, request_slots
from kvtier.daemon.shared_memory import client_memory

__all__ = ["EngineKvPlane", "registration_target"]


def registration_target(call: PlaneCall) -> ClientTarget:
    """The registration the request names, and its ``/dev/shm`` files (none for CUDA IPC tensors)."""
    slots = request_slots(call)
    name = call.req.msg.reg
    if name is None:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "plane 'kv' needs 'reg'")
    reg = call.session.registrations.get(name)
    if reg is None:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no registration {name!r} in this session")
    files = [arena for handle in reg.handles for arena in getattr(handle, "shm_files", ())]
    return checked_target(call, slots, reg.layout, files)


class EngineKvPlane(ClientMemoryPlane):
    """See the module docstring."""

    def __init__(self, *, host: ClientMemoryPlane, device: ClientMemoryPlane) -> None:
        self.host = host  # KV by shm
        self.device = device  # KV by CUDA IPC

    def target(self, call: PlaneCall) -> ClientTarget:
        return registration_target(call)

    def _by_memory(self, target: ClientTarget) -> ClientMemoryPlane:
        return self.host if client_memory.is_client_host_memory(target.layout) else self.device

    def store_at(self, call: PlaneCall, target: ClientTarget) -> Result:
        return self._by_memory(target).store_at(call, target)

    def restore_at(self, call: PlaneCall, target: ClientTarget) -> Result:
        return self._by_memory(target).restore_at(call, target)
