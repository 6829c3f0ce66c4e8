"""What a request says about its reuse, checked as kvtier hints (``kvtier.client.protocol.Hints``).

Contract
========

An engine's adapter reads the request's hints from wherever its engine
carries them (vLLM's: ``kvtier.integrations.vllm.hints``) and passes each
raw value through one of these:

- ``session_of(value)``: a session key (any value, as text), or None;
- ``retain_s_of(value)``: seconds in ``(0, MAX_RETAIN_S]``, or None;
- ``priority_of(value)``: an integer ``0..MAX_PRIORITY``, or None;
- ``hints_or_none(session, retain_s, priority)``: the ``Hints``, or None
  when they say nothing (no session, no retention, priority 0 or None).

A value that is not a valid hint (a negative TTL, a priority over 255, a
session key over ``MAX_STR_LEN`` characters) is None, with one log line per
kind for the process's life: hints are soft, they never fail a request.
Imports no engine.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.client.protocol import MAX_PRIORITY, MAX_RETAIN_S, MAX_STR_LEN, Hints

log = logging.getLogger("kvtier.integrations")

_warned: set[str] = set()


def hints_or_none(session: str | None, retain_s: float | None, priority: int | None) -> Hints | None:
    """The hints, or None when they say nothing."""
    if session is None and retain_s is None and not priority:
        return None
    return Hints(session=session, retain_s=retain_s, priority=priority or 0)


def session_of(value: Any) -> str | None:
    """A session key, or None (absent, or not valid: logged once)."""
    if value is None or value == "":
        return None
    text = str(value)
    if len(text) > MAX_STR_LEN:
        _warn("session", f"a session key longer than {MAX_STR_LEN} characters")
        return None
    return text


def retain_s_of(value: Any) -> float | None:
    """A retention in seconds, or None (absent, or not valid: logged once)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_RETAIN_S:
        _warn("retain_s", f"retain_s / ttl_s {value!r} (a number of seconds in (0, {MAX_RETAIN_S:.0f}] is taken)")
        return None
    return float(value)


def priority_of(value: Any) -> int | None:
    """A priority 0..MAX_PRIORITY, or None (absent, or not valid: logged once)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        _warn("priority", f"priority {value!r} (an integer 0..{MAX_PRIORITY} is taken)")
        return None
    return value


def _warn(kind: str, what: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning("kvtier: ignoring the hint %s of a request (logged once)", what)
