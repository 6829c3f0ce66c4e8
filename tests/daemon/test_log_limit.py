"""Client-caused log lines are capped per kind and summarised (daemon/access/log_limit.py), in the real daemon too."""

from __future__ import annotations

import logging

import pytest

from kvtier.client.client import Client, DaemonError, PoolLayout
from kvtier.daemon.access.log_limit import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_lines_past_the_cap_are_counted_and_summarised_in_the_next_window(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("t"), lines_per_window=3, window_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="t"):
        for i in range(50):
            limited.log("UNAUTHORIZED", "refused %d", i)
        limited.log("MALFORMED", "other kind")  # kinds are capped apart
        clock.now_s = 11.0
        limited.log("UNAUTHORIZED", "refused again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused 0", "refused 1", "refused 2", "other kind",
                     "47 more UNAUTHORIZED lines left out in the last 11 s", "refused again"]
    assert limited.suppressed_total == 47


def test_a_flood_of_refused_requests_writes_a_bounded_log(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = kvtierd_factory()
    layout = PoolLayout(model="m", block_size=4, block_bytes=1024, dtype="bfloat16", num_layers=1, kv_heads=1,
                        head_dim=8, mode="store")
    with Client(daemon.endpoint, "flood", layout) as c:
        for _ in range(500):
            with pytest.raises(DaemonError):
                c._call("lookup", {"hashes": [b"x" * 16], "hints": {"bogus": 1}})
        assert c.stats()["daemon"]["errors_total"]["code=INVALID_FIELD"] == 500  # every one answered and counted
    refused = [line for line in daemon.log().splitlines() if "INVALID_FIELD" in line]
    assert 0 < len(refused) <= 25, len(refused)
