"""bench/vllm_timing.breakdown without vLLM: one request's TTFT cut at hand-made time stamps.

The benches (bench/vllm.py, bench/peers.py) report these parts per request and
their medians; each is checked here against events whose times are known.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))  # at the end: first, bench/vllm.py would shadow vLLM

from vllm_timing import breakdown  # noqa: E402


def scheduler_events() -> list[tuple]:
    return [("new", 0.001, 0.0012, 4242), ("lookup_done", 0.003, None, None),
            ("gnmt", 0.004, 0.0045, 256), ("alloc", 0.0046, 0.0047, 256)]


def test_a_load_inside_the_forward_step() -> None:
    events = sorted(scheduler_events() + [
        ("exec", 0.0050, 0.0500, 32), ("load", 0.0060, 0.0100, 2), ("model", 0.0101, 0.0450, None),
        ("save", 0.0460, 0.0470, None), ("sample", 0.0500, 0.0510, None)], key=lambda e: e[1])
    b = breakdown(0.0, 0.0520, events)
    assert b["ttft_ms"] == 52.0 and b["forward_step_ms"] == 46.0 and b["forward_tokens"] == 32
    assert b["load_ms"] == 4.0 and b["load_in_forward_ms"] == 4.0 and b["load_blocks"] == 2
    assert b["forward_without_load_ms"] == 42.0 and b["save_ms"] == 1.0
    assert b["arrival_to_answer_ms"] == 4.5 and b["answer_to_load_start_ms"] == 1.5
    assert b["rest_ms"] == round(52.0 - 4.5 - 4.0, 3)


def test_a_load_in_an_empty_step_before_the_forward() -> None:
    """A hybrid model's (gemma3) restore runs in the empty step before the forward: the answer -> load time is
    still reported (it was missing), and the forward step holds no load."""
    events = sorted(scheduler_events() + [
        ("exec", 0.0050, 0.0300, 0), ("load", 0.0060, 0.0290, 12), ("sample", 0.0300, 0.0301, None),
        ("exec", 0.0310, 0.1000, 32), ("model", 0.0320, 0.0990, None), ("sample", 0.1000, 0.1010, None)],
        key=lambda e: e[1])
    b = breakdown(0.0, 0.1020, events)
    assert b["empty_steps_before_forward"] == 1
    assert b["load_ms"] == 23.0 and b["load_in_forward_ms"] == 0.0 and b["load_blocks"] == 12
    assert b["forward_without_load_ms"] == b["forward_step_ms"] == 70.0
    assert b["answer_to_load_start_ms"] == 1.5


def test_no_connector_no_scheduler_parts() -> None:
    events = [("exec", 0.001, 0.2, 288), ("model", 0.002, 0.19, None), ("sample", 0.2, 0.201, None)]
    b = breakdown(0.0, 0.202, events)
    assert b["forward_step_ms"] == 200.0 and b["model_forward_ms"] == 188.0
    assert not {"load_ms", "arrival_to_answer_ms", "answer_to_load_start_ms", "rest_ms"} & set(b)
