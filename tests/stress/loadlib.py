"""Sustained load: N client processes against one kvtierd, every restored byte checked.

Contract
========

``run_load(LoadConfig) -> dict`` starts a daemon whose tiers are small
enough that demotion and CPU-tier eviction run all the time, starts
``num_workers`` client processes (``python -m tests.stress.loadlib worker CONFIG``),
releases them together once all are connected, lets them run for
``duration_s``, and collects their reports. It returns the summary:
operations/s, count and p50/p99/max latency per verb (client side, ms),
outcome counts (NO_SPACE, blocks found missing, ...), the daemon's pool
counters, its RSS against the configured capacity, and every failure.

Workers (roles, assigned round-robin):

- ``store-inline`` / ``store-shm``: one session on the shared store-mode
  pool ``load``; a mix of lookup, pin/unpin, store and restore over
  overlapping prefix families (``families`` chains of ``chain_blocks``
  blocks; chains of one root share their first ``shared_blocks`` blocks;
  popular families are picked more often). Block content is a function of
  the block hash (``stresslib.block_content``), so every restore is checked
  byte for byte whoever stored the block. A restore may come back shorter
  than asked (blocks evicted: "missing"), but never shorter than a prefix
  this worker holds pinned, and never with a wrong byte.
- ``engine``: its own engine-mode pool ``load-engine-<i>`` whose GPU tier
  is a shared KV tensor it registered; allocate / append / free requests
  over the same families, writing each computed block's content into its
  slot; every hit slot (GPU or CPU-restored) is checked byte for byte.

A worker that gets no reply within ``call_timeout_s`` records a failure and
stops (a hang is a failure, not a wait). ``run_load`` fails workers that do
not finish within ``duration_s + finish_grace_s`` (a deadlock) and kills
them, by pid.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.testing.daemon import KvtierDaemon
from tests.stress.stresslib import (
    REPO_ROOT,
    block_content,
    chain_hashes,
    latency_summary,
    start_stress_daemon,
    store_layout,
)

SLOW_OP_S = 0.1  # ops slower than this are listed with their time, to tell stalls from noise
VERBS = ("lookup", "pin", "unpin", "store", "restore", "allocate", "append", "free", "clear")
CLEAR_SHARE = 0.002  # of steps: drops every unpinned block of the pool while copies are in flight


@dataclass
class LoadConfig:
    num_workers: int = 6
    duration_s: float = 10.0
    engine_every: int = 3  # every engine_every-th worker is an engine
    block_bytes: int = 4096
    gpu_blocks: int = 32  # store-mode GPU tier of pool "load"
    cpu_blocks: int = 128  # CPU tier of every pool
    engine_blocks: int = 24  # registered KV tensor of each engine
    families: int = 48
    roots: int = 12
    chain_blocks: int = 12
    shared_blocks: int = 6
    max_pin_blocks: int = 4
    call_timeout_s: float = 10.0
    finish_grace_s: float = 30.0
    ready_timeout_s: float = 180.0
    seed: int = 6
    rss_overhead_bytes: int = 160 << 20  # allowed above start-up RSS + configured capacity
    fuzz: bool = True  # hostile frames from the parent for the whole run, on pools of their own
    max_message_bytes: int = 1 << 20
    root: str = ""  # folder for the daemon's socket and log; a temporary one if empty

    def roles(self) -> list[str]:
        out = []
        n_store = 0
        for i in range(self.num_workers):
            if self.engine_every and i % self.engine_every == self.engine_every - 1:
                out.append("engine")
            else:
                out.append("store-inline" if n_store % 2 == 0 else "store-shm")
                n_store += 1
        return out


def family_chain(cfg: LoadConfig, family: int) -> list[bytes]:
    """The block hashes of prefix family ``family``: its root's shared head, then its own tail."""
    root = family % cfg.roots
    head = chain_hashes(f"root-{root}", cfg.shared_blocks)
    return head + chain_hashes(f"family-{family}", cfg.chain_blocks - cfg.shared_blocks, parent=head[-1])


# ---- the worker process ----------------------------------------------------------


