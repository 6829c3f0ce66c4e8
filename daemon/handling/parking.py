"""Requests waiting for their copies: the loop's parking lot.

Contract:

- A handler whose copies are in flight returns ``Pending``; the loop
  ``park``s the request with it. The op's done callback (any thread) only
  appends the request's serial to a list; the loop takes the finished ones
  with ``finished()`` and sends each exactly one reply.
- Every parked request leaves through exactly one of ``finished()`` (its op
  is done) or ``take_all()`` (the drain gave up on it). Leaving undoes what
  parking did: the session's ``in_flight`` count and the connection's
  ``reply_bytes``.
- ``reply_bytes(identity)``: the payload the connection's parked replies
  will carry once their copies finish (``Pending.reply_bytes``), which the
  loop counts against ``max_unread_reply_bytes`` with the replies libzmq
  has not sent yet; ``reply_bytes_total``, all connections' together
  (against ``max_unread_reply_bytes_total``: staging buffers, memory the
  daemon allocated for them).
- Single-threaded but for the done callback, as above.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.client.protocol import Request
from kvtier.daemon.clients.sessions import Session
from kvtier.daemon.handling.handler_context import Pending

__all__ = ["Parked", "ParkingLot"]


@dataclass(eq=False)
class Parked:
    identity: bytes  # the connection's ROUTER identity: where the reply goes
    req: Request
    pending: Pending
    session: Session | None
    started_s: float


class ParkingLot:
    """See the module docstring."""

    def __init__(self) -> None:
        self._serial = itertools.count(1)
        self._parked: dict[int, Parked] = {}
        self._reply_bytes: dict[bytes, int] = {}  # per connection
        self.reply_bytes_total = 0
        self._done: deque[int] = deque()  # serials whose op finished (appended from copy threads)

    def __len__(self) -> int:
        return len(self._parked)

    def __bool__(self) -> bool:
        return bool(self._parked)

    def park(self, parked: Parked) -> None:
        serial = next(self._serial)
        self._parked[serial] = parked
        nbytes = parked.pending.reply_bytes
        if nbytes:
            self._reply_bytes[parked.identity] = self._reply_bytes.get(parked.identity, 0) + nbytes
            self.reply_bytes_total += nbytes
        if parked.session is not None:
            parked.session.in_flight += 1
        parked.pending.op.add_done_callback(lambda _op, s=serial: self._done.append(s))

    def reply_bytes(self, identity: bytes) -> int:
        return self._reply_bytes.get(identity, 0)

    def finished(self) -> Iterator[Parked]:
        """The parked requests whose ops are done, each once, unparked."""
        while self._done:
            parked = self._parked.pop(self._done.popleft(), None)
            if parked is None:
                continue  # already taken by the drain
            self._unpark(parked)
            yield parked

    def take_all(self) -> list[Parked]:
        """Every request still parked, unparked (the drain answers them)."""
        taken = list(self._parked.values())
        self._parked.clear()
        for parked in taken:
            self._unpark(parked)
        return taken

    def _unpark(self, parked: Parked) -> None:
        if parked.session is not None:
            parked.session.in_flight -= 1
        nbytes = parked.pending.reply_bytes
        if nbytes:
            self.reply_bytes_total -= nbytes
            left = self._reply_bytes[parked.identity] - nbytes
            if left:
                self._reply_bytes[parked.identity] = left
            else:
                del self._reply_bytes[parked.identity]
