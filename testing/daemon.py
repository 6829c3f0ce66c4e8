"""kvtierd as a child process: the one launcher of the tests, the benchmarks and the examples.

Used by tests/conftest.py (the ``kvtierd*`` fixtures), tests/stress, the
daemon tests that need their own set-up (tcp:// with CURVE, abstract
sockets), bench/vllm.py, bench/ttft.py, bench/protocol*.py (one daemon
under a cProfile launcher: ``command``) and examples/ (engine, vllm).

Contract
========

``KvtierDaemon(workdir, flags=..., env=..., ...)`` describes one kvtierd;
``KvtierDaemon.start(...)`` is the same followed by ``spawn()``.

- ``workdir``: the folder of its socket and log (created with
  ``dir_mode``, default 0700: nobody else may reach the socket); ``None``
  creates a private temporary one that ``cleanup()`` removes.
- ``endpoint``: ``ipc://<workdir>/kvtierd.sock`` unless given (a tcp://
  or abstract ``ipc://@name`` endpoint).
- ``flags``: ``{"gpu_bytes": 4096}`` becomes ``--gpu-bytes 4096``, after
  ``--socket <endpoint>``; ``kvtierd_args`` holds both (``--socket`` first).
- Persistent CPU tiers: unless ``flags`` name ``arena_dir`` (or the kept
  environment does), the daemon keeps
  them in ``<workdir>/arenas`` (``arena_dir``, owned like ``workdir``), not
  in /dev/shm: they go with the working folder, and a test never leaves
  memory behind. A
  ``restart()`` adopts them, as a restarted kvtierd does.
- ``command``: what starts kvtierd, ``kvtierd_args`` appended: by default
  ``python -m kvtier.daemon`` (this interpreter); another command must run
  kvtierd in the very process it starts (its pid is the one ``health``
  must report), e.g. ``python -c LAUNCHER`` that wraps ``main(argv)`` in a
  profiler (bench/protocol_servers.py). ``argv`` is the whole command line.
- Environment: ours without ``NOTIFY_SOCKET`` (the child would report to
  our own supervisor) and without ``KVTIER_*`` (kvtierd would apply them;
  ``keep_kvtier_env=True`` keeps them, for examples a user configures that
  way), then ``OMP_NUM_THREADS=omp_threads`` when given, then ``env``.
  ``daemon.env`` may be edited before a ``spawn()``/``restart()``.
- ``spawn()``: starts ``argv``, stdout and stderr
  appended to ``log_path``, and returns once this very process answers a
  session-less ``health`` (the reply carries its pid: a daemon still on
  the socket does not count). Raises ``RuntimeError`` with the log's tail
  when it exits first, or when it does not answer within
  ``start_timeout_s`` (it is killed then). Records ``starts`` and, per
  start, ``ready_s`` (seconds from spawn to the first answer).
- ``restart()``: ``kill()`` then ``spawn()``, same socket, same log.
- Socket activation (``listen_fd``): a listening socket the caller made (as
  systemd does for ``kvtierd@.socket``) is given to every start as
  ``LISTEN_FDS=1`` on descriptor 3, with ``LISTEN_PID`` the daemon's own
  (a launcher sets it, then execs kvtierd in the same process): kvtierd
  serves that socket instead of binding one, and never removes its file.
- ``upgrade(timeout_s)``: SIGUSR2, the zero-downtime upgrade: the daemon
  starts its successor (same command line) and hands it the socket and the
  CPU tiers. Returns once the successor answers ``health`` and the old
  process exited (its exit code is returned); from then on this object is
  the successor (``pid``, ``stop()``, ``kill()``...). The calling process
  becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``, once): the
  successor, orphaned when its predecessor exits, is re-parented here, so
  it is waited for and its exit code read like a child's.
- ``kill()``: SIGKILL and reap. ``send_signal(signum)``: any signal.
- ``stop(signum=SIGTERM, timeout_s=30)``: signal, wait; SIGKILL when it
  has not exited in time. Returns the exit code (0 after a clean drain;
  negative: the signal that ended it), None if it never ran.
- ``alive``, ``pid``, ``log()`` (all of it), ``log_tail(lines)``,
  ``rss_bytes()``, ``num_threads()``, ``stats()`` (the ``stats`` verb).
- ``cleanup()``: ``stop()``, and remove ``workdir`` when this object
  created it. As a context manager: spawned on entry (unless running),
  cleaned up on exit.

``loopback_tcp_daemon(workdir, flags)``: a started kvtierd on a free
127.0.0.1 port with ``insecure_tcp`` (no CURVE). Where a test needs a
request to run after its client gave up and closed its socket (on ipc://
the daemon asks that closed connection for its peer's uid, and refuses):
what a daemon too slow for a client's deadline does.

Only the process this object started (or, after ``upgrade()``, the
successor that one started, by the pid it reported) is ever signalled,
never by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from kvtier.client.client import KvtierTimeout, probe_health
from kvtier.client.endpoint import ipc_socket_file

if TYPE_CHECKING:
    from kvtier.client.curve import CurveKeys

START_TIMEOUT_S = 60.0  # importing torch alone takes seconds on a loaded 2-core box
PROBE_TIMEOUT_S = 0.2  # one health probe; the loop retries until START_TIMEOUT_S
KILL_REAP_TIMEOUT_S = 10.0
ERROR_LOG_LINES = 60  # of the log, in the error of a failed start
DEFAULT_COMMAND = (sys.executable, "-m", "kvtier.daemon")  # this interpreter, so the child sees our venv


def flag_argv(flags: Mapping[str, object]) -> list[str]:
    """``{"gpu_bytes": 4096}`` -> ``["--gpu-bytes", "4096"]``; ``{"insecure_tcp": False}`` -> ``["--no-insecure-tcp"]``."""
    argv: list[str] = []
    for key, value in flags.items():
        if isinstance(value, bool):  # a switch: --name / --no-name
            argv.append(f"--{'' if value else 'no-'}{key.replace('_', '-')}")
        else:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def daemon_env(*, keep_kvtier_env: bool = False, omp_threads: int | None = None,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment ``KvtierDaemon`` gives kvtierd (see the module docstring)."""
    env = {k: v for k, v in os.environ.items()
           if k != "NOTIFY_SOCKET" and (keep_kvtier_env or not k.startswith("KVTIER_"))}
    if omp_threads is not None:
        # Its host copies are memory-bound and run on its own worker threads;
        # OpenMP fanning each out over every core only fights the clients.
        env["OMP_NUM_THREADS"] = str(omp_threads)
    env.update(extra or {})
    return env


