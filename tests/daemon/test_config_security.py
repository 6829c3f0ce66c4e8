"""kvtier.daemon.config: socket_mode, [tenants.<name>], and the sha256 default with tenants."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest

from kvtier.daemon.config import ConfigError, DaemonConfig, TenantConfig, format_config, load_config

ENV = {"XDG_RUNTIME_DIR": "/run/user/1000"}
KEY_A = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
KEY_B = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"
TOKEN = "a-long-enough-token-0123"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtierd.toml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(argv: list[str], environ: dict[str, str] = ENV) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(argv, environ)
    return info.value


# -- socket_mode ---------------------------------------------------------------------------------


def test_socket_mode_default_env_flag_and_file(tmp_path: Path) -> None:
    assert load_config([], ENV).socket_mode == 0o600
    # What systemd/kvtierd@.service sets: must load, not be an unknown variable.
    assert load_config([], {**ENV, "KVTIER_SOCKET_MODE": "0660"}).socket_mode == 0o660
    assert load_config(["--socket-mode", "0640"], ENV).socket_mode == 0o640
    assert load_config(["--config", str(write(tmp_path, "socket_mode = 0o660\n"))], ENV).socket_mode == 0o660
    assert load_config(["--config", str(write(tmp_path, 'socket_mode = "0660"\n'))], ENV).socket_mode == 0o660


@pytest.mark.parametrize("text", ["0666", "0644", "0700", "0400", "rw", "9"])
def test_socket_mode_refuses_others_and_nonsense(text: str) -> None:
    assert error_of(["--socket-mode", text]).key == "socket_mode"


def test_socket_mode_in_toml_decimal_is_caught(tmp_path: Path) -> None:
    err = error_of(["--config", str(write(tmp_path, "socket_mode = 660\n"))])  # decimal 660 = 0o1224
    assert err.key == "socket_mode" and "0660" in err.message


# -- tenants ------------------------------------------------------------------------------------


def test_tenants_from_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, f"""
        [tenants.alice]
        public_key = "{KEY_A}"
        cpu_quota_bytes = "8GiB"
        [tenants.bob]
        token = "{TOKEN}"
    """)
    cfg = load_config(["--config", str(path)], ENV)
    assert cfg.tenants["alice"] == TenantConfig(public_key=KEY_A, cpu_quota_bytes=8 << 30)
    # The token is kept (and printed) only as its sha256.
    assert cfg.tenants["bob"] == TenantConfig(token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())
    assert cfg.hash_algo == "sha256", "two tenants: sha256 unless hash_algo is set"
    text = format_config(cfg, available_bytes=8 << 30)
    assert TOKEN not in text and "token_sha256" in text
    printed = tmp_path / "printed.toml"
    printed.write_text(text)
    assert load_config(["--config", str(printed)], {}) == cfg


def test_sha256_default_only_with_two_tenants_and_only_when_unset(tmp_path: Path) -> None:
    one = write(tmp_path, f'[tenants.a]\npublic_key = "{KEY_A}"\n')
    assert load_config(["--config", str(one)], ENV).hash_algo == "xxh3_128"
    two = f'[tenants.a]\npublic_key = "{KEY_A}"\n[tenants.b]\npublic_key = "{KEY_B}"\n'
    assert load_config(["--config", str(write(tmp_path, two))], ENV).hash_algo == "sha256"
    explicit = write(tmp_path, 'hash_algo = "xxh3_128"\n' + two)
    assert load_config(["--config", str(explicit)], ENV).hash_algo == "xxh3_128"
    assert load_config(["--config", str(write(tmp_path, two)), "--hash-algo", "xxh3_128"], ENV).hash_algo == "xxh3_128"


@pytest.mark.parametrize(
    "toml, key, words",
    [
        ("[tenants.a]\n", "tenants.a.public_key", "public_key (CURVE) or a token"),
        ('[tenants.a]\npublic_key = "short"\n', "tenants.a.public_key", "40 Z85"),
        ('[tenants.a]\ntoken = "short"\n', "tenants.a.token", "at least 16"),
        (f'[tenants.a]\ntoken = "{TOKEN}"\ntoken_sha256 = "{"0" * 64}"\n', "tenants.a.token", "not both"),
        ('[tenants.a]\ntoken_sha256 = "xyz"\n', "tenants.a.token_sha256", "64"),
        (f'[tenants.a]\npublic_key = "{KEY_A}"\nquota = 1\n', "tenants.a.quota", "unknown key"),
        (f'[tenants.a]\npublic_key = "{KEY_A}"\ncpu_quota_bytes = "lots"\n', "tenants.a.cpu_quota_bytes", "byte size"),
        (f'[tenants."a b"]\npublic_key = "{KEY_A}"\n', 'tenants."a b"', "tenant names"),
        (f'[tenants.a]\npublic_key = "{KEY_A}"\n[tenants.b]\npublic_key = "{KEY_A}"\n', "tenants.b.public_key",
         "one key, one tenant"),
        (f'[tenants.a]\ntoken = "{TOKEN}"\n[tenants.b]\ntoken = "{TOKEN}"\n', "tenants.b.token", "one token, one tenant"),
        ("tenants = 5\n", "tenants", "table"),
    ],
)
def test_bad_tenants_name_their_key(tmp_path: Path, toml: str, key: str, words: str) -> None:
    err = error_of(["--config", str(write(tmp_path, toml))])
    assert err.key == key, err
    assert words in err.message, err


def test_tenants_are_not_read_from_the_environment() -> None:
    assert error_of([], {**ENV, "KVTIER_TENANTS__A__TOKEN": TOKEN}).key == "KVTIER_TENANTS__A__TOKEN"


def test_direct_construction_validates_tenants() -> None:
    with pytest.raises(ConfigError):
        DaemonConfig(socket="ipc:///x", tenants={"a": TenantConfig()})
    cfg = DaemonConfig(socket="ipc:///x", tenants={"a": TenantConfig(public_key=KEY_A)})
    with pytest.raises(TypeError):
        cfg.tenants["b"] = TenantConfig(public_key=KEY_B)  # type: ignore[index]
