"""A request's deadline (protocol feature ``"deadlines"``): a client's memory is touched only before it.

Contract
========

A ``store`` or ``restore`` on the ``shm`` or ``kv`` plane may carry
``deadline_ns``: the CLOCK_MONOTONIC instant after which its client has
given the call up and handed the memory its slots name back to the engine
(``kvtier.client.shared_clock`` is how the client knows the clock is ours).
Past it, a read of that memory may see another request's KV, and a write
may overwrite it. So:

- ``check_arrival(deadline_ns, op)``: a request already late when the loop
  takes it (it waited in the socket while the daemon was stopped or
  stalled) is refused before anything is planned.
- ``check_read(deadline_ns, op)``: after the daemon read the client's
  memory: the bytes count only if the read ended before the deadline.
  Nothing is stored otherwise.
- ``check_write(deadline_ns, nbytes, op)``: before a write into the
  client's memory: it starts only if it can end before the deadline,
  ``WRITE_MARGIN_NS`` plus ``nbytes`` at ``MIN_WRITE_BYTES_PER_S``.
- ``write_by_ns(deadline_ns, nbytes)``: the same latest start, for a copy
  the pool submits later (a CUDA copy into registered engine KV).

Each refusal raises ``ProtocolError(DEADLINE_EXCEEDED)``: the daemon did
nothing with the client's memory. ``deadline_ns`` None (a client without
the feature) passes every check. A daemon stopped in the middle of a write
that had time to finish can still write late; the margin makes that window
the write itself, not the whole stall.
"""

from __future__ import annotations

import time

from kvtier.client.protocol import ErrorCode, ProtocolError

# A write into client memory is a memcpy (or a CUDA copy) of at most a few
# hundred MiB; 1 GiB/s is several times slower than either on a loaded host.
MIN_WRITE_BYTES_PER_S = 1 << 30
WRITE_MARGIN_NS = 20_000_000


def _late(op: str, what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.DEADLINE_EXCEEDED,
                         f"{op} {what}: the client no longer waits for it, so its memory was left alone; nothing was done")


def check_arrival(deadline_ns: int | None, op: str) -> None:
    now_ns = time.monotonic_ns()
    if deadline_ns is not None and now_ns >= deadline_ns:
        raise _late(op, f"taken up {(now_ns - deadline_ns) / 1e6:.1f} ms after its deadline")


def check_read(deadline_ns: int | None, op: str) -> None:
    now_ns = time.monotonic_ns()
    if deadline_ns is not None and now_ns >= deadline_ns:
        raise _late(op, f"read the client's blocks {(now_ns - deadline_ns) / 1e6:.1f} ms after its deadline")


def write_by_ns(deadline_ns: int | None, nbytes: int) -> int | None:
    if deadline_ns is None:
        return None
    return deadline_ns - WRITE_MARGIN_NS - nbytes * 1_000_000_000 // MIN_WRITE_BYTES_PER_S


def check_write(deadline_ns: int | None, nbytes: int, op: str) -> None:
    latest_ns = write_by_ns(deadline_ns, nbytes)
    now_ns = time.monotonic_ns()
    if latest_ns is not None and now_ns >= latest_ns:
        assert deadline_ns is not None
        raise _late(op, f"would write {nbytes} bytes into the client's memory with "
                        f"{(deadline_ns - now_ns) / 1e6:.1f} ms left before its deadline")
