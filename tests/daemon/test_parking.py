"""The parking lot: each parked request leaves once, and leaving undoes what parking counted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvtier.client.protocol import validate_request
from kvtier.daemon.clients.sessions import Session, SessionTable
from kvtier.daemon.handlers import Pending, Reply
from kvtier.daemon.handling.parking import Parked, ParkingLot


class _Op:
    """Stands in for ``tiers.pool.Op``: the lot only registers a done callback."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self.callbacks.append(fn)

    def finish(self) -> None:
        for fn in self.callbacks:
            fn(self)


def _parked(identity: bytes, session: Any, reply_bytes: int) -> tuple[Parked, _Op]:
    op = _Op()
    req = validate_request({"v": 1, "op": "health", "id": 7}, [])
    pending = Pending(op, lambda _op: Reply(), reply_bytes=reply_bytes)  # type: ignore[arg-type]
    return Parked(identity, req, pending, session, 0.0), op


@pytest.fixture
def session() -> Session:
    return SessionTable(lambda _s, _r: None).open("p", "test", 10.0)


def test_finished_requests_leave_once_with_their_counts(session: Session) -> None:
    lot = ParkingLot()
    a, op_a = _parked(b"conn-1", session, 1000)
    b, op_b = _parked(b"conn-1", session, 500)
    c, op_c = _parked(b"conn-2", None, 0)
    for p in (a, b, c):
        lot.park(p)
    assert len(lot) == 3 and session.in_flight == 2
    assert lot.reply_bytes(b"conn-1") == 1500 and lot.reply_bytes(b"conn-2") == 0

    assert list(lot.finished()) == []  # nothing done yet
    op_b.finish()
    assert list(lot.finished()) == [b]
    assert list(lot.finished()) == []  # once only
    assert lot.reply_bytes(b"conn-1") == 1000 and session.in_flight == 1 and len(lot) == 2

    op_a.finish()
    op_c.finish()
    assert list(lot.finished()) == [a, c]
    assert not lot and session.in_flight == 0 and lot.reply_bytes(b"conn-1") == 0


def test_take_all_answers_the_rest_and_their_ops_finish_later_without_effect(session: Session) -> None:
    lot = ParkingLot()
    a, op_a = _parked(b"conn-1", session, 64)
    b, op_b = _parked(b"conn-1", session, 0)
    lot.park(a)
    lot.park(b)
    op_a.finish()
    assert lot.take_all() == [a, b]  # the drain gave up on both, finished or not
    assert not lot and session.in_flight == 0 and lot.reply_bytes(b"conn-1") == 0
    op_b.finish()
    assert list(lot.finished()) == []  # already answered by the drain: no second reply
    assert session.in_flight == 0
