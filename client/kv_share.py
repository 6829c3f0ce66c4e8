"""Sharing an engine's KV-cache tensors with the daemon: the engine's half of the "kv" data plane.

Contract
========

The engine registers its KV tensors once (``Client.register_kv``); from then
on the daemon copies blocks straight between the engine's slots and its
tiers (docs/protocol.md, "Data planes at a glance"). This module is the
engine's side of that registration:

- ``allocate_shared_kv(shape, dtype, block_dim) -> (tensor, shm handle)``
  (CPU-only machines): a zeroed KV tensor that lives in ``/dev/shm``;
- ``share_kv_in_place(tensors) -> names`` (CPU-only machines): move KV
  tensors an engine already allocated into ``/dev/shm``, every view
  following;
- ``export_kv(tensors, block_dims) -> description`` for a whole layout, or
  ``export_tensor(tensor) -> description`` for one tensor (the wire form of
  ``register_kv``: one ``{desc, block_dim}`` per tensor);
- ``unlink_shared_kv(tensor_or_handle)``: remove a shared KV file's name now.

Shared files are fully allocated when made: ``allocate_shared_kv`` reserves
every page (``posix_fallocate``) and ``share_kv_in_place`` refuses a storage
larger than ``/dev/shm`` has free (torch then writes every page), each with a
``KvShareError`` that names the bytes asked and free and how to make room. A
full ``/dev/shm`` thus fails at allocation, not with SIGBUS in the engine
later, and the daemon, which refuses sparse files, accepts what is made here.

Each raises ``KvShareError`` (a ``ValueError``) for a tensor it cannot share,
and ``export_*`` return descriptions already validated. The description's
format and validation live in ``kvtier.client.kv_description`` (shared with
the daemon); the daemon's half, which maps a description, is
``kvtier.daemon.shared_memory.kv_import``. ``cuda_device_uuid`` and ``libcuda`` are the
GPU facts both halves must read alike (the UUID a handle carries; the CUDA
driver library).

CUDA IPC shares only memory from ``cudaMalloc``. PyTorch's expandable-segments
allocator (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) and any other
VMM (``cuMemCreate``) memory cannot be shared this way: ``export_kv`` refuses
it with a ``KvShareError`` that says to allocate the KV cache with
``expandable_segments:False``.

Lifetimes. A shm KV file's name is removed when the engine's last view of the
tensor is garbage collected (or at interpreter exit, or by
``unlink_shared_kv``); the daemon's mapping keeps the memory alive until the
daemon drops its tensors and calls the closer. An engine killed with SIGKILL
leaves its file in ``/dev/shm``. On CUDA the engine must keep its KV tensors
alive while registered; PyTorch's IPC reference counting keeps the memory from
being reused until the daemon has released it. Ordering between the engine's
writes and the daemon's copies is the protocol's job (the engine synchronises
before it asks the daemon to copy), not this module's.

Imports no torch at module load (the client imports this module); torch is
imported inside the functions that need it.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import math
import os
import secrets
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.client.kv_description import (
    CUDA_IPC_HANDLE_BYTES,
    DESCRIPTION_VERSION,
    EXPANDABLE_HINT,
    MAX_DIMS,
    SUPPORTED_DTYPES,
    KvShareError,
    handle_is_expandable_segment,
    is_int,
    validate_kv_description,
    validate_shm_handle,
    validate_tensor_description,
)
from kvtier.client.shm_arena import SHM_DIR, ShmArena, ShmArenaError, no_room_message, shm_free_bytes
from kvtier.client.shm_orphans import remove_orphaned_arenas

if TYPE_CHECKING:
    import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "KvShareError",
    "allocate_shared_kv",
    "cuda_device_uuid",
    "export_kv",
    "export_tensor",
    "libcuda",
    "share_kv_in_place",
    "unlink_shared_kv",
]

DEFAULT_NAME_PREFIX = "kvtier-kv"
# torch >= 2.5 prefixes a CUDA IPC handle with a version byte and a type byte;
# "c" is cudaMalloc memory, the only kind kvtier shares.
_SHAREABLE_CUDA_MALLOC = ord("c")


# --------------------------------------------------------------------------------------------
# CPU-only transport: KV tensors in /dev/shm

@dataclass(frozen=True)
class _SharedFile:
    name: str
    size_bytes: int
    data_offset_bytes: int = 0  # where the storage's first byte lies in the file
    # share_kv_in_place: torch's own name of the file. Such an entry is keyed by
    # an address that a later storage may reuse once this one is freed, so it
    # holds only while the storage at that address is still that file.
    torch_name: str | None = None


# base address of a shared KV storage -> its file. Entries leave when the
# storage dies (weakref.finalize on the buffer object torch keeps alive).
_SHARED: dict[int, _SharedFile] = {}
_SHARED_LOCK = threading.Lock()


def _dtype(name_or_dtype: object) -> torch.dtype:
    import torch

    if isinstance(name_or_dtype, torch.dtype):
        name = str(name_or_dtype).removeprefix("torch.")
    elif isinstance(name_or_dtype, str):
        name = name_or_dtype.removeprefix("torch.")
    else:
        raise KvShareError(f"dtype must be a torch.dtype or its name, got {name_or_dtype!r}")
    dtype = getattr(torch, name, None)
    if name not in SUPPORTED_DTYPES or not isinstance(dtype, torch.dtype):
        raise KvShareError(f"dtype {name!r} is not supported here; choose one of {', '.join(SUPPORTED_DTYPES)}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        raise KvShareError(f"dtype {name} cannot be shared; choose one of {', '.join(SUPPORTED_DTYPES)}")
    return name


def _forget_shared(base_ptr: int, name: str) -> None:
    with _SHARED_LOCK:
        if (entry := _SHARED.get(base_ptr)) is not None and entry.name == name:
            del _SHARED[base_ptr]
    ShmArena.unlink_name(name)


def allocate_shared_kv(
    shape: Sequence[int],
    dtype: torch.dtype | str,
    block_dim: int,
    name_prefix: str = DEFAULT_NAME_PREFIX,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """A zeroed contiguous CPU tensor backed by a new ``/dev/shm`` file, and its shm handle.

    Use it as the engine's KV cache on a machine without CUDA; then
    ``export_kv`` can describe it (and any view of it) to the daemon. The
    file's name goes away when the last view of the tensor does.
    """
    import torch

    sizes = [int(s) for s in shape]
    if not sizes or any(s < 1 for s in sizes) or len(sizes) > MAX_DIMS:
        raise KvShareError(f"shape must have 1..{MAX_DIMS} positive sizes, got {list(shape)}")
    if not is_int(block_dim) or not -len(sizes) <= block_dim < len(sizes):
        raise KvShareError(f"block_dim {block_dim!r} out of range for a {len(sizes)}-d tensor")
    torch_dtype = _dtype(dtype)
    itemsize = SUPPORTED_DTYPES[_dtype_name(torch_dtype)]
    numel = math.prod(sizes)
    try:
        # create() reserves every page (posix_fallocate): a /dev/shm too small
        # fails here, naming the sizes, instead of SIGBUS in the engine later.
        remove_orphaned_arenas()  # a crashed predecessor's, which a daemon of another user could not remove
        arena = ShmArena.create(1, numel * itemsize, name_prefix=name_prefix)
    except ShmArenaError as exc:
        raise KvShareError(f"cannot allocate a shared KV tensor of shape {sizes} ({_dtype_name(torch_dtype)}): "
                           f"{exc}") from None
    buffer = arena.buffer
    # frombuffer wraps the mapping without copying, and keeps ``buffer``
    # (hence the mapping) alive for as long as any view of the tensor lives.
    flat = torch.frombuffer(buffer, dtype=torch_dtype, count=numel)
    tensor = flat.view(sizes)
    base_ptr = flat.untyped_storage().data_ptr()
    with _SHARED_LOCK:
        _SHARED[base_ptr] = _SharedFile(arena.name, arena.size_bytes)
    weakref.finalize(buffer, _forget_shared, base_ptr, arena.name)
    # The arena object is not needed: the buffer view holds the mapping.
    arena.close()
    return tensor, {"kind": "shm", "name": arena.name, "size_bytes": numel * itemsize}


def share_kv_in_place(tensors: Sequence[torch.Tensor], name_prefix: str = DEFAULT_NAME_PREFIX) -> list[str]:
    """Move CPU tensors that an engine allocated into ``/dev/shm``, in place; returns the new file names.

    For engines whose KV cache is private memory (vLLM's CPU backend): torch
    copies each storage into a shared-memory file and swaps the storage's
    data pointer, so every view of it (the engine's layers hold their own)
    sees the shared copy from then on. Call it before the engine writes KV
    it still needs, and while no other thread uses the tensors. Then
    ``export_kv`` describes the tensors as if ``allocate_shared_kv`` had
    made them.

    torch names the file ``torch_<pid>_...`` and removes it when the engine
    exits; a second name under ``name_prefix`` (a hard link to the same
    memory) is what the daemon attaches, since it attaches ``kvtier-`` names
    only. That name is removed at interpreter exit or by
    ``unlink_shared_kv``; an engine killed with SIGKILL leaves it behind,
    as with ``allocate_shared_kv``.
    """
    names: list[str] = []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.device.type != "cpu":
            raise KvShareError(f"share_kv_in_place takes CPU tensors, got one on {storage.device}")
        if _entry_of(storage) is not None:
            continue  # already shared (another view of the same storage)
        # torch maps a sparse file and copies into it: with /dev/shm full that
        # copy is SIGBUS in the engine. Only a pre-check is possible here
        # (torch allocates the file); it catches the common case, a
        # /dev/shm smaller than the KV cache (docker's 64 MiB default).
        free_bytes = shm_free_bytes()
        if free_bytes is not None and free_bytes < storage.nbytes():
            raise KvShareError(no_room_message("a KV tensor's storage moved in place", storage.nbytes(),
                                               "not enough free space"))
        try:
            _manager, torch_name, data_bytes = storage._share_filename_cpu_()
            name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(6)}"
            os.link(SHM_DIR / torch_name.decode().lstrip("/"), SHM_DIR / name)
            file_bytes = os.stat(SHM_DIR / name).st_size
        except (OSError, RuntimeError) as exc:
            raise KvShareError(f"cannot move a KV tensor into shared memory: {exc}") from None
        # torch's refcounted files keep a header before the data: the data is
        # the file's last data_bytes bytes.
        entry = _SharedFile(name, file_bytes, file_bytes - int(data_bytes), torch_name.decode())
        if entry.data_offset_bytes < 0 or entry.data_offset_bytes % 64:
            ShmArena.unlink_name(name)
            raise KvShareError(f"unexpected shared file layout: {file_bytes} bytes for {data_bytes} bytes of data")
        with _SHARED_LOCK:
            _SHARED[storage.data_ptr()] = entry  # the storage's new (shared) address
        atexit.register(ShmArena.unlink_name, name)
        names.append(name)
    return names


def _torch_file_of(storage: torch.UntypedStorage) -> str | None:
    """torch's name of the shared-memory file behind a CPU storage; None for private memory (never shares it)."""
    if not storage.is_shared():
        return None
    try:
        return storage._share_filename_cpu_()[1].decode()  # already shared: returns its name, copies nothing
    except RuntimeError:
        return None  # shared some other way (file descriptors)


def _entry_of(storage: torch.UntypedStorage) -> _SharedFile | None:
    """The shm file that holds ``storage``, if kv_share put it there."""
    with _SHARED_LOCK:
        entry = _SHARED.get(storage.data_ptr())
    if entry is None or entry.torch_name is None:
        return entry  # allocate_shared_kv's entries leave with their memory (weakref.finalize)
    return entry if _torch_file_of(storage) == entry.torch_name else None


def unlink_shared_kv(tensor_or_handle: torch.Tensor | Mapping[str, Any]) -> None:
    """Remove the ``/dev/shm`` name of a shared KV tensor now (mappings stay valid). Idempotent."""
    if isinstance(tensor_or_handle, Mapping):
        name = validate_shm_handle(dict(tensor_or_handle), "handle")["name"]
    else:
        entry = _SHARED.get(tensor_or_handle.untyped_storage().data_ptr())
        if entry is None:
            raise KvShareError("tensor was not made by allocate_shared_kv")
        name = entry.name
    ShmArena.unlink_name(name)


def _export_shm(t: torch.Tensor) -> tuple[dict[str, Any], int]:
    storage = t.untyped_storage()
    entry = _entry_of(storage)
    if entry is None:
        raise KvShareError(
            "a CPU KV tensor must live in shared memory: allocate it with kvtier.client.kv_share.allocate_shared_kv "
            "(or take a view of such a tensor), or move it there with share_kv_in_place"
        )
    offset_bytes = t.data_ptr() - storage.data_ptr() + entry.data_offset_bytes
    if offset_bytes % t.element_size():
        raise KvShareError(f"tensor starts {offset_bytes} bytes into its storage, not a multiple of its element size")
    return {"kind": "shm", "name": entry.name, "size_bytes": entry.size_bytes}, offset_bytes // t.element_size()


# --------------------------------------------------------------------------------------------
# CUDA transport


@functools.cache
def libcuda() -> ctypes.CDLL | None:
    """The CUDA driver library (loaded once), or None where there is none; the daemon's bounds check uses it too."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10


def _legacy_ipc_capable(ptr: int) -> bool | None:
    """Whether cudaIpcGetMemHandle can share ``ptr`` (False for VMM memory); None when unknown."""
    lib = libcuda()
    if lib is None or not hasattr(lib, "cuPointerGetAttribute"):
        return None
    fn = lib.cuPointerGetAttribute
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    fn.restype = ctypes.c_int
    value = ctypes.c_int(0)
    if fn(ctypes.byref(value), _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_uint64(ptr)) != 0:
        return None
    return bool(value.value)


def cuda_device_uuid(index: int) -> str | None:
    """The UUID of this process's GPU ``index`` as handles carry it (``device_uuid``); None when torch has none.

    The daemon matches the engine's GPU by this string (``kv_import``), since
    the two processes may number GPUs differently (CUDA_VISIBLE_DEVICES).
    """
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else None


def _share_cuda_storage(t: torch.Tensor) -> dict[str, Any]:
    storage = t.untyped_storage()
    capable = _legacy_ipc_capable(storage.data_ptr())
    if capable is False:
        raise KvShareError(EXPANDABLE_HINT)
    try:
        (
            device,
            ipc_handle,
            storage_size_bytes,
            storage_offset_bytes,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        ) = storage._share_cuda_()
    except RuntimeError as exc:
        if "expandable" in str(exc).lower():
            raise KvShareError(EXPANDABLE_HINT) from exc
        raise KvShareError(f"CUDA IPC cannot share this KV tensor: {exc}") from exc
    if ipc_handle is None:
        raise KvShareError("CUDA IPC cannot share an empty storage")
    ipc_handle = bytes(ipc_handle)
    if handle_is_expandable_segment(ipc_handle):
        raise KvShareError(EXPANDABLE_HINT)
    if len(ipc_handle) > CUDA_IPC_HANDLE_BYTES and ipc_handle[1] != _SHAREABLE_CUDA_MALLOC:
        raise KvShareError(f"unknown CUDA shareable handle type {ipc_handle[1:2]!r}; kvtier understands cudaMalloc handles")
    return {
        "kind": "cuda_ipc",
        "device": int(device),
        "device_uuid": cuda_device_uuid(int(device)),
        "ipc_handle": ipc_handle,
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle) if event_handle is not None else bytes(CUDA_IPC_HANDLE_BYTES),
        "event_sync_required": bool(event_sync_required),
    }

# --------------------------------------------------------------------------------------------
# Export


def _transport_of(tensors: Sequence[torch.Tensor]) -> str:
    import torch

    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise KvShareError(f"tensors[{i}] is not a torch.Tensor")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise KvShareError(f"all KV tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise KvShareError(f"cannot share tensors on {device}")
    return "shm" if device.type == "cpu" else "cuda_ipc"


def _entry(t: torch.Tensor, transport: str, shared_storages: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One tensor's dtype, geometry and handle. ``shared_storages`` dedupes CUDA storages within one export."""
    if any(s < 0 for s in t.stride()):
        raise KvShareError("tensors with negative strides cannot be shared")
    if transport == "shm":
        handle, offset = _export_shm(t)
    else:
        key = t.untyped_storage().data_ptr()
        if key not in shared_storages:
            # One _share_cuda_ per storage per export: it adds one reference,
            # which the importer's single open of that storage releases.
            shared_storages[key] = _share_cuda_storage(t)
        handle, offset = shared_storages[key], t.storage_offset()
    return {
        "dtype": _dtype_name(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "storage_offset": int(offset),
        "handle": handle,
    }


def export_kv(tensors: Sequence[torch.Tensor], block_dims: Sequence[int]) -> dict[str, Any]:
    """Describe the engine's KV tensors as one layout (engine side).

    CPU tensors must come from ``allocate_shared_kv`` (views of them are
    fine); CUDA tensors must come from cudaMalloc memory (expandable segments
    off). All tensors are on one device and agree on the number of blocks.
    """
    if not tensors or len(tensors) != len(block_dims):
        raise KvShareError(f"need one block_dim per tensor, got {len(tensors)} tensors and {len(block_dims)} block_dims")
    transport = _transport_of(tensors)
    entries: list[dict[str, Any]] = []
    shared_storages: dict[int, dict[str, Any]] = {}
    num_blocks: int | None = None
    for i, (t, block_dim) in enumerate(zip(tensors, block_dims)):
        if not is_int(block_dim) or not -t.dim() <= block_dim < t.dim():
            raise KvShareError(f"block_dims[{i}] = {block_dim!r} out of range for a {t.dim()}-d tensor")
        block_dim %= t.dim()
        if num_blocks is None:
            num_blocks = t.shape[block_dim]
        elif t.shape[block_dim] != num_blocks:
            raise KvShareError(f"tensors[{i}] has {t.shape[block_dim]} blocks, tensors[0] has {num_blocks}")
        entries.append({**_entry(t, transport, shared_storages), "block_dim": int(block_dim)})
    desc = {"version": DESCRIPTION_VERSION, "transport": transport, "num_blocks": int(num_blocks or 0), "tensors": entries}
    return validate_kv_description(desc)


def export_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """Describe one KV tensor (the ``desc`` of one ``register_kv`` entry; block_dim travels beside it).

    Same rules as ``export_kv``. Each call shares the tensor's storage anew;
    the daemon opens each description once (``kvtier.daemon.shared_memory.kv_import.import_tensor``).
    """
    transport = _transport_of([tensor])
    desc = {"version": DESCRIPTION_VERSION, "transport": transport, **_entry(tensor, transport, {})}
    return validate_tensor_description(desc)
