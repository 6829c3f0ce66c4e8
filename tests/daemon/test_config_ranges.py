"""Every config value is checked against the range the code can use, at load time (issue 32, item 6).

Before: ``max_message_bytes = 2^63`` and ``poll_interval_s = 1e9`` passed
``--print-config`` and crashed kvtierd at bind and at its first poll;
``lease_s = 1e-300`` gave a daemon whose sessions expired before their
first request; a TOML nested 5,000 deep was a ``RecursionError``
traceback; and per-peer caps above the total, a wrapper named twice, an
unclosed IPv6 bracket or port 99999 in a Redis URL, ``clean_ahead_blocks =
10^12``, ``device = cuda:99``, pool names no ``hello`` can send and a
metrics endpoint on every interface all loaded without a word. Now each is
exit 2 with ``kvtierd: config error: <key>: ...`` (the metrics host: a
warning line), from the real ``kvtierd`` (``--print-config`` and a start).
"""

from __future__ import annotations

import io
import os
import resource
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

from kvtier.daemon.access.descriptors import FdBudget
from kvtier.daemon.config import ConfigError, load_config, load_config_or_exit
from kvtier.daemon.config.host import check_gpu_bytes
from kvtier.daemon.config.schema import MAX_CLEAN_AHEAD_BLOCKS, POOL_KEYS, TOP_KEYS
from kvtier.tiers.policies import make_policy

ENV: Mapping[str, str] = {"XDG_RUNTIME_DIR": "/run/user/1000"}
REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "kvtierd.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(argv: list[str], environ: Mapping[str, str] = ENV) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(argv, environ)
    return info.value


