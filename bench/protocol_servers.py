"""The processes bench/protocol.py measures against: kvtierd, a raw ZMQ echo server.

Measures nothing; it starts and stops the other side of every comparison.
``bench_daemon`` describes one kvtierd (``kvtier.testing.KvtierDaemon``:
``python -m kvtier.daemon --socket ipc://...`` in its own 0700 directory,
ready once it answers ``health``) with the bench's flags; not started, so
the caller can register it for clean-up first. ``ProfiledDaemon`` is the
same kvtierd run by a cProfile launcher (``python -c``, same process, so
``KvtierDaemon`` waits for it alike) plus what only the profile section
needs: the profile files and ``rotate_profile`` (``protocol_profile``
reads what it writes). ``EchoServer`` runs ``echo_server`` in a second
Python process (``bench/protocol.py --_echo-server ENDPOINT``): a ZMQ
ROUTER and nothing else, the transport floor of every kvtier request.
(redis-server comes from ``kvtier.testing.redis_servers``.) Every
``stop`` ends its process even on error (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.testing.daemon import DEFAULT_COMMAND, KvtierDaemon

REPO = Path(__file__).resolve().parent.parent
ENTRY = Path(__file__).resolve().parent / "protocol.py"  # runs echo_server on --_echo-server
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


def bench_daemon(workdir: Path, name: str, *, gpu_bytes: int, cpu_bytes: int,
                 command: Sequence[str] = DEFAULT_COMMAND) -> KvtierDaemon:
    """kvtierd ``name`` in ``workdir/name`` on the CPU device, not started (``spawn()`` it)."""
    flags = {"device": "cpu", "gpu_bytes": gpu_bytes, "cpu_bytes": cpu_bytes, "log_level": "warning"}
    return KvtierDaemon(workdir / name, flags=flags, cwd=REPO, command=command)


class ProfiledDaemon:
    """A ``bench_daemon`` run by ``_DAEMON_PROFILER``, and the SIGUSR1 cut of its loop thread's profile."""

    def __init__(self, workdir: Path, name: str, *, gpu_bytes: int, cpu_bytes: int) -> None:
        self.prof_loop = workdir / name / "loop.prof"  # phases go to loop.prof.<n>
        self.prof_workers = workdir / name / "workers.prof"
        command = [sys.executable, "-c", _DAEMON_PROFILER, str(self.prof_loop), str(self.prof_workers)]
        self.daemon = bench_daemon(workdir, name, gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, command=command)
        self._phase = 0

    def rotate_profile(self, timeout_s: float = 30.0) -> Path:
        """End the loop thread's current profile phase; returns its file once written."""
        d = self.daemon
        path = Path(f"{self.prof_loop}.{self._phase}")
        self._phase += 1
        d.send_signal(signal.SIGUSR1)
        deadline_s = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline_s or not d.alive:
                raise RuntimeError(f"profiled kvtierd wrote no {path.name}:\n{d.log_tail()}")
            time.sleep(0.02)
        time.sleep(0.2)  # the file exists from the dump's first write on: let the dump finish
        return path


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