@dataclass
class WorkerReport:
    index: int
    role: str
    ops: Counter[str] = field(default_factory=Counter)
    latencies_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    verified_bytes: int = 0
    seconds: float = 0.0
    slow_ops: list[tuple[float, str, float]] = field(default_factory=list)  # (unix time, verb, ms)

    def fail(self, why: str) -> None:
        self.outcomes["failures"] += 1
        if len(self.failures) < 20:
            self.failures.append(why)


class Worker:
    def __init__(self, cfg: LoadConfig, index: int, role: str, endpoint: str) -> None:
        from kvtier.client.client import Client

        self.cfg = cfg
        self.role = role
        self.rng = random.Random(cfg.seed * 1000 + index)
        self.report = WorkerReport(index, role)
        self.chains = [family_chain(cfg, f) for f in range(cfg.families)]
        self.bb = cfg.block_bytes
        if role == "engine":
            from kvtier.client.kv_share import allocate_shared_kv

            self.client = Client(endpoint, f"load-engine-{index}", store_layout(self.bb, mode="engine"),
                                 timeout_s=cfg.call_timeout_s, client_name=f"load-{index}")
            self.kv, _ = allocate_shared_kv((cfg.engine_blocks, self.bb // 2), "float16", 0)
            self.kv_bytes = self.kv.numpy().view(np.uint8).reshape(cfg.engine_blocks, self.bb)
            self.client.register_kv("kv", [self.kv], 0)
        else:
            self.client = Client(endpoint, "load", store_layout(self.bb), timeout_s=cfg.call_timeout_s,
                                 client_name=f"load-{index}")
            self.arena = self.client.open_arena(cfg.chain_blocks) if role == "store-shm" else None
        self.pinned: list[list[bytes]] = []  # prefixes this worker holds pinned
        self.block_size = int(self.client.layout["block_size"])

    def pick_chain(self) -> list[bytes]:
        # Skewed popularity: low family numbers are hot.
        return self.chains[int(self.cfg.families * self.rng.random() ** 2)]

    def timed(self, verb: str, fn: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            elapsed_s = time.perf_counter() - t0
            self.report.latencies_s[verb].append(elapsed_s)
            self.report.ops[verb] += 1
            if elapsed_s > SLOW_OP_S and len(self.report.slow_ops) < 20:
                self.report.slow_ops.append((round(time.time(), 3), verb, round(elapsed_s * 1e3, 1)))

    # -- store mode --

    def min_held(self, hashes: list[bytes]) -> int:
        """Blocks of ``hashes`` that must be held: the longest prefix this worker has pinned."""
        best = 0
        for p in self.pinned:
            n = 0
            while n < len(p) and n < len(hashes) and p[n] == hashes[n]:
                n += 1
            if n == len(p):
                best = max(best, n)
        return best

    def store_step(self) -> None:
        from kvtier.client.client import DaemonError
        from kvtier.client.protocol import ErrorCode

        r = self.rng
        chain = self.pick_chain()
        n = r.randint(1, len(chain))
        hashes = chain[:n]
        op = r.random()
        rep = self.report
        if op < CLEAR_SHARE:
            rep.outcomes["cleared_blocks"] += self.timed("clear", self.client.clear)
        elif op < 0.25:
            tiers = self.timed("lookup", self.client.lookup, hashes)
            self.check_tiers("lookup", hashes, tiers)
        elif op < 0.33:
            if self.pinned:
                self.timed("unpin", self.client.unpin, self.pinned.pop(0))
            else:
                tiers = self.timed("pin", self.client.pin, hashes[: r.randint(1, self.cfg.max_pin_blocks)])
                if tiers:
                    self.pinned.append(hashes[: len(tiers)])
        elif op < 0.6:
            try:
                if self.arena is not None:
                    for slot, h in enumerate(hashes):
                        self.arena.slot_view(slot)[:] = block_content(h, self.bb)
                    stored, present = self.timed("store", self.client.store, hashes, slots=list(range(n)))
                else:
                    data = b"".join(block_content(h, self.bb) for h in hashes)
                    stored, present = self.timed("store", self.client.store, hashes, data)
                rep.outcomes["stored_blocks"] += stored
                rep.outcomes["present_blocks"] += present
            except DaemonError as exc:
                if exc.code != ErrorCode.NO_SPACE:
                    raise
                rep.outcomes["store_no_space"] += 1
        else:
            if self.arena is not None:
                for slot in range(n):
                    self.arena.slot_view(slot)[:4] = b"\xde\xad\xbe\xef"  # stale bytes must be overwritten
                got = self.timed("restore", self.client.restore, hashes, slots=list(range(n)))
                blocks = [bytes(self.arena.slot_view(i)) for i in range(len(got))]
            else:
                got = self.timed("restore", self.client.restore, hashes)
                data = bytes(got.data or b"")
                blocks = [data[i * self.bb:(i + 1) * self.bb] for i in range(len(got))]
            self.check_tiers("restore", hashes, got.tiers)
            for i, (h, b) in enumerate(zip(hashes, blocks)):
                if b != block_content(h, self.bb):
                    self.report.fail(f"restore: block {i} of a {n}-block chain ({got.tiers[i]}) has wrong bytes")
                else:
                    self.report.verified_bytes += len(b)
            rep.outcomes["restored_blocks"] += len(got)
            rep.outcomes["missing_blocks"] += n - len(got)

    def check_tiers(self, verb: str, hashes: list[bytes], tiers: list[str]) -> None:
        if len(tiers) > len(hashes) or any(t not in ("gpu", "cpu") for t in tiers):
            self.report.fail(f"{verb}: bad tiers {tiers!r} for {len(hashes)} hashes")
        need = self.min_held(hashes)
        if len(tiers) < need:
            self.report.fail(f"{verb}: {len(tiers)} blocks held but this worker pins a prefix of {need}")

    # -- engine mode --

    def engine_step(self, serial: int) -> None:
        from kvtier.client.client import DaemonError
        from kvtier.client.protocol import ErrorCode

        r = self.rng
        rep = self.report
        chain = self.pick_chain()
        bs = self.block_size
        n_full = r.randint(1, min(len(chain) - 1, self.cfg.engine_blocks - 2))
        num_tokens = n_full * bs + r.randrange(bs)
        req = f"r{serial}"
        if r.random() < CLEAR_SHARE:
            rep.outcomes["cleared_blocks"] += self.timed("clear", self.client.clear)
        if r.random() < 0.2:
            tiers = self.timed("lookup", self.client.lookup, chain[:n_full])
            self.check_tiers("lookup", chain[:n_full], tiers)
        try:
            alloc = self.timed("allocate", self.client.allocate, req, chain[:n_full], num_tokens)
        except DaemonError as exc:
            if exc.code != ErrorCode.NO_SPACE:
                raise
            rep.outcomes["allocate_no_space"] += 1
            return
        ids = alloc.block_ids
        for i, tier in enumerate(alloc.tiers):
            if bytes(self.kv_bytes[ids[i]]) != block_content(chain[i], self.bb):
                rep.fail(f"allocate: hit block {i} ({tier}) in slot {ids[i]} has wrong bytes")
            else:
                rep.verified_bytes += self.bb
        rep.outcomes["hit_blocks_gpu"] += alloc.num_gpu_hits
        rep.outcomes["hit_blocks_cpu"] += alloc.num_cpu_hits
        rep.outcomes["computed_blocks"] += n_full - alloc.num_hit_blocks
        # "Compute" the missed full blocks: write what the hash says.
        for i in range(alloc.num_hit_blocks, n_full):
            self.kv_bytes[ids[i]] = np.frombuffer(block_content(chain[i], self.bb), dtype=np.uint8)
        tokens = num_tokens
        if r.random() < 0.5:
            # Decode up to the end of the current block: it fills and is committed.
            fill = bs - tokens % bs
            table, new = self.timed("append", self.client.append, req, fill, [chain[n_full]])
            self.kv_bytes[table[n_full]] = np.frombuffer(block_content(chain[n_full], self.bb), dtype=np.uint8)
            tokens += fill
        self.timed("free", self.client.free, req)

    # -- main loop --

    def run(self, duration_s: float) -> WorkerReport:
        from kvtier.client.client import KvtierError, KvtierTimeout

        t0 = time.monotonic()
        serial = 0
        try:
            while time.monotonic() - t0 < duration_s:
                serial += 1
                if self.role == "engine":
                    self.engine_step(serial)
                else:
                    self.store_step()
            while self.pinned:
                self.timed("unpin", self.client.unpin, self.pinned.pop(0))
        except KvtierTimeout as exc:
            self.report.fail(f"timeout (hang?) after {time.monotonic() - t0:.1f}s: {exc}")
        except KvtierError as exc:
            self.report.fail(f"{type(exc).__name__}: {exc}")
        self.report.seconds = time.monotonic() - t0
        try:
            self.client.close()
        except KvtierError:
            pass
        return self.report


def worker_main(config_path: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(Path(config_path).read_text())
    cfg = LoadConfig(**spec["cfg"])
    worker = Worker(cfg, spec["index"], spec["role"], spec["endpoint"])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    report = worker.run(cfg.duration_s)
    out = {"index": report.index, "role": report.role, "ops": dict(report.ops),
           "latencies_s": {k: v for k, v in report.latencies_s.items()}, "outcomes": dict(report.outcomes),
           "failures": report.failures, "verified_bytes": report.verified_bytes, "seconds": report.seconds,
           "slow_ops": report.slow_ops}
    Path(spec["out"]).write_text(json.dumps(out))


# ---- the parent ------------------------------------------------------------------


def _sample_rss(daemon: KvtierDaemon, stop: threading.Event, samples: list[int]) -> None:
    while not stop.wait(0.25):
        try:
            samples.append(daemon.rss_bytes())
        except Exception:  # the daemon died: the run will say so
            return


def run_load(cfg: LoadConfig, *, progress: bool = False) -> dict[str, Any]:
    """See the module docstring."""
    root = Path(cfg.root or tempfile.mkdtemp(prefix="kvtier-load-"))
    daemon = start_stress_daemon(root, flags={"gpu_bytes": cfg.gpu_blocks * cfg.block_bytes,
                                              "cpu_bytes": cfg.cpu_blocks * cfg.block_bytes,
                                              "log_level": "warning", "lease_s": 10.0,
                                              "max_message_bytes": cfg.max_message_bytes})
    workers: list[subprocess.Popen[str]] = []
    roles = cfg.roles()
    try:
        rss_start = daemon.rss_bytes()
        for i, role in enumerate(roles):
            spec_path = root / f"worker-{i}.json"
            spec_path.write_text(json.dumps({"cfg": asdict(cfg), "index": i, "role": role,
                                             "endpoint": daemon.endpoint, "out": str(root / f"report-{i}.json")}))
            # From the repository root, where `tests` is a package (see tests/__init__.py).
            workers.append(subprocess.Popen([sys.executable, "-m", "tests.stress.loadlib", "worker", str(spec_path)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                            env={**os.environ, "OMP_NUM_THREADS": "1"}))
        deadline_s = time.monotonic() + cfg.ready_timeout_s
        for i, w in enumerate(workers):
            assert w.stdout is not None
            line = w.stdout.readline()  # blocks until the worker has its session (and registration)
            if line.strip() != "ready" or time.monotonic() > deadline_s:
                raise RuntimeError(f"worker {i} ({roles[i]}) did not get ready: {line!r}")
        if progress:
            print(f"  {len(workers)} workers ready; running {cfg.duration_s:.0f} s", flush=True)
        samples: list[int] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_rss, args=(daemon, stop, samples), daemon=True)
        sampler.start()
        t0 = time.monotonic()
        go_unix_s = time.time()
        for w in workers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        fuzz = _start_fuzz(cfg, daemon, t0 + cfg.duration_s) if cfg.fuzz else None
        hung: list[int] = []
        for i, w in enumerate(workers):
            try:
                w.wait(max(1.0, t0 + cfg.duration_s + cfg.finish_grace_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(i)
                w.kill()
                w.wait(10)
        wall_s = time.monotonic() - t0
        stop.set()
        sampler.join(2)
        stats = _daemon_stats(daemon)
        rss_end = daemon.rss_bytes() if daemon.alive else 0
        reports = []
        for i in range(len(workers)):
            path = root / f"report-{i}.json"
            if path.exists():
                reports.append(json.loads(path.read_text()))
        result = summarize(cfg, roles, reports, hung, wall_s, stats, rss_start, max(samples + [rss_end]), daemon)
        if fuzz is not None:
            result["fuzz"] = fuzz.finish()
            result["failures"] += [f"fuzz frame: {f}" for f in result["fuzz"]["failures"]]
            result["passed"] = result["passed"] and not result["fuzz"]["failures"]
        # Slow operations as seconds after the start signal.
        result["slow_ops"] = [(round(t - go_unix_s, 3), verb, ms, i) for t, verb, ms, i in result["slow_ops"]]
        return result
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(10)
        daemon.stop()


class _Fuzzer:
    """Hostile frames (``fuzzlib``) from a thread of the parent while the workers run.

    They aim at fuzz pools of their own; the frames' replies are judged as in
    ``test_fuzz.py``, and the workers' byte checks show that none of it
    reached their blocks.
    """

    def __init__(self, cfg: LoadConfig, daemon: KvtierDaemon, until_s: float) -> None:
        from tests.stress.fuzzlib import FuzzWorld, Judge

        self.world = FuzzWorld.open(daemon.endpoint, cfg.block_bytes, "load", store_layout(cfg.block_bytes).to_wire(),
                                    cfg.max_message_bytes)
        self.judge = Judge(daemon.endpoint, self.world.hard_limit_bytes)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(cfg.seed, until_s), daemon=True)
        self.thread.start()

    def _run(self, seed: int, until_s: float) -> None:
        from tests.stress.fuzzlib import run_campaign

        try:
            run_campaign(self.world, self.judge, 10**9, seed, until_s=until_s)
        except BaseException as exc:  # reported, not raised on this thread
            self.error = exc

    def finish(self) -> dict[str, Any]:
        self.thread.join(30)
        out = {"cases": sum(self.judge.cases.values()), "replies": dict(self.judge.replies),
               "failures": list(self.judge.failures) + ([f"fuzzer crashed: {self.error!r}"] if self.error else []),
               "slowest_reply_ms": round(self.judge.slowest_s * 1e3, 2)}
        self.judge.close()
        self.world.close()
        return out


def _start_fuzz(cfg: LoadConfig, daemon: KvtierDaemon, until_s: float) -> _Fuzzer:
    logging.getLogger("kvtier.client").setLevel(logging.ERROR)  # the fuzz sessions' reconnect chatter
    return _Fuzzer(cfg, daemon, until_s)


def _daemon_stats(daemon: KvtierDaemon) -> dict[str, Any]:
    from kvtier.client.protocol import decode, encode, request_header
    from tests.stress.stresslib import RawSocket

    with RawSocket(daemon.endpoint) as raw:
        got = raw.ask([encode(request_header("stats", 1, None))], timeout_s=5.0)
    if got is None:
        raise RuntimeError("the daemon does not answer stats after the load")
    header, _ = got
    return dict(header) if isinstance(header, dict) else decode(header)


def summarize(cfg: LoadConfig, roles: list[str], reports: list[dict[str, Any]], hung: list[int], wall_s: float,
              stats: dict[str, Any], rss_start: int, rss_max: int, daemon: KvtierDaemon) -> dict[str, Any]:
    ops: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    lat: dict[str, list[float]] = defaultdict(list)
    failures: list[str] = []
    verified = 0
    slow_ops: list[tuple[float, str, float, int]] = []
    for rep in reports:
        slow_ops += [(t, verb, ms, rep["index"]) for t, verb, ms in rep.get("slow_ops", [])]
        ops.update(rep["ops"])
        outcomes.update(rep["outcomes"])
        for verb, values in rep["latencies_s"].items():
            lat[verb].extend(values)
        failures += [f"worker {rep['index']} ({rep['role']}): {f}" for f in rep["failures"]]
        verified += rep["verified_bytes"]
    if len(reports) < len(roles):
        failures.append(f"only {len(reports)} of {len(roles)} workers reported")
    for i in hung:
        failures.append(f"worker {i} ({roles[i]}) did not finish in {cfg.duration_s + cfg.finish_grace_s:.0f} s")
    total_ops = sum(ops.values())
    pools = stats.get("pools", {})
    n_engines = roles.count("engine")
    n_shm = roles.count("store-shm")
    # What the daemon holds by configuration: every pool's CPU tier, the store
    # pool's GPU tier (host memory here), the engines' registered tensors and
    # the arenas it maps.
    capacity_bytes = (len(pools) * cfg.cpu_blocks + cfg.gpu_blocks + n_engines * cfg.engine_blocks
                      + n_shm * cfg.chain_blocks) * cfg.block_bytes
    pool_totals: Counter[str] = Counter()
    for s in pools.values():
        for key in ("demotions", "cpu_evictions", "restores", "loads", "stores", "stores_failed", "copy_failures",
                    "hit_blocks_gpu", "hit_blocks_cpu", "miss_blocks", "lookups"):
            pool_totals[key] += int(s.get(key, 0))
    daemon_errors = stats.get("daemon", {}).get("errors_total", {})
    return {
        "config": asdict(cfg),
        "roles": dict(Counter(roles)),
        "wall_s": round(wall_s, 2),
        "total_ops": total_ops,
        "ops_per_s": round(total_ops / max(cfg.duration_s, 1e-9), 1),
        "verbs": {verb: {**latency_summary(lat[verb]), "ops_per_s": round(ops[verb] / cfg.duration_s, 1)}
                  for verb in VERBS if ops[verb]},
        "outcomes": dict(outcomes),
        "verified_bytes": verified,
        "slow_ops": sorted(slow_ops)[:100],
        "daemon_pool_totals": dict(pool_totals),
        "daemon_errors_total": daemon_errors,
        "pools": len(pools),
        "rss": {
            "start_bytes": rss_start,
            "max_bytes": rss_max,
            "capacity_bytes": capacity_bytes,
            "overhead_allowed_bytes": cfg.rss_overhead_bytes,
            "limit_bytes": rss_start + capacity_bytes + cfg.rss_overhead_bytes,
            "within_limit": rss_max <= rss_start + capacity_bytes + cfg.rss_overhead_bytes,
        },
        "daemon_alive": daemon.alive,
        "failures": failures,
        "passed": not failures and daemon.alive and rss_max <= rss_start + capacity_bytes + cfg.rss_overhead_bytes,
    }


def print_summary(result: dict[str, Any]) -> None:
    from tests.stress.stresslib import print_table

    rows = [[verb, v["count"], v["ops_per_s"], v["p50_ms"], v["p99_ms"], v["max_ms"]] for verb, v in result["verbs"].items()]
    rows.append(["all", result["total_ops"], result["ops_per_s"], "", "", ""])
    print_table(["verb", "count", "ops/s", "p50 ms", "p99 ms", "max ms"], rows)
    print()
    t = result["daemon_pool_totals"]
    print(f"daemon: demotions {t.get('demotions', 0)}, CPU evictions {t.get('cpu_evictions', 0)}, "
          f"restores (CPU->GPU) {t.get('restores', 0)}, loads {t.get('loads', 0)}, stores {t.get('stores', 0)}, "
          f"stores failed {t.get('stores_failed', 0)}, copy failures {t.get('copy_failures', 0)}")
    o = result["outcomes"]
    print(f"clients: restored blocks {o.get('restored_blocks', 0)} (missing after eviction {o.get('missing_blocks', 0)}), "
          f"verified {result['verified_bytes'] / 2**20:.1f} MiB byte for byte, store NO_SPACE {o.get('store_no_space', 0)}, "
          f"engine hits gpu/cpu {o.get('hit_blocks_gpu', 0)}/{o.get('hit_blocks_cpu', 0)}")
    r = result["rss"]
    print(f"daemon RSS: start {r['start_bytes'] / 2**20:.0f} MiB, max {r['max_bytes'] / 2**20:.0f} MiB, "
          f"limit {r['limit_bytes'] / 2**20:.0f} MiB (start + capacity {r['capacity_bytes'] / 2**20:.1f} MiB "
          f"+ overhead {r['overhead_allowed_bytes'] / 2**20:.0f} MiB): {'ok' if r['within_limit'] else 'OVER'}")
    if "fuzz" in result:
        f = result["fuzz"]
        print(f"fuzzing alongside: {f['cases']} hostile frames, slowest reply {f['slowest_reply_ms']} ms, "
              f"{len(f['failures'])} failures")
    print(f"failures: {len(result['failures'])}")
    for f in result["failures"][:20]:
        print("  " + f)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        worker_main(sys.argv[2])
    else:
        raise SystemExit("usage: python -m tests.stress.loadlib worker CONFIG_JSON (run_load() is the entry point)")