def daemon_available() -> bool:
    """True when kvtierd and the client modules an engine needs import here."""
    try:
        import kvtier.client.client  # noqa: F401
        import kvtier.client.kv_share  # noqa: F401
        import kvtier.daemon.__main__  # noqa: F401
    except Exception:  # anything: a half-written module counts as absent
        return False
    return True


class KvtierDaemon:
    """One kvtierd child process (see the module docstring)."""

    def __init__(self, workdir: Path | None = None, *, flags: Mapping[str, object] | None = None,
                 env: Mapping[str, str] | None = None, endpoint: str | None = None,
                 omp_threads: int | None = None, keep_kvtier_env: bool = False, dir_mode: int = 0o700,
                 cwd: Path | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 health_curve: CurveKeys | None = None, command: Sequence[str] = DEFAULT_COMMAND,
                 listen_fd: int | None = None) -> None:
        self._owns_workdir = workdir is None
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="kvtierd-"))  # mode 0700 already
        else:
            workdir.mkdir(parents=True, exist_ok=True)
            os.chmod(workdir, dir_mode)
        self.workdir = workdir
        self.endpoint = endpoint or f"ipc://{workdir}/kvtierd.sock"
        self.log_path = workdir / "kvtierd.log"
        flags = dict(flags or {})
        kept_env = env or {}
        if keep_kvtier_env:
            kept_env = {**os.environ, **kept_env}
        if "arena_dir" not in flags and "KVTIER_ARENA_DIR" not in kept_env:
            self.arena_dir = workdir / "arenas"
            self.arena_dir.mkdir(mode=0o700, exist_ok=True)
            owner = workdir.stat()
            if (owner.st_uid, owner.st_gid) != (os.getuid(), os.getgid()):
                os.chown(self.arena_dir, owner.st_uid, owner.st_gid)  # a daemon that runs as the folder's owner
            flags["arena_dir"] = self.arena_dir
        else:
            self.arena_dir = Path(str(flags.get("arena_dir", kept_env.get("KVTIER_ARENA_DIR", "/dev/shm"))))
        self.kvtierd_args = ["--socket", self.endpoint, *flag_argv(flags)]
        self.argv = [*command, *self.kvtierd_args]
        self.env = daemon_env(keep_kvtier_env=keep_kvtier_env, omp_threads=omp_threads, extra=env)
        self.cwd = cwd
        self.start_timeout_s = start_timeout_s
        self.health_curve = health_curve  # the probe's keys, for a tcp:// daemon with CURVE
        self.listen_fd = listen_fd
        self.proc: subprocess.Popen[bytes] | ReparentedProcess | None = None
        self.starts = 0
        self.ready_s: list[float] = []  # seconds from spawn to the first health answer, per start

    @classmethod
    def start(cls, workdir: Path | None = None, **kwargs: Any) -> KvtierDaemon:
        """``KvtierDaemon(workdir, **kwargs)``, spawned and answering."""
        daemon = cls(workdir, **kwargs)
        daemon.spawn()
        return daemon

    def spawn(self) -> None:
        """Start the process (again) and wait until it answers health."""
        t0_s = time.monotonic()
        argv, pass_fds, env = self.argv, (), self.env
        if self.listen_fd is not None:
            argv = [sys.executable, "-c", SOCKET_ACTIVATION_LAUNCHER, str(self.listen_fd), *self.argv]
            pass_fds = (self.listen_fd,)
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                         env=env, cwd=self.cwd, pass_fds=pass_fds)
        self.starts += 1
        self._wait_answering(t0_s)

    def _wait_answering(self, t0_s: float) -> None:
        """Until this very process (``self.proc``) answers health; see ``spawn``."""
        assert self.proc is not None
        deadline_s = t0_s + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode} at start-up:\n"
                                   f"{self.log_tail(ERROR_LOG_LINES)}")
            try:
                health = probe_health(self.endpoint, timeout_s=PROBE_TIMEOUT_S, curve=self.health_curve)
                if health.get("pid") == self.proc.pid:
                    self.ready_s.append(time.monotonic() - t0_s)
                    return
                # Another daemon answers on this socket; ours will exit saying so.
                time.sleep(0.1)
            except KvtierTimeout:
                pass
            if time.monotonic() > deadline_s:
                self.kill()
                raise RuntimeError(f"kvtierd did not answer health in {self.start_timeout_s:.0f} s:\n"
                                   f"{self.log_tail(ERROR_LOG_LINES)}")

    @property
    def pid(self) -> int:
        assert self.proc is not None, "never spawned"
        return self.proc.pid

    @property
    def socket_file(self) -> str:
        """The socket file of this daemon's ``ipc://`` endpoint (a test of a tcp or abstract one has none)."""
        path = ipc_socket_file(self.endpoint)
        assert path is not None, f"{self.endpoint} has no socket file"
        return path

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, signum: int) -> None:
        assert self.proc is not None, "never spawned"
        self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL this daemon (only this pid) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(KILL_REAP_TIMEOUT_S)

    def restart(self) -> None:
        """SIGKILL, then the same daemon again on the same socket."""
        self.kill()
        self.spawn()

    def upgrade(self, timeout_s: float | None = None) -> int:
        """SIGUSR2 and the hand-over to the successor (see the module docstring); the old process's exit code."""
        assert self.proc is not None and self.proc.poll() is None, "not running"
        become_subreaper()
        old = self.proc
        t0_s = time.monotonic()
        deadline_s = t0_s + (self.start_timeout_s if timeout_s is None else timeout_s)
        old.send_signal(signal.SIGUSR2)
        new_pid = None
        while new_pid is None:
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"no successor answered within {deadline_s - t0_s:.0f} s:\n"
                                   f"{self.log_tail(ERROR_LOG_LINES)}")
            try:
                pid = probe_health(self.endpoint, timeout_s=PROBE_TIMEOUT_S, curve=self.health_curve).get("pid")
                if isinstance(pid, int) and pid != old.pid:
                    new_pid = pid
            except KvtierTimeout:
                pass
            if old.poll() not in (None, 0) and new_pid is None:
                raise RuntimeError(f"kvtierd exited with {old.returncode} during the upgrade:\n"
                                   f"{self.log_tail(ERROR_LOG_LINES)}")
            time.sleep(0.05)
        rc = old.wait(max(1.0, deadline_s - time.monotonic()))
        self.proc = ReparentedProcess(new_pid)
        self.starts += 1
        self.ready_s.append(time.monotonic() - t0_s)
        return rc

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """``signum`` and wait; SIGKILL if it has not exited in ``timeout_s``. The exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def cleanup(self) -> None:
        """Stop it, and remove the working folder when this object made it."""
        self.stop()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:  # removed by cleanup(), or never written
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def rss_bytes(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def num_threads(self) -> int:
        return int(psutil.Process(self.pid).num_threads())

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The daemon's ``stats`` reply (the session-less admin verb)."""
        from kvtier.client.admin import request

        return request(self.endpoint, "stats", timeout_s=timeout_s, curve=self.health_curve)

    def __enter__(self) -> KvtierDaemon:
        if not self.alive:
            self.spawn()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


