"""bench/protocol_hops.py without processes: how client calls meet the server's records, and the hops."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))  # at the end: first, bench/vllm.py would shadow vLLM

from protocol_hops import HOPS, _hops  # noqa: E402


def test_each_call_meets_the_record_received_inside_it_and_its_hops_add_up() -> None:
    # Two serial calls (client: start, send start, send end, reply held, end) and the server's records
    # (poll returned, received, send started, send returned), given out of order; the second call's
    # server returned from its send only after the client held the reply (a sender woken late).
    calls = [(0.0, 1.0, 2.0, 20.0, 21.0), (30.0, 32.0, 33.0, 50.0, 54.0)]
    server = [(36.0, 37.0, 40.0, 60.0), (5.0, 6.0, 16.0, 17.0), (100.0, 101.0, 102.0, 103.0)]
    hops = _hops(calls, server)
    assert list(hops) == list(HOPS)
    assert hops["client, before its send"] == [1.0, 2.0]
    assert hops["client send call"] == [1.0, 1.0]
    assert hops["request: send -> server's poll returns"] == [3.0, 3.0]
    assert hops["server receive"] == [1.0, 1.0]
    assert hops["server work (request to reply)"] == [10.0, 3.0]
    assert hops["reply: server's send -> client holds it"] == [4.0, 10.0]
    assert hops["client, after"] == [1.0, 4.0]
    assert hops["round trip"] == [21.0, 24.0]
    parts = [h for h in HOPS if h != "round trip"]
    for i in range(2):
        assert sum(hops[h][i] for h in parts) == pytest.approx(hops["round trip"][i])


def test_a_call_with_no_record_inside_it_is_left_out() -> None:
    hops = _hops([(0.0, 1.0, 2.0, 20.0, 21.0)], [(50.0, 51.0, 52.0, 53.0)])
    assert all(v == [] for v in hops.values())
