"""kvtier's version comes from the package metadata, with a source tree's pyproject.toml as the fallback.

One answer (``kvtier.tiers.version.kvtier_version``) for ``kvtierd --version``,
``kvtier --version`` and the daemon's ``daemon_version`` in its ``hello`` and
``health`` replies (how an upgrade's successor is told apart).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers import version as version_module
from kvtier.tiers.version import kvtier_version

REPO = Path(__file__).resolve().parents[1]
PYPROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_version_is_the_installed_distributions() -> None:
    assert kvtier_version() == importlib.metadata.version("kvtier")


def test_a_source_tree_that_is_not_installed_reports_its_pyproject_version(tmp_path: Path) -> None:
    # -S: no site-packages, so no kvtier distribution; the checkout's tiers/ comes in through a
    # PYTHONPATH folder of our own. Run from an empty folder: no stray *.egg-info on sys.path.
    tiers_dir = Path(version_module.__file__).resolve().parent
    if not (tiers_dir.parent / "pyproject.toml").exists():
        pytest.skip("kvtier is installed from a wheel here, not run from a source tree")
    (tmp_path / "path" / "kvtier").mkdir(parents=True)
    (tmp_path / "path" / "kvtier" / "tiers").symlink_to(tiers_dir)
    code = ("import importlib.metadata as m\n"
            "try:\n    m.version('kvtier'); print('installed')\nexcept m.PackageNotFoundError:\n    pass\n"
            "from kvtier.tiers.version import kvtier_version\nprint(kvtier_version())\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "path")}
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == [PYPROJECT_VERSION], out.stdout + out.stderr


def test_without_metadata_or_a_kvtier_pyproject_the_version_is_unknown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_distribution(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_distribution)
    assert version_module.kvtier_version.__wrapped__() == PYPROJECT_VERSION  # this checkout's pyproject.toml
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "9.9"\n')
    assert version_module._source_tree_version(tmp_path) is None  # another project's is not ours
    monkeypatch.setattr(version_module, "_SOURCE_ROOT", tmp_path)
    assert version_module.kvtier_version.__wrapped__() == "unknown"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "kvtier"\nversion = "7.0.1"\n')
    assert version_module.kvtier_version.__wrapped__() == "7.0.1"
    (tmp_path / "pyproject.toml").write_text("not toml [")
    assert version_module.kvtier_version.__wrapped__() == "unknown"


def test_both_commands_print_it() -> None:
    for argv, prog in (([sys.executable, "-m", "kvtier.daemon", "--version"], "kvtierd (kvtier)"),
                       ([sys.executable, "-m", "kvtier.tools.cli", "--version"], "kvtier")):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.strip() == f"{prog} {kvtier_version()}", out.stdout + out.stderr


def test_the_daemon_reports_it_in_hello_and_health(kvtierd_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import msgspec

    from kvtier.client.client import Client, PoolLayout, probe_health
    from kvtier.client.transport import Transport

    daemon = kvtierd_factory(gpu_bytes=4 * 1024, cpu_bytes=8 * 1024)
    assert probe_health(daemon.endpoint, timeout_s=10.0)["daemon_version"] == kvtier_version()
    hello: dict[str, Any] = {}
    retry = Transport.retry

    def spy(self: Transport, op: str, *args: Any, **kwargs: Any) -> Any:
        got = retry(self, op, *args, **kwargs)
        if op == "hello":
            hello.update(msgspec.structs.asdict(got[0]))  # the hello reply's Struct
        return got

    monkeypatch.setattr(Transport, "retry", spy)
    layout = PoolLayout(model="m", block_size=4, block_bytes=1024, dtype="bfloat16", num_layers=1, kv_heads=1,
                        head_dim=8, mode="store")
    with Client(daemon.endpoint, "version", layout):
        pass
    assert hello.get("daemon_version") == kvtier_version(), hello
