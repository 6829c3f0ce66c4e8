"""The transfer-engine interface: copy kinds, transfers, and ``TransferEngine`` (no torch).

Contract (the pool is the only caller of ``submit`` and ``poll``):

- ``submit(kind, src, src_slots, dst, dst_slots) -> Transfer`` queues one
  batched copy between two ``BlockLayout``s and returns at once. It never
  blocks on the copy. Copies of one priority class complete in submission
  order; restores and client loads (``HIGH``) never wait behind demotions
  and client stores (``LOW``).
- ``poll() -> list[Transfer]`` returns the transfers that finished since the
  last call (successfully or not; ``Transfer.error`` says which). The pool
  applies its bookkeeping only then, on its own thread.
- ``set_wakeup(fn)`` registers a callable that worker threads call after a
  transfer finishes, so an event loop can stop sleeping early. It must be
  cheap and thread-safe (e.g. write a byte to a socket pair).
- ``close(timeout_s)`` lets queued copies finish, then stops the workers.
  Submitting after close raises ``TransferError``.
- A failed copy fails its transfer only (``TransferError`` in ``error``);
  the engine keeps serving.
- ``submit(..., then=fn)``: after the copy succeeds, the worker that saw it
  finish calls ``fn()`` before completing the transfer, and keeps what it
  returns in ``Transfer.then_result`` (a persistent CPU tier checksums the
  bytes it just received there, off the pool's thread). If ``fn`` raises,
  the transfer fails with a ``TransferError``.

The engines themselves (``kvtier.tiers.transfer``) need torch; this module
does not, so bookkeeping code (the pool, ``kvtier replay``) imports no torch
until bytes move.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.blocks.layout import BlockLayout

__all__ = ["CopyKind", "Transfer", "TransferEngine", "TransferError"]


class TransferError(RuntimeError):
    """A copy failed, or the engine is closed."""


class DeadlinePassed(TransferError):
    """A copy of a client's memory did not run, or its read does not count: the client's deadline passed."""


class CopyKind(enum.Enum):
    DEMOTE = "demote"  # GPU tier -> CPU tier
    RESTORE = "restore"  # CPU tier -> GPU tier
    STORE = "store"  # client -> a tier
    LOAD = "load"  # a tier -> client

    @property
    def high_priority(self) -> bool:
        # Restores and loads sit on the engine's critical path (time to first
        # token); demotions and stores can wait.
        return self in (CopyKind.RESTORE, CopyKind.LOAD)


@dataclass(eq=False)
class Transfer:
    transfer_id: int
    kind: CopyKind
    num_blocks: int
    nbytes: int
    high_priority: bool
    submitted_s: float = field(default_factory=time.monotonic)
    finished_s: float | None = None
    error: BaseException | None = None
    then: Callable[[], object] | None = field(default=None, repr=False)  # see the module docstring
    then_result: object = field(default=None, repr=False)
    _event: threading.Event = field(default_factory=threading.Event, repr=False)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._event.wait(timeout_s)

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self.finished_s = time.monotonic()
        self._event.set()


@dataclass(slots=True)
class CopyJob:
    transfer: Transfer
    src: BlockLayout
    src_slots: Sequence[int]
    dst: BlockLayout
    dst_slots: Sequence[int]


class TransferEngine(ABC):
    """See the module docstring."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._finished: deque[Transfer] = deque()
        self._wakeup: Callable[[], None] | None = None
        self._closed = False
        self.bytes_by_kind: dict[CopyKind, int] = {k: 0 for k in CopyKind}
        self.seconds_by_kind: dict[CopyKind, float] = {k: 0.0 for k in CopyKind}

    def set_wakeup(self, fn: Callable[[], None] | None) -> None:
        self._wakeup = fn

    def submit(
        self,
        kind: CopyKind,
        src: BlockLayout,
        src_slots: Sequence[int],
        dst: BlockLayout,
        dst_slots: Sequence[int],
        *,
        high_priority: bool | None = None,
        then: Callable[[], object] | None = None,
    ) -> Transfer:
        """Queue a copy; ``high_priority`` overrides the kind's class (an
        eviction that blocks an allocation is a demotion on the critical path);
        ``then`` runs on the worker once the copy succeeded (module docstring)."""
        if self._closed:
            raise TransferError("transfer engine is closed")
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} destination slots")
        if src.block_bytes != dst.block_bytes:
            raise ValueError(f"block sizes differ: {src.block_bytes} != {dst.block_bytes} bytes")
        high = kind.high_priority if high_priority is None else high_priority
        transfer = Transfer(next(self._ids), kind, len(src_slots), len(src_slots) * src.block_bytes, high, then=then)
        self._enqueue(CopyJob(transfer, src, list(src_slots), dst, list(dst_slots)))
        return transfer

    def poll(self) -> list[Transfer]:
        done = []
        while self._finished:
            done.append(self._finished.popleft())
        return done

    def _complete(self, transfer: Transfer, error: BaseException | None) -> None:
        if error is None and transfer.then is not None:
            try:
                transfer.then_result = transfer.then()
            except Exception as exc:  # the copy's own failure: the engine keeps serving
                error = TransferError(f"{transfer.kind.value} of {transfer.num_blocks} blocks: after the copy: {exc}")
        transfer._finish(error)
        if error is None:
            self.bytes_by_kind[transfer.kind] += transfer.nbytes
            self.seconds_by_kind[transfer.kind] += (transfer.finished_s or 0.0) - transfer.submitted_s
        self._finished.append(transfer)  # deque.append is atomic under the GIL
        wakeup = self._wakeup
        if wakeup is not None:
            wakeup()

    @abstractmethod
    def _enqueue(self, job: CopyJob) -> None: ...

    @abstractmethod
    def close(self, timeout_s: float = 10.0) -> None: ...
