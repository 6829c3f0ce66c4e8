"""Fixtures of the daemon tests beyond the suite's ``kvtierd*`` ones (tests/conftest.py): ``raw``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def raw(daemon) -> Iterator[zmq.Socket]:  # type: ignore[no-untyped-def]
    """A bare DEALER on the test module's ``daemon``, for hand-made messages."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    yield sock
    sock.close()
    ctx.term()
