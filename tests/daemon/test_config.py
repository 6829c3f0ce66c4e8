"""Tests for kvtier.daemon.config: sources, precedence, sizes, validation, printing."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.tiers.policies import DEFAULT_POLICY
from kvtier.daemon.config import (
    ConfigError,
    DaemonConfig,
    MemoryFraction,
    PoolDefaults,
    PoolOverrides,
    build_arg_parser,
    default_socket,
    exit_on_config_error,
    format_config,
    load_config,
    load_config_or_exit,
    parse_byte_size,
)
from kvtier.tiers.units import format_byte_size

GiB = 1024**3
MiB = 1024**2
ENV: Mapping[str, str] = {"XDG_RUNTIME_DIR": "/run/user/1000"}


def write(tmp_path: Path, text: str, name: str = "kvtierd.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(argv: list[str], environ: Mapping[str, str] = ENV) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(argv, environ)
    return info.value


# -- defaults ----------------------------------------------------------------------------------


def test_defaults_with_no_file_env_or_flags() -> None:
    cfg = load_config([], ENV)
    assert cfg.socket == "ipc:///run/user/1000/kvtier/kvtierd.sock"
    assert cfg.ipc_path == Path("/run/user/1000/kvtier/kvtierd.sock")
    assert not cfg.is_tcp
    assert cfg.lease_s == 10.0
    assert cfg.heartbeat_s is None
    assert cfg.recommended_heartbeat_s == pytest.approx(10.0 / 3)
    assert cfg.poll_interval_s == 0.05
    assert cfg.drain_timeout_s == 10.0
    assert cfg.max_message_bytes == 256 * MiB
    assert cfg.log_level == "info"
    assert cfg.device == "auto"
    assert cfg.metrics_port is None
    assert cfg.metrics_host == "127.0.0.1"
    assert cfg.insecure_tcp is False
    assert cfg.curve_secret_key_file is None and cfg.curve_public_keys_dir is None
    assert cfg.hash_algo == "xxh3_128"
    assert cfg.default_pool == PoolDefaults(gpu_bytes=None, cpu_bytes=None, policy=DEFAULT_POLICY, clean_ahead_blocks=64)
    assert dict(cfg.pools) == {}


def test_default_dataclass_is_valid_and_equal_to_loaded_defaults() -> None:
    assert DaemonConfig(socket=default_socket(ENV)) == load_config([], ENV)


def test_default_socket_prefers_xdg_runtime_dir() -> None:
    assert default_socket({"XDG_RUNTIME_DIR": "/x/y"}, uid=5) == "ipc:///x/y/kvtier/kvtierd.sock"


def test_default_socket_ignores_relative_xdg_and_uses_run_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Path, "is_dir", lambda self: str(self) == "/run/user/4242")
    assert default_socket({"XDG_RUNTIME_DIR": "relative/dir"}, uid=4242) == "ipc:///run/user/4242/kvtier/kvtierd.sock"


def test_default_socket_falls_back_to_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Path, "is_dir", lambda self: False)
    assert default_socket({}, uid=77) == "ipc:///tmp/kvtier-77/kvtierd.sock"
    assert default_socket({"TMPDIR": "/scratch"}, uid=77) == "ipc:///scratch/kvtier-77/kvtierd.sock"
    assert default_socket({"TMPDIR": "rel"}, uid=77) == "ipc:///tmp/kvtier-77/kvtierd.sock"


def test_config_is_frozen() -> None:
    cfg = load_config([], ENV)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lease_s = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.pools["x"] = PoolOverrides()  # type: ignore[index]
    hash(cfg)


# -- precedence --------------------------------------------------------------------------------


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        lease_s = 20
        poll_interval_s = 0.1
        log_level = "debug"
        drain_timeout_s = 3

        [default_pool]
        cpu_bytes = "8GiB"
        gpu_bytes = "2GiB"
        policy = "lru"

        [pools."llama-8b/tp0"]
        cpu_bytes = "16GiB"
        clean_ahead_blocks = 8
        """,
    )
    env = {**ENV, "KVTIER_LEASE_S": "30", "KVTIER_POLL_INTERVAL_S": "0.2", "KVTIER_CPU_BYTES": "4GiB"}
    cfg = load_config(["--config", str(path), "--lease-s", "40", "--cpu-bytes", "1GiB"], env)
    assert cfg.lease_s == 40.0  # flag beats env beats file
    assert cfg.poll_interval_s == 0.2  # env beats file
    assert cfg.log_level == "debug"  # file beats default
    assert cfg.drain_timeout_s == 3.0
    assert cfg.default_pool.cpu_bytes == 1 * GiB
    assert cfg.default_pool.gpu_bytes == 2 * GiB  # untouched keys of a table survive
    assert cfg.pools["llama-8b/tp0"] == PoolOverrides(cpu_bytes=16 * GiB, clean_ahead_blocks=8)

    cfg = load_config(["--config", str(path)], env)
    assert cfg.lease_s == 30.0
    assert cfg.default_pool.cpu_bytes == 4 * GiB

    cfg = load_config(["--config", str(path)], ENV)
    assert cfg.lease_s == 20.0
    assert cfg.default_pool.cpu_bytes == 8 * GiB


