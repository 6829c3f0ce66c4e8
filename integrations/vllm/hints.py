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
never failing the request: hints are soft (``kvtier.integrations.adapter.hints``
checks each value).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvtier.client.protocol import MAX_PRIORITY, Hints
from kvtier.integrations.adapter.hints import hints_or_none, priority_of, retain_s_of, session_of

if TYPE_CHECKING:
    from vllm.v1.request import Request

KV_TRANSFER_PARAMS_KEY = "kvtier"


def hints_of(request: Request) -> Hints | None:
    """The request's hints, or None when it says nothing."""
    session: str | None = None
    retain_s: float | None = None
    priority: int | None = None
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get(KV_TRANSFER_PARAMS_KEY) if isinstance(params, Mapping) else None
    if isinstance(ours, Mapping):
        session = session_of(ours.get("session"))
        retain_s = retain_s_of(ours.get("retain_s"))
        priority = priority_of(ours.get("priority"))
    if session is None:
        session = session_of(getattr(request, "session_id", None))
    envelope = getattr(request, "kv_hints", None)
    for action in getattr(envelope, "actions", None) or ():
        kind = str(getattr(action, "action_type", "")).lower()
        payload = getattr(action, "payload", None) or {}
        if kind not in ("retain", "pin") or not isinstance(payload, Mapping):
            continue
        if retain_s is None:
            retain_s = retain_s_of(payload.get("ttl_s", payload.get("retain_s")))
        if priority is None:
            priority = priority_of(payload.get("priority")) if "priority" in payload else (
                MAX_PRIORITY if kind == "pin" else None)
    return hints_or_none(session, retain_s, priority)
