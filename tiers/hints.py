"""What an application tells the cache about one request: ``RequestHints``.

Hints are optional and soft. A policy that ignores them is correct; one that
uses them (``kvtier.tiers.policies``) must behave exactly as without them
when a request carries none.

- ``session``: an opaque key naming the conversation or agent session the
  request belongs to (Anthropic's and OpenAI's prompt-cache keys, vLLM's
  session id). Requests of one session tend to come back, with their own
  rhythm (think time, tool time); a policy may learn it per session.
- ``retain_s``: a soft TTL in seconds: keep the request's blocks at least
  this long after the request, while capacity allows. Never above pinned
  data, and bounded by the pool (a client cannot retain more than its share).
- ``priority``: higher is evicted later, among blocks otherwise alike.
- ``at_s``: when the request happened, in seconds on any clock that only
  moves forward (the daemon's monotonic clock, a trace's timestamps).
  ``retain_s`` and session gaps are measured on it.
- ``output_tokens``: the tokens the request generated so far (0: not
  reported). Not the application's word but the engine's: it knows the
  count as it generates and reports it with the request's stores. The
  time a response takes is part of the silence before the session's next
  request, so a long answer means a later return.
- ``continues``: set by the pool, not the client: these hints follow a
  request already recorded (a store of its blocks, its allocation after
  its lookup) and must not be read as a new request.

The daemon validates and bounds what arrives on the wire
(``kvtier.protocol.messages``); this type is what the tiers receive.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestHints"]

MAX_SESSION_KEY_BYTES = 256


@dataclass(frozen=True, slots=True)
class RequestHints:
    session: bytes | None = None
    retain_s: float = 0.0
    priority: int = 0
    at_s: float = 0.0
    output_tokens: int = 0
    continues: bool = False

    def __post_init__(self) -> None:
        if self.session is not None and not (0 < len(self.session) <= MAX_SESSION_KEY_BYTES):
            raise ValueError(f"a session key is 1..{MAX_SESSION_KEY_BYTES} bytes, got {len(self.session)}")
        if not self.retain_s >= 0.0:  # also refuses NaN
            raise ValueError(f"retain_s must be >= 0, got {self.retain_s}")
        if not -(2**31) <= self.priority < 2**31:
            raise ValueError(f"priority must fit in 32 bits, got {self.priority}")
        if not 0 <= self.output_tokens < 2**31:
            raise ValueError(f"output_tokens must be in 0..2**31-1, got {self.output_tokens}")

    @property
    def empty(self) -> bool:
        """No hint at all: a policy must treat the request as one without hints."""
        return self.session is None and self.retain_s == 0.0 and self.priority == 0 and self.output_tokens == 0
