"""bench/protocol.py section 3g (profile): a lookup's round trip hop by hop, beside the raw echo's.

Why: the lookup target is a ratio to a raw ZMQ echo of the same bytes, and
the daemon's own handling time (3a) does not say which part of the gap is
Python on either side and which is the transport. Here every hop is timed
from ``time.perf_counter`` stamps (CLOCK_MONOTONIC: one clock for every
process on the host) taken on both sides of each socket call:

- a kvtierd started under ``_STAMPER`` (a launcher that wraps pyzmq's
  ``Poller.poll``, ``recv_multipart`` and ``send_multipart`` on the loop
  thread and writes, at exit, per reply: poll returned, request received,
  reply send started and returned);
- an echo server (``_ECHO``) that is the bench's echo server with the same
  stamps (a ROUTER, ``poll``, ``recv_multipart``, ``send_multipart``);
- this process: the client's own socket calls are wrapped for the section
  only (``_client_stamps``), so ``Client.lookup`` runs unchanged inside.

Each client call is matched to the server record whose receipt lies between
its send and its reply. Hops: the client before its send; its send call;
send to the server's poll returning (the request crossing both processes'
libzmq I/O threads); the server's receive; the server's work (its whole
``_handle`` up to the reply's send: nothing for the echo); from the start of
its send to the client holding the reply (back across: measured from the
start, since a sender woken late may return from its send after the client
already read the reply); the client after. The
wrappers add the same ~1 us per socket call to both variants. Calls are
interleaved (echo, lookup in random order), as in section 1.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from protocol_common import LOOKUP_HASHES, SPECS, PoolClient
from protocol_servers import bench_daemon
from report import progress, table

# kvtierd's main() with its loop thread's socket calls stamped; the records go to argv[1] at exit.
_STAMPER = r"""
import json, sys, threading, time
import zmq
out, argv = sys.argv[1], sys.argv[2:]
pc, loop = time.perf_counter, threading.main_thread()
records, last = [], {}
def stamped(name):
    owner = zmq.Poller if name == "poll" else zmq.Socket
    orig = getattr(owner, name)
    def call(self, *a, **k):
        if threading.current_thread() is not loop:
            return orig(self, *a, **k)
        t0 = pc()
        r = orig(self, *a, **k)
        t1 = pc()
        if name == "send_multipart":
            records.append((last.get("poll", 0.0), last.get("recv", 0.0), t0, t1))
        else:
            last["poll" if name == "poll" else "recv"] = t1
        return r
    setattr(owner, name, call)
for name in ("poll", "recv_multipart", "send_multipart"):
    stamped(name)
from kvtier.daemon.__main__ import main
rc = main(argv)
with open(out, "w") as f:
    json.dump(records, f)
sys.exit(rc)
"""

# The bench's echo server (protocol_servers.echo_server: ROUTER, poll, echo) with the same stamps.
_ECHO = r"""
import json, signal, sys, time
import zmq
pc, records, stop = time.perf_counter, [], []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(sys.argv[1])
while not stop:
    if not sock.poll(100):
        continue
    t_poll = pc()
    frames = sock.recv_multipart(copy=False)
    t_recv = pc()
    sock.send_multipart(frames, copy=False)
    records.append((t_poll, t_recv, t_recv, pc()))
with open(sys.argv[2], "w") as f:
    json.dump(records, f)
