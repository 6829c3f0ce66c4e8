"""The processes bench/protocol.py measures against: kvtierd, a raw ZMQ echo server, redis-server.

Measures nothing; it starts and stops the other side of every comparison.
``Daemon`` runs one kvtierd (``python -m kvtier.daemon --socket ipc://...``)
in its own 0700 directory and waits for it to answer ``health``; with
``profile=True`` it runs kvtierd's ``main()`` under a cProfile launcher
(``protocol_profile`` reads what it writes). ``EchoServer`` runs
``echo_server`` in a second Python process (``bench/protocol.py
--_echo-server ENDPOINT``): a ZMQ ROUTER and nothing else, the transport
floor of every kvtier request. (redis-server comes from
``kvtier.testing.redis_servers``.) Every ``stop`` ends its process even on
error (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ENTRY = Path(__file__).resolve().parent / "protocol.py"  # runs echo_server on --_echo-server
DAEMON_START_TIMEOUT_S = 60.0
ECHO_START_TIMEOUT_S = 30.0

# Runs kvtierd's main() with cProfile on the loop thread (from Server.run on:
# start-up imports are not measured) and on every thread it starts (the copy
# workers). SIGUSR1 dumps the loop thread's profile so far to LOOP.<n> and
# starts a new one, so a bench can cut the run into phases; at exit the last
# phase goes to LOOP.<n> and the copy threads' merged profile to WORKERS.
_DAEMON_PROFILER = r"""
from __future__ import annotations
import cProfile, pstats, signal, sys, threading
out_loop, out_workers = sys.argv[1], sys.argv[2]
argv = sys.argv[3:]
finished = []
_orig_run = threading.Thread.run
def _run(self: threading.Thread) -> None:
    p = cProfile.Profile()
    p.enable()
    try:
        _orig_run(self)
    finally:
        p.disable()
        finished.append(p)
threading.Thread.run = _run
state = {"prof": None, "n": 0}
def _rotate(*_: object) -> None:
    p = state["prof"]
    if p is None:
        return
    p.disable()
    p.dump_stats(f"{out_loop}.{state['n']}")
    state["n"] += 1
    state["prof"] = p = cProfile.Profile()
    p.enable()
signal.signal(signal.SIGUSR1, _rotate)
import kvtier.daemon.server as _server
_orig_serve = _server.Server.run
def _serve(self: _server.Server) -> None:
    state["prof"] = p = cProfile.Profile()
    p.enable()
    try:
        return _orig_serve(self)
    finally:
        state["prof"].disable()
        state["prof"].dump_stats(f"{out_loop}.{state['n']}")
        state["prof"] = None
_server.Server.run = _serve
from kvtier.daemon.__main__ import main
rc = main(argv)
if finished:
    st = pstats.Stats(finished[0])
    for p in finished[1:]:
        st.add(p)
    st.dump_stats(out_workers)
