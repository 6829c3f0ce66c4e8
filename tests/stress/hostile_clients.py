"""Hostile and careless clients as separate processes: the daemon tests' floods and the hostile stress scenario's attackers.

Each mode is one process (``python -m tests.stress.hostile_clients MODE ...``
from the repository root), so that the test process's own GIL and
descriptors stay out of the measurement:

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

The hostile scenario's attackers (issue 32, items 1, 2, 4 and 5) each print
one JSON object of counts when done; a client error never stops them (it is
counted by code name: ``errors``), only the time does:

- ``lookups ENDPOINT POOL BLOCK_BYTES SECONDS SESSIONS``: lookups of
  ``MAX_HASHES`` hashes nobody stored (``lookup_flood``); with SESSIONS 1
  each names a new hint session.
- ``careless ENDPOINT POOL BLOCK_BYTES SECONDS``: pinned batches
  (``Client.lookup_many``) with 256-character sessions in their hints, past
  the session's pin share (some requests get ``TOO_MANY_PINS``), every third
  with a deadline too short to read the answers; each request's pins dropped
  by its tag afterwards. At the end it reports the pool's ``pinned_blocks``
  (a pin nobody heard of that outlived its request shows there).
- ``unread ENDPOINT POOL BLOCK_BYTES SECONDS``: sessions on sockets that never
  read, asking for restores (copied replies) and heartbeats; every few
  seconds it leaves them with their replies unread and opens new ones.
- ``sessions ENDPOINT POOL BLOCK_BYTES SECONDS``: hellos until
  ``TOO_MANY_SESSIONS``, then ``bye`` of half of them, again and again.
- ``redis URL BLOCK_BYTES SECONDS TARGET_KEY TARGET_FAMILIES PER_S``: the
  attacks of ``redis_attacks.Attacker`` on the block keys it finds, PER_S a
  second, injected keys for the chains ``chain_hashes(f"{TARGET_KEY}-{f}",
  CHAIN_BLOCKS)`` for f below TARGET_FAMILIES.

With ``--gated`` before the mode's arguments, a scenario attacker prints
``ready`` once set up and waits for ``go`` on stdin before it starts.

``spawn(mode, *args, gated=False)`` starts one as a ``subprocess.Popen`` with
its stdout piped (and stdin, gated); ``result(proc, timeout_s)`` waits and
returns what it printed (its last line).
"""

from __future__ import annotations

import json
import os
import random
import resource
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
UNREAD_CYCLE_S = 10.0  # how long a non-reading session piles replies up before it leaves
UNREAD_LEASE_S = 5.0  # its heartbeats keep it; left behind, it ends a lease later
UNREAD_SOCKETS = 6  # each its share of a busy loop's turns
UNREAD_BLOCKS = 8  # restored in one request: half the pool, each between two blocks of its own
CARELESS_CHAINS = 4
CHAIN_BLOCKS = 12
LONG_SESSION_CHARS = 256  # the longest session key the protocol takes (docs/protocol.md §2.6)


def spawn(mode: str, *args: object, gated: bool = False) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "tests.stress.hostile_clients", mode, *(["--gated"] if gated else []),
            *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.PIPE if gated else None, text=True,
                            cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def result(proc: subprocess.Popen[str], timeout_s: float) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, (proc.args, proc.returncode, out)
    return out.strip().splitlines()[-1] if out.strip() else ""


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


# ---- the hostile scenario's attackers ----------------------------------------------------------


def lookup_flood(client: Any, tag: str, lookups: int, sessions: bool) -> None:
    """``lookups`` lookups of MAX_HASHES hashes nobody stored; with ``sessions``, each names a new session."""
    from kvtier.client.protocol import HASH_BYTES, MAX_HASHES, Hints

    for i in range(lookups):
        data = os.urandom(HASH_BYTES * MAX_HASHES)
        hashes = [data[j:j + HASH_BYTES] for j in range(0, len(data), HASH_BYTES)]
        hints = Hints(session=f"{tag}-{i}") if sessions else None
        assert list(client.lookup(hashes, hints=hints)) == []


