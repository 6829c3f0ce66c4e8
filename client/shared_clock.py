"""Whether kvtierd and a client read one monotonic clock, so that a deadline means the same instant to both.

Contract
========

A store or restore on the ``shm`` or ``kv`` plane has kvtierd read or write
the client's own memory. When the client gives up such a call (its deadline
passed) it hands that memory back to its engine, so the daemon must not
touch it any later: the request carries the client's deadline
(``deadline_ns``, protocol feature ``"deadlines"``) as a CLOCK_MONOTONIC
instant, which only means something if the daemon reads the same clock.

- ``daemon_clock() -> dict``: what the daemon puts in its hello reply as
  ``clock``: ``{"boot_id": str, "monotonic_ns": int}``, read as the reply is
  built.
- ``shares_clock(clock, sent_ns, received_ns) -> bool``: the client's test,
  with its own ``time.monotonic_ns()`` just before the hello went out and
  just after the reply came. True only when the boot ids are equal (one
  kernel since boot) and the daemon's reading lies between the two (a clock
  of another time namespace, or another host booted at nearly the same
  moment, does not). Anything missing or malformed is False: the client
  then sends no deadlines, as to a daemon without the feature.

The shared-memory planes only work within one host anyway; a client on
another host uses the ``inline`` plane, where the bytes travel in the
message and no deadline is needed.
"""

from __future__ import annotations

import time
from typing import Any

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

# Slack for the daemon's reading against the client's window: both come from
# the same clock, so only rounding could put a true reading outside it.
WINDOW_SLACK_NS = 1_000_000


def boot_id() -> str:
    """This kernel's boot id, or "" where it cannot be read (then no clock is shared)."""
    # Bytes, decoded as UTF-8: that codec is built in, while a daemon that dropped its privileges may no
    # longer be able to import another one from the standard library.
    try:
        with open(BOOT_ID_PATH, "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def daemon_clock() -> dict[str, Any]:
    return {"boot_id": boot_id(), "monotonic_ns": time.monotonic_ns()}


def shares_clock(clock: Any, sent_ns: int, received_ns: int) -> bool:
    if not isinstance(clock, dict):
        return False
    theirs = clock.get("boot_id")
    reading = clock.get("monotonic_ns")
    if not isinstance(theirs, str) or not theirs or isinstance(reading, bool) or not isinstance(reading, int):
        return False
    return theirs == boot_id() and sent_ns - WINDOW_SLACK_NS <= reading <= received_ns + WINDOW_SLACK_NS
