#!/usr/bin/env python3
"""Remote-tier benchmarks: restore throughput and lookup latency against a real Redis.

Usage:
    python bench/remote.py [--url redis://HOST:PORT/DB] [--blocks 256] [--sizes-kib 256,2048]
                           [--reps 7] [--lookups 300] [--json PATH] [--quick]

Without ``--url`` it starts its own ``redis-server`` on a free loopback port
(kvtier.testing.redis_servers) with the recommended settings of docs/remote-tier.md
(``maxmemory`` + ``allkeys-lru``, no persistence) and stops it at the end.

Sections
1. Restore throughput. ``--blocks`` random blocks of each size are written
   through ``RemoteTier.write_back`` (untimed), then read back ``--reps``
   times (``--reps`` for the largest size, more for smaller ones, up to 60),
   rotating which goes first, by
   - ``plain``:  one redis-py pipeline of ``GET`` for the same keys, on the
     same server, in the same process: the floor for any Redis client;
   - ``kvtier``: ``RemoteTier.fetch`` (pipelined ``GETRANGE key 0
     value_bytes`` in round trips of at most 64 MiB, header + length + MAC
     (keyed BLAKE3) check of every block, counters).
   Both get every block back (asserted, and kvtier's bytes compared with
   plain's once). Reported: median seconds and GB/s of each, and kvtier's
   overhead = median over reps of kvtier/plain - 1 (each rep runs both back
   to back, so load drift on a shared box cancels; target <= 15%).
   ``chunked``: plain GETs in the same round trips as kvtier (64 MiB each),
   so ``vs chunked`` isolates the cost of kvtier's checks and bookkeeping;
   ``verify`` times the checks alone on the fetched values (the MAC).
2. Lookup latency of 256 hashes (``--lookups`` calls each, interleaved, p50/p99):
   - ``exists_prefix``: RemoteTier's one round trip (standalone: the Lua
     prefix script of STRLEN checks), all present, and plain redis-py pipelined EXISTS of the
     same keys;
   - remote off vs on: ``TieredPool.lookup`` (bookkeeping mode, 64 of the
     256 blocks in its CPU tier) alone, and followed by
     ``RemoteTier.exists_prefix`` of the 192 hashes past the CPU prefix,
     which is what a lookup with the remote tier on does.

Results are printed as tables and written as JSON (default
``bench/results/remote-cpu.json``; ``--quick`` writes JSON only with ``--json``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis
import xxhash

from kvtier.testing import redis_servers as rs
from kvtier.tiers.remote.tier import RemoteTier, RemoteTierSettings
from kvtier.tiers.remote.values import OK, ValueMac, decode

from report import git, utc_now, write_json

REPO = Path(__file__).resolve().parent.parent
TARGET_OVERHEAD = 0.15


def _hashes(n: int, seed: str) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{seed}:{i}".encode()) for i in range(n)]


def _pct(values_s: Sequence[float], q: float) -> float:
    ordered = sorted(values_s)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _plain_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=30.0)


def _plain_get(client: redis.Redis, keys: Sequence[bytes]) -> list[bytes | None]:
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
    return pipe.execute()


def _plain_get_chunked(client: redis.Redis, keys: Sequence[bytes], per_round_trip: int) -> list[bytes | None]:
    out: list[bytes | None] = []
    for start in range(0, len(keys), per_round_trip):
        out += _plain_get(client, keys[start : start + per_round_trip])
    return out


def bench_restore(url: str, num_blocks: int, size_bytes: int, reps: int) -> dict[str, Any]:
    tier = RemoteTier(url, b"bench-restore", size_bytes,
                      RemoteTierSettings(timeout_s=30.0, write_queue_blocks=num_blocks), secret=rs.SECRET)
    mac = ValueMac(rs.SECRET)
    plain = _plain_client(url)
    try:
        hs = _hashes(num_blocks, f"restore-{size_bytes}")
        data = [os.urandom(size_bytes) for _ in range(num_blocks)]
        for h, d in zip(hs, data):
            assert tier.write_back(h, d, copy=False)
        assert tier.flush(120.0) and tier.stats()["writes_done"] == num_blocks, tier.stats()
        keys = [tier.key(h) for h in hs]
        # Warm-up, and the correctness check: both paths return the same blocks.
        values = _plain_get(plain, keys)
        got = tier.fetch(hs)
        header_bytes = len(values[0]) - size_bytes
        assert all(g is not None and bytes(g) == v[header_bytes:] == d for g, v, d in zip(got, values, data))
        del got
        plain_s: list[float] = []
        kvtier_s: list[float] = []
        chunked_s: list[float] = []
        # The same round trips as RemoteTier.fetch: even splits of at most _fetch_chunk_blocks.
        trips = -(-num_blocks // tier._fetch_chunk_blocks)
        per_round_trip = -(-num_blocks // trips)

        def run_plain() -> None:
            t0 = time.perf_counter()
            vals = _plain_get(plain, keys)
            plain_s.append(time.perf_counter() - t0)
            assert all(v is not None for v in vals)

        def run_kvtier() -> None:
            t0 = time.perf_counter()
            vals = tier.fetch(hs)
            kvtier_s.append(time.perf_counter() - t0)
            assert all(v is not None for v in vals)

        def run_chunked() -> None:
            t0 = time.perf_counter()
            vals = _plain_get_chunked(plain, keys, per_round_trip)
            chunked_s.append(time.perf_counter() - t0)
            assert all(v is not None for v in vals)

        order = [run_plain, run_kvtier, run_chunked]
        for rep in range(reps):
            for fn in order[rep % 3:] + order[: rep % 3]:  # rotate who goes first
                fn()
        verify_s = []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert all(decode(v, k, size_bytes, mac)[1] == OK for v, k in zip(values, keys))
            verify_s.append(time.perf_counter() - t0)
        total_bytes = num_blocks * size_bytes
        p, k = statistics.median(plain_s), statistics.median(kvtier_s)
        # The box is shared: load drifts between reps. Each rep runs both back to back,
        # so the median of per-rep ratios is the steadier estimate of the overhead.
        paired = statistics.median(kv / pl for kv, pl in zip(kvtier_s, plain_s)) - 1.0
        paired_chunked = statistics.median(kv / pl for kv, pl in zip(kvtier_s, chunked_s)) - 1.0
        return {
            "block_bytes": size_bytes,
            "blocks": num_blocks,
            "reps": reps,
            "total_bytes": total_bytes,
            "plain_median_s": round(p, 6),
            "kvtier_median_s": round(k, 6),
            "plain_chunked_median_s": round(statistics.median(chunked_s), 6),
            "round_trip_blocks": per_round_trip,
            "plain_min_s": round(min(plain_s), 6),
            "kvtier_min_s": round(min(kvtier_s), 6),
            "plain_GBps": round(total_bytes / p / 1e9, 3),
            "kvtier_GBps": round(total_bytes / k / 1e9, 3),
            "verify_median_s": round(statistics.median(verify_s), 6),
            "overhead_of_medians": round(k / p - 1.0, 4),
            "overhead": round(paired, 4),  # median of per-rep kvtier/plain - 1
            "meets_target": paired <= TARGET_OVERHEAD,
            # Against plain GETs in the same round trips as kvtier: the cost of the checks alone.
            "overhead_vs_chunked": round(paired_chunked, 4),
            "plain_s": [round(x, 6) for x in plain_s],
            "kvtier_s": [round(x, 6) for x in kvtier_s],
            "plain_chunked_s": [round(x, 6) for x in chunked_s],
        }
    finally:
        plain.delete(*[tier.key(h) for h in _hashes(num_blocks, f"restore-{size_bytes}")])
        plain.close()
        tier.close()


def _latencies(fns: dict[str, Callable[[], object]], n: int) -> dict[str, dict[str, float]]:
    """p50/p99 of each function, calls interleaved round-robin so load drift hits all alike."""
    for fn in fns.values():
        for _ in range(min(20, n)):
            fn()  # warm-up: connections, script cache
    lat_s: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            lat_s[name].append(time.perf_counter() - t0)
    return {name: {"p50_us": round(_pct(v, 0.5) * 1e6, 1), "p99_us": round(_pct(v, 0.99) * 1e6, 1),
                   "mean_us": round(statistics.fmean(v) * 1e6, 1)} for name, v in lat_s.items()}


def bench_lookup(url: str, num_hashes: int, calls: int) -> dict[str, Any]:
    block_bytes = 4096  # the value size does not matter to EXISTS or STRLEN
    tier = RemoteTier(url, b"bench-lookup", block_bytes,
                      RemoteTierSettings(timeout_s=5.0, write_queue_blocks=num_hashes), secret=rs.SECRET)
    plain = _plain_client(url)
    out: dict[str, Any] = {"hashes": num_hashes, "calls": calls}
    try:
        hs = _hashes(num_hashes, "lookup")
        payload = os.urandom(block_bytes)
        for h in hs:
            assert tier.write_back(h, payload)
        assert tier.flush(30.0)
        assert tier.exists_prefix(hs) == num_hashes
        keys = [tier.key(h) for h in hs]

        def plain_exists() -> None:
            pipe = plain.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            pipe.execute()

        fns: dict[str, Callable[[], object]] = {
            "exists_prefix": lambda: tier.exists_prefix(hs),
            "plain_exists_pipeline": plain_exists,
        }
        try:
            from kvtier.tiers.pool import PoolSpec, TieredPool

            cpu_held = num_hashes // 4
            pool = TieredPool(PoolSpec("bench", 16, block_bytes), cpu_blocks=cpu_held, policy="lru", data=False)
            pool.store(hs[:cpu_held], None, list(range(cpu_held)))
            assert len(pool.lookup(hs, count=False)) == cpu_held

            def lookup_on() -> int:
                tiers = pool.lookup(hs, count=False)
                return len(tiers) + tier.exists_prefix(hs[len(tiers):])

            assert lookup_on() == num_hashes
            out["pool_cpu_prefix_blocks"] = cpu_held
            fns["pool_lookup_remote_off"] = lambda: pool.lookup(hs, count=False)
            fns["pool_lookup_remote_on"] = lookup_on
        except Exception as exc:  # noqa: BLE001 - pool.py is edited concurrently; report, don't die
            out["pool_lookup_error"] = f"{type(exc).__name__}: {exc}"
        out.update(_latencies(fns, calls))
        return out
    finally:
        plain.delete(*[tier.key(h) for h in _hashes(num_hashes, "lookup")])
        plain.close()
        tier.close()


def _env(url: str, own_server: bool) -> dict[str, Any]:
    version = "unknown"
    try:
        info = redis.Redis.from_url(url).info("server")
        version = f"{info.get('redis_version')} ({'valkey' if 'valkey_version' in info else 'redis'})"
    except redis.exceptions.RedisError:
        pass
    try:
        hiredis = bool(redis.utils.HIREDIS_AVAILABLE)
    except AttributeError:
        hiredis = False
    return {
        "date": utc_now(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "hiredis": hiredis,
        "server": version,
        "server_started_by_bench": own_server,
        "transport": "loopback TCP",
        "git": git("rev-parse", "--short", "HEAD") or "",
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an existing server (default: start a redis-server on loopback)")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--sizes-kib", default="256,2048")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--lookups", type=int, default=300)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="fewer blocks and reps (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.reps, args.lookups = 32, 3, 50
    sizes = [int(s) * 1024 for s in args.sizes_kib.split(",")]
    json_path = args.json or (None if args.quick else REPO / "bench" / "results" / "remote-cpu.json")

    server = None
    url = args.url
    if url is None:
        if not rs.have_redis():
            print(rs.MISSING_REASON, file=sys.stderr)
            return 2
        need_mib = 2 * args.blocks * max(sizes) // (1 << 20) + 256
        server = rs.RedisServer(Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-")),
                                extra_args=("--maxmemory", f"{need_mib}mb", "--maxmemory-policy", "allkeys-lru"))
        server.start()
        url = server.url
    try:
        result: dict[str, Any] = {"env": _env(url, server is not None), "target_overhead": TARGET_OVERHEAD}
        # Smaller blocks run faster: give them more repetitions (same bytes moved, capped),
        # which the shared box's noise needs.
        restore = [bench_restore(url, args.blocks, size, min(60, args.reps * max(sizes) // size))
                   for size in sizes]
        result["restore"] = restore
        lookup = bench_lookup(url, 256, args.lookups)
        result["lookup"] = lookup
    finally:
        if server is not None:
            server.stop()

    print(f"\nRestore throughput, {args.blocks} blocks, median of {'/'.join(str(r['reps']) for r in restore)} reps (server {result['env']['server']}, "
          f"redis-py {result['env']['redis_py']}, hiredis={result['env']['hiredis']})")
    print(f"{'block':>8} {'plain GET s':>12} {'chunked s':>10} {'kvtier s':>9} {'plain GB/s':>11} "
          f"{'kvtier GB/s':>12} {'verify s':>9} {'overhead':>9} {'vs chunked':>11}  target")
    for r in restore:
        print(f"{r['block_bytes'] // 1024:>5}KiB {r['plain_median_s']:>12.4f} {r['plain_chunked_median_s']:>10.4f} "
              f"{r['kvtier_median_s']:>9.4f} {r['plain_GBps']:>11.3f} {r['kvtier_GBps']:>12.3f} "
              f"{r['verify_median_s']:>9.4f} {r['overhead']:>+9.1%} {r['overhead_vs_chunked']:>+11.1%}  "
              f"{'ok' if r['meets_target'] else 'MISSED'} (<= {TARGET_OVERHEAD:.0%})")
    print(f"\nLookup latency, {lookup['hashes']} hashes, {lookup['calls']} calls")
    print(f"{'what':<34} {'p50 us':>9} {'p99 us':>9}")
    for name in ("exists_prefix", "plain_exists_pipeline", "pool_lookup_remote_off", "pool_lookup_remote_on"):
        if name in lookup:
            print(f"{name:<34} {lookup[name]['p50_us']:>9.1f} {lookup[name]['p99_us']:>9.1f}")
    if "pool_lookup_error" in lookup:
        print(f"pool lookup skipped: {lookup['pool_lookup_error']}")
    if json_path is not None:
        write_json(result, json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
