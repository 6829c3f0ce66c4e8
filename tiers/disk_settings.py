"""How a ``DiskTier`` runs: its settings, in one frozen value, and its configuration error.

Contract:

- ``DiskTierSettings(...)``: every knob of ``DiskTier`` that is not the
  tier's identity (directory, block size, capacity) or an object it calls
  (``admission``). Frozen and slotted: one value may be shared by many
  tiers. Defaults are the recommended ones of docs/disk-tier.md. Units are
  in the names (``_s`` seconds, ``_bytes``, ``_blocks``).
- ``__post_init__`` refuses, with ``DiskTierError`` naming the field and the
  value, a wrong type (``True`` is no count), a count or size below 1 and a
  time that is not a positive finite number.
- ``DiskTierError``: bad configuration (settings, directory, sizes);
  ``kvtier.tiers.disk_tier`` raises it too.

Stdlib only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DiskTierError", "DiskTierSettings"]


class DiskTierError(RuntimeError):
    """Bad configuration of a disk tier (settings, directory, sizes)."""


_AT_LEAST_ONE = ("write_queue_bytes", "write_batch_blocks", "reader_threads", "read_task_bytes")
_POSITIVE_SECONDS = ("index_sync_interval_s", "error_backoff_s")


@dataclass(frozen=True, slots=True)
class DiskTierSettings:
    """The settings of one ``DiskTier`` (see the module docstring and docs/disk-tier.md)."""

    # Write-back. Memory: the queue holds at most write_queue_bytes of blocks (at least one block),
    # in page-aligned buffers reused from one write to the next.
    write_queue_bytes: int = 256 << 20  # a full queue drops the block (counted), never blocks the caller
    write_batch_blocks: int = 32  # blocks written per data sync (fdatasync) and index update
    # Reads: a fetch's blocks are read by this many threads at once (queue depth of the device).
    reader_threads: int = 8
    # A read task covers at least one block and about this many bytes (small blocks share a task).
    read_task_bytes: int = 4 << 20
    # Records reach the device at most this long after their blocks did (see docs/disk-tier.md).
    index_sync_interval_s: float = 1.0
    # After an I/O error (EIO, ENOSPC), that direction (reads or writes) rests this long: misses meanwhile.
    error_backoff_s: float = 5.0
    direct_io: bool = True  # O_DIRECT where the filesystem takes it; False: buffered, with posix_fadvise

    def __post_init__(self) -> None:
        for name in _AT_LEAST_ONE:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise DiskTierError(f"DiskTierSettings.{name} must be an int >= 1, got {value!r}")
        for name in _POSITIVE_SECONDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value < math.inf:
                raise DiskTierError(f"DiskTierSettings.{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.direct_io, bool):
            raise DiskTierError(f"DiskTierSettings.direct_io must be True or False, got {self.direct_io!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
