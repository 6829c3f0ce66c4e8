"""The daemon's half of the "kv" data plane: mapping the KV tensors an engine registered.

Contract
========

An engine registers its KV tensors once (``register_kv``) with descriptions
made by ``kvtier.client.kv_share``; the format, and the validation both sides
run, is ``kvtier.client.kv_description``. This module opens what a validated
description names, in the daemon's process:

- ``import_kv(desc) -> (tensors, block_dims, closer)``: a whole layout, ready
  for ``kvtier.blocks.layout.BlockLayout(tensors, block_dims)``;
- ``import_tensor(desc) -> (tensor, closer)``: one ``export_tensor``
  description (what ``register_kv`` carries per tensor; kvtierd's
  ``HandlerContext.kv_import``, wired in ``daemon/__main__.py``).

Both validate first (nothing is mapped for a description that fails), then
map: a ``/dev/shm`` file through ``ShmArena.attach`` (which checks the name,
refuses symlinks, requires the exact declared size and refuses a sparse
file), or a CUDA IPC handle
through ``torch.UntypedStorage._new_shared_cuda`` on the GPU whose UUID the
engine named, after which the declared storage must lie inside the
allocation the driver reports. Anything malformed, out of bounds or
unmappable raises ``KvShareError`` (a ``ValueError``); a shm file this
process may not open (its mode or group) raises ``KvShareAccessError``, which
kvtierd answers with ACCESS_DENIED; a sparse one (pages not allocated, see
``kvtier.client.shm_arena``) raises ``KvShareSparseError``, answered with
SPARSE_FILE. Nothing stays mapped on failure.

The closer (``KvImport``) is the daemon's hold on the memory: calling it ends
this module's references; the memory is released once the caller has also
dropped the tensors and every layout built on them. On CUDA, dropping the
storages releases their IPC references in the engine.
``KvImport.shm_files`` are the mapped ``/dev/shm`` files, whose
``check_intact()`` the daemon calls around copies (``daemon/handling/session_memory.py``).

Imports no torch at module load (``daemon/handling/session_memory.py`` imports this module
for ``KvShareAccessError``); torch is imported where tensors are made.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.client.kv_description import (
    SUPPORTED_DTYPES,
    KvShareError,
    validate_kv_description,
    validate_tensor_description,
)
from kvtier.client.kv_share import cuda_device_uuid, libcuda
from kvtier.client.shm_arena import ShmAccessError, ShmArena, ShmArenaError, ShmSparseError

if TYPE_CHECKING:
    import torch

__all__ = ["KvImport", "KvShareAccessError", "KvShareError", "KvShareSparseError", "import_kv", "import_tensor"]


class KvShareAccessError(KvShareError):
    """The importing process may not open a tensor's shared-memory file (its mode or group)."""


class KvShareSparseError(KvShareError):
    """A tensor's shared-memory file has pages not allocated: refused, a copy into a hole could SIGBUS the daemon."""


class KvImport:
    """The daemon's hold on imported KV memory. Call it (or ``close()``) when the registration ends.

    Closing drops this object's references; the memory is released once the
    caller has dropped the tensors and every layout built on them too.
    """

    def __init__(self, transport: str, keepalive: list[object], nbytes: int) -> None:
        self.transport = transport
        self.nbytes = nbytes
        # The shared-memory files mapped (one descriptor each while open):
        # (inode, owner uid) per file, for the daemon's ownership checks and caps.
        self.files: list[tuple[tuple[int, int], int]] = [
            (obj.inode, obj.file_uid) for obj in keepalive
            if isinstance(obj, ShmArena) and obj.inode is not None and obj.file_uid is not None
        ]
        self._keepalive: list[object] = keepalive
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for obj in self._keepalive:
            if isinstance(obj, ShmArena):
                obj.close()
        self._keepalive.clear()

    @property
    def shm_files(self) -> list[ShmArena]:
        """The ``/dev/shm`` files mapped, for ``ShmArena.check_intact`` before a copy (none for CUDA, none once closed)."""
        return [obj for obj in self._keepalive if isinstance(obj, ShmArena)]

    def __call__(self) -> None:
        self.close()


def import_kv(desc: object) -> tuple[list[torch.Tensor], list[int], KvImport]:
    """Map a layout description's memory and rebuild the engine's tensors.

    Returns ``(tensors, block_dims, closer)`` ready for
    ``BlockLayout(tensors, block_dims)``. Raises ``KvShareError`` for anything
    malformed, out of bounds or unmappable; nothing stays mapped on failure.
    """
    d = validate_kv_description(desc)
    tensors, closer = _import_entries(d["transport"], d["tensors"])
    return tensors, [e["block_dim"] for e in d["tensors"]], closer


def import_tensor(desc: object) -> tuple[torch.Tensor, KvImport]:
    """Map one ``export_tensor`` description: ``(tensor, closer)``. Raises ``KvShareError``."""
    d = validate_tensor_description(desc)
    tensors, closer = _import_entries(d["transport"], [d])
    return tensors[0], closer


def _import_entries(transport: str, entries: Sequence[Mapping[str, Any]]) -> tuple[list[torch.Tensor], KvImport]:
    if transport == "shm":
        return _import_shm(entries)
    return _import_cuda(entries)


