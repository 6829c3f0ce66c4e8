"""The plain install: a clean venv, ``pip install .`` with no extras, and the commands work.

What it guards: pyproject's ``dependencies`` against what kvtier imports. The
development venv has every extra (and more) installed, so a missing
declaration passes every other test; here the venv is built fresh on every
run (a cached one would hide exactly that) with no system site-packages, and
only pip's wheel cache is reused.

Steps (README, "Two commands", "Tools"): ``torch==2.13.0`` first (as
``scripts/env.sh`` does: a bare ``torch`` requirement would pull CUDA wheels on
a CPU-only box), then ``pip install SRC`` from a copy of the source tree (a
regular, non-editable install, build isolation included, nothing written into
the checkout), then ``kvtierd --help``; a daemon on a private ipc socket with
its metrics endpoint on, asked ``health``, ``kvtier stats`` and ``/metrics``,
stopped with SIGTERM (exit 0); and ``kvtier replay`` of the sample trace.

``install_kvtier(root, extras)`` is the helper; ``EXTRAS`` lists what is
checked. ``vllm``: vLLM's CPU build first (``scripts/install-vllm.sh``, as
``scripts/env.sh`` does), then ``kvtier[vllm]``, and the connector imports
by the names a vLLM user configures.

Time: about 40 s on the 2-core dev VM, most of it unpacking torch; the venv
goes to /dev/shm when it has room (the same install takes twice as long on
the VM's disk). ``KVTIER_INSTALL_TEST_DIR`` picks another place.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.client.client import KvtierTimeout, probe_health

pytestmark = [pytest.mark.install, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
TORCH = os.environ.get("KVTIER_TORCH_VERSION", "2.13.0")
SAMPLE_TRACE = ROOT / "examples" / "traces" / "sample.jsonl"
EXTRAS = ["", "vllm"]  # "" = no extras; the others are checked by the same steps
START_TIMEOUT_S = 60.0
SHM_NEEDED_BYTES = 4 << 30


@dataclass
class Venv:
    path: Path
    env: dict[str, str]  # the environment to run its commands in (nothing of the dev venv)

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def run(self, *argv: str, timeout_s: float = 120, check: bool = True, cwd: Path | None = None
            ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(list(argv), env=self.env, cwd=cwd or self.path, capture_output=True, text=True,
                              timeout=timeout_s)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}\n"
                                 f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
        return proc


def copy_source(dst: Path) -> Path:
    """What ``pip install .`` builds from: pyproject, the readme, and every package folder it maps."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dst.mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", dst)
    readme = meta["project"].get("readme")
    if isinstance(readme, str):
        shutil.copy2(ROOT / readme, dst)
    folders = {Path(d).parts[0] for d in meta["tool"]["setuptools"]["package-dir"].values()}
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for folder in sorted(folders):
        shutil.copytree(ROOT / folder, dst / folder, ignore=ignore)
    return dst


def _pip_has_python_option() -> bool:
    """pip >= 22.3 can install into another interpreter (``pip --python``): the venv needs no pip of its own."""
    try:
        import pip
    except ImportError:
        return False
    major, minor = (int(x) for x in re.findall(r"\d+", pip.__version__)[:2])
    return (major, minor) >= (22, 3)