"""

HOPS = ("client, before its send", "client send call", "request: send -> server's poll returns", "server receive",
        "server work (request to reply)", "reply: server's send -> client holds it", "client, after", "round trip")


@contextlib.contextmanager
def _client_stamps(last: dict[str, float]) -> Iterator[None]:
    """This thread's pyzmq send/recv calls leave their start and end in ``last`` (the section only): the
    socket's methods, and the backend send the client's transport calls directly (``transport._send``)."""
    import zmq

    from kvtier.client import transport

    me = threading.current_thread()
    targets: list[tuple[Any, str]] = [(zmq.Socket, n) for n in ("send", "send_multipart", "recv", "recv_multipart")]
    if hasattr(transport, "_send"):
        targets.append((transport, "_send"))
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name in targets]

    def wrap(orig: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            if threading.current_thread() is not me:
                return orig(*a, **k)
            t0 = time.perf_counter()
            r = orig(*a, **k)
            last[kind + "0"], last[kind + "1"] = t0, time.perf_counter()
            return r
        return call

    for owner, name in targets:
        setattr(owner, name, wrap(getattr(owner, name), "recv" if name.startswith("recv") else "send"))
    try:
        yield
    finally:
        for owner, name, orig in saved:
            if orig is None:
                delattr(owner, name)  # it was inherited: the class's own lookup finds it again
            else:
                setattr(owner, name, orig)


def _hops(calls: list[tuple[float, float, float, float, float]],
          server: list[tuple[float, float, float, float]]) -> dict[str, list[float]]:
    """Per hop, the seconds of every client call matched to its server record."""
    server = sorted(server, key=lambda r: r[1])
    starts = [r[1] for r in server]
    out: dict[str, list[float]] = {h: [] for h in HOPS}
    for t0, s0, s1, r1, t3 in calls:
        i = bisect.bisect_left(starts, s1)
        if i >= len(server) or not server[i][1] < r1:
            continue  # no server record inside this call (cannot happen on a serial client; skipped)
        poll, recv, ss, _send_returned = server[i]
        for hop, v in zip(HOPS, (s0 - t0, s1 - s0, poll - s1, recv - poll, ss - recv, r1 - ss, t3 - r1, t3 - t0)):
            out[hop].append(v)
    return out


def lookup_hops(args: Any, env: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The section's JSON object: p50/mean per hop for the echo and the lookup, and their difference."""
    import zmq

    from kvtier.client.protocol import encode, request_header

    n = 300 if args.quick else 3000
    d_records = workdir / "hops" / "kvtierd-stamps.json"
    e_records = workdir / "hops-echo-stamps.json"
    d = env["daemons"]["hops"] = bench_daemon(workdir, "hops", gpu_bytes=args.gpu_bytes, cpu_bytes=args.cpu_bytes,
                                              command=[sys.executable, "-c", _STAMPER, str(d_records)])
    progress("profile: hop by hop, a stamped kvtierd and a stamped echo server")
    d.spawn()
    endpoint = f"ipc://{workdir}/hops-echo.sock"
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, endpoint, str(e_records)])
    pc: PoolClient | None = None
    sock = None
    try:
        spec0 = SPECS[0]
        hashes = env["lookup_hashes"]
        pc = PoolClient(d, spec0, hashes, env["specs"][spec0[0]]["data"], store_n=LOOKUP_HASHES)
        client = pc.client
        req = encode(request_header("lookup", 1 << 40, client.sid, packed_hashes=client._packed_hashes,
                                    hashes=hashes, pin=False))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)

        def echo_call() -> Any:
            sock.send(req, copy=False)
            return sock.recv_multipart(copy=False)

        def lookup_call() -> Any:
            return client.lookup(hashes)

        for _ in range(50):
            echo_call()
            lookup_call()
        last: dict[str, float] = {}
        calls: dict[str, list[tuple[float, float, float, float, float]]] = {"echo": [], "lookup": []}
        rng = random.Random(n)
        order = [("echo", echo_call), ("lookup", lookup_call)]
        with _client_stamps(last):
            for _ in range(n):
                rng.shuffle(order)
                for name, fn in order:
                    t0 = time.perf_counter()
                    fn()
                    t3 = time.perf_counter()
                    calls[name].append((t0, last["send0"], last["send1"], last["recv1"], t3))
    finally:
        if sock is not None:
            sock.close(linger=0)
        if pc is not None:
            pc.close()
        echo.send_signal(signal.SIGTERM)
        echo_rc = echo.wait(timeout=30)
        rc = d.stop()
        del env["daemons"]["hops"]
    server = {"echo": json.loads(e_records.read_text()), "lookup": json.loads(d_records.read_text())}
    out: dict[str, Any] = {"calls": n, "exit_status": {"kvtierd": rc, "echo": echo_rc}, "hops": {}}
    for name in ("echo", "lookup"):
        per_hop = _hops(calls[name], [tuple(r) for r in server[name]])
        out["hops"][name] = {h: dict(p50_us=statistics.median(v) * 1e6, mean_us=statistics.fmean(v) * 1e6,
                                     matched=len(v)) for h, v in per_hop.items() if v}
    return out


def report_hops(h: dict[str, Any]) -> list[str]:
    """Table 3g, as printed (none when the section did not run)."""
    if not h or "hops" not in h:
        return []
    e, lk = h["hops"].get("echo", {}), h["hops"].get("lookup", {})
    rows = []
    for hop in HOPS:
        if hop in e and hop in lk:
            rows.append([hop, f"{e[hop]['p50_us']:.1f}", f"{lk[hop]['p50_us']:.1f}",
                         f"{lk[hop]['p50_us'] - e[hop]['p50_us']:+.1f}"])
    return [table(["hop", "echo p50 us", "lookup p50 us", "lookup - echo"], rows,
                  f"\n3g. A lookup's round trip hop by hop beside the raw echo's ({h['calls']} calls each, "
                  "interleaved; stamps on both sides of every socket call)")]
