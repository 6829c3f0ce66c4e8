"""One shape for a pool's settings, one default everywhere (issue 36, item 4).

Before: the configuration's ``PoolSettings``, the daemon's ``PoolSizing`` and
``TieredPool``'s constructor each had defaults of their own (``PoolSizing``
and ``TieredPool`` built ``"lru"`` pools while the product default was
``"chain"``), and ``RemoteTierSettings`` reached no pool but with its
defaults. Now the configuration produces a ``PoolSettings``, the daemon
sizes it and builds the pool from it, and every default comes from
``kvtier.tiers.pool_defaults``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from kvtier.daemon.config import PoolDefaults, PoolSettings, load_config
from kvtier.daemon.pooling.pools import PoolRegistry
from kvtier.daemon.server import ServeOptions
from kvtier.tiers.pool import TieredPool
from kvtier.tiers.pool_defaults import DEFAULT_CLEAN_AHEAD_BLOCKS, DEFAULT_POLICY
from kvtier.tools.replay.core import ReplayConfig

ENV: Mapping[str, str] = {"XDG_RUNTIME_DIR": "/run/user/1000"}
BLOCK = 1024
LAYOUT = {"model": "m", "block_size": 4, "block_bytes": BLOCK, "dtype": "bfloat16", "num_layers": 1, "kv_heads": 1,
          "head_dim": 8, "mode": "store"}


def test_one_default_everywhere() -> None:
    pool = inspect.signature(TieredPool).parameters
    replay = {f.name: f.default for f in dataclasses.fields(ReplayConfig)}
    served = ServeOptions(endpoint="ipc://@unused").sizing_for("x", 0)
    configured = load_config([], ENV).pool_settings("x")
    for name, default in (("policy", DEFAULT_POLICY), ("clean_ahead_blocks", DEFAULT_CLEAN_AHEAD_BLOCKS)):
        assert pool[name].default == default, f"TieredPool's {name}"
        assert getattr(PoolDefaults(), name) == getattr(PoolSettings("x"), name) == default, name
        assert getattr(configured, name) == getattr(served, name) == default, name
    assert replay["policy"] == DEFAULT_POLICY
    # The configuration's defaults are the shape's own: an empty configuration is PoolSettings' defaults.
    assert configured == PoolSettings("x")


def test_sized_settings_are_bytes_and_the_rest_unchanged() -> None:
    s = load_config(["--cpu-bytes", "25%", "--policy", "lru+admit2"], ENV).pool_settings("x")
    sized = s.sized(on_cuda=False, available_bytes=8 << 30)
    assert (sized.cpu_bytes, sized.gpu_bytes) == (2 << 30, 256 << 20)
    assert dataclasses.replace(sized, cpu_bytes=s.cpu_bytes, gpu_bytes=s.gpu_bytes) == s
    assert sized.sized(on_cuda=True, available_bytes=1) == sized  # once sized, sizes stay put


def test_the_registry_builds_each_pool_from_its_settings_remote_tier_included(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    pytest.importorskip("blake3")
    secret_file = tmp_path / "remote.remote_secret"
    secret_file.write_text("ab" * 32 + "\n")
    os.chmod(secret_file, 0o600)
    config = tmp_path / "kvtierd.toml"
    # Port 1: nothing listens; the tier starts unavailable and never raises for it.
    config.write_text(f'remote_secret_key_file = "{secret_file}"\nremote_timeout_s = 0.25\nremote_ttl_s = 60\n'
                      '[default_pool]\npolicy = "lru+admit2"\nclean_ahead_blocks = 3\n'
                      '[pools.remote]\nremote_url = "redis://127.0.0.1:1/0"\n')
    cfg = load_config(["--config", str(config)], ENV)
    sized: list[str] = []

    def sizing_for(name: str, reusable_bytes: int = 0) -> PoolSettings:
        sized.append(name)
        return cfg.pool_settings(name).sized(on_cuda=False, available_bytes=1 << 30)

    registry = PoolRegistry(device="cpu", sizing_for=sizing_for, remote_secret=bytes.fromhex("ab" * 32))
    try:
        remote = registry.get_or_create("remote", LAYOUT).pool
        plain = registry.get_or_create("plain", LAYOUT).pool
        assert sized == ["remote", "plain"]
        assert remote.remote is not None and remote.remote.settings == cfg.remote_settings
        assert (remote.remote.settings.timeout_s, remote.remote.settings.ttl_s) == (0.25, 60)
        assert plain.remote is None
        for pool in (remote, plain):
            assert pool.cpu.policy.name == "admit2" and pool.clean_ahead_blocks == 3
            assert pool.cpu_blocks == cfg.pool_settings("x").resolve_cpu_bytes(1 << 30) // BLOCK
    finally:
        registry.close_all(5.0)


def test_a_remote_tier_without_its_secret_is_refused_before_anything_is_built() -> None:
    registry = PoolRegistry(device="cpu", sizing_for=lambda name, reusable_bytes=0: PoolSettings(
        name, gpu_bytes=4 * BLOCK, cpu_bytes=4 * BLOCK, remote_url="redis://127.0.0.1:1/0"))
    with pytest.raises(ValueError, match="remote_secret_key_file"):
        registry.get_or_create("p", LAYOUT)
    assert len(registry) == 0
