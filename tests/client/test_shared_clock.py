"""shared_clock: a deadline crosses the wire only where the daemon reads the client's clock."""

from __future__ import annotations

import time

import pytest

from kvtier.client.shared_clock import WINDOW_SLACK_NS, boot_id, daemon_clock, shares_clock


def test_this_process_shares_its_own_clock() -> None:
    sent_ns = time.monotonic_ns()
    clock = daemon_clock()
    received_ns = time.monotonic_ns()
    assert clock["boot_id"] == boot_id() != ""
    assert shares_clock(clock, sent_ns, received_ns)


@pytest.mark.parametrize("change", [
    {"boot_id": "00000000-0000-0000-0000-000000000000"},  # another kernel
    {"monotonic_ns": -1},  # a reading before the hello went out: another time namespace
    {"monotonic_ns": "later"},
    {"monotonic_ns": True},
    {"boot_id": ""},
    {"boot_id": None},
], ids=["other-boot", "before-window", "str-reading", "bool-reading", "empty-boot", "no-boot"])
def test_anything_but_the_same_kernel_and_a_reading_inside_the_window_shares_nothing(change: dict) -> None:
    sent_ns = time.monotonic_ns()
    clock = {**daemon_clock(), **change}
    if clock.get("monotonic_ns") == -1:
        clock["monotonic_ns"] = sent_ns - 2 * WINDOW_SLACK_NS
    assert not shares_clock(clock, sent_ns, time.monotonic_ns())


def test_a_reading_after_the_reply_came_shares_nothing() -> None:
    sent_ns = time.monotonic_ns()
    received_ns = time.monotonic_ns()
    assert not shares_clock({"boot_id": boot_id(), "monotonic_ns": received_ns + 2 * WINDOW_SLACK_NS}, sent_ns, received_ns)
    assert not shares_clock(None, sent_ns, received_ns) and not shares_clock([], sent_ns, received_ns)