# (TOML, the key named, words of the message)
OUT_OF_RANGE = [
    ("lease_s = 1e-300", "lease_s", "0.1..3600"),
    ("lease_s = 7200", "lease_s", "0.1..3600"),
    ("heartbeat_s = 0.001", "heartbeat_s", "0.01"),
    ("poll_interval_s = 1e9", "poll_interval_s", "0.001..1 seconds"),
    ("poll_interval_s = 0.0001", "poll_interval_s", "whole milliseconds"),
    ("drain_timeout_s = 1e300", "drain_timeout_s", "0..3600"),
    (f"max_message_bytes = {2**63}", "max_message_bytes", "more than this host's memory"),
    ('max_unread_reply_bytes = "1024TiB"', "max_unread_reply_bytes", "more than this host's memory"),
    (f"max_shm_files_per_session = {2**40}", "max_shm_files_per_session", "in 1..1048576"),
    (f"max_registrations_per_session = {2**40}", "max_registrations_per_session", "in 1..1048576"),
    ("max_pools = 1000000000", "max_pools", "in 1..2097152"),
    ("max_connections = 10\nmax_connections_per_peer = 11", "max_connections_per_peer", "more than max_connections (10)"),
    ('[default_pool]\npolicy = "chain+session+session"', "default_pool.policy", "named twice"),
    ('[pools.x]\npolicy = "lru+admit2+admit2"', "pools.x.policy", "named twice"),
    ('[default_pool]\nremote_url = "redis://[::1"', "default_pool.remote_url", "Invalid IPv6 URL"),
    ('[default_pool]\nremote_url = "redis://h:99999/0"', "default_pool.remote_url", "1..65535"),
    ('[default_pool]\nremote_url = "redis://h:0/0"', "default_pool.remote_url", "1..65535"),
    ('[default_pool]\nremote_url = "redis://h:6379/zero"', "default_pool.remote_url", "not a number"),
    ('[pools.x]\nremote_url = "redis+cluster://h:7000,h:99999"', "pools.x.remote_url", "1..65535"),
    ('[pools.x]\nremote_url = "unix://relative.sock"', "pools.x.remote_url", "absolute"),
    (f"[default_pool]\nclean_ahead_blocks = {10**12}", "default_pool.clean_ahead_blocks", "in 0..8388608"),
    (f'[pools."{"m" * 129}"]\ncpu_bytes = 1', f'pools.{"m" * 129}', "no hello can name this pool"),
    ('metrics_host = "not a host!"', "metrics_host", "IP address"),
    ("cpu_budget_bytes = 0", "cpu_budget_bytes", "NO_SPACE"),
    ('cpu_budget_bytes = "1GiB"\n[default_pool]\ncpu_bytes = "2GiB"', "cpu_budget_bytes",
     "less than default_pool.cpu_bytes"),
    ('cpu_budget_bytes = "1GiB"\n[pools.big]\ncpu_bytes = "2GiB"', "cpu_budget_bytes", "less than pools.big.cpu_bytes"),
    ('socket = "tcp://127.0.0.1:9400"\ninsecure_tcp = true\nmetrics_port = 9400', "metrics_port", "socket's port"),
    ('[default_pool]\nremote_url = "redis://127.0.0.1:6379/0"', "remote_secret_key_file", "kvtier keygen"),
    ('remote_secret_key_file = "/nonexistent/remote.secret"\n[pools.x]\nremote_url = "redis://h/0"',
     "remote_secret_key_file", "does not exist"),
    ('[default_pool]\ndisk_dir = "relative/dir"', "default_pool.disk_dir", "absolute"),
    ('[default_pool]\ndisk_dir = "/tmp/kvtier-disk"\ndisk_bytes = "1KiB"', "default_pool.disk_bytes", "1MiB..1024TiB"),
    ('[pools.x]\ndisk_bytes = "2048TiB"', "pools.x.disk_bytes", "1MiB..1024TiB"),
    ('[pools.x]\ndisk_dir = "/etc/hostname/kvtier"', "pools.x.disk_dir", "/etc/hostname is not a directory"),
    ('[default_pool]\ndisk_dir = "/tmp/kvtier-disk"\ndisk_bytes = "1023TiB"', "default_pool.disk_bytes",
     "more than the whole filesystem"),
    ('[default_pool]\ndisk_bytes = "1023TiB"\n[pools.x]\ndisk_dir = "/tmp/kvtier-disk"', "default_pool.disk_bytes",
     "more than the whole filesystem"),
    ("remote_writer_threads = 0", "remote_writer_threads", "in 1..64"),
    ("remote_reader_threads = 65", "remote_reader_threads", "in 1..64"),
    (f"remote_write_queue_blocks = {2**21}", "remote_write_queue_blocks", "in 1..1048576"),
    ("remote_write_batch_blocks = 0", "remote_write_batch_blocks", "in 1..4096"),
    ("remote_ttl_s = 0", "remote_ttl_s", "in 1..315360000"),
    ("remote_ttl_s = 1.5", "remote_ttl_s", "integer"),
    (f"remote_fetch_round_trip_bytes = {2**63}", "remote_fetch_round_trip_bytes", "more than this host's memory"),
    ("remote_timeout_s = 0", "remote_timeout_s", "> 0 seconds"),
    ("remote_timeout_s = 3600", "remote_timeout_s", "0.001..60 seconds"),
    ("remote_connect_timeout_s = 1e300", "remote_connect_timeout_s", "0.001..60 seconds"),
    ("remote_max_connections = 100000", "remote_max_connections", "in 1..4096"),
    ("remote_retry_initial_s = 10\nremote_retry_max_s = 5", "remote_retry_max_s", "less than remote_retry_initial_s"),
    ("remote_retry_max_s = 1e9", "remote_retry_max_s", "0.001..3600 seconds"),
    ("remote_retry_jitter_fraction = 1.0", "remote_retry_jitter_fraction", "[0, 1)"),
    ("remote_retry_jitter_fraction = -0.1", "remote_retry_jitter_fraction", "[0, 1)"),
    ("remote_health_interval_s = 0.001", "remote_health_interval_s", "0.01..3600 seconds"),
]


@pytest.mark.parametrize("toml, key, words", OUT_OF_RANGE)
def test_values_outside_what_the_code_can_use_name_their_key(tmp_path: Path, toml: str, key: str, words: str) -> None:
    err = error_of(["--config", str(write(tmp_path, toml + "\n"))])
    assert err.key == key, err
    assert words in err.message, err


