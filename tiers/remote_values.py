"""The remote tier's value format: what a block looks like in Redis/Valkey, and its checks.

A value is a 24-byte header ``struct "<4sBxxxQQ"`` (magic ``b"KVT1"``, format
version 1, three pad bytes, payload length, xxh3-64 of the payload) followed
by the payload. The reader (``remote_tier``) accepts a value only if every
field and the checksum match; the writer (``remote_writer``) builds it.
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash

__all__ = ["FORMAT_VERSION", "HEADER", "HEADER_BYTES", "MAGIC", "byte_view", "decode", "encode_header", "seal"]

MAGIC = b"KVT1"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBxxxQQ")  # magic, version, 3 pad, payload length, xxh3-64 of payload
HEADER_BYTES = HEADER.size  # 24


def encode_header(payload: bytes | bytearray | memoryview) -> bytes:
    """The header of a value holding ``payload``."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), xxhash.xxh3_64_intdigest(payload))


def seal(value: bytearray, payload_bytes: int) -> None:
    """Write the header in place, in front of the payload already at ``value[HEADER_BYTES:]``."""
    HEADER.pack_into(value, 0, MAGIC, FORMAT_VERSION, payload_bytes,
                     xxhash.xxh3_64_intdigest(memoryview(value)[HEADER_BYTES:]))


def decode(value: bytes, payload_bytes: int) -> memoryview | None:
    """The verified, read-only payload of a value, or None if it is not a block of ``payload_bytes``."""
    if len(value) != HEADER_BYTES + payload_bytes:
        return None
    magic, version, length, digest = HEADER.unpack_from(value)
    if magic != MAGIC or version != FORMAT_VERSION or length != payload_bytes:
        return None
    payload = memoryview(value)[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(payload) != digest:
        return None
    return payload.toreadonly()


def byte_view(data: Any) -> memoryview:
    """A flat C-contiguous byte view of a buffer (bytes, bytearray, memoryview, numpy, CPU tensor)."""
    if hasattr(data, "numpy") and not isinstance(data, memoryview):
        data = data.numpy()  # a CPU torch tensor; torch tensors lack the buffer protocol
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("write_back needs a C-contiguous buffer")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view
