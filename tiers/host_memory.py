"""Host memory for the CPU tier: capacity checks and (pinned) slab allocation.

Contract:

- ``check_host_capacity(nbytes)`` raises ``HostMemoryError`` with the numbers
  when ``nbytes`` exceeds what the machine can give now (psutil's available
  memory less a reserve), and, when the memory is to be pinned, the process's
  RLIMIT_MEMLOCK. Callers check before allocating so a daemon refuses at
  start-up instead of being killed later.
- ``allocate_host_slab(num_blocks, block_bytes, pin=None)`` returns a
  ``BlockLayout`` over one ``[num_blocks, block_bytes]`` uint8 host tensor,
  pinned when CUDA is available (``pin=None`` means "pin if CUDA is there").
"""

from __future__ import annotations

import resource

import psutil
import torch

from kvtier.tiers.layout import BlockLayout

# Leave the OS and the engine room: never take the last 512 MiB.
RESERVE_BYTES = 512 * 1024**2


class HostMemoryError(MemoryError):
    """A host allocation that the machine cannot (or may not) satisfy."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / 1024**3:.2f} GiB"


def check_host_capacity(nbytes: int, *, pin: bool = False, what: str = "CPU tier") -> None:
    available = psutil.virtual_memory().available
    usable = max(0, available - RESERVE_BYTES)
    if nbytes > usable:
        raise HostMemoryError(
            f"{what} needs {_gib(nbytes)} but only {_gib(available)} is available "
            f"({_gib(usable)} after a {_gib(RESERVE_BYTES)} reserve); lower cpu_bytes"
        )
    if pin:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and nbytes > soft:
            raise HostMemoryError(
                f"{what} wants {_gib(nbytes)} of pinned memory but RLIMIT_MEMLOCK is {_gib(soft)}; "
                "raise it (systemd: LimitMEMLOCK=infinity; shell: ulimit -l unlimited) or lower cpu_bytes"
            )


def allocate_host_slab(num_blocks: int, block_bytes: int, *, pin: bool | None = None) -> BlockLayout:
    if pin is None:
        pin = torch.cuda.is_available()
    check_host_capacity(num_blocks * block_bytes, pin=pin)
    return BlockLayout.contiguous(num_blocks, block_bytes, "cpu", pin=pin)
