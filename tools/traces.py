"""Trace readers: JSONL request traces turned into per-request block keys.

Two formats, one request per line, plain or gzip (detected by the gzip magic
bytes, not the file name):

- **Mooncake** (``hash_ids``): ``{"timestamp": ms, "input_length": tokens,
  "output_length": tokens, "hash_ids": [int, ...]}``. The ids are already
  prefix-chained block ids (two requests share id k at position i only if
  their first i+1 blocks are equal), one per ``block_size`` tokens; the last
  one may cover a partial block. Each id becomes a 16-byte key,
  ``id.to_bytes(16, "little")`` (ids must lie in 0 .. 2**128-1).
- **token ids** (``token_ids``): ``{"token_ids": [int, ...], "timestamp"?: ms,
  "output_length"?: n, "lora_id"?: ..., "cache_salt"?: ...}``, hashed with
  kvtier's own chained hashing (``kvtier.client.hashing.BlockHasher``), so the
  keys are the ones an engine using kvtier would send. ``input_length`` is
  ``len(token_ids)``.

Both formats may carry ``session`` (an integer naming the conversation or
agent session) and ``subagent`` (0/1), as the Claude Code traces do; the
replay turns ``session`` into request hints (``kvtier replay --hints``).

Only full blocks get a key: block i is full when ``(i+1) * block_size <=
input_length``. A ``Request`` carries the keys of its full blocks only.

The format is decided per line by which field is present, so a file may not
need to say which one it is; a line with neither is an error naming the line.
Blank lines are skipped.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = ["Request", "TraceError", "read_trace", "load_trace", "open_trace", "mooncake_key"]

GZIP_MAGIC = b"\x1f\x8b"


class TraceError(ValueError):
    """A trace line that cannot be read."""


@dataclass(slots=True, frozen=True)
class Request:
    """One request of a trace: the keys of its full blocks, in order."""

    timestamp: float  # ms since the trace start (0 when the trace has none)
    input_length: int  # prompt tokens
    output_length: int  # generated tokens (0 when unknown)
    keys: tuple[bytes, ...]  # 16-byte keys of the full blocks only
    session: int | None = None  # the trace's session id, when it has one (agent traces)
    subagent: bool = False  # a sub-agent's request (read for reports; policies find streams themselves)

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


def mooncake_key(block_id: int) -> bytes:
    """The 16-byte key of a Mooncake hash id."""
    return block_id.to_bytes(16, "little")


def open_trace(path: str | Path) -> IO[str]:
    """A text stream over a plain or gzip JSONL file."""
    raw = open(path, "rb")  # noqa: SIM115 - returned to the caller
    magic = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    if magic == GZIP_MAGIC:
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


def read_trace(path: str | Path, block_size: int = 512, *, hash_algo: str = "xxh3_128",
               limit: int | None = None) -> Iterator[Request]:
    """Yield the requests of a trace file in file order (at most ``limit``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hasher = None
    ids: dict[int, bytes] = {}  # Mooncake id -> key, shared so equal ids share one bytes object
    with open_trace(path) as f:
        n = 0
        for lineno, line in enumerate(f, start=1):
            if limit is not None and n >= limit:
                return
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not JSON: {exc}") from None
            if not isinstance(rec, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object")
            if "hash_ids" in rec:
                req = _mooncake(rec, block_size, ids, f"{path}:{lineno}")
            elif "token_ids" in rec:
                if hasher is None:
                    from kvtier.client.hashing import BlockHasher

                    hasher = BlockHasher(block_size, hash_algo)
                req = _tokens(rec, hasher, f"{path}:{lineno}")
            else:
                raise TraceError(f"{path}:{lineno}: a request needs 'hash_ids' (Mooncake) or 'token_ids'")
            n += 1
            yield req


def load_trace(path: str | Path, block_size: int = 512, **kwargs: Any) -> list[Request]:
    return list(read_trace(path, block_size, **kwargs))


def _int(rec: dict, field: str, where: str, default: int | None = None) -> int:
    value = rec.get(field, default)
    if value is None:
        raise TraceError(f"{where}: missing {field!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise TraceError(f"{where}: {field!r} must be a non-negative integer, got {value!r}")
    return int(value)


def _timestamp(rec: dict, where: str) -> float:
    ts = rec.get("timestamp", 0)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise TraceError(f"{where}: 'timestamp' must be a number, got {ts!r}")
    return float(ts)


def _mooncake(rec: dict, block_size: int, ids: dict[int, bytes], where: str) -> Request:
    hash_ids = rec["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list")
    input_length = _int(rec, "input_length", where)
    num_full = input_length // block_size
    if len(hash_ids) < num_full:
        raise TraceError(
            f"{where}: input_length {input_length} makes {num_full} full blocks of {block_size} tokens but "
            f"there are only {len(hash_ids)} hash_ids (is --block-size the trace's block size?)"
        )
    keys = []
    for h in hash_ids[:num_full]:
        key = ids.get(h)
        if key is None:
            if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 1 << 128:
                raise TraceError(f"{where}: hash id {h!r} is not an integer in 0 .. 2**128-1")
            key = ids[h] = mooncake_key(h)
        keys.append(key)
    return Request(_timestamp(rec, where), input_length, _int(rec, "output_length", where, 0), tuple(keys),
                   *_session(rec, where))


def _session(rec: dict, where: str) -> tuple[int | None, bool]:
    """The optional ``session`` (a non-negative integer) and ``subagent`` (0/1 or a bool) fields."""
    session = _int(rec, "session", where) if rec.get("session") is not None else None
    sub = rec.get("subagent", False)
    if sub not in (0, 1):  # also True/False
        raise TraceError(f"{where}: 'subagent' must be 0 or 1, got {sub!r}")
    return session, bool(sub)


def _tokens(rec: dict, hasher: Any, where: str) -> Request:
    tokens = rec["token_ids"]
    if not isinstance(tokens, list):
        raise TraceError(f"{where}: 'token_ids' must be a list")
    try:
        keys = hasher.hash_blocks(tokens, lora_id=rec.get("lora_id"), cache_salt=rec.get("cache_salt"))
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: {exc}") from None
    return Request(_timestamp(rec, where), len(tokens), _int(rec, "output_length", where, 0), tuple(keys),
                   *_session(rec, where))
