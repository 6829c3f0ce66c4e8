"""The handler tables: a verb that needs a session is typed to get one, and the tables follow ``OPS``."""

from __future__ import annotations

import inspect

import pytest

from kvtier.client.protocol import OPS
from kvtier.daemon import handlers


def test_every_op_is_in_the_table_its_spec_says() -> None:
    for op, spec in OPS.items():
        in_session = op in handlers.SESSION_HANDLERS
        in_open = op in handlers.OPEN_HANDLERS
        assert in_session != in_open, op
        assert in_session == (spec.session == "required"), (op, spec.session)


def test_session_handlers_take_a_session_and_open_ones_none() -> None:
    # The wrappers (_names_disk, _packs_tiers) keep the wrapped signature (functools.wraps).
    for op, handler in handlers.SESSION_HANDLERS.items():
        params = inspect.signature(handler).parameters
        assert list(params) == ["ctx", "req", "session"], op
        assert params["session"].annotation == "Session", op  # not Optional: the server resolved it
    for op, open_handler in handlers.OPEN_HANDLERS.items():
        assert list(inspect.signature(open_handler).parameters) == ["ctx", "req"], op


def test_a_table_that_disagrees_with_ops_fails_on_import(monkeypatch: pytest.MonkeyPatch) -> None:
    handlers._check_tables()  # as shipped: agrees
    moved = dict(handlers.SESSION_HANDLERS)
    lookup = moved.pop("lookup")
    monkeypatch.setattr(handlers, "SESSION_HANDLERS", moved)
    with pytest.raises(RuntimeError, match="disagree with OPS"):
        handlers._check_tables()
    monkeypatch.setattr(handlers, "OPEN_HANDLERS", {**handlers.OPEN_HANDLERS, "lookup": lambda ctx, req: lookup})
    with pytest.raises(RuntimeError, match="disagree with OPS"):
        handlers._check_tables()
