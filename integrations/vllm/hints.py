"""What a vLLM request says about its reuse, as kvtier hints (``kvtier.client.protocol.Hints``).

A vLLM user sets them per request in any of three ways (the first that gives
a value wins, per field):

1. ``kv_transfer_params={"kvtier": {"session": str, "retain_s": float,
   "priority": int}}`` in ``SamplingParams.extra_args`` (the per-request
   channel every vLLM connector reads; works with ``LLM.generate`` and, as
   ``kv_transfer_params`` in the request body, with ``vllm serve``);
2. the request's ``session_id`` (vLLM's session field) as ``session``;
3. vLLM's KV-hints envelope (``kv_hints``): a ``Retain`` or ``Pin`` action's
   ``payload["ttl_s"]`` (or ``retain_s``) becomes ``retain_s``, its
   ``payload["priority"]`` the priority; ``Pin`` without a priority is
   priority 255 (kvtier never hard-pins on a hint: pins belong to requests
   being loaded). Other actions (Share, Prefetch, Demote) are not used yet.

Values that are not valid hints (a negative TTL, a priority over 255, a
session key over 256 characters) are dropped with one log line per kind,
never failing the request: hints are soft.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.client.protocol import MAX_PRIORITY, MAX_RETAIN_S, MAX_STR_LEN, Hints

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.integrations.vllm")

KV_TRANSFER_PARAMS_KEY = "kvtier"
_warned: set[str] = set()


def hints_of(request: Request) -> Hints | None:
    """The request's hints, or None when it says nothing."""
    session: str | None = None
    retain_s: float | None = None
    priority: int | None = None
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get(KV_TRANSFER_PARAMS_KEY) if isinstance(params, Mapping) else None
    if isinstance(ours, Mapping):
        session = _session(ours.get("session"))
        retain_s = _retain(ours.get("retain_s"))
        priority = _priority(ours.get("priority"))
    if session is None:
        session = _session(getattr(request, "session_id", None))
    envelope = getattr(request, "kv_hints", None)
    for action in getattr(envelope, "actions", None) or ():
        kind = str(getattr(action, "action_type", "")).lower()
        payload = getattr(action, "payload", None) or {}
        if kind not in ("retain", "pin") or not isinstance(payload, Mapping):
            continue
        if retain_s is None:
            retain_s = _retain(payload.get("ttl_s", payload.get("retain_s")))
        if priority is None:
            priority = _priority(payload.get("priority")) if "priority" in payload else (
                MAX_PRIORITY if kind == "pin" else None)
    if session is None and retain_s is None and not priority:
        return None
    return Hints(session=session, retain_s=retain_s, priority=priority or 0)


def _session(value: Any) -> str | None:
    if value is None or value == "":
        return None
    text = str(value)
    if len(text) > MAX_STR_LEN:
        _warn("session", f"a session key longer than {MAX_STR_LEN} characters")
        return None
    return text


def _retain(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_RETAIN_S:
        _warn("retain_s", f"retain_s / ttl_s {value!r} (a number of seconds in (0, {MAX_RETAIN_S:.0f}] is taken)")
        return None
    return float(value)


def _priority(value: Any) -> int | None:
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
