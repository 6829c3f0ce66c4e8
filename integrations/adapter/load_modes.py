"""When a load runs: before the step's forward, or beside it (``load_mode``).

Contract
========

The scheduler half asks its mode once per request with something to load,
``background(blocks)``, when vLLM first gets a non-zero answer: ``False`` is a
synchronous load (the next step's forward waits for it), ``True`` one that
runs on the worker's load thread while vLLM runs steps without the request
(vLLM's asynchronous loads). It never raises.

The mode is told what it may base that on, by the scheduler half:
``observe_step(running, now_s)`` at the end of each scheduler step (how many
requests it scheduled, on the monotonic clock), and ``observe_load(blocks,
seconds)`` when the worker reports loads it ran (restored blocks, and the
seconds those restores took).

Modes, by ``load_mode`` name (``LOAD_MODES``):

- ``sync``: always before the forward.
- ``async``: always beside it.
- ``adaptive`` (the default): on an idle engine (its last step scheduled
  nothing) before the forward, since the request would only wait a step
  longer. On a busy one it weighs the two costs, in request-seconds: a
  synchronous load stalls each of the ``running`` requests for the load's
  time (the blocks times the measured restore rate), while an
  asynchronous one costs the arriving request about ``async_extra_steps``
  engine steps (the setting; default ``ASYNC_EXTRA_STEPS``, measured by
  ``bench/vllm_busy.py``: its load is reported done at the end of a step,
  and it is scheduled in the step after). Beside
  the forward when the stall costs more. Until a load and a busy step have
  been measured it loads beside the forward: the first loads measure the
  restore rate.
"""

from __future__ import annotations

from typing import Protocol

# The arriving request's extra wait under an asynchronous load, in engine
# steps. bench/vllm_busy.py (the 2-core VM, 4 decoders, always-async
# against sync): its TTFT exceeded sync's by 2.5 before-arrival
# inter-token latencies. With vLLM's async scheduling on a GPU it may be
# nearer 1-2 (unmeasured): the connector's async_extra_steps setting.
ASYNC_EXTRA_STEPS = 2.5
# Weight of a new measurement in the running averages: a few steps follow a
# change of load (a longer batch), one outlier does not swing the choice.
SMOOTHING = 0.25


class LoadMode(Protocol):
    name: str

    def background(self, blocks: int) -> bool: ...

    def observe_step(self, running: int, now_s: float) -> None: ...

    def observe_load(self, blocks: int, seconds: float) -> None: ...


class SyncLoads:
    name = "sync"

    def background(self, blocks: int) -> bool:
        return False

    def observe_step(self, running: int, now_s: float) -> None:
        pass

    def observe_load(self, blocks: int, seconds: float) -> None:
        pass


class AsyncLoads:
    name = "async"

    def background(self, blocks: int) -> bool:
        return blocks > 0

    def observe_step(self, running: int, now_s: float) -> None:
        pass

    def observe_load(self, blocks: int, seconds: float) -> None:
        pass


class AdaptiveLoads:
    name = "adaptive"

    def __init__(self, async_extra_steps: float = ASYNC_EXTRA_STEPS) -> None:
        self.async_extra_steps = async_extra_steps
        self.running = 0  # requests the last step scheduled
        self.step_s: float | None = None  # a busy step's period, smoothed
        # Restores reported, smoothed: blocks and seconds apart, so a load's
        # fixed cost (a round trip, ~3 ms for 1 block on the 2-core bench
        # against 11 ms for 32) weighs by its blocks, not as a rate of its own.
        self._blocks: float | None = None
        self._seconds: float | None = None
        self._last_step_at_s: float | None = None
        self._last_running = 0

    @property
    def seconds_per_block(self) -> float | None:
        """The restore rate: smoothed seconds over smoothed blocks."""
        return None if not self._blocks or self._seconds is None else self._seconds / self._blocks

    def background(self, blocks: int) -> bool:
        if blocks <= 0 or self.running == 0:
            return False
        if self.step_s is None or self.seconds_per_block is None:
            return True
        stall_s = self.running * blocks * self.seconds_per_block
        return stall_s > self.async_extra_steps * self.step_s

    def observe_step(self, running: int, now_s: float) -> None:
        # A step's period is the time from the end of its scheduling to the
        # end of the next one's; only busy ones count (an idle engine's
        # period is its polling, not a forward).
        if self._last_step_at_s is not None and self._last_running > 0 and running > 0:
            self.step_s = _smooth(self.step_s, now_s - self._last_step_at_s)
        self._last_step_at_s, self._last_running = now_s, running
        self.running = running

    def observe_load(self, blocks: int, seconds: float) -> None:
        if blocks > 0 and seconds >= 0:
            self._blocks = _smooth(self._blocks, blocks)
            self._seconds = _smooth(self._seconds, seconds)


def _smooth(average: float | None, sample: float) -> float:
    return sample if average is None else average + SMOOTHING * (sample - average)


LOAD_MODES: dict[str, type[SyncLoads] | type[AsyncLoads] | type[AdaptiveLoads]] = {
    "adaptive": AdaptiveLoads, "sync": SyncLoads, "async": AsyncLoads,
}


def make_load_mode(name: str, async_extra_steps: float = ASYNC_EXTRA_STEPS) -> LoadMode:
    """The mode ``name`` (one of ``LOAD_MODES``; ``ConnectorSettings`` checked both)."""
    return AdaptiveLoads(async_extra_steps) if name == AdaptiveLoads.name else LOAD_MODES[name]()