def test_config_path_from_environment_and_flag_wins(tmp_path: Path) -> None:
    a = write(tmp_path, "lease_s = 5", "a.toml")
    b = write(tmp_path, "lease_s = 6", "b.toml")
    assert load_config([], {**ENV, "KVTIER_CONFIG": str(a)}).lease_s == 5.0
    assert load_config(["--config", str(b)], {**ENV, "KVTIER_CONFIG": str(a)}).lease_s == 6.0


def test_every_top_level_key_has_env_and_flag(tmp_path: Path) -> None:
    keys = {
        "socket": ("ipc:///run/kv.sock", "ipc:///run/kv.sock"),
        "lease_s": ("12.5", 12.5),
        "heartbeat_s": ("2", 2.0),
        "poll_interval_s": ("0.01", 0.01),
        "drain_timeout_s": ("0", 0.0),
        "max_message_bytes": ("64MiB", 64 * MiB),
        "log_level": ("WARN", "warning"),
        "device": ("cuda", "cuda:0"),
        "metrics_port": ("9400", 9400),
        "metrics_host": ("0.0.0.0", "0.0.0.0"),
        "hash_algo": ("sha256", "sha256"),
    }
    for key, (text, expected) in keys.items():
        from_env = load_config([], {**ENV, f"KVTIER_{key.upper()}": text})
        from_flag = load_config([f"--{key.replace('_', '-')}", text], ENV)
        assert getattr(from_env, key) == expected, key
        assert getattr(from_flag, key) == expected, key


def test_booleans_from_env_and_flags() -> None:
    tcp = {**ENV, "KVTIER_SOCKET": "tcp://127.0.0.1:5555"}
    for text in ("1", "true", "YES", "on"):
        assert load_config([], {**tcp, "KVTIER_INSECURE_TCP": text}).insecure_tcp is True
    assert load_config([], {**ENV, "KVTIER_INSECURE_TCP": "off"}).insecure_tcp is False
    assert load_config(["--socket", "tcp://127.0.0.1:5555", "--insecure-tcp"], ENV).insecure_tcp is True
    assert load_config(["--no-insecure-tcp"], {**ENV, "KVTIER_INSECURE_TCP": "1"}).insecure_tcp is False
    assert error_of([], {**ENV, "KVTIER_INSECURE_TCP": "maybe"}).key == "insecure_tcp"


def test_optional_values_can_be_switched_off_from_text() -> None:
    path_env = {**ENV, "KVTIER_METRICS_PORT": "9400", "KVTIER_HEARTBEAT_S": "1"}
    cfg = load_config(["--metrics-port", "off", "--heartbeat-s", "auto"], path_env)
    assert cfg.metrics_port is None and cfg.heartbeat_s is None


