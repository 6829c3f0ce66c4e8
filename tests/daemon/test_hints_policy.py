"""Hints through a live kvtierd reach a session-aware CPU-tier policy and change what it keeps."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.client.client import Client, PoolLayout
from kvtier.client.protocol import Hints

BLOCK = 1024


def layout() -> PoolLayout:
    return PoolLayout(model="m", block_size=4, block_bytes=BLOCK, dtype="bfloat16", num_layers=1, kv_heads=1,
                      head_dim=8, mode="store")


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def run(daemon, pool: str, retain: bool, token: str | None = None, session: str = "r") -> tuple[list[str], list[str]]:  # type: ignore[no-untyped-def]
    """Store a chain R (retained or not), then a chain U, then fillers that overflow the CPU tier; R's and U's tiers."""
    r, u = chain(1, 2), chain(2, 2)
    with Client(daemon.endpoint, pool, layout(), **({"token": token} if token else {})) as c:
        c.store(r, bytes(2 * BLOCK), hints=Hints(session=session, retain_s=600.0) if retain else None)
        c.store(u, bytes(2 * BLOCK))
        for tag in range(10, 18):  # 16 more blocks through a 2-block GPU tier and an 8-block CPU tier
            c.store(chain(tag, 2), bytes(2 * BLOCK))
        return list(c.lookup(r)), list(c.lookup(u))


def test_a_retained_chain_outlives_an_older_unhinted_one_under_lru_session(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    d = kvtierd_factory(gpu_bytes=2 * BLOCK, cpu_bytes=8 * BLOCK, policy="lru+session", clean_ahead_blocks=0)
    kept, lost = run(d, "with-hint", retain=True)
    assert kept == ["cpu", "cpu"], kept  # retained: evicted after every unhinted block
    assert lost == [], lost
    # The same traffic without the hint: plain LRU order, R (older) goes first.
    kept, _ = run(d, "without-hint", retain=False)
    assert kept == [], kept


def test_hints_reach_the_policy_under_tenant_quotas(kvtierd_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With tenants the pool's policy is wrapped for quotas; the wrapper passes the hints on (it once dropped them)."""
    token = "alice-token-0123456789abcdef0123"
    config = tmp_path / "tenants.toml"
    config.write_text(f'[tenants.alice]\ntoken = "{token}"\n')
    os.chmod(config, 0o600)
    d = kvtierd_factory(gpu_bytes=2 * BLOCK, cpu_bytes=8 * BLOCK, policy="lru+session", clean_ahead_blocks=0,
                        config=config)
    kept, lost = run(d, "with-hint", retain=True, token=token)
    assert kept == ["cpu", "cpu"], kept
    assert lost == [], lost


def test_a_session_key_of_256_characters_reaches_the_policy_for_a_tenant_with_a_long_name(kvtierd_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """docs/protocol.md 2.6 takes 1..256 characters; kvtierd once put the tenant's name in front of the key and
    answered a 256-byte key INTERNAL (257 bytes past the tiers' bound), and 256 characters of 4-byte UTF-8 too."""
    token = "tenant-token-0123456789abcdef0123"
    tenant = "t" * 64  # the longest tenant name the configuration takes
    config = tmp_path / "tenants.toml"
    config.write_text(f'[tenants.{tenant}]\ntoken = "{token}"\n')
    os.chmod(config, 0o600)
    d = kvtierd_factory(gpu_bytes=2 * BLOCK, cpu_bytes=8 * BLOCK, policy="lru+session", clean_ahead_blocks=0,
                        config=config)
    for i, key in enumerate(["k" * 256, "\U0001f600" * 256]):
        kept, lost = run(d, f"long-{i}", retain=True, token=token, session=key)
        assert kept == ["cpu", "cpu"], kept  # the retention hint worked, under that key
        assert lost == [], lost
    assert "INTERNAL" not in d.log()