def long_session(key: str) -> str:
    """A session key of LONG_SESSION_CHARS characters (the longest valid), non-ASCII for odd keys."""
    fill = "\U0001f600" if sum(map(ord, key)) % 2 else "x"
    return (key + "-" + fill * LONG_SESSION_CHARS)[:LONG_SESSION_CHARS]


class _Attack:
    """A scenario attacker: counts, the client errors it shrugs off, the JSON it prints."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.deadline_s = 0.0

    def start(self) -> None:
        self.deadline_s = time.monotonic() + self.seconds

    def running(self) -> bool:
        return time.monotonic() < self.deadline_s

    def shrug(self, exc: BaseException) -> None:
        code = getattr(exc, "code", None)
        self.errors[getattr(code, "name", None) or type(exc).__name__] += 1
        if type(exc).__name__ in ("KvtierTimeout", "DaemonUnavailable"):
            time.sleep(0.05)

    def report(self, **more: object) -> None:
        print(json.dumps({"counts": dict(self.counts), "errors": dict(self.errors), **more}), flush=True)


def _client(endpoint: str, pool: str, block_bytes: int, **kw: Any) -> Any:
    from kvtier.client.client import Client
    from tests.stress.stresslib import store_layout

    return Client(endpoint, pool, store_layout(block_bytes), **kw)


def _lookups(attack: _Attack, endpoint: str, pool: str, block_bytes: int, sessions: bool) -> None:
    from kvtier.client.client import KvtierError

    c = _client(endpoint, pool, block_bytes, timeout_s=60.0, client_name="hostile-lookups")
    yield_ready()
    attack.start()
    tag = f"flood-{os.getpid()}"
    while attack.running():
        try:
            lookup_flood(c, f"{tag}-{attack.counts['lookups']}", 1, sessions)
            attack.counts["lookups"] += 1
        except KvtierError as exc:
            attack.shrug(exc)
    c.close()
    attack.report()


def _careless(attack: _Attack, endpoint: str, pool: str, block_bytes: int) -> None:
    from kvtier.client.client import KvtierError, KvtierTimeout
    from kvtier.client.protocol import Hints
    from tests.stress.stresslib import block_content, chain_hashes

    c = _client(endpoint, pool, block_bytes, timeout_s=60.0, client_name="hostile-careless")
    chains = [chain_hashes(f"careless-{i}", CHAIN_BLOCKS) for i in range(CARELESS_CHAINS)]
    for ch in chains:
        c.store(ch, b"".join(block_content(h, block_bytes) for h in ch))
    yield_ready()
    attack.start()
    owed: set[str] = set()  # tags whose pins were not dropped yet
    batch = 0
    while attack.running():
        batch += 1
        n = 6  # 6 x 12 pins: past a session's share of a pool of fewer than 144 blocks
        tags = [f"b{batch}-{i}" for i in range(n)]
        hints = [Hints(session=long_session(f"careless-{batch}-{i}")) if i % 3 else None for i in range(n)]
        owed.update(tags)
        try:
            answers = c.lookup_many([chains[i % len(chains)] for i in range(n)], pin=True, hints=hints,
                                    pin_tags=tags, timeout_s=0.001 if batch % 3 == 0 else 60.0)
            for a in answers:
                attack.counts["answered_" + (getattr(getattr(a, "code", None), "name", "") or "tiers")] += 1
        except KvtierTimeout:
            attack.counts["batches_timed_out"] += 1  # its pins, if any, are known only to the daemon
        except KvtierError as exc:
            attack.shrug(exc)
        attack.counts["batches"] += 1
        _unpin_tags(attack, c, owed, time.monotonic() + 60.0)
    _unpin_tags(attack, c, owed, time.monotonic() + 120.0)
    time.sleep(2.0)  # a lookup that outran its unpin would land by now
    pinned = _pool_stat(attack, c, pool, "pinned_blocks")
    c.close()
    attack.report(pinned_blocks_at_end=pinned, tags_not_unpinned=len(owed))


def _unpin_tags(attack: _Attack, c: Any, owed: set[str], deadline_s: float) -> None:
    from kvtier.client.client import KvtierError

    while owed and time.monotonic() < deadline_s:
        tag = min(owed)
        try:
            attack.counts["unpinned_blocks"] += c.unpin_tag(tag, timeout_s=30.0)
            owed.discard(tag)
        except KvtierError as exc:  # a new connection refused while a flood holds them all: again
            attack.shrug(exc)
            time.sleep(0.1)


def _pool_stat(attack: _Attack, c: Any, pool: str, key: str) -> int | None:
    from kvtier.client.client import KvtierError

    for _ in range(20):
        try:
            return int(c.stats(timeout_s=30.0)["pools"][pool][key])
        except KvtierError as exc:
            attack.shrug(exc)
            time.sleep(0.2)
    return None


def _unread(attack: _Attack, endpoint: str, pool: str, block_bytes: int) -> None:
    import zmq

    from kvtier.client.client import KvtierError
    from kvtier.client.protocol import encode
    from tests.stress.stresslib import store_layout

    rng = random.Random(os.getpid())
    owner = _client(endpoint, pool, block_bytes, timeout_s=60.0, client_name="hostile-unread-owner")
    hs = [rng.randbytes(16) for _ in range(UNREAD_BLOCKS)]
    layout = store_layout(block_bytes).to_wire()
    ctx = zmq.Context()
    yield_ready()
    attack.start()
    rid = 0
    while attack.running():
        try:
            # Each between two other blocks: a restore gathers them into a staging copy (lying in
            # one run they would be lent, costing the daemon nothing).
            for h in hs:
                owner.store([h, rng.randbytes(16)], bytes(2 * block_bytes))
        except KvtierError as exc:
            attack.shrug(exc)
        socks = _hellos(attack, ctx, endpoint, pool, layout)
        attack.counts["sessions"] += len(socks)
        cycle_end_s = min(attack.deadline_s, time.monotonic() + UNREAD_CYCLE_S)
        while time.monotonic() < cycle_end_s and socks:
            for sock, sid in socks:
                for op, n in (("restore", 4), ("heartbeat", 1)):
                    for _ in range(n):
                        rid += 1
                        fields = {"hashes": hs} if op == "restore" else {}
                        try:
                            sock.send(encode({"v": 1, "op": op, "id": rid, "sid": sid, **fields}), zmq.NOBLOCK)
                            attack.counts[op + "_sent"] += 1
                        except zmq.Again:
                            attack.counts["send_blocked"] += 1
            time.sleep(0.1)
        for sock, _sid in socks:  # leave, every reply unread
            sock.close(0)
    ctx.term()
    owner.close()
    attack.report()


def _hellos(attack: _Attack, ctx: Any, endpoint: str, pool: str, layout: dict[str, Any]) -> list[tuple[Any, str]]:
    """UNREAD_SOCKETS new sockets, each with a session (those a connection flood lets in within 5 s)."""
    import zmq

    from kvtier.client.protocol import decode, encode

    pending = []
    for i in range(UNREAD_SOCKETS):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 1)  # reads nothing, queues almost nothing on its side
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(encode({"v": 1, "op": "hello", "id": i + 1, "pool": pool, "layout": layout,
                          "lease_s": UNREAD_LEASE_S}))
        pending.append(sock)
    deadline_s = time.monotonic() + 5.0
    socks = []
    for sock in pending:
        reply = decode(sock.recv()) if sock.poll(max(1, int((deadline_s - time.monotonic()) * 1000))) else None
        if reply is None or not reply.get("ok"):
            attack.errors["hello_" + (reply["error"]["name"] if reply else "timeout")] += 1
            sock.close(0)
            continue
        socks.append((sock, reply["sid"]))
    return socks


def _sessions(attack: _Attack, endpoint: str, pool: str, block_bytes: int) -> None:
    import zmq

    from tests.stress.stresslib import store_layout

    layout = store_layout(block_bytes).to_wire()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    yield_ready()
    attack.start()
    sids: list[str] = []
    rid = 0
    while attack.running():
        full = False
        msgs = []
        for _ in range(64):
            rid += 1
            msgs.append({"v": 1, "op": "hello", "id": rid, "pool": pool, "layout": layout, "client": "x" * 128})
        for reply in _ask_all(attack, sock, msgs):
            if reply.get("ok"):
                sids.append(reply["sid"])
                attack.counts["hellos_ok"] += 1
            else:
                name = reply["error"]["name"]
                attack.errors[name] += 1
                full = full or name == "TOO_MANY_SESSIONS"
        if full:  # the daemon is full: end half of ours, then fill it again
            half, sids = sids[: len(sids) // 2], sids[len(sids) // 2:]
            byes = []
            for sid in half:
                rid += 1
                byes.append({"v": 1, "op": "bye", "id": rid, "sid": sid})
            attack.counts["byes"] += sum(1 for r in _ask_all(attack, sock, byes) if r.get("ok"))
    for i in range(0, len(sids), 64):
        _ask_all(attack, sock, [{"v": 1, "op": "bye", "id": 10**9 + i + j, "sid": sid}
                                for j, sid in enumerate(sids[i:i + 64])])
    sock.close(0)
    ctx.term()
    attack.report()


def _ask_all(attack: _Attack, sock: Any, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send ``msgs`` pipelined and read their replies (those that come within 10 s each)."""
    from kvtier.client.protocol import decode, encode

    for m in msgs:
        sock.send(encode(m))
    out = []
    for _ in msgs:
        if not sock.poll(10_000):
            attack.errors["reply_lost"] += 1
            break
        out.append(decode(sock.recv_multipart()[0]))
    return out


