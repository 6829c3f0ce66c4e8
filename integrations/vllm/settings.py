"""The connector's settings: vLLM's ``kv_connector_extra_config``, validated once.

Every key is optional. An unknown key or a bad value raises ``ValueError``
naming the key, so a typo in ``--kv-transfer-config`` fails vLLM's start-up
instead of being ignored. Each key is documented in ``docs/vllm.md``.

"Bad" includes every value that passes for a setting but would leave the
engine without kvtier for good, retrying: a socket no kvtierd can be at
(``ipc://``, ``x://y``; ``$KVTIER_SOCKET`` too, when it is the socket), a
``timeout_s`` no answer can meet, a ``token`` or ``model_id`` kvtierd's
hello refuses, ``staging_blocks`` past what an arena can hold, CURVE key
files that do not load. What needs the engine's KV layout is checked when
vLLM builds the connector, with the same kind of error: the pool name
``model_id`` makes (``pool.choose_pool``) and the staged plane's arena
against ``/dev/shm`` (``adapter.planes.StagedPlane``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.client.admin import SOCKET_ENV, endpoint_problem, resolve_endpoint
from kvtier.client.curve import CurveKeys, read_public_key
from kvtier.client.hashing import HASH_ALGOS
from kvtier.client.protocol import MAX_STR_LEN, MAX_TOKEN_LEN, ProtocolError, check_text
from kvtier.integrations.adapter.load_modes import ASYNC_EXTRA_STEPS, LOAD_MODES

DATA_PLANES = ("auto", "registered", "staged")
# Where the connector's settings live, for errors that name one.
SETTING_PREFIX = "kv_connector_extra_config."
# What the connector's links (adapter.link.DaemonLink) call this engine in hello, and the setting
# their "no kvtierd here" line names.
CLIENT_NAME = "vllm"
SOCKET_SETTING = SETTING_PREFIX + "socket"
# The registration of vLLM's KV tensors in kvtierd (adapter.planes; "-g<id>" per group of a hybrid engine).
REGISTRATION = "vllm-kv"
# Below this, no call to kvtierd answers in time on a loaded host: the engine would run without it for good.
MIN_TIMEOUT_S = 0.01
# attach_arena's num_slots (protocol.OPS): an arena of more slots is refused by every kvtierd.
MAX_STAGING_BLOCKS = 2**32 - 1


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    socket: str  # kvtierd's endpoint; default: $KVTIER_SOCKET, else kvtierd's default socket
    model_id: str | None = None  # names the pool; default: vLLM's served model name
    hash_algo: str = "xxh3_128"  # block keys: "xxh3_128" or "sha256" (tenants sharing a daemon)
    timeout_s: float = 1.0  # one call to kvtierd; past it the daemon counts as down
    retry_s: float = 2.0  # after a failure, calls are skipped (recompute) for this long
    data_plane: str = "auto"  # "registered": kvtierd copies in place; "staged": through an arena
    staging_blocks: int = 64  # arena size of the staged plane, in blocks
    # registered plane, CPU KV: copy CPU-tier blocks kvtierd lends, in this process (lent_restore.py);
    # "auto": where vLLM's layout takes a block in runs of 16 KiB or more; true: always; false: never
    lend: bool | str = "auto"
    # lent restores before the forward: the first layer at once, the rest beside the forward (layer_copies.py)
    layer_overlap: bool = False
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
        resolved = resolve_endpoint(socket) if socket is None or isinstance(socket, str) else socket
        problem = endpoint_problem(resolved)
        if problem is not None:
            source = "" if socket is not None else f" (from ${SOCKET_ENV})"
            raise ValueError(f"kv_connector_extra_config.socket{source}: {problem}")
        settings = cls(socket=resolved, **extra)
        settings._check()
        return settings

    def _check(self) -> None:
        def fail(key: str, why: str) -> None:
            got = "a secret, not shown" if key == "token" else repr(getattr(self, key))
            raise ValueError(f"kv_connector_extra_config.{key}: {why}, got {got:.200}")

        if self.hash_algo not in HASH_ALGOS:
            fail("hash_algo", f"one of {', '.join(HASH_ALGOS)}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not MIN_TIMEOUT_S <= self.timeout_s <= 3600:
            fail("timeout_s", f"a number of seconds in [{MIN_TIMEOUT_S:g}, 3600] (below it no call to kvtierd "
                              "answers in time, and the engine would run without kvtier)")
        if isinstance(self.retry_s, bool) or not isinstance(self.retry_s, (int, float)) or not 0 < self.retry_s <= 3600:
            fail("retry_s", "a number of seconds in (0, 3600]")
        if isinstance(self.lookup_wait_ms, bool) or not isinstance(self.lookup_wait_ms, (int, float)) \
                or not 0 <= self.lookup_wait_ms <= 1000:
            fail("lookup_wait_ms", "a number of milliseconds in [0, 1000]")
        if self.data_plane not in DATA_PLANES:
            fail("data_plane", f"one of {', '.join(DATA_PLANES)}")
        if self.lend not in (True, False, "auto") or (self.lend in (0, 1) and not isinstance(self.lend, bool)):
            fail("lend", "true, false or 'auto'")
        if not isinstance(self.layer_overlap, bool):
            fail("layer_overlap", "true or false")
        if self.load_mode not in LOAD_MODES:
            fail("load_mode", f"one of {', '.join(LOAD_MODES)}")
        if isinstance(self.async_extra_steps, bool) or not isinstance(self.async_extra_steps, (int, float)) \
                or not 0 < self.async_extra_steps <= 100:
            fail("async_extra_steps", "a number of engine steps in (0, 100]")
        for key, most in (("staging_blocks", MAX_STAGING_BLOCKS), ("events_max_blocks", None)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (most is not None and value > most):
                fail(key, "a positive number of blocks" + (f", at most {most}" if most is not None else ""))
        if isinstance(self.events_interval_s, bool) or not isinstance(self.events_interval_s, (int, float)) \
                or not 0.001 <= self.events_interval_s <= 60:
            fail("events_interval_s", "a number of seconds in [0.001, 60]")
        if self.load_failure_policy not in ("recompute", "fail"):
            fail("load_failure_policy", "'recompute' or 'fail'")
        if (self.curve_server_key is None) != (self.curve_secret_key_file is None):
            fail("curve_server_key", "CURVE needs both curve_server_key and curve_secret_key_file")
        if self.curve_server_key is not None:
            self._check_curve()
        # What kvtierd's hello takes (protocol.OPS): a longer value is refused at every connect.
        limits = {"model_id": MAX_STR_LEN, "token": MAX_TOKEN_LEN}
        for key, max_len in limits.items():
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, str):
                fail(key, "a non-empty string")
            try:
                check_text(key, value, max_len)
            except ProtocolError:
                fail(key, f"a string of 1..{max_len} characters (kvtierd's hello refuses "
                          f"others); this one has {len(value)}")

    def _check_curve(self) -> None:
        """Both key files load: a missing or malformed one would refuse every connect, for good."""
        try:
            read_public_key(self.curve_server_key)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise ValueError(f"kv_connector_extra_config.curve_server_key: kvtierd's public key (40 Z85 characters "
                             f"or its key file) does not load: {exc}") from None
        try:
            CurveKeys.load(self.curve_server_key, self.curve_secret_key_file)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise ValueError(f"kv_connector_extra_config.curve_secret_key_file: this engine's secret key file "
                             f"(kvtier keygen's NAME.key_secret) does not load: {exc}") from None

    def client_kwargs(self) -> dict[str, Any]:
        """What ``kvtier.client.Client`` takes besides endpoint, pool and layout."""
        return {
            "timeout_s": float(self.timeout_s),
            "token": self.token,
            "curve_server_key": self.curve_server_key,
            "curve_secret_key_file": self.curve_secret_key_file,
        }
