"""KV by CUDA IPC: the kv plane over registered device tensors the engine shared by CUDA IPC handles.

Contract (see ``kvtier.daemon.planes`` and ``engine_kv``): the pool's copy
engine copies between its tiers and the engine's tensors directly (device
memory cannot be truncated under the daemon, so no staging buffer and no
fault-safe copy). The deadline binds the copy itself: a store's copy must
have read the engine's memory by ``deadline_ns`` (``read_by_ns``), a
restore's copy starts only if it can write it by then (``start_by_ns``,
``deadlines.write_by_ns``); past it the op fails DEADLINE_EXCEEDED and
nothing was stored or written. Runs on a GPU only (tests without one cover
the other planes; docs/protocol.md specifies this one).
"""

from __future__ import annotations

from kvtier.daemon.handling.handler_context import Reply, Result, done_or_pending
from kvtier.daemon.planes.base import ClientMemoryPlane, ClientTarget, PlaneCall, store_into_pool
from kvtier.daemon.planes.engine_kv import registration_target
from kvtier.daemon.shared_memory import deadlines

__all__ = ["KvCudaIpcPlane"]


class KvCudaIpcPlane(ClientMemoryPlane):
    """See the module docstring."""

    def target(self, call: PlaneCall) -> ClientTarget:
        return registration_target(call)

    def store_at(self, call: PlaneCall, target: ClientTarget) -> Result:
        call.check_store()
        return store_into_pool(call, target.layout, target.slots, read_by_ns=call.deadline_ns)

    def restore_at(self, call: PlaneCall, target: ClientTarget) -> Result:
        n = len(call.hashes)
        start_by_ns = deadlines.write_by_ns(call.deadline_ns, n * call.entry.block_bytes)
        op = call.entry.pool.restore(call.hashes, target.layout, target.slots, start_by_ns=start_by_ns)
        return done_or_pending(op, lambda o: Reply({"tiers": list(o.result["tiers"])}))
