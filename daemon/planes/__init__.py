"""Data planes: where a ``store``'s block bytes come from and a ``restore``'s go, one implementation per plane.

Contract
========

A plane moves block bytes between a client and a pool for the verbs
``store`` and ``restore`` of a store-mode pool. ``daemon.handlers`` checks
what every store and restore share (the pool's mode, the deadline on arrival,
the session's keys, no hash named twice in a store), builds a ``PlaneCall``
and hands it to ``plane_for(req.msg.plane)``; nothing else calls a
plane. ``PLANES`` is the table, keyed by the wire name (``client.protocol.PLANES``):

- ``"inline"``: ``InlinePlane`` (``inline``): the bytes travel in the
  request's or the reply's one payload frame;
- ``"shm"``: ``ShmArenaPlane`` (``shm_arena``): the session's shared-memory
  arena;
- ``"kv"``: ``EngineKvPlane`` (``engine_kv``) resolves the registration and
  hands the call on by its memory: ``KvShmPlane`` (``kv_shm``) for host
  tensors in ``/dev/shm`` files, ``KvCudaIpcPlane`` (``kv_cuda_ipc``) for
  device tensors shared by CUDA IPC.

Restores into client host memory (shm arena, KV by shm) up to
``HandlerContext.lend_restore_max_bytes`` are lent in place from the tiers
(``lent``); an inline restore whose prefix lies in one run of one tier is
lent to ZMQ as its reply frame (``lent.lend_frame``).

Each plane's ``store(call)`` / ``restore(call) -> Reply | Pending``:

- validates its own fields first (``slots``, ``reg``, payload frames, slot
  range) and raises ``ProtocolError`` (INVALID_FIELD, INVALID_STATE,
  NOT_FOUND, TOO_LARGE) before anything changed; a store then asks the
  tenant's quota (``TenantRegistry.check_store``) before any copy;
- copies: a store returns ``Pending`` (or the done ``Reply``) of the pool's
  ``store``, its reply the pool's result (``stored``, ``present``); a restore
  replies ``tiers`` (as strings: the handler packs them for packed requests)
  and, for ``"inline"``, the blocks' bytes as one frame;
- never faults on a client's memory: copies to and from ``/dev/shm`` go
  through ``session_memory.client_copy``, which fails the request with
  TRANSFER_FAILED and drops the session's arena and registrations on a
  truncated file; copies the pool makes itself (CUDA IPC, staging) fail as
  the pool's ``Op`` fails (TRANSFER_FAILED by the server);
- keeps the deadline (``daemon.shared_memory.deadlines``): a client's memory is read or
  written only before the request's ``deadline_ns``; past it
  DEADLINE_EXCEEDED and nothing was stored or written.

To add a plane: a module here with one ``Plane`` subclass, its wire name in
``PLANES`` (and in ``client.protocol.PLANES``, with its fields), the client
half in ``client/data_planes.py``, the spec in docs/protocol.md.
"""

from __future__ import annotations

from kvtier.client.protocol import PLANES as WIRE_PLANES
from kvtier.daemon.planes.base import Plane, PlaneCall
from kvtier.daemon.planes.engine_kv import EngineKvPlane
from kvtier.daemon.planes.inline import InlinePlane
from kvtier.daemon.planes.kv_cuda_ipc import KvCudaIpcPlane
from kvtier.daemon.planes.kv_shm import KvShmPlane
from kvtier.daemon.planes.shm_arena import ShmArenaPlane

__all__ = ["PLANES", "EngineKvPlane", "InlinePlane", "KvCudaIpcPlane", "KvShmPlane", "Plane", "PlaneCall",
           "ShmArenaPlane", "plane_for"]

# The wire plane name -> its implementation (see the module docstring).
PLANES: dict[str, Plane] = {
    "inline": InlinePlane(),
    "shm": ShmArenaPlane(),
    "kv": EngineKvPlane(host=KvShmPlane(), device=KvCudaIpcPlane()),
}
assert set(PLANES) == set(WIRE_PLANES), "every wire plane has one implementation"


def plane_for(name: str) -> Plane:
    """The plane of a request's ``plane`` field (already validated against ``client.protocol.PLANES``)."""
    return PLANES[name]
