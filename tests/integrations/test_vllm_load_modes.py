"""``load_mode``: when a load runs, before the forward or beside it (``integrations/adapter/load_modes.py``).

Pure: no vLLM, no daemon. The scheduler half's use of it runs against a live
kvtierd in ``test_vllm_scheduler.py``.
"""

from __future__ import annotations

import pytest

from kvtier.integrations.adapter.load_modes import ASYNC_EXTRA_STEPS, LOAD_MODES, AdaptiveLoads, make_load_mode


def busy(mode: AdaptiveLoads, running: int, step_s: float, steps: int = 3) -> None:
    """``steps`` scheduler steps ``step_s`` apart, each scheduling ``running`` requests."""
    t = 100.0 if mode._last_step_at_s is None else mode._last_step_at_s
    for _ in range(steps):
        t += step_s
        mode.observe_step(running, t)


def test_sync_and_async_ignore_what_they_are_told() -> None:
    sync, asyn = make_load_mode("sync"), make_load_mode("async")
    for mode in (sync, asyn):
        mode.observe_step(50, 1.0)
        mode.observe_load(10, 5.0)
    assert sync.background(32) is False
    assert asyn.background(32) is True and asyn.background(0) is False
    assert list(LOAD_MODES) == ["adaptive", "sync", "async"]  # the order the settings' error lists them


def test_adaptive_loads_before_the_forward_on_an_idle_engine() -> None:
    mode = AdaptiveLoads()
    assert mode.background(32) is False  # nothing ran yet
    mode.observe_load(32, 32.0)  # even a very slow restore: nobody else waits for it
    mode.observe_step(0, 1.0)
    assert mode.background(32) is False


def test_adaptive_loads_beside_the_forward_while_busy_until_it_has_measured() -> None:
    mode = AdaptiveLoads()
    mode.observe_step(4, 1.0)
    assert mode.step_s is None and mode.background(32) is True  # no step period yet
    busy(mode, 4, 0.05)
    assert mode.step_s == pytest.approx(0.05) and mode.background(32) is True  # no restore rate yet
    assert mode.background(0) is False  # nothing to load is never a background load (vLLM asserts it)


def test_adaptive_weighs_the_running_requests_stall_against_the_requests_extra_steps() -> None:
    mode = AdaptiveLoads()
    busy(mode, 4, 0.050)
    mode.observe_load(32, 0.0096)  # 0.3 ms a block: the 2-core bench's 4,096-token restore
    # 4 requests x 32 blocks x 0.3 ms = 38 ms of stall, against 2.5 steps of 50 ms: sync.
    assert mode.background(32) is False
    busy(mode, 40, 0.050, steps=1)  # 40 running: 384 ms of stall
    assert mode.background(32) is True
    # The boundary: stall = ASYNC_EXTRA_STEPS x the step period.
    boundary_blocks = ASYNC_EXTRA_STEPS * 0.050 / (40 * 0.0003)
    assert mode.background(int(boundary_blocks) - 1) is False
    assert mode.background(int(boundary_blocks) + 1) is True


def test_adaptive_measures_only_busy_step_periods_and_smooths_them() -> None:
    mode = AdaptiveLoads()
    busy(mode, 2, 0.04)
    mode.observe_step(0, mode._last_step_at_s + 5.0)  # an idle spell: not a step period
    mode.observe_step(2, mode._last_step_at_s + 7.0)  # the first busy step after it: nor this
    assert mode.step_s == pytest.approx(0.04)
    busy(mode, 2, 0.24, steps=1)  # one slow step moves the average a quarter of the way
    assert 0.04 < mode.step_s < 0.24 and mode.step_s == pytest.approx(0.04 + 0.25 * 0.20)


def test_a_small_loads_fixed_cost_weighs_by_its_blocks() -> None:
    """The 2-core bench's reports: 1 block in 3.3 ms (mostly the round trip), then 32 in 11.3 ms."""
    mode = AdaptiveLoads()
    mode.observe_load(1, 0.0033)
    mode.observe_load(32, 0.0113)
    assert mode.seconds_per_block is not None and mode.seconds_per_block < 0.001  # not 3.3 ms a block
    busy(mode, 4, 0.060)
    assert mode.background(32) is False  # 4 x 32 x 0.6 ms = 78 ms of stall < 2.5 steps of 60 ms


def test_adaptive_ignores_reports_of_nothing_restored() -> None:
    mode = AdaptiveLoads()
    mode.observe_load(0, 3.0)
    assert mode.seconds_per_block is None
    mode.observe_load(10, 0.01)
    mode.observe_load(0, 0.0)
    assert mode.seconds_per_block == pytest.approx(0.001)


def test_the_extra_steps_an_async_load_costs_are_a_setting() -> None:
    """On a GPU with vLLM's async scheduling the extra wait may be nearer one step (unmeasured)."""
    default, eager = make_load_mode("adaptive"), make_load_mode("adaptive", async_extra_steps=1.0)
    assert isinstance(default, AdaptiveLoads) and default.async_extra_steps == ASYNC_EXTRA_STEPS
    for mode in (default, eager):
        busy(mode, 4, 0.050)
        mode.observe_load(32, 0.0096)
    # 4 x 64 blocks x 0.3 ms = 77 ms of stall: above one 50 ms step, below 2.5 of them.
    assert default.background(64) is False and eager.background(64) is True