def _redis(attack: _Attack, url: str, block_bytes: int, target_key: str, target_families: int,
           per_s: float) -> None:
    import redis

    from tests.stress.redis_attacks import Attacker
    from tests.stress.stresslib import chain_hashes

    targets = [h for f in range(target_families) for h in chain_hashes(f"{target_key}-{f}", CHAIN_BLOCKS)]
    attacker = Attacker(redis.Redis.from_url(url), targets, block_bytes, seed=os.getpid())
    yield_ready()
    attack.start()
    while attack.running():
        try:
            if not attacker.step():
                time.sleep(0.05)
                continue
        except redis.RedisError as exc:
            attack.shrug(exc)
        time.sleep(1.0 / per_s)  # some blocks stay intact: the engine restores those, byte-exact
    attack.counts.update(attacker.counts)
    attack.report()


_GATED = False


def yield_ready() -> None:
    """Gated: say so once set up, and wait for the go."""
    if _GATED:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit(0)


def main(argv: list[str]) -> None:
    global _GATED
    mode, *rest = argv
    if rest and rest[0] == "--gated":
        _GATED, rest = True, rest[1:]
    if mode == "raw":
        _raw(rest[0], int(rest[1]), float(rest[2]))
    elif mode == "busy":
        _busy(rest[0], float(rest[1]))
    elif mode == "guess":
        _guess(rest[0], float(rest[1]))
    elif mode in ("lookups", "careless", "unread", "sessions"):
        endpoint, pool, block_bytes, seconds = rest[0], rest[1], int(rest[2]), float(rest[3])
        attack = _Attack(seconds)
        if mode == "lookups":
            _lookups(attack, endpoint, pool, block_bytes, sessions=rest[4] == "1")
        elif mode == "careless":
            _careless(attack, endpoint, pool, block_bytes)
        elif mode == "unread":
            _unread(attack, endpoint, pool, block_bytes)
        else:
            _sessions(attack, endpoint, pool, block_bytes)
    elif mode == "redis":
        _redis(_Attack(float(rest[2])), rest[0], int(rest[1]), rest[3], int(rest[4]), float(rest[5]))
    else:
        raise SystemExit(f"unknown mode {mode!r}: raw, busy, guess, lookups, careless, unread, sessions or redis")


if __name__ == "__main__":
    main(sys.argv[1:])