def _torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a validated dtype name; refused when this torch lacks it (an older one, say)."""
    import torch

    dtype = getattr(torch, name, None)
    if name not in SUPPORTED_DTYPES or not isinstance(dtype, torch.dtype):
        raise KvShareError(f"dtype {name!r} is not supported here; choose one of {', '.join(SUPPORTED_DTYPES)}")
    return dtype


def _import_shm(entries: Sequence[Mapping[str, Any]]) -> tuple[list[torch.Tensor], KvImport]:
    import torch

    arenas: dict[str, ShmArena] = {}
    tensors: list[torch.Tensor] = []
    try:
        for entry in entries:
            handle = entry["handle"]
            name, size_bytes = handle["name"], handle["size_bytes"]
            arena = arenas.get(name)
            if arena is None:
                try:
                    # attach() checks the name, refuses symlinks and requires the exact size.
                    arena = arenas[name] = ShmArena.attach(name, 1, size_bytes)
                except ShmAccessError as exc:
                    raise KvShareAccessError(str(exc)) from None
                except ShmSparseError as exc:
                    raise KvShareSparseError(str(exc)) from None
                except ShmArenaError as exc:
                    raise KvShareError(str(exc)) from None
            elif arena.size_bytes != size_bytes:
                raise KvShareError(f"shm file {name} is described with two sizes")
            dtype = _torch_dtype(entry["dtype"])
            itemsize = SUPPORTED_DTYPES[entry["dtype"]]
            flat = torch.frombuffer(arena.buffer, dtype=dtype, count=size_bytes // itemsize)
            tensors.append(torch.as_strided(flat, entry["shape"], entry["stride"], entry["storage_offset"]))
    except BaseException:
        tensors.clear()
        for arena in arenas.values():
            arena.close()
        raise
    nbytes = sum(a.size_bytes for a in arenas.values())
    return tensors, KvImport("shm", list(arenas.values()), nbytes)


def _local_cuda_device(handle: Mapping[str, Any]) -> int:
    """The daemon's index of the engine's GPU: matched by UUID, since CUDA_VISIBLE_DEVICES may differ."""
    import torch

    if not torch.cuda.is_available():
        raise KvShareError("the engine registered CUDA tensors, but this process has no CUDA device")
    uuid = handle.get("device_uuid")
    if uuid is None:
        index = int(handle["device"])
        if index >= torch.cuda.device_count():
            raise KvShareError(f"engine GPU {index} is not visible here")
        return index
    for index in range(torch.cuda.device_count()):
        if cuda_device_uuid(index) == uuid:
            return index
    raise KvShareError(f"the engine's GPU {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")


def _import_cuda(entries: Sequence[Mapping[str, Any]]) -> tuple[list[torch.Tensor], KvImport]:
    import torch

    storages: dict[tuple[bytes, int], tuple[Mapping[str, Any], torch.UntypedStorage]] = {}
    tensors: list[torch.Tensor] = []
    device = _local_cuda_device(entries[0]["handle"])
    # _new_shared_cuda does not initialise CUDA itself (reductions.py calls _lazy_init too).
    torch.cuda.init()
    try:
        for i, entry in enumerate(entries):
            h = entry["handle"]
            key = (h["ipc_handle"], h["storage_offset_bytes"])
            if key in storages:
                opened, storage = storages[key]
                if opened != h:
                    raise KvShareError(f"tensors[{i}] names an opened storage with different details")
            else:
                try:
                    with torch.cuda.device(device):
                        storage = torch.UntypedStorage._new_shared_cuda(
                            device,
                            h["ipc_handle"],
                            h["storage_size_bytes"],
                            h["storage_offset_bytes"],
                            h["ref_counter_handle"],
                            h["ref_counter_offset"],
                            h["event_handle"],
                            h["event_sync_required"],
                        )
                except RuntimeError as exc:
                    raise KvShareError(f"cannot open the engine's CUDA memory (tensors[{i}]): {exc}") from exc
                storages[key] = (h, storage)
                with torch.cuda.device(device):
                    _check_inside_allocation(storage, h, f"tensors[{i}]")
            t = torch.empty(0, dtype=_torch_dtype(entry["dtype"]), device=f"cuda:{device}")
            t.set_(storage, entry["storage_offset"], entry["shape"], entry["stride"])
            tensors.append(t)
    except BaseException:
        # Dropping the storages releases their IPC references in the engine.
        tensors.clear()
        storages.clear()
        raise
    nbytes = sum(int(h["storage_size_bytes"]) for h, _ in storages.values())
    keepalive: list[object] = [s for _, s in storages.values()]
    return tensors, KvImport("cuda_ipc", keepalive, nbytes)


def _address_range(ptr: int) -> tuple[int, int] | None:
    """(base, size) of the device allocation containing ``ptr``; None when the driver cannot say."""
    lib = libcuda()
    fn = getattr(lib, "cuMemGetAddressRange_v2", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return int(base.value), int(size.value)


def _check_inside_allocation(storage: torch.UntypedStorage, handle: Mapping[str, Any], what: str) -> None:
    # The engine states storage_size_bytes; a lie would let the daemon touch
    # memory past the allocation and fault. The driver knows the real extent.
    ptr = storage.data_ptr()
    extent = _address_range(ptr)
    if extent is None:
        return
    base, size = extent
    if ptr + int(handle["storage_size_bytes"]) > base + size:
        raise KvShareError(
            f"{what}: the described storage ({handle['storage_size_bytes']} bytes) runs past the end of the "
            f"shared CUDA allocation ({base + size - ptr} bytes available)"
        )