def test_the_bounds_themselves_load(tmp_path: Path) -> None:
    cfg = load_config(["--config", str(write(tmp_path, """
        lease_s = 3600
        heartbeat_s = 0.01
        poll_interval_s = 1
        drain_timeout_s = 3600
        max_shm_files_per_session = 1048576
        max_connections = 10
        max_connections_per_peer = 10
        cpu_budget_bytes = "2GiB"
        metrics_host = "::1"
        [default_pool]
        clean_ahead_blocks = 8388608
        cpu_bytes = "2GiB"
        policy = "lru+admit2+session"
        [pools."%s"]
        cpu_bytes = 1
        """ % ("m" * 128)))], ENV)
    assert (cfg.lease_s, cfg.poll_interval_s, cfg.default_pool.clean_ahead_blocks) == (3600, 1, 8388608)
    assert load_config(["--lease-s", "0.1"], ENV).lease_s == 0.1
    assert load_config(["--poll-interval-s", "0.001"], ENV).poll_interval_s == 0.001


def test_the_remote_tier_settings_are_an_operators_to_set(tmp_path: Path) -> None:
    """Issue 36 item 4: RemoteTierSettings from the file, the environment and flags, into every pool's settings."""
    from kvtier.tiers.remote.settings import RemoteTierSettings

    assert load_config([], ENV).pool_settings("x").remote == RemoteTierSettings()  # the defaults are its own
    cfg = load_config(["--config", str(write(tmp_path, """
        remote_write_queue_blocks = 4096
        remote_writer_threads = 4
        remote_write_batch_blocks = 64
        remote_ttl_s = 3600
        remote_reader_threads = 2
        remote_fetch_round_trip_bytes = "16MiB"
        remote_timeout_s = 1.5
        remote_connect_timeout_s = 2
        remote_max_connections = 8
        remote_retry_initial_s = 0.1
        remote_retry_max_s = 30
        remote_retry_jitter_fraction = 0
        remote_health_interval_s = 10
        """)), "--remote-timeout-s", "0.75"], {**ENV, "KVTIER_REMOTE_MAX_CONNECTIONS": "16"})
    want = RemoteTierSettings(write_queue_blocks=4096, writer_threads=4, write_batch_blocks=64, ttl_s=3600,
                              reader_threads=2, fetch_round_trip_bytes=16 << 20, timeout_s=0.75,
                              connect_timeout_s=2, max_connections=16, retry_initial_s=0.1, retry_max_s=30,
                              retry_jitter_fraction=0, health_interval_s=10)
    assert cfg.remote_settings == want
    assert cfg.pool_settings("x").remote == cfg.pool_settings("other").remote == want
    assert load_config(["--remote-ttl-s", "off"], ENV).remote_settings.ttl_s is None


def test_per_peer_cap_against_the_automatic_total() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    auto = FdBudget.of(1 << 20 if hard == resource.RLIM_INFINITY else hard).connections
    assert load_config(["--max-connections-per-peer", str(auto)], ENV).max_connections_per_peer == auto
    err = error_of(["--max-connections-per-peer", str(auto + 1)])
    assert err.key == "max_connections_per_peer" and "'auto' here" in err.message


def test_a_toml_nested_5000_deep_is_a_config_error(tmp_path: Path) -> None:
    for value in ("[" * 5000 + "]" * 5000, "{a = " * 5000 + "1" + "}" * 5000):
        err = error_of(["--config", str(write(tmp_path, f"lease_s = {value}\n"))])
        assert err.key == "config" and "nested too deeply" in err.message


def test_policies_name_each_wrapper_once() -> None:
    with pytest.raises(ValueError, match="named twice"):
        make_policy("chain+session+session", 8)
    assert make_policy("lru+admit2+session", 8) is not None


def test_clean_ahead_bound_is_the_gpu_tiers_block_bound() -> None:
    from kvtier.daemon.pooling.pools import MAX_BLOCKS_PER_TIER

    assert MAX_CLEAN_AHEAD_BLOCKS == MAX_BLOCKS_PER_TIER


# ---- the host: device, GPU-tier size ----------------------------------------------------------


def test_a_cuda_device_this_host_lacks_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def exit_text(argv: list[str]) -> str:
        err = io.StringIO()
        with pytest.raises(SystemExit) as info:
            load_config_or_exit(argv, ENV, stderr=err)
        assert info.value.code == 2
        return err.getvalue()

    if not torch.cuda.is_available():
        assert "device: cuda:0, but CUDA is not available" in exit_text(["--device", "cuda"])
    # The count is torch's (CUDA_VISIBLE_DEVICES applies): a host that sees two devices.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "sees 2 CUDA devices (cuda:0..cuda:1" in exit_text(["--device", "cuda:99"])
    assert "kvtierd: config error: device: cuda:2," in exit_text(["--device", "cuda:2"])
    assert load_config_or_exit(["--device", "cuda:1"], ENV).device == "cuda:1"


