"""One thread that runs an adapter's daemon calls in order, off the engine's own threads."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("kvtier.integrations")


class Background:
    """Jobs run in submission order on one daemon thread; results as futures."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._pending = 0  # submitted and not finished
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._idle:
            self._pending += 1
        self._jobs.put((fn, fut))
        return fut

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted job has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as exc:  # a bug here must not kill the thread
                log.exception("kvtier: background job failed")
                fut.set_exception(exc)
            with self._idle:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.notify_all()

    def close(self, timeout_s: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)