def install_kvtier(root: Path, extras: str = "") -> Venv:
    """A fresh venv under ``root`` with ``torch==TORCH`` and then ``kvtier[extras]`` from a source copy."""
    src = copy_source(root / "src")
    venv = root / "venv"
    # vLLM's CPU build goes in through scripts/install-vllm.sh, which runs the venv's own pip.
    with_pip = "vllm" in extras or not _pip_has_python_option()
    subprocess.run([sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(venv)],
                   check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # PYTHONDONTWRITEBYTECODE goes too: with --no-compile below, the first
    # import of torch writes the .pyc files of the modules it loads (a fraction
    # of torch) and the later commands load those instead of compiling again.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVTIER_")
           and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "NOTIFY_SOCKET", "PYTHONDONTWRITEBYTECODE")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = [python, "-m", "pip"] if with_pip else [sys.executable, "-m", "pip", "--python", python]
    # --no-compile: byte-compiling all of torch costs more than the rest of the install.
    opts = ["install", "--no-compile", "-q"]
    box = Venv(venv, env)
    box.run(*pip, *opts, f"torch=={TORCH}", timeout_s=600, cwd=root)
    if "vllm" in extras:
        box.run("env", f"PYTHON={python}", "bash", str(ROOT / "scripts" / "install-vllm.sh"), timeout_s=900, cwd=root)
    box.run(*pip, *opts, f"{src}[{extras}]" if extras else str(src), timeout_s=600, cwd=root)
    return box


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A folder for the venv: /dev/shm when it has room (unpacking torch is mostly writes)."""
    base = os.environ.get("KVTIER_INSTALL_TEST_DIR")
    if base is None and os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free >= SHM_NEEDED_BYTES:
        base = "/dev/shm"
    path = Path(tempfile.mkdtemp(prefix="kvtier-install-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen[str], endpoint: str) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"kvtierd exited {proc.returncode} at start-up:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            return probe_health(endpoint, timeout_s=0.3)
        except KvtierTimeout:
            if time.monotonic() > deadline:
                raise AssertionError(f"kvtierd did not answer health in {START_TIMEOUT_S} s") from None


@pytest.mark.parametrize("extras", EXTRAS, ids=lambda e: e or "no-extras")
def test_plain_install_runs_kvtierd_and_kvtier(scratch: Path, extras: str) -> None:
    t0 = time.monotonic()
    venv = install_kvtier(scratch, extras)
    installed_s = time.monotonic() - t0

    # The package comes from the venv, not from the checkout.
    where = venv.run(venv.bin("python"), "-c", "import kvtier.tiers as t; print(t.__file__)").stdout.strip()
    assert where.startswith(str(venv.path)), where

    if "vllm" in extras:
        # The module path and class name a vLLM user writes in --kv-transfer-config.
        base = venv.run(venv.bin("python"), "-c", "from kvtier.integrations.vllm import KvtierConnector as K; "
                        "print(K.__mro__[1].__name__)", timeout_s=300).stdout
        assert base.strip().endswith("KVConnectorBase_V1"), base

    out = venv.run(venv.bin("kvtierd"), "--help").stdout
    assert "usage: kvtierd" in out

    # A daemon on a private socket, metrics endpoint on (prometheus-client is a dependency).
    sock_dir = scratch / "run"
    sock_dir.mkdir()
    endpoint = f"ipc://{sock_dir}/kvtierd.sock"
    port = free_port()
    proc = subprocess.Popen(
        [venv.bin("kvtierd"), "--socket", endpoint, "--cpu-bytes", str(64 * 1024), "--gpu-bytes", str(16 * 1024),
         "--metrics-port", str(port)],
        env=venv.env, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = wait_healthy(proc, endpoint)
        assert health, health
        stats = venv.run(venv.bin("kvtier"), "stats", "--json", "--socket", endpoint, timeout_s=60).stdout
        assert stats.lstrip().startswith("{"), stats[:500]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"kvtier_" in reply.read()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        log = proc.stdout.read() if proc.stdout else ""
        assert rc == 0, f"kvtierd exited {rc} on SIGTERM:\n{log}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    # The README's replay command.
    out = venv.run(venv.bin("kvtier"), "replay", str(SAMPLE_TRACE), "--cpu-tokens", "1M", timeout_s=300).stdout
    assert "replayed in" in out, out[-2000:]
    if "tools" not in extras:
        # An optional feature whose extra is missing says so, at once.
        bad = venv.run(venv.bin("kvtier"), "replay", str(SAMPLE_TRACE), "--plot", str(scratch / "x.png"), check=False)
        assert bad.returncode != 0 and "kvtier[tools]" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr

    print(f"plain install ({extras or 'no extras'}): installed in {installed_s:.1f} s, "
          f"all steps in {time.monotonic() - t0:.1f} s")
