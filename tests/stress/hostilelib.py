"""Hostile and careless clients together against one kvtierd, with a well-behaved engine beside them (issue 32).

Contract
========

``run_hostile(HostileConfig) -> dict`` starts a real redis-server and one
kvtierd (a descriptor limit of ``nofile``, the pools and limits of
``HostileConfig.toml()``, a remote tier on pool ``good-remote`` with a
secret), then, for ``duration_s``, all at once (issue 32, items 1 to 5):

1. ``lookups`` attackers: lookups of 65,536 never-stored hashes, one on the
   engine's ``chain`` pool, one on its ``chain+session`` pool naming a new
   hint session each time;
2. a ``careless`` client: pinned batches (``lookup_many``) with
   256-character sessions, past its pin share, every third one abandoned at
   a deadline too short to read it, pins dropped by tag;
3. connection floods: rounds of ``flood_processes`` processes opening
   ``flood_connections`` raw connections each, while a ``busy`` client
   keeps the loop busy;
4. an ``unread`` client (sessions on sockets that never read, restores
   piling up copied replies, left behind every few seconds) and a
   ``sessions`` client (hellos up to ``max_sessions``, byes, again);
5. a ``redis`` attacker writing to the remote tier's server: values copied
   between keys, forged values, keys injected for the engine's future
   hashes, oversized values.

The attackers are ``tests.stress.hostile_clients`` processes. Beside them
the well-behaved engine (``python -m tests.stress.hostilelib engine SPEC``)
runs scheduler steps over its three pools: a pinned batch lookup
(``lookup_many``, tags per request, 256-character sessions in its hints),
a restore of every pinned prefix (byte for byte; never shorter than what
it pinned), ``unpin_tag`` of each request (exactly what it pinned), a
store of what it "computed", now and then a plain restore. It opens its
sessions before any attacker runs and keeps them.

Its errors: none expected. A well-behaved client gets none here: it never
reconnects (no deadline of ``call_timeout_s`` passes), never says hello
again (its lease is renewed), never pins past its share. What it must
accept is a restore shorter than asked when nothing is pinned (blocks
evicted, or a remote value refused): a miss, not an error.

The result: the engine's counts and failures, each attacker's report, the
daemon's counters, its policies' key counts against their bounds, its RSS
(start, peak, end, a curve) against ``memory_bound.rss_bound`` of the
configuration, ``coverage`` (did each attack reach the daemon), every
failure, and ``passed``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tests.stress import hostile_clients
from tests.stress.memory_bound import DaemonSpec, PoolSpec, policy_key_bound, rss_bound
from tests.stress.stresslib import REPO_ROOT, block_content, chain_hashes, store_layout

KIB = 1 << 10
MIB = 1 << 20
GOOD_POOLS = ("good", "good-session", "good-remote")
STEP_POOLS = ("good", "good-remote", "good-session", "good-remote")  # the remote tier's pool every other step
ATTACK_POOLS = ("careless", "unread", "sessions")  # "sessions" is configured by [default_pool]
VALID_TIERS = ("gpu", "cpu", "remote")


@dataclass
class HostileConfig:
    duration_s: float = 60.0
    block_bytes: int = 4096
    unread_block_bytes: int = 32 * KIB  # a restore of 8 of them: one 256 KiB copied reply
    good_gpu_blocks: int = 64
    good_cpu_blocks: int = 256
    remote_gpu_blocks: int = 16  # small: the engine's blocks reach Redis within its first steps
    remote_cpu_blocks: int = 32
    careless_gpu_blocks: int = 32
    careless_cpu_blocks: int = 64  # a share of 48 pins: the careless batches of 72 pass it
    unread_blocks: int = 16  # each tier of pool "unread"
    default_blocks: int = 16  # each tier of a pool no [pools] table names ("sessions")
    families: int = 48
    remote_families: int = 8  # 96 blocks for a pool of 48: they go through Redis and come back
    chain_blocks: int = hostile_clients.CHAIN_BLOCKS
    max_batch: int = 4  # requests per engine batch, and at most a pool's pin share of chains
    max_pinned_share: float = 0.5  # the daemon's default
    lease_s: float = 30.0
    max_sessions: int = 128  # fewer than the session flood opens within a lease on a busy loop
    max_connections: int = 128
    nofile: int = 4096  # the daemon's descriptor limit: room for the worst flood (docs/operating.md)
    max_message_bytes: int = 256 * KIB
    max_unread_reply_bytes: int = 4 * MIB  # 16 of the non-readers' replies
    max_unread_reply_bytes_total: int = 16 * MIB
    flood_processes: int = 4
    flood_connections: int = 1500
    flood_hold_s: float = 2.0
    flood_pause_s: float = 2.0
    redis_attacks_per_s: float = 0.5
    call_timeout_s: float = 60.0
    ready_timeout_s: float = 240.0
    finish_grace_s: float = 180.0
    seed: int = 32
    root: str = ""

    @property
    def max_pools(self) -> int:
        return len(GOOD_POOLS) + len(ATTACK_POOLS)

    def pools(self) -> list[PoolSpec]:
        """The pools the configuration names, with the block size their first hello brings."""
        bb = self.block_bytes
        return [
            PoolSpec("good", "chain", self.good_gpu_blocks * bb, self.good_cpu_blocks * bb, bb),
            PoolSpec("good-session", "chain+session", self.good_gpu_blocks * bb, self.good_cpu_blocks * bb, bb),
            PoolSpec("good-remote", "chain", self.remote_gpu_blocks * bb, self.remote_cpu_blocks * bb, bb, remote=True),
            PoolSpec("careless", "chain+session", self.careless_gpu_blocks * bb, self.careless_cpu_blocks * bb, bb),
            PoolSpec("unread", "chain", self.unread_blocks * self.unread_block_bytes,
                     self.unread_blocks * self.unread_block_bytes, self.unread_block_bytes),
        ]

    def batch_limit(self, pool: str) -> int:
        """Requests in one of the engine's batches on ``pool``: whole chains within its pin share."""
        p = next(p for p in self.pools() if p.name == pool)
        share = int((p.gpu_bytes + p.cpu_bytes) // p.block_bytes * self.max_pinned_share)
        return max(1, min(self.max_batch, share // self.chain_blocks))

    def daemon_spec(self) -> DaemonSpec:
        return DaemonSpec(max_sessions=self.max_sessions, max_connections=self.max_connections, nofile=self.nofile,
                          max_unread_reply_bytes_total=self.max_unread_reply_bytes_total,
                          max_message_bytes=self.max_message_bytes, max_pools=self.max_pools,
                          default_gpu_bytes=self.default_blocks * self.block_bytes,
                          default_cpu_bytes=self.default_blocks * self.block_bytes,
                          default_block_bytes=self.block_bytes)

    def toml(self, redis_url: str, secret_path: Path) -> str:
        lines = [
            f"lease_s = {self.lease_s}",
            f"max_sessions = {self.max_sessions}",
            f"max_connections = {self.max_connections}",
            f"max_connections_per_peer = {self.max_connections}",  # every client here is one peer (our uid)
            f"max_message_bytes = {self.max_message_bytes}",
            f"max_unread_reply_bytes = {self.max_unread_reply_bytes}",
            f"max_unread_reply_bytes_total = {self.max_unread_reply_bytes_total}",
            f"max_pools = {self.max_pools}",
            f"max_pinned_share = {self.max_pinned_share}",
            f'remote_secret_key_file = "{secret_path}"',
            'device = "cpu"',
            'log_level = "info"',
            "[default_pool]",
            f"gpu_bytes = {self.default_blocks * self.block_bytes}",
            f"cpu_bytes = {self.default_blocks * self.block_bytes}",
        ]
        for p in self.pools():
            lines += [f'[pools."{p.name}"]', f"gpu_bytes = {p.gpu_bytes}", f"cpu_bytes = {p.cpu_bytes}",
                      f'policy = "{p.policy}"']
            if p.remote:
                lines.append(f'remote_url = "{redis_url}"')
        return "\n".join(lines) + "\n"


def engine_chain(pool: str, family: int, chain_blocks: int) -> list[bytes]:
    """The engine's prefix family ``family`` on ``pool`` (the Redis attacker computes the same)."""
    return chain_hashes(f"{pool}-{family}", chain_blocks)


# ---- the well-behaved engine (a process) -----------------------------------------------------------


class GoodEngine:
    """Scheduler steps over the engine's pools (see the module docstring); every failure recorded."""

    def __init__(self, cfg: HostileConfig, endpoint: str) -> None:
        from kvtier.client.client import Client

        self.cfg = cfg
        self.bb = cfg.block_bytes
        self.rng = random.Random(cfg.seed)
        self.clients = {pool: Client(endpoint, pool, store_layout(self.bb), timeout_s=cfg.call_timeout_s,
                                     client_name=f"good-engine-{pool}") for pool in GOOD_POOLS}
        # The chain pool's blocks go through a shared-memory arena, the others inline.
        self.arena = self.clients["good"].open_arena(cfg.chain_blocks)
        self.chains = {pool: [engine_chain(pool, f, cfg.chain_blocks)
                              for f in range(cfg.remote_families if pool == "good-remote" else cfg.families)]
                       for pool in GOOD_POOLS}
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self.slowest_s = 0.0
        self.sids = {pool: c.sid for pool, c in self.clients.items()}  # kept for the whole run (heartbeats)

    def fail(self, why: str) -> None:
        self.counts["failures"] += 1
        if len(self.failures) < 50:
            self.failures.append(why)

    def call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``; a client error is a failure of the engine (None returned)."""
        from kvtier.client.client import KvtierError

        t0 = time.monotonic()
        try:
            return fn(*args, **kw)
        except KvtierError as exc:
            code = getattr(exc, "code", None)
            self.counts["errors_" + (getattr(code, "name", None) or type(exc).__name__)] += 1
            self.fail(f"{what}: {type(exc).__name__}: {exc}")
            return None
        finally:
            self.slowest_s = max(self.slowest_s, time.monotonic() - t0)

    def pick(self, pool: str) -> list[bytes]:
        chains = self.chains[pool]
        chain = chains[int(len(chains) * self.rng.random() ** 2)]  # low families are hot
        if pool == "good-remote":
            return chain  # whole prompts: the pool overflows into Redis within a few steps
        return chain[: self.rng.randint(1, len(chain))]

    def hints(self, pool: str, serial: int, i: int) -> Any:
        from kvtier.client.protocol import Hints

        if pool == "good-remote" and i % 2:
            return None
        conversation = f"{pool}-conversation-{self.rng.randrange(16)}"
        return Hints(session=hostile_clients.long_session(conversation), priority=i % 2)

    def restore_checked(self, pool: str, hashes: list[bytes], *, at_least: int) -> None:
        c = self.clients[pool]
        if not hashes:
            return
        if pool == "good":
            n = len(hashes)
            for slot in range(n):
                self.arena.slot_view(slot)[:4] = b"\xde\xad\xbe\xef"  # stale bytes must be overwritten
            got = self.call("restore", c.restore, hashes, slots=list(range(n)))
            blocks = [bytes(self.arena.slot_view(i)) for i in range(len(got))] if got is not None else []
        else:
            got = self.call("restore", c.restore, hashes)
            data = bytes(got.data or b"") if got is not None else b""
            blocks = [data[i * self.bb:(i + 1) * self.bb] for i in range(len(got))] if got is not None else []
        if got is None:
            return
        if len(got) < at_least:
            self.fail(f"restore on {pool}: {len(got)} blocks back, but {at_least} are pinned")
        for i, (h, b) in enumerate(zip(hashes, blocks)):
            if b != block_content(h, self.bb):
                self.fail(f"restore on {pool}: block {i} ({got.tiers[i]}) of {len(hashes)} has wrong bytes")
            else:
                self.counts["verified_blocks"] += 1
                self.counts[f"verified_blocks_{got.tiers[i]}"] += 1
        self.counts["missing_blocks"] += len(hashes) - len(got)

    def store(self, pool: str, hashes: list[bytes]) -> None:
        c = self.clients[pool]
        if not hashes:
            return
        if pool == "good":
            for slot, h in enumerate(hashes):
                self.arena.slot_view(slot)[:] = block_content(h, self.bb)
            done = self.call("store", c.store, hashes, slots=list(range(len(hashes))))
        else:
            done = self.call("store", c.store, hashes, b"".join(block_content(h, self.bb) for h in hashes))
        if done is not None:
            self.counts["stored_blocks"] += done[0]
            self.counts["present_blocks"] += done[1]

    def step(self, serial: int) -> None:
        from kvtier.client.client import KvtierError

        pool = STEP_POOLS[serial % len(STEP_POOLS)]
        c = self.clients[pool]
        k = self.rng.randint(1, self.cfg.batch_limit(pool))
        requests = [self.pick(pool) for _ in range(k)]
        tags = [f"step{serial}-req{i}" for i in range(k)]
        answers = self.call("lookup_many", c.lookup_many, requests, pin=True,
                            hints=[self.hints(pool, serial, i) for i in range(k)], pin_tags=tags)
        self.counts["batches"] += 1
        pinned = [0] * k
        if answers is not None:
            for i, a in enumerate(answers):
                if isinstance(a, KvtierError):
                    code = getattr(a, "code", None)
                    self.counts["errors_" + (getattr(code, "name", None) or type(a).__name__)] += 1
                    self.fail(f"lookup_many on {pool}: request {i} of {k} refused: {a}")
                    continue
                tiers = list(a)
                if len(tiers) > len(requests[i]) or any(t not in VALID_TIERS for t in tiers):
                    self.fail(f"lookup_many on {pool}: bad tiers {tiers} for {len(requests[i])} hashes")
                pinned[i] = len(tiers)
                self.counts["requests"] += 1
                self.counts["pinned_blocks"] += len(tiers)
                for t in tiers:
                    self.counts[f"hit_blocks_{t}"] += 1  # "remote": fetched from Redis, pinned, restored below
        for i, req in enumerate(requests):  # "load" each request's cached prefix while it is pinned
            self.restore_checked(pool, req[: pinned[i]], at_least=pinned[i])
        for i, tag in enumerate(tags):  # each request ends: its pins go
            dropped = self.call("unpin_tag", c.unpin_tag, tag)
            if dropped is not None and dropped != pinned[i]:
                self.fail(f"unpin_tag on {pool}: {dropped} pins dropped, {pinned[i]} were taken")
        for i, req in enumerate(requests):  # ...and what it computed is stored
            self.store(pool, req[pinned[i]:])
        if serial % 5 == 0:  # a plain restore: whatever is held comes back byte-exact
            self.restore_checked(pool, self.pick(pool), at_least=0)

    def finish(self) -> dict[str, int | None]:
        """The pins the engine's pools hold once every request ended: 0, or some leaked."""
        out: dict[str, int | None] = {}
        for pool, c in self.clients.items():
            if c.sid != self.sids[pool]:
                self.counts["sessions_lost"] += 1
                self.fail(f"{pool}: the engine's session was lost and opened again (lease expired?)")
            stats = self.call("stats", c.stats)
            out[pool] = None if stats is None else int(stats["pools"][pool]["pinned_blocks"])
            if out[pool]:
                self.fail(f"{pool}: {out[pool]} blocks still pinned after every request ended")
        return out

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        serial = 0
        while time.monotonic() - t0 < self.cfg.duration_s:
            serial += 1
            self.step(serial)
        pinned_at_end = self.finish()
        self.arena = None
        for c in self.clients.values():
            self.call("bye", c.close)
        return {"counts": dict(self.counts), "failures": self.failures, "steps": serial,
                "seconds": round(time.monotonic() - t0, 2), "slowest_call_s": round(self.slowest_s, 3),
                "pinned_blocks_at_end": pinned_at_end}


def engine_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    engine = GoodEngine(HostileConfig(**spec["cfg"]), spec["endpoint"])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    print(json.dumps(engine.run()), flush=True)


# ---- the parent -----------------------------------------------------------------------------------


class _Sampler:
    """The daemon's RSS and descriptors every ``period_s``, on a thread."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.period_s = period_s
        self.t0 = time.monotonic()
        self.curve: list[tuple[float, int]] = []
        self.max_rss = 0
        self.max_fds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_point_s = -1.0
        while not self._stop.wait(self.period_s):
            try:
                rss = int(self.proc.memory_info().rss)
                self.max_fds = max(self.max_fds, self.proc.num_fds())
            except Exception:  # the daemon died: the run says so
                return
            self.max_rss = max(self.max_rss, rss)
            now_s = time.monotonic() - self.t0
            if now_s - last_point_s >= 1.0:
                self.curve.append((round(now_s, 1), rss))
                last_point_s = now_s

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class _Flooder:
    """Rounds of raw-connection floods (``hostile_clients raw``) until ``until_s``, on a thread."""

    def __init__(self, cfg: HostileConfig, socket_path: str, until_s: float) -> None:
        self.cfg = cfg
        self.path = socket_path
        self.until_s = until_s
        self.rounds = 0
        self.connected: list[int] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while time.monotonic() < self.until_s:
            procs = [hostile_clients.spawn("raw", self.path, self.cfg.flood_connections, self.cfg.flood_hold_s)
                     for _ in range(self.cfg.flood_processes)]
            for p in procs:
                try:
                    self.connected.append(int(hostile_clients.result(p, 300)))
                except Exception as exc:  # reported with the run
                    self.errors.append(repr(exc))
                    p.kill()
            self.rounds += 1
            time.sleep(self.cfg.flood_pause_s)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def _gated(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_ready(name: str, proc: subprocess.Popen[str], deadline_s: float) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until it is set up (or died)
    if line.strip() != "ready" or time.monotonic() > deadline_s:
        raise RuntimeError(f"{name} did not get ready: {line!r} (exit {proc.poll()})")


def _go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _report(name: str, proc: subprocess.Popen[str], timeout_s: float, failures: list[str]) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=30)
        failures.append(f"{name} did not finish in time (a hang?)")
        return {}
    lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        failures.append(f"{name} exited {proc.returncode} without its report")
        return {}
    return dict(json.loads(lines[-1]))


def run_hostile(cfg: HostileConfig, *, progress: bool = False) -> dict[str, Any]:
    """See the module docstring."""
    from kvtier.testing import redis_servers as rs
    from kvtier.testing.daemon import KvtierDaemon

    root = Path(cfg.root or tempfile.mkdtemp(prefix="kvtier-hostile-"))
    root.mkdir(parents=True, exist_ok=True)
    redis = rs.RedisServer(root / "redis").start()
    secret = rs.secret_file(root / "remote.secret")
    config_path = root / "kvtierd.toml"
    config_path.write_text(cfg.toml(redis.url, secret))
    config_path.chmod(0o600)
    daemon = KvtierDaemon(root / "d", flags={"config": config_path}, omp_threads=1, start_timeout_s=180.0,
                          command=["prlimit", f"--nofile={cfg.nofile}:{cfg.nofile}", sys.executable, "-m",
                                   "kvtier.daemon"])
    procs: dict[str, subprocess.Popen[str]] = {}
    failures: list[str] = []
    try:
        daemon.spawn()
        rss_start = daemon.rss_bytes()
        endpoint = daemon.endpoint
        spec = root / "engine.json"
        spec.write_text(json.dumps({"cfg": asdict(cfg), "endpoint": endpoint}))
        deadline_s = time.monotonic() + cfg.ready_timeout_s
        # The engine's sessions come first: the session flood fills the rest.
        procs["engine"] = _gated([sys.executable, "-m", "tests.stress.hostilelib", "engine", str(spec)])
        _wait_ready("engine", procs["engine"], deadline_s)
        secs = cfg.duration_s
        bb = cfg.block_bytes
        attackers = {
            "lookups-chain": ("lookups", endpoint, "good", bb, secs, 0),
            "lookups-session": ("lookups", endpoint, "good-session", bb, secs, 1),
            "careless": ("careless", endpoint, "careless", bb, secs),
            "unread": ("unread", endpoint, "unread", cfg.unread_block_bytes, secs),
            "sessions": ("sessions", endpoint, "sessions", bb, secs),
            "redis": ("redis", redis.url, bb, secs, "good-remote", cfg.remote_families, cfg.redis_attacks_per_s),
        }
        for name, (mode, *args) in attackers.items():
            procs[name] = hostile_clients.spawn(mode, *args, gated=True)
        for name, p in procs.items():
            if name != "engine":
                _wait_ready(name, p, deadline_s)
        if progress:
            print(f"  engine and {len(attackers)} attackers ready; running {secs:.0f} s", flush=True)
        sampler = _Sampler(daemon.pid)
        t0 = time.monotonic()
        for p in procs.values():
            _go(p)
        procs["busy"] = hostile_clients.spawn("busy", endpoint, secs)
        flooder = _Flooder(cfg, endpoint[len("ipc://"):], t0 + secs)
        reports = {name: _report(name, p, t0 + secs + cfg.finish_grace_s - time.monotonic(), failures)
                   for name, p in procs.items() if name != "busy"}
        busy_answered = _report_line("busy", procs["busy"], failures)
        flooder.join(600)
        wall_s = time.monotonic() - t0
        alive = daemon.alive
        stats = daemon.stats(timeout_s=30.0) if alive else {}
        time.sleep(1.0)
        rss_end = daemon.rss_bytes() if alive else 0
        sampler.stop()
        log = daemon.log()
        exit_code = daemon.stop(timeout_s=60.0)
        result = _summarize(cfg, reports, stats, failures, rss_start, sampler, rss_end, wall_s, alive, log,
                            exit_code, flooder, busy_answered)
        if progress:
            print_summary(result)
        return result
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
        daemon.kill()
        redis.stop()


def _report_line(name: str, proc: subprocess.Popen[str], failures: list[str]) -> int:
    try:
        return int(hostile_clients.result(proc, 120))
    except Exception as exc:  # reported with the run
        failures.append(f"{name}: {exc!r}")
        return 0


def _summarize(cfg: HostileConfig, reports: dict[str, dict[str, Any]], stats: dict[str, Any], failures: list[str],
               rss_start: int, sampler: _Sampler, rss_end: int, wall_s: float, alive: bool, log: str,
               exit_code: int | None, flooder: _Flooder, busy_answered: int) -> dict[str, Any]:
    engine = reports.get("engine", {})
    failures = list(failures) + [f"engine: {f}" for f in engine.get("failures", [])]
    if not alive:
        failures.append("the daemon died")
    if exit_code not in (0, None) and alive:
        failures.append(f"the daemon exited {exit_code} on SIGTERM, not 0")
    for marker in ("Traceback", "Too many open files"):
        if marker in log:
            failures.append(f"{marker!r} in the daemon's log")
    daemon = stats.get("daemon", {})
    errors_total = daemon.get("errors_total", {})
    if errors_total.get("code=INTERNAL", 0):
        failures.append(f"{errors_total['code=INTERNAL']} INTERNAL errors")
    careless = reports.get("careless", {})
    if careless and (careless.get("pinned_blocks_at_end") != 0 or careless.get("tags_not_unpinned")):
        failures.append(f"careless: {careless.get('pinned_blocks_at_end')} blocks pinned after every tag was "
                        f"unpinned ({careless.get('tags_not_unpinned')} tags never unpinned): pins leaked")
    pools_stats = stats.get("pools", {})
    policies = {}
    for p in cfg.pools():
        s = pools_stats.get(p.name)
        if s is None:
            continue
        bound = policy_key_bound(p.policy, int(s["cpu_blocks"]))
        keys = s.get("policy_keys")
        policies[p.name] = {"policy": p.policy, "policy_keys": keys, "bound_keys": bound}
        if keys is None or keys > bound:
            failures.append(f"pool {p.name}: its {p.policy} policy holds {keys} keys, bound {bound}")
    bound = rss_bound(rss_start, cfg.daemon_spec(), cfg.pools(), mapped_shm_bytes=cfg.chain_blocks * cfg.block_bytes)
    rss_max = max(sampler.max_rss, rss_end)
    if rss_max > bound["bound_bytes"]:
        failures.append(f"daemon RSS {rss_max / MIB:.0f} MiB over its bound {bound['bound_bytes'] / MIB:.0f} MiB")
    if flooder.errors:
        failures += [f"flood process: {e}" for e in flooder.errors[:5]]
    remote = pools_stats.get("good-remote", {}).get("remote", {})
    refused = daemon.get("connections_refused_total", {})
    dropped = daemon.get("replies_dropped_total", {})
    coverage = {
        "policy_floods": all(reports.get(n, {}).get("counts", {}).get("lookups", 0) > 0
                             for n in ("lookups-chain", "lookups-session")),
        "long_hints_in_pinned_batches": engine.get("counts", {}).get("batches", 0) > 0
                                        and careless.get("counts", {}).get("batches", 0) > 0,
        "careless_refused_in_batch": careless.get("counts", {}).get("answered_TOO_MANY_PINS", 0) > 0,
        "careless_abandoned_batches": careless.get("counts", {}).get("batches_timed_out", 0) > 0,
        "connections_shed": sum(refused.values()) > 0,
        "unread_replies_refused": errors_total.get("code=UNREAD_REPLIES", 0) > 0 or dropped.get("reason=full", 0) > 0,
        "sessions_refused": errors_total.get("code=TOO_MANY_SESSIONS", 0) > 0,
        "remote_values_rejected": sum(remote.get(k, 0) for k in ("remote_unauthentic", "remote_corrupt",
                                                                 "remote_oversized")) > 0,
        "engine_blocks_through_redis": engine.get("counts", {}).get("hit_blocks_remote", 0) > 0,
    }
    return {
        "config": asdict(cfg),
        "wall_s": round(wall_s, 1),
        "engine": engine,
        "attackers": {k: v for k, v in reports.items() if k != "engine"},
        "busy_stats_answered": busy_answered,
        "flood": {"rounds": flooder.rounds, "processes": len(flooder.connected), "connected": sum(flooder.connected)},
        "daemon": {
            "alive_at_end": alive,
            "exit_code": exit_code,
            "errors_total": errors_total,
            "connections_refused_total": refused,
            "replies_dropped_total": dropped,
            "unread_connections_shut_total": daemon.get("unread_connections_shut_total"),
            "heap_trims_total": daemon.get("heap_trims_total"),
            "peak_fds": sampler.max_fds,
            "remote": {k: v for k, v in remote.items() if isinstance(v, int)},
        },
        "policies": policies,
        "rss": {**bound, "max_bytes": rss_max, "end_bytes": rss_end, "within_bound": rss_max <= bound["bound_bytes"],
                "curve_s_bytes": sampler.curve},
        "coverage": coverage,
        "failures": failures,
        "passed": not failures and all(coverage.values()),
    }


def print_summary(result: dict[str, Any]) -> None:
    from tests.stress.stresslib import print_table

    e = result["engine"].get("counts", {})
    print_table(["engine", "steps", "batches", "requests", "pinned", "verified blocks", "gpu/cpu/remote",
                 "missing", "failures"],
                [["good", result["engine"].get("steps", 0), e.get("batches", 0), e.get("requests", 0),
                  e.get("pinned_blocks", 0), e.get("verified_blocks", 0),
                  f"{e.get('verified_blocks_gpu', 0)}/{e.get('verified_blocks_cpu', 0)}/"
                  f"{e.get('verified_blocks_remote', 0)}", e.get("missing_blocks", 0), e.get("failures", 0)]])
    print()
    rows = [[name, json.dumps(r.get("counts", {}), sort_keys=True)[:110], json.dumps(r.get("errors", {}))[:60]]
            for name, r in result["attackers"].items()]
    rows.append(["flood", f"{result['flood']['rounds']} rounds, {result['flood']['connected']} connections", ""])
    print_table(["attacker", "counts", "errors"], rows)
    print()
    r = result["rss"]
    terms = ", ".join(f"{k} {v / MIB:.1f}" for k, v in r["terms"].items())
    print(f"daemon RSS: start {r['start_bytes'] / MIB:.0f} MiB, max {r['max_bytes'] / MIB:.0f} MiB, end "
          f"{r['end_bytes'] / MIB:.0f} MiB; bound {r['bound_bytes'] / MIB:.0f} MiB = start + {terms} (MiB): "
          f"{'within' if r['within_bound'] else 'OVER'}")
    print(f"policies: {json.dumps(result['policies'])}")
    print(f"daemon: {json.dumps(result['daemon'], sort_keys=True)}")
    print(f"coverage: {json.dumps(result['coverage'])}")
    print(f"failures: {len(result['failures'])}")
    for f in result["failures"][:30]:
        print("  " + f)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        engine_main(sys.argv[2])
    else:
        raise SystemExit("usage: python -m tests.stress.hostilelib engine SPEC_JSON (run_hostile() is the entry point)")