def test_gpu_bytes_past_the_device_is_refused() -> None:
    cfg = load_config(["--gpu-bytes", "1024TiB"], ENV)
    with pytest.raises(ConfigError) as info:
        check_gpu_bytes(cfg, "cpu")
    assert info.value.key == "default_pool.gpu_bytes" and "host's memory" in info.value.message
    check_gpu_bytes(load_config(["--gpu-bytes", "1GiB"], ENV), "cpu")
    check_gpu_bytes(load_config([], ENV), "cpu")  # auto: sized by the daemon


# ---- the real kvtierd -------------------------------------------------------------------------


def kvtierd(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["XDG_RUNTIME_DIR"] = str(cwd)
    return subprocess.run([sys.executable, "-m", "kvtier.daemon", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


# The issue's examples, as flags (a file for the nesting); each both with --print-config and as a start.
ISSUE_EXAMPLES = [
    (["--max-message-bytes", str(2**63)], "max_message_bytes"),
    (["--poll-interval-s", "1e9"], "poll_interval_s"),
    (["--lease-s", "1e-300"], "lease_s"),
    (["--max-connections", "8", "--max-connections-per-peer", "9"], "max_connections_per_peer"),
    (["--policy", "chain+session+session"], "default_pool.policy"),
    (["--remote-url", "redis://[::1"], "default_pool.remote_url"),
    (["--remote-url", "redis://127.0.0.1:99999/0"], "default_pool.remote_url"),
    (["--clean-ahead-blocks", str(10**12)], "default_pool.clean_ahead_blocks"),
    (["--device", "cuda:99"], "device"),
    (["--pool", "p" * 129, "cpu_bytes=1"], f"pools.{'p' * 129}"),
    (["--remote-url", "redis://127.0.0.1:6379/0"], "remote_secret_key_file"),
]


@pytest.mark.parametrize("print_config", [True, False], ids=["print-config", "start"])
def test_kvtierd_exits_2_naming_the_key(tmp_path: Path, print_config: bool) -> None:
    deep = write(tmp_path, "lease_s = " + "[" * 5000 + "]" * 5000 + "\n", "deep.toml")
    for args, key in [*ISSUE_EXAMPLES, (["--config", str(deep)], "config")]:
        argv = [*args, "--print-config"] if print_config else args
        result = kvtierd(argv, tmp_path)
        assert result.returncode == 2, (args, result.returncode, result.stderr[-2000:])
        assert result.stderr.startswith(f"kvtierd: config error: {key}: "), (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr[-2000:]


def test_kvtierd_warns_about_a_metrics_endpoint_beyond_loopback(tmp_path: Path) -> None:
    result = kvtierd(["--metrics-port", "9464", "--metrics-host", "0.0.0.0", "--print-config"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("kvtierd: config warning: metrics_host: 0.0.0.0 is not a loopback address")
    quiet = kvtierd(["--metrics-port", "9464", "--metrics-host", "127.0.0.1", "--print-config"], tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == ""
    off = kvtierd(["--metrics-host", "0.0.0.0", "--print-config"], tmp_path)  # no endpoint: nothing exposed
    assert off.returncode == 0 and off.stderr == ""


def test_kvtierd_refuses_a_gpu_tier_larger_than_the_device_at_start(tmp_path: Path) -> None:
    result = kvtierd(["--device", "cpu", "--gpu-bytes", "1024TiB"], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "kvtierd: config error: default_pool.gpu_bytes: is 1TiB" not in result.stderr
    assert "config error: default_pool.gpu_bytes: is 1024TiB, more than this host's memory" in result.stderr


# ---- every key documented ---------------------------------------------------------------------


def test_every_key_is_in_the_example_file_and_the_operating_guide() -> None:
    example = (REPO / "systemd" / "kvtierd.toml").read_text()
    guide = (REPO / "docs" / "operating.md").read_text()
    for name in [*TOP_KEYS, *POOL_KEYS]:
        assert f"{name} = " in example, f"systemd/kvtierd.toml lacks {name}"
        assert f"`{name}`" in guide, f"docs/operating.md lacks {name}"
