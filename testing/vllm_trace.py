"""Time stamps inside vLLM's engine-core process, for the vLLM benchmarks (``bench/vllm.py``, ``bench/vllm_busy.py``).

These run in the engine core through ``LLM.collective_rpc``, which passes
the worker first (sending a function needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); on vLLM's CPU backend the worker
lives in that process, beside the scheduler. ``trace_events`` gives the
worker its event list; ``timed`` wraps a method so that each call appends
``(name, start, end, count)`` to it (CLOCK_MONOTONIC, which every process
shares; a few microseconds a call, nothing else changes); ``take_events``
hands the list over and empties it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Event = tuple[str, float, float, Any]


def trace_events(worker: Any) -> list[Event]:
    """The worker's event list, created empty on first use."""
    if not hasattr(worker, "_bench_events"):
        worker._bench_events = []
    return worker._bench_events


def timed(events: list[Event], name: str, orig: Callable[..., Any],
          count: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """``orig``, recording each call as ``(name, start, end, count(*args))``."""
    def call(*a: Any, **k: Any) -> Any:
        t0 = time.monotonic()
        try:
            return orig(*a, **k)
        finally:
            events.append((name, t0, time.monotonic(), count(*a) if count else None))
    return call


def take_events(worker: Any) -> list[Event]:
    """The events recorded since the last call."""
    events = trace_events(worker)
    out = list(events)
    events.clear()
    return out