sys.exit(rc)
"""


class Daemon:
    """One kvtierd subprocess on an ipc socket in its own 0700 directory."""

    def __init__(self, workdir: Path, name: str, *, gpu_bytes: int, cpu_bytes: int, profile: bool = False) -> None:
        self.dir = workdir / name
        self.dir.mkdir(mode=0o700)
        self.name = name
        self.endpoint = f"ipc://{self.dir}/kvtierd.sock"
        self.log_path = self.dir / "kvtierd.log"
        self.prof_loop = self.dir / "loop.prof"
        self.prof_workers = self.dir / "workers.prof"
        flags = ["--socket", self.endpoint, "--device", "cpu", "--gpu-bytes", str(gpu_bytes),
                 "--cpu-bytes", str(cpu_bytes), "--log-level", "warning"]
        if profile:
            self.argv = [sys.executable, "-c", _DAEMON_PROFILER, str(self.prof_loop), str(self.prof_workers), *flags]
        else:
            self.argv = [sys.executable, "-m", "kvtier.daemon", *flags]
        self.flags = flags
        self._phase = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        """Start kvtierd and wait until it answers ``health``; a daemon that exits first raises with its log."""
        from kvtier.client.client import KvtierTimeout, probe_health

        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") and k != "NOTIFY_SOCKET"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=REPO)
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd {self.name} exited with {self.proc.returncode} at start-up:\n{self.log()}")
            try:
                probe_health(self.endpoint, timeout_s=0.2)
                return self
            except KvtierTimeout:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvtierd {self.name} did not answer health in {DAEMON_START_TIMEOUT_S}s") from None

    def log(self) -> str:
        """The last 4,000 characters of the daemon's log (for an error message)."""
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def rotate_profile(self, timeout_s: float = 30.0) -> Path:
        """Profiled daemons: end the loop thread's current profile phase; returns its file."""
        assert self.proc is not None
        path = Path(f"{self.prof_loop}.{self._phase}")
        self._phase += 1
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"profiled kvtierd wrote no {path.name}:\n{self.log()}")
            time.sleep(0.02)
        time.sleep(0.2)  # let the dump finish
        return path

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait; SIGKILL if it does not stop. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


def echo_server(endpoint: str) -> int:
    """The raw ZMQ baseline: a ROUTER that echoes every message, answers a
    bandwidth request ``b"BW" + size`` with one preallocated ``size``-byte
    buffer sent as a zero-copy frame (what kvtierd does with a restore reply),
    and a copy request ``b"CP" + arena name`` by filling that shared-memory
    file from a preallocated buffer before answering (what a copy plane
    costs at the least when another process does the copy)."""
    import numpy as np
    import zmq

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    buffers: dict[int, Any] = {}
    arenas: dict[str, Any] = {}
    ok = b"\x81\xa2ok\xc3"  # msgpack {"ok": true}
    while not stop:
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes[:2] == b"CP":
            # b"CP" + arena file name: copy a preallocated buffer into the
            # client's shared-memory arena, then answer (a copy plane's floor).
            name = frames[1].bytes[2:].decode()
            arena = arenas.get(name)
            if arena is None:
                from kvtier.client.shm_arena import ShmArena

                size = os.path.getsize(f"/dev/shm/{name}")
                arena = arenas[name] = np.frombuffer(ShmArena.attach(name, 1, size).buffer, dtype=np.uint8)
            buf = buffers.get(arena.nbytes)
            if buf is None:
                buf = buffers[arena.nbytes] = np.full(arena.nbytes, 7, dtype=np.uint8)
            np.copyto(arena, buf)
            sock.send_multipart([frames[0], ok], copy=False)
            continue
        body = frames[1].bytes if len(frames) == 2 and len(frames[1]) == 10 else None
        if body is not None and body[:2] == b"BW":
            size = int.from_bytes(body[2:], "little")
            buf = buffers.get(size)
            if buf is None:
                buf = buffers[size] = np.full(size, 7, dtype=np.uint8)
            sock.send_multipart([frames[0], ok, buf], copy=False)
        else:
            sock.send_multipart(frames, copy=False)
    sock.close(0)
    ctx.term()
    return 0


class EchoServer:
    """``echo_server`` in its own process (another process, as kvtierd is), on an ipc socket in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "echo"
        self.dir.mkdir(mode=0o700)
        self.endpoint = f"ipc://{self.dir}/echo.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EchoServer:
        """Start the echo process and ping it until it answers."""
        import zmq

        self.proc = subprocess.Popen([sys.executable, str(ENTRY), "--_echo-server", self.endpoint],
                                     stdin=subprocess.DEVNULL)
        ctx = zmq.Context.instance()
        deadline = time.monotonic() + ECHO_START_TIMEOUT_S
        while True:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.endpoint)
            s.send(b"ping")
            got = s.poll(200)
            s.close(0)
            if got:
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the raw ZMQ echo server did not start")

    def stop(self) -> int | None:
        """SIGTERM, wait; SIGKILL if it does not stop. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