def test_empty_env_values_count_as_unset() -> None:
    cfg = load_config([], {**ENV, "KVTIER_LEASE_S": "", "KVTIER_SOCKET": ""})
    assert cfg.lease_s == 10.0
    assert cfg.socket == default_socket(ENV)


def test_unrelated_env_is_ignored() -> None:
    assert load_config([], {**ENV, "PATH": "/bin", "KV_TIER": "x", "HOME": "/root"}).lease_s == 10.0


def test_pool_overrides_from_env_match_file_pool_by_env_spelling(tmp_path: Path) -> None:
    path = write(tmp_path, '[pools."llama-8b/tp0"]\ncpu_bytes = "16GiB"\npolicy = "lru"\n')
    env = {**ENV, "KVTIER_POOLS__LLAMA_8B_TP0__CPU_BYTES": "32GiB", "KVTIER_POOLS__llama_8b_tp0__GPU_BYTES": "1GiB"}
    cfg = load_config(["--config", str(path)], env)
    assert set(cfg.pools) == {"llama-8b/tp0"}
    assert cfg.pools["llama-8b/tp0"] == PoolOverrides(cpu_bytes=32 * GiB, gpu_bytes=1 * GiB, policy="lru")


def test_pool_from_env_only_is_found_by_real_name() -> None:
    cfg = load_config([], {**ENV, "KVTIER_POOLS__LLAMA_8B_TP0__CPU_BYTES": "30%", "KVTIER_CPU_BYTES": "1GiB"})
    settings = cfg.pool_settings("llama-8b/tp0")
    assert settings.cpu_bytes == MemoryFraction(0.3)
    assert settings.policy == DEFAULT_POLICY  # inherited from the default pool
    assert cfg.pool_settings("other").cpu_bytes == 1 * GiB


def test_pool_flag_overrides_env_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[pools."m/tp0"]\ncpu_bytes = "1GiB"\nclean_ahead_blocks = 4\n')
    env = {**ENV, "KVTIER_POOLS__M_TP0__CPU_BYTES": "2GiB"}
    cfg = load_config(["--config", str(path), "--pool", "m/tp0", "cpu_bytes=3GiB"], env)
    assert cfg.pools["m/tp0"] == PoolOverrides(cpu_bytes=3 * GiB, clean_ahead_blocks=4)
    # Env-only pool, then a flag naming it precisely: one entry, the precise name.
    cfg = load_config(["--pool", "m/tp0", "gpu_bytes=5MiB"], env)
    assert dict(cfg.pools) == {"m/tp0": PoolOverrides(cpu_bytes=2 * GiB, gpu_bytes=5 * MiB)}


