"""The KV description: the wire form of ``register_kv`` that the engine and the daemon agree on.

Contract
========

The engine describes its KV tensors (``kvtier.client.kv_share.export_kv`` /
``export_tensor``); the daemon maps what a description names
(``kvtier.daemon.shared_memory.kv_import.import_kv`` / ``import_tensor``). This module is
the format between them, and its validation, which both sides run: the
engine on what it is about to send, the daemon on what it received, before
it maps anything. It imports no torch (validation needs only element sizes)
and maps nothing.

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

Primitives:

- ``validate_kv_description(desc)`` / ``validate_tensor_description(desc)``:
  check a layout / one-tensor description completely and return it,
  unchanged. Unknown keys, unknown dtypes, block_dim out of range, tensors
  disagreeing on ``num_blocks``, a block stride of 0, negative strides or
  offsets, any view whose last element lies beyond the shared memory it
  names, malformed handles (an expandable-segments CUDA handle included), and
  too many tensors or dimensions all raise ``KvShareError`` (a ``ValueError``,
  so the daemon's handlers refuse it as an invalid field). What only the
  importing process can check (a shm file's real size, the real extent of a
  CUDA allocation) is ``kv_import``'s.
- ``handle_is_expandable_segment(ipc_handle)``: whether a CUDA IPC handle
  names expandable-segments (VMM) memory, which cannot be shared; the export
  side refuses such a tensor before it describes it, with ``EXPANDABLE_HINT``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from kvtier.client.shm_arena import ShmArenaError, validate_arena_name

__all__ = [
    "CUDA_IPC_HANDLE_BYTES",
    "DESCRIPTION_VERSION",
    "EXPANDABLE_HINT",
    "MAX_DIMS",
    "SUPPORTED_DTYPES",
    "KvShareError",
    "handle_is_expandable_segment",
    "is_int",
    "validate_kv_description",
    "validate_shm_handle",
    "validate_tensor_description",
]

DESCRIPTION_VERSION = 1

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
CUDA_IPC_HANDLE_BYTES = 64
# torch >= 2.5 prefixes the handle with a version byte and a type byte.
_SHAREABLE_EXPANDABLE_SEGMENT = ord("e")

EXPANDABLE_HINT = (
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


def is_int(value: object) -> bool:
    """An int that is not a bool (msgpack and Python both let True pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: object, what: str, *, minimum: int = 0, maximum: int = MAX_EXTENT) -> int:
    if not is_int(value):
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


def validate_shm_handle(handle: object, what: str) -> dict[str, Any]:
    """Check one ``{"kind": "shm", ...}`` handle; returns it. ``unlink_shared_kv`` takes such a handle too."""
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
    ipc = _bytes(h["ipc_handle"], f"{what}.ipc_handle", min_len=CUDA_IPC_HANDLE_BYTES, max_len=512)
    if handle_is_expandable_segment(ipc):
        raise KvShareError(f"{what}: {EXPANDABLE_HINT}")
    _int(h["storage_size_bytes"], f"{what}.storage_size_bytes", minimum=1)
    _int(h["storage_offset_bytes"], f"{what}.storage_offset_bytes")
    counter = _bytes(h["ref_counter_handle"], f"{what}.ref_counter_handle", min_len=1, max_len=128)
    if not _REF_COUNTER_RE.fullmatch(counter):
        raise KvShareError(f"{what}.ref_counter_handle is not a torch IPC reference-counter name")
    _int(h["ref_counter_offset"], f"{what}.ref_counter_offset", maximum=_REF_COUNTER_SLOTS - 1)
    _bytes(h["event_handle"], f"{what}.event_handle", min_len=CUDA_IPC_HANDLE_BYTES, max_len=CUDA_IPC_HANDLE_BYTES)
    if not isinstance(h["event_sync_required"], bool):
        raise KvShareError(f"{what}.event_sync_required must be a bool")
    return h


def handle_is_expandable_segment(ipc_handle: bytes) -> bool:
    """Whether a CUDA IPC handle names expandable-segments memory (which CUDA IPC cannot share)."""
    # A bare 64-byte handle is the pre-2.5 cudaIpcMemHandle_t; longer ones
    # start with a version byte then the type byte.
    return len(ipc_handle) > CUDA_IPC_HANDLE_BYTES and ipc_handle[1] == _SHAREABLE_EXPANDABLE_SEGMENT


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
        validate_shm_handle(handle, f"{what}.handle")
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
