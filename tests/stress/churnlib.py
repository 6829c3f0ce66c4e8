"""Many engines churning pools and arenas under the daemon's CPU budget (issue 15).

Each worker process loops until the deadline: a hello on one of
``pool_names`` pool names (more pools than the budget holds, so idle pools
are reclaimed all the time), an arena, a store of a fresh chain through it,
a restore of that chain into other slots checked byte for byte (a prefix:
other workers' stores into the same small pool may evict the chain's tail
in between, which is counted), a lookup of
an older chain (it may be gone with its reclaimed pool: that is the point),
then ``bye``. A hello refused for room (``NO_SPACE``, ``TOO_MANY_POOLS``)
while every pool is in use is an expected outcome, counted; any other error,
a short or wrong restore, or a hang is a failure.

The daemon's RSS is sampled with time stamps; its bound is the start-up RSS
plus the most tiers the budget lets live at once (CPU tiers within
``cpu_budget_bytes``, and one store-mode GPU tier per such pool) plus a
stated overhead. After the run no arena file of the run is left in /dev/shm.

``run_churn(ChurnConfig(...))`` returns the summary; ``test_churn.py`` runs
the CI size, ``churn_full.py`` the full one (``bench/results/stress-churn.json``).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.stress.stresslib import REPO_ROOT, block_content, chain_hashes, start_stress_daemon, store_layout

KIB = 1024
MIB = 1024 * KIB


@dataclass
class ChurnConfig:
    workers: int = 4
    duration_s: float = 8.0
    block_bytes: int = 64 * KIB
    pool_cpu_bytes: int = 1 * MIB
    pool_gpu_bytes: int = 512 * KIB
    budget_bytes: int = 6 * MIB  # room for 6 pools' CPU tiers at once
    pool_names: int = 24
    chain_blocks: int = 6
    rss_overhead_bytes: int = 192 * MIB
    seed: int = 1
    root: str = ""
    finish_grace_s: float = 60.0

    def max_live_pools(self) -> int:
        return self.budget_bytes // self.pool_cpu_bytes

    def tier_bytes_bound(self) -> int:
        return self.max_live_pools() * (self.pool_cpu_bytes + self.pool_gpu_bytes)


@dataclass
class ChurnReport:
    index: int
    hellos: int = 0
    refused_hellos: int = 0
    stores: int = 0
    restored_blocks: int = 0
    short_restores: int = 0
    verified_bytes: int = 0
    old_lookups: int = 0
    old_hits: int = 0
    failures: list[str] = field(default_factory=list)


def worker(cfg: ChurnConfig, index: int, endpoint: str, until_s: float) -> ChurnReport:
    from kvtier.client.client import Client, DaemonError
    from kvtier.client.protocol import ErrorCode

    rng = random.Random(cfg.seed * 1000 + index)
    rep = ChurnReport(index)
    bb, n = cfg.block_bytes, cfg.chain_blocks
    stored: list[tuple[str, list[bytes]]] = []
    i = 0
    while time.monotonic() < until_s:
        i += 1
        name = f"churn-{rng.randrange(cfg.pool_names)}"
        try:
            c = Client(endpoint, name, store_layout(bb, model=name), timeout_s=30.0)
        except DaemonError as exc:
            if exc.code in (ErrorCode.NO_SPACE, ErrorCode.TOO_MANY_POOLS):
                rep.refused_hellos += 1
                time.sleep(0.01)
                continue
            rep.failures.append(f"hello {name}: {exc}")
            continue
        rep.hellos += 1
        try:
            arena = c.open_arena(2 * n)
            keys = chain_hashes(f"{name}/w{index}/{i}", n)
            for s, k in enumerate(keys):
                arena.slot_view(s)[:] = block_content(k, bb)
            c.store(keys, slots=list(range(n)))
            rep.stores += 1
            got = c.restore(keys, slots=list(range(n, 2 * n)))
            if len(got.tiers) != n:
                # Other workers' stores into the same small pool may evict blocks of this chain
                # between the store and the restore: a shorter prefix, never wrong bytes.
                rep.short_restores += 1
            for s, k in enumerate(keys[: len(got.tiers)]):
                if bytes(arena.slot_view(n + s)) != block_content(k, bb):
                    rep.failures.append(f"{name}: block {s} of a restore has wrong bytes")
                    break
                rep.verified_bytes += bb
            rep.restored_blocks += len(got.tiers)
            same_pool = [ks for p, ks in stored if p == name]
            if same_pool:
                old = rng.choice(same_pool)
                rep.old_lookups += 1
                rep.old_hits += 1 if len(c.lookup(old)) == n else 0
            stored.append((name, keys))
            stored = stored[-50:]
        except DaemonError as exc:
            rep.failures.append(f"{name}: {exc}")
        finally:
            c.close()
    return rep


def _worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    cfg = ChurnConfig(**spec["cfg"])
    print("ready", flush=True)
    sys.stdin.readline()  # "go"
    rep = worker(cfg, spec["index"], spec["endpoint"], time.monotonic() + cfg.duration_s)
    Path(spec["out"]).write_text(json.dumps(asdict(rep)))


def run_churn(cfg: ChurnConfig, *, progress: bool = False) -> dict[str, Any]:
    root = Path(cfg.root or tempfile.mkdtemp(prefix="kvtier-churn-"))
    shm_before = {p.name for p in Path("/dev/shm").glob("kvtier-*")}
    daemon = start_stress_daemon(root, flags={"cpu_bytes": cfg.pool_cpu_bytes, "gpu_bytes": cfg.pool_gpu_bytes,
                                              "cpu_budget_bytes": cfg.budget_bytes, "log_level": "warning"})
    procs: list[subprocess.Popen[str]] = []
    curve: list[tuple[float, int]] = []
    try:
        rss_start = daemon.rss_bytes()
        for i in range(cfg.workers):
            spec = root / f"churn-{i}.json"
            spec.write_text(json.dumps({"cfg": asdict(cfg), "index": i, "endpoint": daemon.endpoint,
                                        "out": str(root / f"churn-report-{i}.json")}))
            # From the repository root, where `tests` is a package (see tests/__init__.py).
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.stress.churnlib", "worker", str(spec)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.wait(0.25):
                try:
                    curve.append((round(time.monotonic() - t0, 2), daemon.rss_bytes()))
                except Exception:  # the daemon died: the summary says so
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        if progress:
            print(f"  {cfg.workers} workers churning for {cfg.duration_s:.0f} s", flush=True)
        hung = []
        for i, p in enumerate(procs):
            try:
                p.wait(max(1.0, t0 + cfg.duration_s + cfg.finish_grace_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(i)
                p.kill()
        stop.set()
        sampler.join(2)
        from kvtier.client.client import probe_health
        from kvtier.client.admin import request

        stats = request(daemon.endpoint, "stats", timeout_s=10.0) if daemon.alive else {}
        health = probe_health(daemon.endpoint, timeout_s=10.0) if daemon.alive else {}
        reports = [json.loads((root / f"churn-report-{i}.json").read_text())
                   for i in range(cfg.workers) if (root / f"churn-report-{i}.json").exists()]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        daemon.stop()
    leftover = sorted({p.name for p in Path("/dev/shm").glob("kvtier-*")} - shm_before)
    rss_max = max([r for _, r in curve] + [rss_start])
    bound = rss_start + cfg.tier_bytes_bound() + cfg.rss_overhead_bytes
    failures = [f for r in reports for f in r["failures"]] + [f"worker {i} hung" for i in hung]
    if len(reports) != cfg.workers:
        failures.append(f"{cfg.workers - len(reports)} workers wrote no report")
    total = {k: sum(r[k] for r in reports) for k in ("hellos", "refused_hellos", "stores", "restored_blocks",
                                                    "short_restores", "verified_bytes", "old_lookups", "old_hits")}
    reclaimed = (stats.get("daemon") or {}).get("pools_reclaimed_total", {})
    return {
        "config": asdict(cfg),
        "totals": total,
        "failures": failures,
        "daemon_alive_at_end": bool(health),
        "pools_at_end": health.get("pools"),
        "pools_reclaimed": reclaimed,
        "rss": {"start_bytes": rss_start, "max_bytes": rss_max, "bound_bytes": bound, "within_bound": rss_max <= bound,
                "curve_s_bytes": curve},
        "shm_files_left": leftover,
    }


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker_main(sys.argv[2])
