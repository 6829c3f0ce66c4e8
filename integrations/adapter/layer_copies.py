"""Layer-by-layer restores: a restore's later layers copy on a helper thread while the forward runs.

Contract
========

``LayerCopies()``: one per worker, engine-free. The worker restores a step's
synchronous loads inside ``deferring()``; a lent copy made there
(``LentRestore``) copies its first layer's pieces at once and hands the rest to
``defer``. The forward then waits per layer (``wait``, from vLLM's
``wait_for_layer_load``), and the step ends with ``settle``.

- ``deferring()``: a context manager; ``active()`` is True on the calling
  thread inside it (never on another thread: the loads thread restores in the
  background and must copy everything itself), unless deferral was turned off.
- ``defer(group, block_ids, pieces, finish)``: ``pieces`` ``[(tensor, engine
  view, slab view)]`` are copied on the helper thread, in order, after the
  jobs deferred before; then ``finish()`` runs there (the lend's lease check
  and its release) and returns whether the bytes are good. A job whose copy
  raises, or whose ``finish`` says no, fails: its ``block_ids`` go to
  ``settle``'s answer.
- ``wait(group, tensor)``: returns once every piece deferred for that tensor
  of that group is copied. Never blocks where nothing was deferred.
- ``settle() -> set[int]``: waits for every job, then returns the engine
  block ids vLLM must treat as not restored: the failed jobs', and, where a
  tensor got pieces that no ``wait`` asked for (the forward may have read it
  before they landed), every deferred block of the step; deferral is then off
  for good (logged once), so a model whose attention skips the per-layer wait
  stays correct and loses only the overlap.
- ``close()``: stops the thread (after the jobs queued).

Why: on vLLM's CPU build the worker restores before the forward, which waits
for all of a 32 MiB restore (3.3 ms of a 67 ms TTFT in bench/peers.py) though
it reads layer 0 first. vLLM reserves a core for a KV connector's transfers
(``ompmultiprocessing``: one more per rank); the helper thread moves itself off
the cores of the thread that started it (vLLM binds the worker's threads to its
compute cores, and a new thread inherits that), so the kernel runs it on
another core, beside the forward.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

__all__ = ["LayerCopies", "Piece"]

log = logging.getLogger("kvtier.integrations")

Piece = tuple[int, np.ndarray, np.ndarray]  # (engine tensor index, engine view, slab view)


@dataclass(slots=True)
class _Job:
    group: int
    block_ids: list[int]
    pieces: Sequence[Piece]
    finish: Callable[[], bool]


def _cores_of_this_thread() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return set()


class LayerCopies:
    """See the module docstring."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._pending: dict[tuple[int, int], int] = {}  # (group, tensor) -> pieces not copied yet
        self._deferred: dict[tuple[int, int], bool] = {}  # this step's (group, tensor) -> waited for
        self._step_blocks: set[int] = set()
        self._failed: set[int] = set()
        self._running = 0  # jobs taken off the queue and not done
        self._owner: int | None = None  # the thread inside deferring()
        self._off = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.jobs = 0
        self.pieces = 0
        self.waits = 0
        self.wait_s = 0.0  # how long waits blocked, in all
        self.blocks_landed = 0  # deferred blocks that settle found intact

    @contextmanager
    def deferring(self) -> Iterator[None]:
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            self._owner = None

    def active(self) -> bool:
        return not self._off and self._owner == threading.get_ident()

    def defer(self, group: int, block_ids: list[int], pieces: Sequence[Piece], finish: Callable[[], bool]) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, args=(_cores_of_this_thread(),),
                                                name="kvtier-layer-copies", daemon=True)
                self._thread.start()
            for t, _, _ in pieces:
                key = (group, t)
                self._pending[key] = self._pending.get(key, 0) + 1
                self._deferred.setdefault(key, False)
            self._step_blocks.update(block_ids)
            self._jobs.append(_Job(group, block_ids, pieces, finish))
            self.jobs += 1
            self.pieces += len(pieces)
            self._cv.notify_all()

    def wait(self, group: int, tensor: int) -> None:
        key = (group, tensor)
        with self._cv:
            if key not in self._deferred:
                return
            self._deferred[key] = True
            self.waits += 1
            if self._pending.get(key, 0):
                t0 = time.perf_counter()
                while self._pending.get(key, 0):
                    self._cv.wait()
                self.wait_s += time.perf_counter() - t0

    def settle(self) -> set[int]:
        with self._cv:
            while self._jobs or self._running:
                self._cv.wait()
            failed, self._failed = self._failed, set()
            unwaited = sorted(k for k, waited in self._deferred.items() if not waited)
            if unwaited:
                failed |= self._step_blocks
                if not self._off:
                    self._off = True
                    log.warning("kvtier: the forward read layers %s (group, tensor) without waiting for their "
                                "restore (wait_for_layer_load); those blocks are recomputed, and restores copy "
                                "every layer before the forward from now on", unwaited[:4])
            self.blocks_landed += len(self._step_blocks - failed)
            self._deferred.clear()
            self._step_blocks.clear()
            return failed

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)

    def _serve(self, forward_cores: set[int]) -> None:
        # Off the cores vLLM bound the forward's threads to (where this thread was started from), onto the
        # others (the core vLLM reserves for a KV connector); every core where there are no others.
        cores = set(range(os.cpu_count() or 1))
        for choice in (cores - forward_cores, cores):
            try:
                if choice:
                    os.sched_setaffinity(0, choice)
                    break
            except (OSError, AttributeError):
                continue
        copyto = np.copyto
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running += 1
            ok = True
            done = 0
            try:
                for tensor, dst, src in job.pieces:
                    copyto(dst, src)  # the GIL let go for the copy
                    done += 1
                    with self._cv:
                        self._pending[(job.group, tensor)] -= 1
                        self._cv.notify_all()
                ok = job.finish()
            except Exception:
                log.exception("kvtier: a deferred layer copy failed; vLLM recomputes its blocks")
                ok = False
            with self._cv:
                for t, _, _ in job.pieces[done:]:  # a copy that raised: its waiters go on (and settle fails it)
                    self._pending[(job.group, t)] -= 1
                if not ok:
                    self._failed.update(job.block_ids)
                self._running -= 1
                self._cv.notify_all()
