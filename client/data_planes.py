"""Where a request's block bytes travel: inline frames, the client's shm arena, or registered KV tensors.

Contract
========

``store`` and ``restore`` name a data plane (docs/protocol.md, "Data planes
at a glance"). ``Client`` calls:

- ``plane_fields(data, slots, reg, n, have_arena=, max_payload_bytes=) ->
  (fields, frames)``: the request fields that pick the plane, and the frames
  that carry inline bytes. ``data`` (one bytes-like object, a list of
  per-block ones, a numpy array or a CPU torch tensor) goes inline;
  ``slots`` alone name slots of the client's arena (``have_arena`` must be
  true); ``slots`` with ``reg`` name slots of registered tensors. Refuses a
  mix, a slot count other than ``n``, a GPU tensor, or an inline payload
  over the daemon's ``max_payload_bytes`` with ``ProtocolError``; a missing
  arena with ``KvtierError``.
- ``arena_fields(arena)``: the ``attach_arena`` fields of an arena.
- ``kv_tensor_fields(tensors, block_dims)``: the ``tensors`` of
  ``register_kv``, one ``{desc, block_dim}`` per tensor, described by
  ``kvtier.client.kv_share.export_tensor`` (imported only here, when called:
  it imports torch). ``block_dims`` is one for all tensors or one each;
  raises ``KvtierError`` for a count that does not match, ``KvShareError``
  for a tensor that cannot be shared. ``shm_names(fields)``: the
  ``/dev/shm`` files those name.
- ``share_with_daemon(endpoint, shm_names)``: give shared-memory files this
  client made to a daemon that runs as another user (its socket's group,
  mode 0660); a file it cannot give is logged, and the daemon then answers
  ACCESS_DENIED naming it. Never raises.

Imports no torch at load: ``as_buffer`` recognises a tensor by its
attributes, ``kv_tensor_fields`` imports ``kv_share`` when called.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.client.endpoint import EndpointError, ipc_socket_file
from kvtier.client.protocol import ErrorCode, KvtierError, ProtocolError, frame_nbytes
from kvtier.client.shm_arena import SHM_DIR, ShmArena

__all__ = ["arena_fields", "as_buffer", "kv_tensor_fields", "plane_fields", "share_with_daemon", "shm_names"]

log = logging.getLogger(__name__)


def as_buffer(data: Any) -> Any:
    """A zero-copy buffer for an inline payload (bytes-like, numpy array, CPU torch tensor)."""
    if hasattr(data, "numpy") and hasattr(data, "is_cuda"):
        # A torch tensor: its numpy view shares memory. Checked by attribute so
        # this module never imports torch.
        if data.is_cuda:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "inline data must be in host memory")
        return data.contiguous().numpy()
    return data


def plane_fields(data: Any, slots: Sequence[int] | None, reg: str | None, n: int, *,
                 have_arena: bool, max_payload_bytes: int | None) -> tuple[dict[str, Any], list[Any]]:
    if slots is None:
        if reg is not None:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "reg needs slots")
        frames: list[Any] = []
        if data is not None:
            if isinstance(data, (list, tuple)):
                data = b"".join(bytes(memoryview(as_buffer(d)).cast("B")) for d in data)
            buf = as_buffer(data)
            if max_payload_bytes is not None and frame_nbytes(buf) > max_payload_bytes:
                raise ProtocolError(ErrorCode.TOO_LARGE,
                                    f"payload of {frame_nbytes(buf)} bytes exceeds the daemon's {max_payload_bytes}")
            frames = [buf]
        return {"plane": "inline"}, frames
    if data is not None:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "give data or slots, not both")
    slots = [int(s) for s in slots]
    if len(slots) != n:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{n} hashes but {len(slots)} slots")
    if reg is None:
        if not have_arena:
            raise KvtierError("no arena: call open_arena first")
        return {"plane": "shm", "slots": slots}, []
    return {"plane": "kv", "slots": slots, "reg": reg}, []


def arena_fields(arena: ShmArena) -> dict[str, Any]:
    return {"name": arena.name, "num_slots": arena.num_slots, "slot_bytes": arena.slot_bytes}


def kv_tensor_fields(tensors: Sequence[Any], block_dims: int | Sequence[int]) -> list[dict[str, Any]]:
    from kvtier.client import kv_share  # imports torch: only engines that register pay for it

    dims = [block_dims] * len(tensors) if isinstance(block_dims, int) else list(block_dims)
    if len(dims) != len(tensors):
        raise KvtierError(f"{len(tensors)} tensors but {len(dims)} block dims")
    return [{"desc": kv_share.export_tensor(t), "block_dim": d} for t, d in zip(tensors, dims)]


def shm_names(kv_fields: Sequence[Mapping[str, Any]]) -> list[str]:
    return sorted({f["desc"]["handle"]["name"] for f in kv_fields if f["desc"].get("transport") == "shm"})


def share_with_daemon(endpoint: str, shm_names: Sequence[str]) -> None:
    """Give shared-memory files to a daemon running as another user: its group, mode 0660.

    The daemon's socket file is owned by the daemon's user and group.
    When that user is not this one, the files this client made (0600)
    get the socket's group, which this process can give only if it is a
    member (the documented set-up: engines in the daemon's group). Where
    it cannot, the daemon answers ACCESS_DENIED with the file's mode.
    """
    try:
        path = ipc_socket_file(endpoint)
    except EndpointError:
        return  # no kvtierd binds such an endpoint
    if path is None:
        return  # tcp: the daemon maps no client file; abstract: the daemon serves its own user only
    try:
        st = os.stat(path)
    except OSError:
        return
    if st.st_uid == os.getuid():
        return
    for name in shm_names:
        path = SHM_DIR / name
        try:
            os.chown(path, -1, st.st_gid)
            os.chmod(path, 0o660)
        except OSError as exc:
            log.warning("cannot give %s to kvtierd's group %d (%s): the daemon will refuse it; add this user "
                        "to that group", path, st.st_gid, exc.strerror)
