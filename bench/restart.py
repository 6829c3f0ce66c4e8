#!/usr/bin/env python3
"""Restart benchmark (issue 34): SIGKILL a kvtierd holding a full CPU tier, start another, count what it serves.

Usage:
    python bench/restart.py [--gib 4] [--block-mib 2] [--arena-dir /dev/shm] [--out bench/results] [--quick]

What it does, in one run:

1. ``fill``: a kvtierd (store mode, no GPU tier: every block lands in the CPU
   tier) with a ``--gib`` CPU tier, persistent in a private folder under
   ``--arena-dir`` (default /dev/shm, what kvtierd uses). A client stores
   blocks through its shared-memory arena until the tier is full (the
   baseline daemon's, below, gets the same blocks in turn); each
   block's bytes are a random base page stamped with its key, so every byte
   served later is checked against its key.
2. ``kill``: SIGKILL, the daemon idle with its tier full.
3. ``adopt``: a new kvtierd with the same flags. Timed from the spawn: the
   first ``health`` answer (``ready``), the hello, and the first hit (a
   one-block restore of a random stored block, its bytes checked). Then
   every stored block is restored (64 per call) and compared byte for byte:
   served, wrong, and not served; the pool's counters say what was dropped
   at adoption and when background verification finished.
4. ``standby``: the same daemon with ``--standby`` (``daemon.process.standby``):
   stopped (SIGTERM), started again with a standby beside it (it adopts the
   same tier); once the standby says it waits and the tier is verified, the
   primary is SIGKILLed and the first hit is timed from the kill: the
   standby adopts and serves. Every block is restored and checked as in 3.
   ``--standby-rounds`` times (each new primary starts a new standby). The
   standby's memory (RSS, USS) is recorded.
5. ``baseline``: the same daemon with ``--no-persist-cpu-tier``, filled with
   the same blocks at the same time as the persistent one, a batch to each
   in turn (seconds in store calls: the store throughput of a persistent
   tier, which checksums and records every block, over a private one), then
   killed and started the same way (its start alone, and the first request:
   a miss): what a restart cost before, measured in the same run.
6. ``import floor``: seconds a fresh Python takes to import kvtierd's server
   (torch included), the part of any start no cache can shorten.

Targets (the issue): the first hit within 2 s of the restart; >= 99% of the
blocks the CPU tier held served byte-exact; 0 wrong. Without a standby the
first-hit time is reported from the spawn (it includes the daemon's own
start: importing torch takes most of it on a small VM) and from ``ready``;
with a standby, from the SIGKILL of the primary (nothing else to start:
the standby is that restart). The baseline row is the start with nothing
to adopt, in the same run.

Results are printed as a table and written as JSON (``--out``/restart-cpu.json, or
restart-<GPU name>.json where CUDA is: the daemons then pin their CPU tiers, and
the adopting one registers its tier again, which the adoption log line times;
``--quick`` writes only with ``--out`` given explicitly).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvtier.client.client import Client, PoolLayout, probe_health  # noqa: E402
from kvtier.testing.daemon import KvtierDaemon, ReparentedProcess, become_subreaper  # noqa: E402

POOL = "bench"
STAMP_EVERY = 4096  # the key is stamped at the start of every 4 KiB of a block
BATCH = 64  # blocks per store / restore call


def layout(block_bytes: int) -> PoolLayout:
    return PoolLayout(model="restart-bench", block_size=16, block_bytes=block_bytes, dtype="bfloat16",
                      num_layers=32, kv_heads=8, head_dim=128)


def key(i: int) -> bytes:
    return struct.pack("<QQ", 0x6B76_7469_6572_3334, i)


class Contents:
    """Each block's bytes: a random base, its key stamped every 4 KiB (any misplaced page shows)."""

    def __init__(self, block_bytes: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.base = rng.integers(0, 256, block_bytes, dtype=np.uint8)
        self.block_bytes = block_bytes

    def write(self, k: bytes, out: np.ndarray) -> None:
        out[:] = self.base
        out.reshape(-1, STAMP_EVERY)[:, :16] = np.frombuffer(k, dtype=np.uint8)

    def check(self, k: bytes, got: np.ndarray) -> bool:
        want = self.base.copy()
        want.reshape(-1, STAMP_EVERY)[:, :16] = np.frombuffer(k, dtype=np.uint8)
        return bool(np.array_equal(want, got))


def fill(daemons: list[KvtierDaemon], contents: Contents, num_blocks: int,
         lay: PoolLayout) -> tuple[list[bytes], list[float]]:
    """Store the same blocks into each daemon until its tier is full, a batch to each in turn (load drift on a
    shared machine hits them alike); returns the keys and each daemon's seconds in its store calls."""
    keys = [key(i) for i in range(num_blocks)]
    clients = [Client(d.endpoint, POOL, lay, timeout_s=120.0) for d in daemons]
    seconds = [0.0] * len(daemons)
    try:
        slots = [c.open_arena(BATCH).as_numpy().reshape(BATCH, contents.block_bytes) for c in clients]
        for i in range(0, num_blocks, BATCH):
            batch = keys[i:i + BATCH]
            for n, c in enumerate(clients):
                for j, k in enumerate(batch):
                    contents.write(k, slots[n][j])
                t0 = time.monotonic()
                stored, present = c.store(batch, slots=list(range(len(batch))))
                seconds[n] += time.monotonic() - t0
                assert stored + present == len(batch)
        for c in clients:
            stats = c.stats()["pools"][POOL]
            assert stats["cpu_used_blocks"] == num_blocks, stats
    finally:
        for c in clients:
            c.close()
    return keys, seconds


def check_all(c: Client, keys: list[bytes], contents: Contents) -> dict[str, int]:
    """Restore every key (the longest held prefix of each batch, then on past a gap); count bytes."""
    arena = c._session.arena
    assert arena is not None
    slots = arena.as_numpy().reshape(-1, contents.block_bytes)
    served = wrong = 0
    i = 0
    while i < len(keys):
        batch = keys[i:i + BATCH]
        n = len(c.restore(batch, slots=list(range(len(batch)))).tiers)
        for j in range(n):
            served += 1
            wrong += not contents.check(batch[j], slots[j])
        i += n + 1 if n < len(batch) else n
    return {"served": served, "wrong": wrong, "not_served": len(keys) - served}


def timed_restart(daemon: KvtierDaemon, lay: PoolLayout, probe: bytes, contents: Contents | None) -> dict[str, Any]:
    """SIGKILL, spawn, then the first request; seconds from the spawn."""
    daemon.kill()
    t0 = time.monotonic()
    daemon.spawn()
    ready_s = time.monotonic() - t0
    c = Client(daemon.endpoint, POOL, lay, timeout_s=120.0)
    hello_s = time.monotonic() - t0
    r = c.restore([probe])
    first_s = time.monotonic() - t0
    row: dict[str, Any] = {"ready_s": ready_s, "hello_s": hello_s, "first_request_s": first_s,
                           "first_request_hit": bool(r.tiers)}
    if contents is not None and r.tiers:
        row["first_hit_exact"] = contents.check(probe, np.frombuffer(bytes(r.data), dtype=np.uint8))
    row["client"] = c
    return row


def standby_ready(daemon: KvtierDaemon, primary_pid: int, seen: set[int], timeout_s: float = 300.0) -> int:
    """The pid of the standby ``primary_pid`` started, once the primary logged that it waits."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        kids = {p.pid for p in psutil.Process(primary_pid).children()}
        for line in daemon.log().splitlines():
            if "is ready: it serves if this daemon dies" in line:
                pid = int(line.split("standby kvtierd pid ", 1)[1].split()[0])
                if pid in kids and pid not in seen:
                    return pid
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.05)


def standby_rounds(daemon: KvtierDaemon, lay: PoolLayout, keys: list[bytes], contents: Contents, rng: random.Random,
                   rounds: int) -> dict[str, Any]:
    """SIGKILL the primary with its standby waiting, ``rounds`` times; seconds from the kill to the first hit."""
    import psutil

    become_subreaper()  # the standbys outlive their primaries: reaped here
    daemon.spawn()
    primary = daemon.pid
    seen: set[int] = set()
    out: list[dict[str, Any]] = []
    for _ in range(rounds):
        standby = standby_ready(daemon, primary, seen)
        seen.add(standby)
        deadline = time.monotonic() + 300
        while daemon.stats()["pools"][POOL]["cpu_adoption_pending_blocks"]:  # idle and verified, as in ``adopt``
            assert time.monotonic() < deadline
            time.sleep(0.02)
        mem = psutil.Process(standby).memory_full_info()
        probe = keys[rng.randrange(len(keys))]
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        os.kill(primary, signal.SIGKILL)
        c = Client(daemon.endpoint, POOL, lay, timeout_s=120.0)
        hello_s = time.monotonic() - t0
        r = c.restore([probe])
        first_s = time.monotonic() - t0
        row: dict[str, Any] = {"hello_s": hello_s, "first_request_s": first_s, "first_request_hit": bool(r.tiers),
                               "first_hit_exact": bool(r.tiers) and contents.check(
                                   probe, np.frombuffer(bytes(r.data), dtype=np.uint8)),
                               "load_1m_at_kill": load, "standby_rss_bytes": mem.rss, "standby_uss_bytes": mem.uss}
        try:
            assert probe_health(daemon.endpoint, timeout_s=5.0).get("pid") == standby  # the standby serves, nothing else
            deadline = time.monotonic() + 300
            while (s := c.stats()["pools"][POOL])["cpu_adoption_pending_blocks"]:
                assert time.monotonic() < deadline, s
                time.sleep(0.02)
            c.open_arena(BATCH)
            row.update(check_all(c, keys, contents))
            s = c.stats()["pools"][POOL]
        finally:
            c.close()
        row.update(adopted=s["cpu_adopted_blocks"], dropped_at_adoption=s["cpu_adoption_dropped_blocks"],
                   served_share=row["served"] / len(keys))
        out.append(row)
        daemon.proc.wait(10)  # the killed primary (ours, or reaped here as an orphan)
        daemon.proc = ReparentedProcess(standby)
        primary = standby
    log = daemon.log()
    took = [line.split("kvtier.daemon.process.standby: ", 1)[-1] for line in log.splitlines() if "died; adopting" in line]
    firsts = sorted(r["first_request_s"] for r in out)
    return {"rounds": out, "first_request_s_median": firsts[len(firsts) // 2], "first_request_s_max": firsts[-1],
            "served": min(r["served"] for r in out), "wrong": sum(r["wrong"] for r in out),
            "served_share": min(r["served_share"] for r in out), "takeover_log": took[-1] if took else "",
            "adoption_log": adoption_line(log)}


def adoption_line(log: str) -> str:
    lines = [line for line in log.splitlines() if "persistent CPU tier of" in line and "adopted" in line]
    return lines[-1].split("kvtier.daemon.pooling.pools: ", 1)[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0, help="CPU tier size in GiB (default: 4)")
    ap.add_argument("--block-mib", type=float, default=2.0, help="block size in MiB (default: 2, Llama-3-8B's 16 tokens)")
    ap.add_argument("--arena-dir", type=Path, default=Path("/dev/shm"),
                    help="tmpfs for the arenas; a private folder is made in it and removed (default: /dev/shm)")
    ap.add_argument("--out", type=Path, default=None, help="folder of the JSON (default: bench/results)")
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--standby-rounds", type=int, default=3,
                    help="SIGKILLs of a primary with a standby waiting (each new primary starts a new standby; default: 3)")
    ap.add_argument("--quick", action="store_true", help="a 64 MiB tier: a check of the script, not a measurement")
    args = ap.parse_args()
    if args.quick:
        args.gib = 1 / 16
    block_bytes = int(args.block_mib * 2**20) // STAMP_EVERY * STAMP_EVERY
    if block_bytes <= 0:
        ap.error("--block-mib must be at least 4 KiB")
    cpu_bytes = int(args.gib * 2**30) // block_bytes * block_bytes
    num_blocks = cpu_bytes // block_bytes
    free = shutil.disk_usage(args.arena_dir).free
    if cpu_bytes > free * 0.9:
        ap.error(f"--arena-dir {args.arena_dir} has {free / 2**30:.1f} GiB free; a {args.gib:g} GiB tier does not fit")
    lay = layout(block_bytes)
    contents = Contents(block_bytes, args.seed)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kvtier-restart-bench-"))
    arenas = Path(tempfile.mkdtemp(prefix="kvtier-restart-bench-", dir=args.arena_dir))
    flags = {"gpu_bytes": 0, "cpu_bytes": cpu_bytes, "arena_dir": arenas, "log_level": "info",
             "max_message_bytes": max(256 << 20, 2 * BATCH * block_bytes)}
    import torch

    device = torch.cuda.get_device_name(0).replace(" ", "-") if torch.cuda.is_available() else "cpu"
    result: dict[str, Any] = {
        "device": device,
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_1m": os.getloadavg()[0]},
        "cpu_tier_bytes": cpu_bytes, "block_bytes": block_bytes, "blocks": num_blocks,
        "arena_dir": str(args.arena_dir),
    }
    daemon = KvtierDaemon(work / "persistent", flags=flags, start_timeout_s=300)
    # The same instance (workdir, socket, arena) with a standby: it adopts what ``daemon`` left.
    standby = KvtierDaemon(work / "persistent", flags={**flags, "standby": True}, start_timeout_s=300)
    baseline = KvtierDaemon(work / "baseline", flags={**flags, "persist_cpu_tier": False}, start_timeout_s=300)
    try:
        t0 = time.monotonic()
        daemon.spawn()
        result["first_start_s"] = time.monotonic() - t0
        baseline.spawn()
        keys, (fill_s, base_fill_s) = fill([daemon, baseline], contents, num_blocks, lay)
        result["fill_s"] = fill_s
        result["fill_gbps"] = cpu_bytes / fill_s / 1e9
        result["baseline_fill_s"] = base_fill_s
        result["baseline_fill_gbps"] = cpu_bytes / base_fill_s / 1e9
        probe = keys[rng.randrange(len(keys))]
        row = timed_restart(daemon, lay, probe, contents)
        c = row.pop("client")
        try:
            deadline = time.monotonic() + 300
            while (s := c.stats()["pools"][POOL])["cpu_adoption_pending_blocks"]:
                assert time.monotonic() < deadline, s
                time.sleep(0.02)
            c.open_arena(BATCH)
            counts = check_all(c, keys, contents)
            s = c.stats()["pools"][POOL]
        finally:
            c.close()
        row.update(counts)
        row.update(adopted=s["cpu_adopted_blocks"], dropped_at_adoption=s["cpu_adoption_dropped_blocks"],
                   served_share=counts["served"] / num_blocks)
        row["adoption_log"] = adoption_line(daemon.log())
        result["adopt"] = row
        # Background verification of the whole tier, timed on its own: kill again (idle, nothing new),
        # start, and wait until no adopted block is left unverified.
        daemon.kill()
        t0 = time.monotonic()
        daemon.spawn()
        ready = time.monotonic() - t0
        deadline = time.monotonic() + 300
        while daemon.stats()["pools"][POOL]["cpu_adoption_pending_blocks"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        result["verify_all"] = {"ready_s": ready, "all_verified_s": time.monotonic() - t0,
                                "after_ready_s": time.monotonic() - t0 - ready}
        daemon.stop()
        result["standby"] = standby_rounds(standby, lay, keys, contents, rng, args.standby_rounds)
        standby.stop()  # SIGTERM: it drains and stands its own standby down
        base = timed_restart(baseline, lay, probe, None)
        base.pop("client").close()
        result["baseline_no_persistence"] = base
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import kvtier.daemon.server"], check=True, timeout=300)
        result["import_floor_s"] = time.monotonic() - t0
    finally:
        if standby.alive:
            standby.stop(timeout_s=30)  # SIGTERM first: a SIGKILL would hand over to its standby
        for d in (daemon, standby, baseline):
            if d.alive:
                d.proc.send_signal(signal.SIGKILL)
                d.proc.wait(10)
        shutil.rmtree(arenas, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    a, b, sb = result["adopt"], result["baseline_no_persistence"], result["standby"]
    gib = cpu_bytes / 2**30
    print(f"\nRestart after SIGKILL of a kvtierd holding {gib:.2f} GiB of CPU tier "
          f"({num_blocks} blocks of {block_bytes / 2**20:g} MiB) in {args.arena_dir}; "
          f"{os.cpu_count()} CPUs, load {result['machine']['load_1m']:.1f}")
    print(f"filled in {result['fill_s']:.1f} s ({result['fill_gbps']:.2f} GB/s; a private tier "
          f"{result['baseline_fill_gbps']:.2f} GB/s: persistent/private {result['fill_gbps'] / result['baseline_fill_gbps']:.2f}x); "
          f"first start {result['first_start_s']:.1f} s; importing kvtierd's server alone {result['import_floor_s']:.1f} s")
    print(f"{a['adoption_log']}\n")
    header = ("restart", "ready s", "hello s", "first request s", "hit", "served", "wrong", "dropped")
    rows = [
        ("persistent (adopt)", f"{a['ready_s']:.2f}", f"{a['hello_s']:.2f}", f"{a['first_request_s']:.2f}",
         "yes" if a["first_request_hit"] else "no", f"{a['served']}/{num_blocks} ({100 * a['served_share']:.2f}%)",
         str(a["wrong"]), str(a["dropped_at_adoption"])),
        ("standby: SIGKILL -> first hit (median)", "-", f"{sb['rounds'][0]['hello_s']:.2f}",
         f"{sb['first_request_s_median']:.2f} (max {sb['first_request_s_max']:.2f})",
         "yes" if all(r["first_request_hit"] and r["first_hit_exact"] for r in sb["rounds"]) else "no",
         f"{sb['served']}/{num_blocks} ({100 * sb['served_share']:.2f}%)", str(sb["wrong"]),
         str(max(r["dropped_at_adoption"] for r in sb["rounds"]))),
        ("baseline (no persistence)", f"{b['ready_s']:.2f}", f"{b['hello_s']:.2f}", f"{b['first_request_s']:.2f}",
         "yes" if b["first_request_hit"] else "no", "0 (empty)", "-", "-"),
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    v = result["verify_all"]
    print(f"\nbackground verification of all {num_blocks} blocks: done {v['after_ready_s']:.2f} s after ready")
    first_after_ready = a["first_request_s"] - a["ready_s"]
    over_baseline = a["first_request_s"] - b["first_request_s"]
    result["targets"] = {
        "first_hit_after_spawn_s": a["first_request_s"], "first_hit_after_ready_s": first_after_ready,
        "first_hit_over_baseline_start_s": over_baseline, "import_floor_s": result["import_floor_s"],
        "store_throughput_persistent_over_private": result["fill_gbps"] / result["baseline_fill_gbps"], "first_hit_within_2s_of_spawn": a["first_request_s"] <= 2.0,
        "first_hit_within_2s_of_ready": first_after_ready <= 2.0,
        "served_share": a["served_share"], "served_share_met": a["served_share"] >= 0.99, "wrong": a["wrong"],
        "standby_first_hit_after_kill_s_median": sb["first_request_s_median"],
        "standby_first_hit_after_kill_s_max": sb["first_request_s_max"],
        "standby_first_hit_within_2s_of_kill": sb["first_request_s_max"] <= 2.0,
        "standby_served_share": sb["served_share"], "standby_served_share_met": sb["served_share"] >= 0.99,
        "standby_wrong": sb["wrong"],
        "standby_rss_bytes": max(r["standby_rss_bytes"] for r in sb["rounds"]),
        "standby_uss_bytes": max(r["standby_uss_bytes"] for r in sb["rounds"]),
    }
    t = result["targets"]
    print(f"targets: first hit {a['first_request_s']:.2f} s after the spawn "
          f"({'met' if t['first_hit_within_2s_of_spawn'] else 'NOT met'}: 2 s), {first_after_ready:.2f} s after "
          f"ready ({'met' if t['first_hit_within_2s_of_ready'] else 'NOT met'}), {over_baseline:+.2f} s against the "
          f"baseline's first request; served {100 * a['served_share']:.2f}% "
          f"({'met' if t['served_share_met'] else 'NOT met'}: 99%), wrong {a['wrong']} "
          f"({'met' if a['wrong'] == 0 else 'NOT met'}: 0)")
    print(f"with a standby: first hit {sb['first_request_s_median']:.2f} s after the SIGKILL (median of "
          f"{len(sb['rounds'])}, max {sb['first_request_s_max']:.2f}: "
          f"{'met' if t['standby_first_hit_within_2s_of_kill'] else 'NOT met'}: 2 s), "
          f"{sb['first_request_s_median'] / a['first_request_s']:.3f}x the restart without one; served "
          f"{100 * sb['served_share']:.2f}%, wrong {sb['wrong']}; the standby holds {t['standby_rss_bytes'] / 2**20:.0f} MiB "
          f"RSS ({t['standby_uss_bytes'] / 2**20:.0f} MiB its own, USS); load at the kills "
          + ", ".join(f"{r['load_1m_at_kill']:.1f}" for r in sb["rounds"]))
    result["machine"]["load_1m_end"] = os.getloadavg()[0]
    out_dir = args.out if args.out is not None else (None if args.quick else REPO / "bench" / "results")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"restart-{result['device']}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
