"""Sharing an engine's KV-cache tensors with the daemon: the "kv" data plane (docs/protocol.md, "Data planes at a glance").

Contract
========

The engine registers its KV tensors once (``register_kv``); from then on the
daemon copies blocks straight between the engine's slots and its tiers. This
module is both halves of that registration:

- engine side: ``allocate_shared_kv`` (CPU-only machines: KV tensors that live
  in ``/dev/shm``), ``share_kv_in_place`` (CPU-only machines: move KV tensors
  that an engine already allocated into ``/dev/shm``, every view following), and ``export_kv(tensors, block_dims) -> description`` for
  a whole layout or ``export_tensor(tensor) -> description`` for one tensor
  (the wire form of ``register_kv``: one ``{desc, block_dim}`` per tensor);
- daemon side: ``import_kv(desc) -> (tensors, block_dims, closer)`` or
  ``import_tensor(desc) -> (tensor, closer)``, after the same validation
  (``validate_kv_description`` / ``validate_tensor_description``); the daemon
  then builds ``kvtier.tiers.layout.BlockLayout(tensors, block_dims)``.

A description is plain data (str, int, bool, bytes, lists, dicts), so it
travels in msgpack as is. A layout::

    {"version": 1,
     "transport": "shm" | "cuda_ipc",
     "num_blocks": N,
     "tensors": [{"dtype": "float16",           # a name in SUPPORTED_DTYPES
                  "shape": [...], "stride": [...],   # strides in elements, >= 0
                  "storage_offset": int,        # elements from the start of the handle's memory
                  "block_dim": int,             # 0 <= block_dim < len(shape); shape[block_dim] == N
                  "handle": {...}}, ...]}

One tensor (``export_tensor``) is one entry without ``block_dim``, with the
header beside it: ``{"version": 1, "transport": ..., "dtype": ..., "shape":
..., "stride": ..., "storage_offset": ..., "handle": {...}}``; block counts
are then checked by ``BlockLayout``.

``handle`` by transport:

- ``{"kind": "shm", "name": "kvtier-kv-...", "size_bytes": int}``: a
  ``/dev/shm`` file; offsets count from the file's first byte.
- ``{"kind": "cuda_ipc", "device": int, "device_uuid": str | None,
  "ipc_handle": bytes, "storage_size_bytes": int, "storage_offset_bytes": int,
  "ref_counter_handle": bytes, "ref_counter_offset": int, "event_handle":
  bytes, "event_sync_required": bool}``: what ``torch.UntypedStorage.
  _share_cuda_()`` returns for the tensor's storage (see
  ``torch/multiprocessing/reductions.py``); offsets count from the start of
  that storage. Tensors that share a storage carry equal handles and are
  opened once.

Validation happens entirely before anything is mapped: unknown keys, unknown
dtypes, block_dim out of range, tensors disagreeing on ``num_blocks``, a
block stride of 0, negative strides or offsets, any view whose last element
lies beyond the shared memory it names, malformed handles, and too many
tensors or dimensions all raise ``KvShareError`` (a ``ValueError``). The daemon also checks that
a shm file has exactly the declared size and, on CUDA, that the declared
storage lies inside the allocation the IPC handle opened.

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
import os
import secrets
import math
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.client.shm_arena import SHM_DIR, ShmAccessError, ShmArena, ShmArenaError, validate_arena_name

if TYPE_CHECKING:
    import torch

__all__ = [
    "DESCRIPTION_VERSION",
    "SUPPORTED_DTYPES",
    "KvImport",
    "KvShareError",
    "allocate_shared_kv",
    "share_kv_in_place",
    "export_kv",
    "export_tensor",
    "import_kv",
    "import_tensor",
    "unlink_shared_kv",
    "validate_kv_description",
    "validate_tensor_description",
]

DESCRIPTION_VERSION = 1
DEFAULT_NAME_PREFIX = "kvtier-kv"

# Element sizes by dtype name; names are torch's attribute names. Validation
# needs only these numbers, so the daemon can refuse a description before it
# imports torch or maps anything.
SUPPORTED_DTYPES: Mapping[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}

MAX_TENSORS = 4096
MAX_DIMS = 8
# Far above any real KV cache, low enough that shape arithmetic stays exact.
MAX_EXTENT = 2**62

_TOP_KEYS = {"version", "transport", "num_blocks", "tensors"}
_TENSOR_KEYS = {"dtype", "shape", "stride", "storage_offset", "block_dim", "handle"}
_SINGLE_KEYS = {"version", "transport", "dtype", "shape", "stride", "storage_offset", "handle"}
_SHM_KEYS = {"kind", "name", "size_bytes"}
_CUDA_KEYS = {
    "kind",
    "device",
    "device_uuid",
    "ipc_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
}
# torch names its IPC reference-counter files "/torch_<pid>_<random>_<n>"
# (at::NewProcessWideShmHandle); the daemon writes into that file when it
# releases a storage, so nothing else may be named here.
_REF_COUNTER_RE = re.compile(rb"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")
# torch::CUDA_IPC_REF_COUNTER_FILE_SIZE: counters per reference-counter file.
_REF_COUNTER_SLOTS = 10000
_CUDA_IPC_HANDLE_BYTES = 64
# torch >= 2.5 prefixes the handle with a version byte and a type byte.
_SHAREABLE_CUDA_MALLOC = ord("c")
_SHAREABLE_EXPANDABLE_SEGMENT = ord("e")

_EXPANDABLE_HINT = (
    "CUDA IPC can only share memory from cudaMalloc. This KV tensor lives in memory from PyTorch's "
    "expandable-segments allocator (or another cuMemCreate/VMM allocator, or the cudaMallocAsync "
    "backend), which it cannot share. "
    "Allocate the KV cache with expandable segments off: start the engine with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or call "
    "torch.cuda.memory._set_allocator_settings('expandable_segments:False') before allocating the KV "
    "cache (and back to True afterwards if you want it for everything else)."
)


class KvShareError(ValueError):
    """A KV tensor that cannot be shared, or a description that must not be imported."""


class KvShareAccessError(KvShareError):
    """The importing process may not open a tensor's shared-memory file (its mode or group)."""