def test_pool_settings_merge_defaults_and_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [default_pool]
        cpu_bytes = "4GiB"
        gpu_bytes = "1GiB"
        clean_ahead_blocks = 32
        [pools.a]
        cpu_bytes = "8GiB"
        [pools.b]
        clean_ahead_blocks = 0
        """,
    )
    cfg = load_config(["--config", str(path)], ENV)
    a, b, c = cfg.pool_settings("a"), cfg.pool_settings("b"), cfg.pool_settings("c")
    assert (a.cpu_bytes, a.gpu_bytes, a.clean_ahead_blocks, a.policy) == (8 * GiB, 1 * GiB, 32, DEFAULT_POLICY)
    assert (b.cpu_bytes, b.clean_ahead_blocks) == (4 * GiB, 0)
    assert (c.name, c.cpu_bytes) == ("c", 4 * GiB)


# -- sizes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (4096, 4096),
        (0, 0),
        ("4096", 4096),
        ("8GiB", 8 * GiB),
        ("512MiB", 512 * MiB),
        ("512 MiB", 512 * MiB),
        ("0.5 TiB", 1024 * GiB // 2),
        ("0.5TiB", 1024 * GiB // 2),
        ("1.5GB", 1_500_000_000),
        ("2kb", 2000),
        ("2K", 2048),
        ("3g", 3 * GiB),
        ("10B", 10),
        (".5KiB", 512),
        ("1.0000001KiB", 1024),
    ],
)
def test_parse_byte_size(text: object, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text", ["-1", -1, "8 GiBs", "abc", "", "1.2.3GiB", "GiB", 1.5, True, None, "1e9", "30%"])
def test_parse_byte_size_rejects(text: object) -> None:
    with pytest.raises(ValueError):
        parse_byte_size(text)


def test_percent_only_for_cpu() -> None:
    assert parse_byte_size("30%", allow_percent=True) == MemoryFraction(0.3)
    assert parse_byte_size("100 %", allow_percent=True) == MemoryFraction(1.0)
    for bad in ("0%", "150%", "-5%"):
        with pytest.raises(ValueError):
            parse_byte_size(bad, allow_percent=True)
    err = error_of(["--gpu-bytes", "30%"])
    assert err.key == "default_pool.gpu_bytes"
    assert "percentage" in err.message


@given(st.integers(min_value=0, max_value=2**62))
def test_byte_size_formatting_round_trips(n: int) -> None:
    assert parse_byte_size(format_byte_size(n)) == n


def test_auto_sizing() -> None:
    cfg = load_config([], ENV)
    s = cfg.pool_settings("any")
    assert s.resolve_cpu_bytes(available_bytes=16 * GiB) == 4 * GiB
    assert s.resolve_cpu_bytes(available_bytes=1024 * GiB) == 64 * GiB  # capped
    assert 0 < s.resolve_cpu_bytes() <= 64 * GiB  # psutil's figure
    assert s.resolve_gpu_bytes(on_cuda=True) == 1 * GiB
    assert s.resolve_gpu_bytes(on_cuda=False) == 256 * MiB
    s = load_config(["--cpu-bytes", "30%", "--gpu-bytes", "3MiB"], ENV).pool_settings("any")
    assert s.resolve_cpu_bytes(available_bytes=1000) == 300
    assert s.resolve_gpu_bytes(on_cuda=True) == 3 * MiB
    s = load_config(["--cpu-bytes", "0"], ENV).pool_settings("any")
    assert s.resolve_cpu_bytes(available_bytes=10 * GiB) == 0  # a pool with no CPU tier


# -- validation: every class of mistake names its key -----------------------------------------


@pytest.mark.parametrize(
    "toml, key, words",
    [
        ("leas_s = 3", "leas_s", "did you mean 'lease_s'"),
        ("nonsense = 3", "nonsense", "unknown key"),
        ("[default_pool]\ncpu_byte = 1", "default_pool.cpu_byte", "did you mean 'cpu_bytes'"),
        ('[pools."a/b"]\npolicyy = "lru"', 'pools."a/b".policyy', "did you mean 'policy'"),
        ('lease_s = "ten"', "lease_s", "number of seconds"),
        ("lease_s = true", "lease_s", "number of seconds"),
        ("lease_s = 0", "lease_s", "> 0"),
        ("lease_s = -1.5", "lease_s", "> 0"),
        ("lease_s = nan", "lease_s", "finite"),
        ("poll_interval_s = 0", "poll_interval_s", "> 0"),
        ("drain_timeout_s = -1", "drain_timeout_s", ">= 0"),
        ("heartbeat_s = 10", "heartbeat_s", "shorter than lease_s"),
        ("max_message_bytes = 10", "max_message_bytes", ">= 4096"),
        ('max_message_bytes = "-5MiB"', "max_message_bytes", "negative"),
        ("[default_pool]\ncpu_bytes = -1", "default_pool.cpu_bytes", "negative"),
        ('[default_pool]\ngpu_bytes = "-1GiB"', "default_pool.gpu_bytes", "negative"),
        ('[pools.x]\ncpu_bytes = "lots"', "pools.x.cpu_bytes", "byte size"),
        ("[default_pool]\ncpu_bytes = 1.5", "default_pool.cpu_bytes", "byte size"),
        ('[default_pool]\npolicy = "mru"', "default_pool.policy", "unknown eviction policy"),
        ('[pools.x]\npolicy = "lru+nope"', "pools.x.policy", "unknown policy wrapper"),
        ("[default_pool]\nclean_ahead_blocks = -1", "default_pool.clean_ahead_blocks", "in 0..8388608"),
        ('[default_pool]\nclean_ahead_blocks = "4"', "default_pool.clean_ahead_blocks", "integer"),
        ('log_level = "loud"', "log_level", "debug, info"),
        ('device = "gpu"', "device", "cuda:N"),
        ('device = "cuda:-1"', "device", "cuda:N"),
        ("metrics_port = 70000", "metrics_port", "1..65535"),
        ("metrics_port = 0", "metrics_port", "1..65535"),
        ('hash_algo = "md5"', "hash_algo", "xxh3_128"),
        ("insecure_tcp = 1", "insecure_tcp", "true or false"),
        ('socket = "http://x:1"', "socket", "ipc:// or tcp://"),
        ('socket = "ipc://relative/path.sock"', "socket", "absolute"),
        ('socket = "ipc://"', "socket", "absolute"),
        ('socket = "ipc://@"', "socket", "name after '@'"),
        (f'socket = "ipc:///{"x" * 120}"', "socket", "limit is 107"),
        ('socket = "tcp://host"', "socket", "tcp://HOST:PORT"),
        ('socket = "tcp://host:0"', "socket", "tcp://HOST:PORT"),
        ('socket = "tcp://host:99999"', "socket", "tcp://HOST:PORT"),
        ('socket = "tcp://:5555"', "socket", "tcp://HOST:PORT"),
        ('socket = "tcp://0.0.0.0:5555"', "socket", "insecure_tcp"),
        ('socket = 5', "socket", "string"),
        ("default_pool = 5", "default_pool", "table"),
        ("pools = 5", "pools", "table"),
        ("[pools]\nx = 5", "pools.x", "table"),
        ('[pools."a-b"]\n[pools."a/b"]', 'pools."a/b"', "same pool in the environment"),
    ],
)
def test_invalid_file_values_name_their_key(tmp_path: Path, toml: str, key: str, words: str) -> None:
    path = write(tmp_path, toml + "\n")
    err = error_of(["--config", str(path)])
    assert err.key == key, err
    assert words in err.message, err
    assert str(err) == f"{key}: {err.message}"


def test_errors_say_where_the_value_came_from(tmp_path: Path) -> None:
    path = write(tmp_path, "lease_s = 0\n")
    assert str(path) in error_of(["--config", str(path)]).message
    assert "environment KVTIER_LEASE_S" in error_of([], {**ENV, "KVTIER_LEASE_S": "-1"}).message
    assert "flag --lease-s" in error_of(["--lease-s", "abc"]).message
    assert "KVTIER_POOLS__X__CPU_BYTES" in error_of([], {**ENV, "KVTIER_POOLS__X__CPU_BYTES": "-1"}).message


@pytest.mark.parametrize(
    "var, value, key",
    [
        ("KVTIER_LEASE", "3", "KVTIER_LEASE"),
        ("KVTIER_SOKET", "ipc:///x", "KVTIER_SOKET"),
        ("KVTIER_POOLS__X__NOPE", "1", "KVTIER_POOLS__X__NOPE"),
        ("KVTIER_POOLS__CPU_BYTES", "1", "KVTIER_POOLS__CPU_BYTES"),
        ("KVTIER_POOLS____CPU_BYTES", "1", "KVTIER_POOLS____CPU_BYTES"),
        ("KVTIER_LEASE_S", "soon", "lease_s"),
        ("KVTIER_CPU_BYTES", "-1", "default_pool.cpu_bytes"),
        ("KVTIER_POLICY", "nope", "default_pool.policy"),
        ("KVTIER_POOLS__LLAMA__POLICY", "nope", "pools.LLAMA.policy"),
        ("KVTIER_METRICS_PORT", "http", "metrics_port"),
        ("KVTIER_SOCKET", "tcp://0.0.0.0:1", "socket"),
    ],
)
def test_invalid_env_names_its_key(var: str, value: str, key: str) -> None:
    assert error_of([], {**ENV, var: value}).key == key


def test_unknown_env_var_suggests_the_right_one() -> None:
    err = error_of([], {**ENV, "KVTIER_LEASE": "3"})
    assert "KVTIER_LEASE_S" in err.message


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--lease-s", "0"], "lease_s"),
        (["--cpu-bytes", "huge"], "default_pool.cpu_bytes"),
        (["--pool", "a", "cpu_bytes"], "pools.a"),
        (["--pool", "a", "cpu_byte=1"], "pools.a.cpu_byte"),
        (["--pool", "a/b", "policy=nope"], 'pools."a/b".policy'),
        (["--clean-ahead-blocks", "1.5"], "default_pool.clean_ahead_blocks"),
        (["--socket", "tcp://h:1", "--no-insecure-tcp"], "socket"),
    ],
)
def test_invalid_flags_name_their_key(argv: list[str], key: str) -> None:
    assert error_of(argv).key == key


def test_config_file_problems_name_config(tmp_path: Path) -> None:
    err = error_of(["--config", str(tmp_path / "missing.toml")])
    assert err.key == "config" and "no such file" in err.message
    bad = write(tmp_path, "lease_s = = 3\n")
    err = error_of(["--config", str(bad)])
    assert err.key == "config" and "not valid TOML" in err.message
    err = error_of(["--config", str(tmp_path)])
    assert err.key == "config"


def test_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_config(["--leas-s", "3"], ENV)
    assert info.value.code == 2
    assert "usage: kvtierd" in capsys.readouterr().err


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError) as info:
        DaemonConfig(socket="ipc:///x.sock", lease_s=0)
    assert info.value.key == "lease_s"
    with pytest.raises(ConfigError):
        PoolDefaults(cpu_bytes=-1)
    with pytest.raises(ConfigError):
        PoolOverrides(policy="nope")
    with pytest.raises(ConfigError):
        DaemonConfig(socket="ipc:///x.sock", pools={"a": "not overrides"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError):
        dataclasses.replace(load_config([], ENV), heartbeat_s=20.0)


# -- tcp and CURVE -----------------------------------------------------------------------------


def test_tcp_needs_insecure_or_curve(tmp_path: Path) -> None:
    assert error_of(["--socket", "tcp://0.0.0.0:5555"]).key == "socket"
    cfg = load_config(["--socket", "tcp://0.0.0.0:5555", "--insecure-tcp"], ENV)
    assert cfg.is_tcp and cfg.ipc_path is None
    assert load_config(["--socket", "tcp://[::1]:5555", "--insecure-tcp"], ENV).socket == "tcp://[::1]:5555"

    secret = tmp_path / "server.key_secret"
    secret.write_text("secret")
    keys = tmp_path / "clients"
    keys.mkdir()
    curve = ["--curve-secret-key-file", str(secret), "--curve-public-keys-dir", str(keys)]
    cfg = load_config(["--socket", "tcp://0.0.0.0:5555", *curve], ENV)
    assert cfg.curve_secret_key_file == secret and cfg.curve_public_keys_dir == keys

    err = error_of(["--socket", "tcp://h:5555", "--curve-secret-key-file", str(secret)])
    assert err.key == "curve_public_keys_dir"
    err = error_of(["--socket", "tcp://h:5555", "--curve-public-keys-dir", str(keys)])
    assert err.key == "curve_secret_key_file"
    err = error_of(["--socket", "tcp://h:5555", "--curve-secret-key-file", str(tmp_path / "nope"), "--curve-public-keys-dir", str(keys)])
    assert err.key == "curve_secret_key_file" and "does not exist" in err.message
    err = error_of(["--socket", "tcp://h:5555", "--curve-secret-key-file", str(secret), "--curve-public-keys-dir", str(secret)])
    assert err.key == "curve_public_keys_dir"


def test_abstract_ipc_socket_is_accepted() -> None:
    cfg = load_config(["--socket", "ipc://@kvtierd"], ENV)
    assert cfg.ipc_path is None and not cfg.is_tcp


# -- printing and main() helpers --------------------------------------------------------------


def test_print_config_round_trips(tmp_path: Path) -> None:
    secret = tmp_path / "k"
    secret.write_text("k")
    argv = [
        "--socket", "tcp://127.0.0.1:7000",
        "--curve-secret-key-file", str(secret), "--curve-public-keys-dir", str(tmp_path),
        "--lease-s", "7.5", "--heartbeat-s", "2", "--metrics-port", "9400", "--max-message-bytes", "12345",
        "--cpu-bytes", "30%", "--gpu-bytes", "3GiB", "--device", "cuda:1", "--hash-algo", "sha256",
        "--pool", 'we"ird/na\\me', "cpu_bytes=1000", "--pool", "b", "policy=lru",
    ]  # fmt: skip
    cfg = load_config(argv, ENV)
    text = format_config(cfg, available_bytes=8 * GiB)
    printed = write(tmp_path, text, "printed.toml")
    assert load_config(["--config", str(printed)], {}) == cfg

    defaults = load_config([], ENV)
    printed = write(tmp_path, format_config(defaults), "defaults.toml")
    assert load_config(["--config", str(printed)], {}) == defaults


def test_load_config_or_exit_prints_config(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    with pytest.raises(SystemExit) as info:
        load_config_or_exit(["--print-config", "--lease-s", "4"], ENV, stdout=out)
    assert info.value.code == 0
    assert "lease_s = 4.0" in out.getvalue()
    assert "[default_pool]" in out.getvalue()


def test_load_config_or_exit_returns_config_without_print() -> None:
    assert load_config_or_exit(["--lease-s", "4"], ENV).lease_s == 4.0


def test_config_error_exits_2_with_one_line() -> None:
    err = io.StringIO()
    with pytest.raises(SystemExit) as info:
        load_config_or_exit(["--lease-s", "0"], ENV, stderr=err)
    assert info.value.code == 2
    line = err.getvalue()
    assert line.startswith("kvtierd: config error: lease_s: must be > 0 seconds")
    assert line.count("\n") == 1

    err = io.StringIO()
    with pytest.raises(SystemExit) as info:
        exit_on_config_error(ConfigError("socket", "nope"), err)
    assert info.value.code == 2
    assert err.getvalue() == "kvtierd: config error: socket: nope\n"


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_arg_parser().parse_args(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in [
        "--config", "--print-config", "--socket", "--lease-s", "--heartbeat-s", "--poll-interval-s",
        "--drain-timeout-s", "--max-message-bytes", "--log-level", "--device", "--metrics-port",
        "--metrics-host", "--insecure-tcp", "--curve-secret-key-file", "--curve-public-keys-dir",
        "--hash-algo", "--gpu-bytes", "--cpu-bytes", "--policy", "--clean-ahead-blocks", "--pool",
        "KVTIER_POOLS__",
    ]:  # fmt: skip
        assert flag in text, flag
    # Every option carries help text (argparse prints nothing after a bare flag otherwise).
    for action in build_arg_parser()._actions:
        assert action.help, action.option_strings


def test_example_config_in_systemd_dir_loads() -> None:
    example = Path(__file__).resolve().parents[2] / "systemd" / "kvtierd.toml"
    if not example.exists():
        pytest.skip("systemd/kvtierd.toml not written yet")
    cfg = load_config(["--config", str(example)], ENV)
    assert cfg == load_config([], ENV), "the example must only show the defaults, commented or not"


MAIN_PY = Path(__file__).resolve().parents[2] / "daemon" / "__main__.py"


@pytest.mark.skipif(not MAIN_PY.exists(), reason="daemon/__main__.py (the daemon lead's) not written yet")
def test_kvtierd_exits_2_on_bad_config_file(tmp_path: Path) -> None:
    bad = write(tmp_path, "lease_s = -1\n", "bad.toml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2, result
    assert "kvtierd: config error: lease_s:" in result.stderr


@pytest.mark.skipif(not MAIN_PY.exists(), reason="daemon/__main__.py (the daemon lead's) not written yet")
def test_kvtierd_print_config_exits_0() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.daemon", "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result
    assert "[default_pool]" in result.stdout
