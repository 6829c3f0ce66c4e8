"""Log lines a client can cause, capped per kind: a flood costs a summary line, not a line each.

Why: every refused request is worth a line for the operator, but a client
that guesses tokens or sends garbage in a loop would otherwise write one
line per request, filling the disk and drowning everything else.

``RateLimitedLog(logger, lines_per_window, window_s)``: ``log(kind, msg,
*args)`` writes at most ``lines_per_window`` lines of one ``kind`` (e.g.
the error code) per window; the rest are counted, and the first line of a
later window says how many of that kind were left out. Called from the
daemon's loop thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Window:
    started_s: float
    written: int = 0
    suppressed: int = 0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, *, lines_per_window: int = 20, window_s: float = 10.0,
                 level: int = logging.INFO, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._max = lines_per_window
        self._window_s = window_s
        self._level = level
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self.suppressed_total = 0

    def log(self, kind: str, msg: str, *args: object) -> None:
        now_s = self._clock()
        w = self._windows.get(kind)
        if w is None or now_s - w.started_s >= self._window_s:
            if w is not None and w.suppressed:
                self._log.log(self._level, "%d more %s lines left out in the last %.0f s", w.suppressed, kind,
                              now_s - w.started_s)
            w = self._windows[kind] = _Window(now_s)
        if w.written < self._max:
            w.written += 1
            self._log.log(self._level, msg, *args)
        else:
            w.suppressed += 1
            self.suppressed_total += 1