# Socket activation without systemd: ``python -c LAUNCHER FD kvtierd-argv...`` moves FD to descriptor 3, says so in
# LISTEN_FDS / LISTEN_FDNAMES with LISTEN_PID = its own pid, and execs kvtierd in the same process (same pid).
SOCKET_ACTIVATION_LAUNCHER = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "if fd != 3:\n"
    "    os.dup2(fd, 3)\n"
    "    os.close(fd)\n"
    "os.set_inheritable(3, True)\n"
    "os.environ.update(LISTEN_FDS='1', LISTEN_FDNAMES='kvtierd', LISTEN_PID=str(os.getpid()))\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (Linux), so that a kvtierd started by another
    kvtierd (an upgrade's successor) is waited for here once its parent exits."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


class ReparentedProcess:
    """A kvtierd this process did not start but reaps (``become_subreaper``): ``Popen``'s methods the launcher
    and the tests use, by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not re-parented to us (yet): it runs while the pid does
                return None if psutil.pid_exists(self.pid) else -1
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline_s = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline_s is not None and time.monotonic() > deadline_s:
                raise subprocess.TimeoutExpired(f"kvtierd pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def loopback_tcp_daemon(workdir: Path, flags: Mapping[str, object] | None = None, **kwargs: Any) -> KvtierDaemon:
    """kvtierd on a free 127.0.0.1 port, without CURVE (see the module docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "kvtierd-tcp.toml"
    config.write_text(f'socket = "{endpoint}"\ninsecure_tcp = true\n')
    return KvtierDaemon.start(workdir, endpoint=endpoint, flags={"config": config, **(flags or {})}, **kwargs)
