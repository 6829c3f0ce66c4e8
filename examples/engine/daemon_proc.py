"""Run kvtierd as a separate process for the examples and benchmarks.

Contract
========

``DaemonProcess(cpu_bytes=..., device=...)``:

- ``start(timeout_s) -> endpoint``: starts ``python -m kvtier.daemon`` on a
  private ``ipc://`` socket in a fresh temporary directory (mode 0700), its
  stderr going to ``log_path``, and returns once the daemon answers a
  session-less ``health`` request. Raises ``RuntimeError`` with the log's
  tail if it exits or does not answer in time.
- ``stop(timeout_s) -> exit code``: SIGTERM, then waits; the daemon drains
  and exits 0 when all is well. Kills it (SIGKILL, that process only) if it
  does not exit in time and returns the resulting code. Idempotent.
- ``log_tail(lines)``: the end of the daemon's log.
- ``torch_threads`` (default 1) sets ``OMP_NUM_THREADS`` for the daemon: its
  copies are memory-bound, and on a 2-core box its OpenMP threads would
  compete with the engine's.

Only the process this object started is ever signalled, by its pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def daemon_available() -> bool:
    """True when kvtierd and the client library it needs can be imported here."""
    try:
        import kvtier.client.client  # noqa: F401
        import kvtier.client.kv_share  # noqa: F401
        import kvtier.daemon.__main__  # noqa: F401
        import kvtier.daemon.kv_import  # noqa: F401  (imported lazily by kvtierd: checked here)
    except Exception:  # anything: a half-written module counts as absent
        return False
    return True


class DaemonProcess:
    def __init__(self, *, cpu_bytes: int, device: str = "cpu", log_level: str = "info",
                 extra_args: tuple[str, ...] = (), torch_threads: int | None = 1) -> None:
        self.cpu_bytes = cpu_bytes
        self.device = "cpu" if device == "cpu" else device if ":" in device else f"{device}:0"
        self.log_level = log_level
        self.extra_args = extra_args
        self.torch_threads = torch_threads
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None
        self.endpoint: str | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> Path | None:
        return self._dir / "kvtierd.log" if self._dir else None

    def start(self, timeout_s: float = 60.0) -> str:
        from kvtier.client.client import probe_health

        self._dir = Path(tempfile.mkdtemp(prefix="kvtier-example-"))
        os.chmod(self._dir, 0o700)
        self.endpoint = f"ipc://{self._dir / 'kvtierd.sock'}"
        cmd = [sys.executable, "-m", "kvtier.daemon", "--socket", self.endpoint, "--cpu-bytes", str(self.cpu_bytes),
               "--device", self.device, "--log-level", self.log_level, *self.extra_args]
        assert self.log_path is not None
        env = dict(os.environ)
        if self.torch_threads is not None:
            # The daemon's host copies are memory-bound and run on its own
            # worker threads; letting each also fan out over every core (torch's
            # OpenMP default) only makes it fight the engine's compute threads,
            # which on a small CPU-only box stalls the engine's parallel regions.
            env["OMP_NUM_THREADS"] = str(self.torch_threads)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                self.exit_code = self._proc.returncode
                raise RuntimeError(f"kvtierd exited with code {self.exit_code} at start-up:\n{self.log_tail()}")
            try:
                probe_health(self.endpoint, timeout_s=0.5)
                return self.endpoint
            except Exception:  # not bound yet (or still importing torch): keep probing until the deadline
                if time.monotonic() >= deadline:
                    self.stop()
                    raise RuntimeError(f"kvtierd did not answer within {timeout_s:.0f} s:\n{self.log_tail()}") from None
                time.sleep(0.2)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self._proc is None:
            return self.exit_code
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self.exit_code = self._proc.returncode
        self._proc = None
        return self.exit_code

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def cleanup(self) -> None:
        """Stop the daemon and remove its temporary directory (log included)."""
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> DaemonProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
