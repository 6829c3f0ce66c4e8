"""Giving reply buffers' memory back to the kernel once a backlog of them has drained.

kvtierd keeps freed large buffers in glibc's heap (``daemon.__main__``
raises glibc's mmap and trim thresholds, so that an inline restore's staging
buffer is not faulted in afresh per request). So after a backlog of copied
replies was freed (clients that did not read them went away, or read them at
last) that memory stayed resident for good: four non-reading clients left the
daemon at +2,147 MB RSS after they were gone (issue 32 item 4).

Contract (the event loop's thread):

- ``HeapTrimmer(min_peak_bytes, metrics)``; ``note(held_bytes, now_s)`` after
  each turn's releases, with the payload bytes of copied replies the daemon
  holds (unsent and parked). It follows their peak since the last trim; when
  they have fallen to a quarter of a peak of at least ``min_peak_bytes`` it
  collects cyclic garbage and calls glibc's ``malloc_trim(0)`` (free pages
  of every arena go back to the kernel) ``TRIM_DELAY_S`` later (pyzmq's gc
  thread drops the last reference to a sent frame just after its tracker
  says done), and counts ``heap_trims_total``. Returns True when it trimmed.
  The collection is what frees most: each restore's op and its staging
  buffer sit in a reference cycle (the op's done callbacks), which the
  frozen, rarely run full collection left alone: 895 of them held 450 MiB
  after their clients had gone.
- Traffic whose clients read stays far below ``min_peak_bytes`` (the loop
  gives twice the largest reply), so its buffers stay mapped as before.
- Without glibc it never trims (``enabled`` is False).
"""

from __future__ import annotations

import ctypes
import gc
import logging
from collections.abc import Callable

from kvtier.daemon.telemetry.metrics import Counters

log = logging.getLogger(__name__)

TRIM_DELAY_S = 0.5


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


class HeapTrimmer:
    """See the module docstring."""

    def __init__(self, min_peak_bytes: int, metrics: Counters) -> None:
        self.min_peak_bytes = min_peak_bytes
        self.metrics = metrics
        self._trim = _malloc_trim()
        self._peak_bytes = 0
        self._trim_at_s: float | None = None
        metrics.inc("heap_trims_total", 0)

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def note(self, held_bytes: int, now_s: float) -> bool:
        """See the module docstring."""
        if held_bytes > self._peak_bytes:
            self._peak_bytes = held_bytes
        if self._peak_bytes < self.min_peak_bytes or self._trim is None:
            return False
        if held_bytes > self._peak_bytes // 4:
            self._trim_at_s = None
            return False
        if self._trim_at_s is None:
            self._trim_at_s = now_s + TRIM_DELAY_S
            return False
        if now_s < self._trim_at_s:
            return False
        peak_bytes = self._peak_bytes
        self._peak_bytes = held_bytes
        self._trim_at_s = None
        gc.collect()
        self._trim(0)
        self.metrics.inc("heap_trims_total")
        log.info("replies holding up to %d MiB of copied payload drained to %d MiB: heap trimmed",
                 peak_bytes >> 20, held_bytes >> 20)
        return True
