"""The connector's settings: vLLM's ``kv_connector_extra_config``, validated once.

Every key is optional. An unknown key or a bad value raises ``ValueError``
naming the key, so a typo in ``--kv-transfer-config`` fails vLLM's start-up
instead of being ignored. Each key is documented in ``docs/vllm.md``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.client.admin import resolve_endpoint
from kvtier.client.hashing import HASH_ALGOS
from kvtier.integrations.vllm.load_modes import ASYNC_EXTRA_STEPS, LOAD_MODES

DATA_PLANES = ("auto", "registered", "staged")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    socket: str  # kvtierd's endpoint; default: $KVTIER_SOCKET, else kvtierd's default socket
    model_id: str | None = None  # names the pool; default: vLLM's served model name
    hash_algo: str = "xxh3_128"  # block keys: "xxh3_128" or "sha256" (tenants sharing a daemon)
    timeout_s: float = 1.0  # one call to kvtierd; past it the daemon counts as down
    retry_s: float = 2.0  # after a failure, calls are skipped (recompute) for this long
    data_plane: str = "auto"  # "registered": kvtierd copies in place; "staged": through an arena
    staging_blocks: int = 64  # arena size of the staged plane, in blocks
    token: str | None = None  # tenant token, when kvtierd serves tenants
    curve_server_key: str | None = None  # kvtierd's public key (tcp:// with CURVE)
    curve_secret_key_file: str | None = None  # this engine's secret key file
    load_failure_policy: str = "recompute"  # vLLM's kv_load_failure_policy while kvtier is used
    lookup_wait_ms: float = 3.0  # per scheduler step, how long new requests' lookups may be waited for
    load_mode: str = "adaptive"  # "sync": before the forward; "async": beside it; "adaptive": whichever costs less (load_modes.py)
    async_extra_steps: float = ASYNC_EXTRA_STEPS  # adaptive: engine steps an async load costs the arriving request
    events_interval_s: float = 0.1  # with vLLM's KV cache events on: how often kvtierd's are read
    events_max_blocks: int = 100_000  # with them on: blocks whose vLLM hashes are remembered for events

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        for key in extra:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"kv_connector_extra_config: unknown key {key!r}{hint}; known: {', '.join(sorted(known))}")
        socket = extra.pop("socket", None)
        if socket is not None and not (isinstance(socket, str) and "://" in socket):
            raise ValueError(f"kv_connector_extra_config.socket: expected an endpoint like ipc:///path or tcp://host:port, got {socket!r}")
        settings = cls(socket=resolve_endpoint(socket), **extra)
        settings._check()
        return settings

    def _check(self) -> None:
        def fail(key: str, why: str) -> None:
            raise ValueError(f"kv_connector_extra_config.{key}: {why}, got {getattr(self, key)!r}")

        if self.hash_algo not in HASH_ALGOS:
            fail("hash_algo", f"one of {', '.join(HASH_ALGOS)}")
        for key in ("timeout_s", "retry_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                fail(key, "a number of seconds in (0, 3600]")
        if isinstance(self.lookup_wait_ms, bool) or not isinstance(self.lookup_wait_ms, (int, float)) \
                or not 0 <= self.lookup_wait_ms <= 1000:
            fail("lookup_wait_ms", "a number of milliseconds in [0, 1000]")
        if self.data_plane not in DATA_PLANES:
            fail("data_plane", f"one of {', '.join(DATA_PLANES)}")
        if self.load_mode not in LOAD_MODES:
            fail("load_mode", f"one of {', '.join(LOAD_MODES)}")
        if isinstance(self.async_extra_steps, bool) or not isinstance(self.async_extra_steps, (int, float)) \
                or not 0 < self.async_extra_steps <= 100:
            fail("async_extra_steps", "a number of engine steps in (0, 100]")
        for key in ("staging_blocks", "events_max_blocks"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(key, "a positive number of blocks")
        if isinstance(self.events_interval_s, bool) or not isinstance(self.events_interval_s, (int, float)) \
                or not 0.001 <= self.events_interval_s <= 60:
            fail("events_interval_s", "a number of seconds in [0.001, 60]")
        if self.load_failure_policy not in ("recompute", "fail"):
            fail("load_failure_policy", "'recompute' or 'fail'")
        if (self.curve_server_key is None) != (self.curve_secret_key_file is None):
            fail("curve_server_key", "CURVE needs both curve_server_key and curve_secret_key_file")
        for key in ("model_id", "token"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, str) and value):
                fail(key, "a non-empty string")

    def client_kwargs(self) -> dict[str, Any]:
        """What ``kvtier.client.Client`` takes besides endpoint, pool and layout."""
        return {
            "timeout_s": float(self.timeout_s),
            "token": self.token,
            "curve_server_key": self.curve_server_key,
            "curve_secret_key_file": self.curve_secret_key_file,
        }