# --------------------------------------------------------------------------------------------
# Validation (no torch needed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: object, what: str, *, minimum: int = 0, maximum: int = MAX_EXTENT) -> int:
    if not _is_int(value):
        raise KvShareError(f"{what} must be an integer, got {value!r}")
    assert isinstance(value, int)
    if not minimum <= value <= maximum:
        raise KvShareError(f"{what} must be in [{minimum}, {maximum}], got {value}")
    return value


def _exact_keys(obj: object, keys: set[str], what: str, optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise KvShareError(f"{what} must be a map, got {type(obj).__name__}")
    unknown = set(obj) - keys
    missing = keys - optional - set(obj)
    if unknown:
        raise KvShareError(f"{what} has unknown keys {sorted(map(str, unknown))}")
    if missing:
        raise KvShareError(f"{what} is missing {sorted(missing)}")
    return obj


def _bytes(value: object, what: str, *, min_len: int, max_len: int) -> bytes:
    if not isinstance(value, bytes):
        raise KvShareError(f"{what} must be bytes, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise KvShareError(f"{what} must be {min_len}..{max_len} bytes, got {len(value)}")
    return value


def _check_shm_handle(handle: object, what: str) -> dict[str, Any]:
    h = _exact_keys(handle, _SHM_KEYS, what)
    try:
        validate_arena_name(h["name"])
    except ShmArenaError as exc:
        raise KvShareError(f"{what}.name: {exc}") from None
    _int(h["size_bytes"], f"{what}.size_bytes", minimum=1)
    return h


def _check_cuda_handle(handle: object, what: str) -> dict[str, Any]:
    h = _exact_keys(handle, _CUDA_KEYS, what, optional=frozenset({"device_uuid"}))
    _int(h["device"], f"{what}.device", maximum=1023)
    uuid = h.get("device_uuid")
    if uuid is not None and not (isinstance(uuid, str) and 0 < len(uuid) <= 128):
        raise KvShareError(f"{what}.device_uuid must be a short string or nil")
    ipc = _bytes(h["ipc_handle"], f"{what}.ipc_handle", min_len=_CUDA_IPC_HANDLE_BYTES, max_len=512)
    if _handle_is_expandable_segment(ipc):
        raise KvShareError(f"{what}: {_EXPANDABLE_HINT}")
    _int(h["storage_size_bytes"], f"{what}.storage_size_bytes", minimum=1)
    _int(h["storage_offset_bytes"], f"{what}.storage_offset_bytes")
    counter = _bytes(h["ref_counter_handle"], f"{what}.ref_counter_handle", min_len=1, max_len=128)
    if not _REF_COUNTER_RE.fullmatch(counter):
        raise KvShareError(f"{what}.ref_counter_handle is not a torch IPC reference-counter name")
    _int(h["ref_counter_offset"], f"{what}.ref_counter_offset", maximum=_REF_COUNTER_SLOTS - 1)
    _bytes(h["event_handle"], f"{what}.event_handle", min_len=_CUDA_IPC_HANDLE_BYTES, max_len=_CUDA_IPC_HANDLE_BYTES)
    if not isinstance(h["event_sync_required"], bool):
        raise KvShareError(f"{what}.event_sync_required must be a bool")
    return h


def _handle_is_expandable_segment(ipc_handle: bytes) -> bool:
    # A bare 64-byte handle is the pre-2.5 cudaIpcMemHandle_t; longer ones
    # start with a version byte then the type byte.
    return len(ipc_handle) > _CUDA_IPC_HANDLE_BYTES and ipc_handle[1] == _SHAREABLE_EXPANDABLE_SEGMENT


def _storage_bytes(handle: Mapping[str, Any]) -> int:
    return int(handle["size_bytes"] if handle["kind"] == "shm" else handle["storage_size_bytes"])


def _check_header(d: Mapping[str, Any], what: str) -> str:
    if d["version"] != DESCRIPTION_VERSION:
        raise KvShareError(f"{what} version {d['version']!r} is not supported (this side speaks {DESCRIPTION_VERSION})")
    transport = d["transport"]
    if transport not in ("shm", "cuda_ipc"):
        raise KvShareError(f"unknown transport {transport!r}; expected 'shm' or 'cuda_ipc'")
    return str(transport)


def _check_entry(t: Mapping[str, Any], what: str, transport: str) -> tuple[list[int], list[int], tuple[int, str | None] | None]:
    """Checks one tensor's dtype, geometry, handle and bounds; returns (sizes, strides, cuda device)."""
    dtype = t["dtype"]
    if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
        raise KvShareError(f"{what}.dtype {dtype!r} is not one of {', '.join(SUPPORTED_DTYPES)}")
    itemsize = SUPPORTED_DTYPES[dtype]
    shape, stride = t["shape"], t["stride"]
    if not isinstance(shape, list) or not isinstance(stride, list):
        raise KvShareError(f"{what}.shape and .stride must be lists")
    if not 1 <= len(shape) <= MAX_DIMS:
        raise KvShareError(f"{what}.shape must have 1..{MAX_DIMS} dimensions, got {len(shape)}")
    if len(stride) != len(shape):
        raise KvShareError(f"{what}.stride has {len(stride)} entries for {len(shape)} dimensions")
    sizes = [_int(s, f"{what}.shape[{k}]", minimum=1) for k, s in enumerate(shape)]
    strides = [_int(s, f"{what}.stride[{k}]") for k, s in enumerate(stride)]
    offset = _int(t["storage_offset"], f"{what}.storage_offset")
    if math.prod(sizes) > MAX_EXTENT:
        raise KvShareError(f"{what} is implausibly large")
    handle = t["handle"]
    kind = handle.get("kind") if isinstance(handle, dict) else None
    if kind != transport:
        raise KvShareError(f"{what}.handle.kind {kind!r} does not match transport {transport!r}")
    device: tuple[int, str | None] | None = None
    if transport == "shm":
        _check_shm_handle(handle, f"{what}.handle")
    else:
        h = _check_cuda_handle(handle, f"{what}.handle")
        device = (h["device"], h.get("device_uuid"))
    # The highest element any index can reach must lie inside the memory the
    # handle names: no view may reach past it.
    last_element = offset + sum((n - 1) * s for n, s in zip(sizes, strides))
    end_bytes = (last_element + 1) * itemsize
    if end_bytes > _storage_bytes(handle):
        raise KvShareError(
            f"{what} reaches byte {end_bytes} but its shared memory is {_storage_bytes(handle)} bytes "
            f"(shape {sizes}, stride {strides}, storage_offset {offset}, {dtype})"
        )
    return sizes, strides, device


def validate_kv_description(desc: object) -> dict[str, Any]:
    """Check a layout description completely (see the module docstring); returns it, unchanged.

    Needs no torch and maps nothing, so the daemon can refuse a hostile
    description before it touches any memory.
    """
    d = _exact_keys(desc, _TOP_KEYS, "description")
    transport = _check_header(d, "description")
    num_blocks = _int(d["num_blocks"], "num_blocks", minimum=1)
    tensors = d["tensors"]
    if not isinstance(tensors, list) or not tensors:
        raise KvShareError("tensors must be a non-empty list")
    if len(tensors) > MAX_TENSORS:
        raise KvShareError(f"at most {MAX_TENSORS} tensors, got {len(tensors)}")
    devices: set[tuple[int, str | None]] = set()
    for i, entry in enumerate(tensors):
        what = f"tensors[{i}]"
        t = _exact_keys(entry, _TENSOR_KEYS, what)
        sizes, strides, device = _check_entry(t, what, transport)
        block_dim = _int(t["block_dim"], f"{what}.block_dim", maximum=len(sizes) - 1)
        if sizes[block_dim] != num_blocks:
            raise KvShareError(
                f"{what}.shape[{block_dim}] = {sizes[block_dim]} blocks, but num_blocks is {num_blocks}"
            )
        if num_blocks > 1 and strides[block_dim] == 0:
            raise KvShareError(f"{what}: a block stride of 0 would make every block the same memory")
        if device is not None:
            devices.add(device)
    if len(devices) > 1:
        raise KvShareError(f"all tensors must be on one GPU, got devices {sorted(devices, key=str)}")
    return d


def validate_tensor_description(desc: object) -> dict[str, Any]:
    """Check a one-tensor description (``export_tensor``'s); returns it, unchanged. No torch, no mapping."""
    d = _exact_keys(desc, _SINGLE_KEYS, "tensor description")
    transport = _check_header(d, "tensor description")
    _check_entry(d, "tensor", transport)
    return d


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
    if not _is_int(block_dim) or not -len(sizes) <= block_dim < len(sizes):
        raise KvShareError(f"block_dim {block_dim!r} out of range for a {len(sizes)}-d tensor")
    torch_dtype = _dtype(dtype)
    itemsize = SUPPORTED_DTYPES[_dtype_name(torch_dtype)]
    numel = math.prod(sizes)
    try:
        arena = ShmArena.create(1, numel * itemsize, name_prefix=name_prefix)
    except ShmArenaError as exc:
        raise KvShareError(str(exc)) from None
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
        name = _check_shm_handle(dict(tensor_or_handle), "handle")["name"]
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
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10


def _legacy_ipc_capable(ptr: int) -> bool | None:
    """Whether cudaIpcGetMemHandle can share ``ptr`` (False for VMM memory); None when unknown."""
    lib = _libcuda()
    if lib is None or not hasattr(lib, "cuPointerGetAttribute"):
        return None
    fn = lib.cuPointerGetAttribute
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    fn.restype = ctypes.c_int
    value = ctypes.c_int(0)
    if fn(ctypes.byref(value), _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_uint64(ptr)) != 0:
        return None
    return bool(value.value)


def _address_range(ptr: int) -> tuple[int, int] | None:
    """(base, size) of the device allocation containing ``ptr``; None when the driver cannot say."""
    lib = _libcuda()
    fn = getattr(lib, "cuMemGetAddressRange_v2", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return int(base.value), int(size.value)


def _device_uuid(index: int) -> str | None:
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else None


def _share_cuda_storage(t: torch.Tensor) -> dict[str, Any]:
    storage = t.untyped_storage()
    capable = _legacy_ipc_capable(storage.data_ptr())
    if capable is False:
        raise KvShareError(_EXPANDABLE_HINT)
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
            raise KvShareError(_EXPANDABLE_HINT) from exc
        raise KvShareError(f"CUDA IPC cannot share this KV tensor: {exc}") from exc
    if ipc_handle is None:
        raise KvShareError("CUDA IPC cannot share an empty storage")
    ipc_handle = bytes(ipc_handle)
    if _handle_is_expandable_segment(ipc_handle):
        raise KvShareError(_EXPANDABLE_HINT)
    if len(ipc_handle) > _CUDA_IPC_HANDLE_BYTES and ipc_handle[1] != _SHAREABLE_CUDA_MALLOC:
        raise KvShareError(f"unknown CUDA shareable handle type {ipc_handle[1:2]!r}; kvtier understands cudaMalloc handles")
    return {
        "kind": "cuda_ipc",
        "device": int(device),
        "device_uuid": _device_uuid(int(device)),
        "ipc_handle": ipc_handle,
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle) if event_handle is not None else bytes(_CUDA_IPC_HANDLE_BYTES),
        "event_sync_required": bool(event_sync_required),
    }


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
        if _device_uuid(index) == uuid:
            return index
    raise KvShareError(f"the engine's GPU {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")


# --------------------------------------------------------------------------------------------
# Export and import


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
        if not _is_int(block_dim) or not -t.dim() <= block_dim < t.dim():
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
    the daemon opens each description once (``import_tensor``).
    """
    transport = _transport_of([tensor])
    desc = {"version": DESCRIPTION_VERSION, "transport": transport, **_entry(tensor, transport, {})}
    return validate_tensor_description(desc)


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

    def __call__(self) -> None:
        self.close()


def import_kv(desc: object) -> tuple[list[torch.Tensor], list[int], KvImport]:
    """Map a layout description's memory and rebuild the engine's tensors (daemon side).

    Returns ``(tensors, block_dims, closer)`` ready for
    ``BlockLayout(tensors, block_dims)``. Raises ``KvShareError`` for anything
    malformed, out of bounds or unmappable; nothing stays mapped on failure.
    """
    d = validate_kv_description(desc)
    tensors, closer = _import_entries(d["transport"], d["tensors"])
    return tensors, [e["block_dim"] for e in d["tensors"]], closer


def import_tensor(desc: object) -> tuple[torch.Tensor, KvImport]:
    """Map one ``export_tensor`` description (daemon side): ``(tensor, closer)``. Raises ``KvShareError``."""
    d = validate_tensor_description(desc)
    tensors, closer = _import_entries(d["transport"], [d])
    return tensors[0], closer


def _import_entries(transport: str, entries: Sequence[Mapping[str, Any]]) -> tuple[list[torch.Tensor], KvImport]:
    if transport == "shm":
        return _import_shm(entries)
    return _import_cuda(entries)


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
                except ShmArenaError as exc:
                    raise KvShareError(str(exc)) from None
            elif arena.size_bytes != size_bytes:
                raise KvShareError(f"shm file {name} is described with two sizes")
            dtype = _dtype(entry["dtype"])
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
            t = torch.empty(0, dtype=_dtype(entry["dtype"]), device=f"cuda:{device}")
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
