"""Hostile clients as separate processes, for the daemon tests that flood or keep kvtierd busy.

Run as a script (``python tests/daemon/hostile_clients.py MODE ...``), each
mode one process, so that the test process's own GIL and descriptors stay out
of the measurement:

- ``raw PATH N HOLD_S``: opens ``N`` plain unix-socket connections to the ipc
  socket file ``PATH`` as fast as the kernel lets it (blocking connects, no
  ZMTP: each costs the daemon one accept and nothing else), holds them
  ``HOLD_S`` seconds, closes them, prints how many connected.
- ``busy ENDPOINT SECONDS``: keeps the daemon's event loop busy for
  ``SECONDS``: ``stats`` requests pipelined 32 at a time, every reply read;
  prints how many were answered.
- ``guess ENDPOINT SECONDS``: sends ``hello`` with wrong tenant tokens one
  after another for ``SECONDS`` and prints ``{"answered": n, "codes": {...}}``
  as JSON (token guesses per second = answered / SECONDS).

``spawn(mode, *args)`` starts one as a ``subprocess.Popen`` with its stdout
piped; ``result(proc, timeout_s)`` waits and returns what it printed.
"""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path


def spawn(mode: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), mode, *map(str, args)],
                            stdout=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen[str], timeout_s: float) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, (proc.args, proc.returncode, out)
    return out.strip()


def _raw(path: str, n: int, hold_s: float) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 64
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
        except OSError:
            s.close()
            continue
        socks.append(s)
    time.sleep(hold_s)
    for s in socks:
        s.close()
    print(len(socks))


def _busy(endpoint: str, seconds: float) -> None:
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    answered = 0
    rid = 0
    deadline_s = time.monotonic() + seconds
    while time.monotonic() < deadline_s:
        for _ in range(32):
            rid += 1
            sock.send(msgpack.packb({"v": 1, "op": "stats", "id": rid}))
        for _ in range(32):
            if not sock.poll(5000):
                break
            sock.recv_multipart()
            answered += 1
    sock.close()
    ctx.term()
    print(answered)


def _guess(endpoint: str, seconds: float) -> None:
    import msgpack
    import zmq

    layout = {"model": "m", "block_size": 4, "block_bytes": 4096, "dtype": "bfloat16", "num_layers": 1,
              "kv_heads": 1, "head_dim": 8, "tp_rank": 0, "tp_size": 1, "hash_algo": "xxh3_128", "mode": "store"}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    codes: dict[str, int] = {}
    answered = 0
    deadline_s = time.monotonic() + seconds
    rid = 0
    while time.monotonic() < deadline_s:
        rid += 1
        sock.send(msgpack.packb({"v": 1, "op": "hello", "id": rid, "pool": "p", "layout": layout,
                                 "token": f"guess-{rid:032d}"}))
        if not sock.poll(5000):
            break
        reply = msgpack.unpackb(sock.recv_multipart()[0])
        answered += 1
        name = "ok" if reply["ok"] else reply["error"]["name"]
        codes[name] = codes.get(name, 0) + 1
    sock.close()
    ctx.term()
    print(json.dumps({"answered": answered, "codes": codes}))


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "raw":
        _raw(rest[0], int(rest[1]), float(rest[2]))
    elif mode == "busy":
        _busy(rest[0], float(rest[1]))
    elif mode == "guess":
        _guess(rest[0], float(rest[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}: raw, busy or guess")
