#!/usr/bin/env python3
"""kvtier protocol benchmarks: lookup latency and restore bandwidth through a live kvtierd.

Usage:
    python bench/protocol.py [--lookups 5000] [--reps 100] [--json PATH] [--quick]
                             [--profile auto|always|never]

Everything runs on this machine, in one run, side by side: the bench starts
two kvtierd daemons (``python -m kvtier.daemon --socket ipc://...``), one
raw-ZMQ echo server (a second Python process: a ROUTER socket, nothing else)
and one ``redis-server`` (kvtier.testing.redis_servers, no persistence), and stops
all of them at the end, even on error (daemons: SIGTERM, exit status 0
checked). Every comparison is interleaved: each iteration (lookups) or
repetition (restores) calls every variant once, in a fresh random order, so
load drift on a shared machine (and the after-effects of the previous call)
hits every variant alike.

This file sets up, runs the sections and reports; each measurement lives in
its own module (``bench/protocol_*.py``, whose docstrings say what and how):
1. ``protocol_lookup``: lookup of 256 hashes (all held in the GPU tier),
   round trip p50/p99/mean, vs. a raw ZMQ echo, the echo + msgpack and
   Redis MGET (unix socket and TCP).
2. ``protocol_restore``: restore bandwidth of 256 KiB x 64 and 2 MiB x 16
   blocks through the inline, shm, kv and kv-vllm planes, from daemon
   ``gpu``'s GPU tier and daemon ``cpu``'s CPU tier, vs. memcpy (numpy and
   torch), raw ZMQ, pipelined Redis GET and a ZMQ request + memcpy in
   another process.
3. ``protocol_profile`` and ``protocol_paths`` (``--profile auto``: only
   when a target is missed): the client/daemon split of a request's time,
   cProfile of the client and of a third daemon started under a cProfile
   launcher (its loop thread phase by phase, its copy worker threads), the
   lookup and host copy paths timed piece by piece in-process, and a
   lookup's round trip hop by hop beside the echo's (``protocol_hops``).
``protocol_common`` holds the layouts, targets and the interleaving clock,
``protocol_servers`` the daemon launcher and the echo server,
``report`` (shared by all bench scripts) tables, machine facts and JSON.

Targets (issue 3): lookup p50 <= 0.25x Redis MGET (unix socket) and <= 2x the
raw ZMQ echo (issue 36: <= 1.5x the echo, reported beside them); shm-plane
restore >= 0.7x memcpy (the faster of numpy and torch); inline restore >= 0.8x
raw ZMQ. Evaluated on the GPU-tier runs; the
CPU-tier runs are reported beside them.

Results are printed as tables (stdout; progress on stderr) and written as
JSON (default ``bench/results/protocol-cpu.json``; ``--quick`` writes JSON
only with ``--json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from protocol_common import (
    LOOKUP_HASHES,
    SPECS,
    TARGET_INLINE_VS_ZMQ,
    TARGET_LOOKUP_VS_ECHO,
    TARGET_LOOKUP_VS_ECHO_TYPED,
    TARGET_LOOKUP_VS_REDIS,
    TARGET_SHM_VS_MEMCPY,
    PoolClient,
)
from protocol_lookup import bench_lookup, lookup_target_rows, report_lookup
from protocol_profile import report_profile, run_profiles
from protocol_restore import bench_restore, report_restore, restore_target_rows
from protocol_servers import REPO, EchoServer, bench_daemon, echo_server
from report import (
    cpu_model_facts,
    git,
    loadavg,
    loadavg_text,
    machine_info,
    memory_facts,
    progress,
    run_text,
    table,
    write_json,
)

DEFAULT_JSON = REPO / "bench" / "results" / "protocol-cpu.json"


def report(res: dict[str, Any]) -> str:
    """Every section's tables, then the targets table, then the profiles, as printed on stdout."""
    parts: list[str] = []
    lk = res.get("lookup")
    if lk:
        parts += report_lookup(lk)
    for name, r in res.get("restore", {}).items():
        parts.append(report_restore(name, r))
    trows = lookup_target_rows(lk) if lk else []
    for name, r in res.get("restore", {}).items():
        trows += restore_target_rows(name, r)
    if trows:
        parts.append(table(["target", "measured", "met"], trows, "\nTargets (issue 3; the issue-36 lookup row beside them)"))
    parts += report_profile(res.get("profile"))
    return "\n".join(parts)


def protocol_machine_info() -> dict[str, Any]:
    """The shared machine facts plus what these numbers depend on: the CPU model and the versions of
    torch, numpy, ZMQ, msgpack, redis-py (and its parser) and redis-server."""
    # Others edit concurrently: say whether the measured code differs from HEAD.
    info = machine_info(dirty_paths=(git("status", "--porcelain", "--", "client", "daemon", "tiers") or "").splitlines())
    info.update(cpu_model_facts())
    import msgpack
    import numpy
    import redis
    import torch
    import zmq

    info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(), numpy=numpy.__version__,
                pyzmq=zmq.__version__, libzmq=zmq.zmq_version(), msgpack=".".join(map(str, msgpack.version)),
                redis_py=redis.__version__, redis_py_parser="hiredis" if importlib.util.find_spec("hiredis") else "python",
                redis_server=run_text(shutil.which("redis-server") or "redis-server", "--version", cwd=None))
    info.update(memory_facts())
    return info


def run_all(args: argparse.Namespace, res: dict[str, Any], workdir: Path, env: dict[str, Any]) -> None:
    """Start redis-server, the echo server and daemons ``gpu`` and ``cpu`` (kept in ``env`` for ``cleanup``),
    store the blocks, run the chosen sections into ``res``, and the profiles when a target is missed."""
    import numpy as np

    from kvtier.testing import redis_servers as rs  # redis-py: imported only for a run, not for --help

    if not rs.have_redis():
        raise SystemExit(rs.MISSING_REASON)

    # Data: 256 lookup hashes (blocks of the 256 KiB pool); per block size, stored blocks.
    rng = random.Random(args.seed)
    env["specs"] = {}
    for name, bb, batch, _ in SPECS:
        n = LOOKUP_HASHES if name == SPECS[0][0] else batch
        hashes = [rng.randbytes(16) for _ in range(n)]
        data = np.frombuffer(np.random.default_rng(args.seed).bytes(n * bb), dtype=np.uint8)
        env["specs"][name] = {"hashes": hashes, "data": data}
    env["lookup_hashes"] = env["specs"][SPECS[0][0]]["hashes"]

    progress("starting redis-server (unix socket + loopback TCP)")
    redis_sock = workdir / "redis" / "redis.sock"
    server = rs.RedisServer(workdir / "redis", extra_args=("--unixsocket", str(redis_sock), "--unixsocketperm", "700"))
    env["redis"] = server
    server.start()
    import redis

    env["redis_unix"] = redis.Redis(unix_socket_path=str(redis_sock), socket_timeout=30)
    env["redis_tcp"] = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
    r = env["redis_unix"]
    r.mset({h: b"gpu" for h in env["lookup_hashes"]})
    for name, bb, batch, _ in SPECS:
        st = env["specs"][name]
        pipe = r.pipeline(transaction=False)
        for i, h in enumerate(st["hashes"][:batch]):
            pipe.set(b"blk:" + h, st["data"][i * bb:(i + 1) * bb].tobytes())
        pipe.execute()
    res["redis"] = dict(version=r.info("server").get("redis_version"), unix_socket=str(redis_sock), tcp_port=server.port)

    progress("starting the raw ZMQ echo server")
    env["echo"] = EchoServer(workdir).start()

    progress(f"starting kvtierd 'gpu' (gpu_bytes {args.gpu_bytes >> 20} MiB) and 'cpu' (gpu_bytes 0)")
    # Each is in env["daemons"] (by name) before it spawns: cleanup stops one that fails to start.
    dg = env["daemons"]["gpu"] = bench_daemon(workdir, "gpu", gpu_bytes=args.gpu_bytes, cpu_bytes=args.cpu_bytes)
    dg.spawn()
    dc = env["daemons"]["cpu"] = bench_daemon(workdir, "cpu", gpu_bytes=0, cpu_bytes=args.cpu_bytes)
    dc.spawn()
    res["daemons"] = {name: dict(flags=d.kvtierd_args) for name, d in (("gpu", dg), ("cpu", dc))}

    progress("storing blocks, opening arenas, registering KV tensors")
    for spec in SPECS:
        name, bb, batch, _ = spec
        st = env["specs"][name]
        st["clients"] = {}
        for tier, d in (("gpu", dg), ("cpu", dc)):
            pc = PoolClient(d, spec, st["hashes"], st["data"], store_n=len(st["hashes"]) if tier == "gpu" else batch)
            env["clients"].append(pc)
            st["clients"][tier] = pc
            tiers = pc.client.lookup(st["hashes"][:batch])
            assert tiers == [tier] * batch, f"{name} blocks are in {set(tiers)}, expected the {tier} tier"
        if spec is SPECS[0]:
            env["lookup_client"] = st["clients"]["gpu"]

    if "lookup" in args.sections:
        progress("lookup latency")
        res["lookup"] = bench_lookup(args, env)
    res["restore"] = {}
    if "restore" in args.sections:
        for spec in SPECS:
            res["restore"][spec[0]] = bench_restore(args, env, spec)

    lk = res.get("lookup")
    missed = (lk is not None and not (lk["met_vs_redis"] and lk["met_vs_echo"])) or any(
        not (t["shm_met"] and t["inline_met"]) for r in res["restore"].values() for tier, t in r["targets"].items()
        if tier == "gpu")
    res["all_targets_met"] = not missed
    if args.profile == "always" or (args.profile == "auto" and missed):
        res["profile"] = run_profiles(args, env, workdir)


def cleanup(env: dict[str, Any], res: dict[str, Any]) -> None:
    """Close the clients and stop every process ``run_all`` started; a daemon that exits non-zero is an error."""
    errors = []
    for pc in env["clients"]:
        pc.close()
    exit_status = {}
    for name, d in list(env["daemons"].items()):
        rc = d.stop()
        exit_status[name] = rc
        if rc != 0:
            errors.append(f"kvtierd {name} exited with {rc}:\n{d.log_tail()}")
    if env.get("echo") is not None:
        exit_status["echo"] = env["echo"].stop()
    if env.get("redis") is not None:
        env["redis"].stop()
        exit_status["redis"] = "killed"
    res["exit_status"] = exit_status
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        res["cleanup_errors"] = errors


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run, print the tables and write the JSON; 1 on error or a daemon's bad exit."""
    p = argparse.ArgumentParser(prog="bench/protocol.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lookups", type=int, default=None, help="timed lookups per variant (default 5000, 300 with --quick)")
    p.add_argument("--reps", type=int, default=None, help="timed restores per variant and block size (default 100, 8 with --quick)")
    p.add_argument("--gpu-bytes", type=int, default=256 << 20, help="GPU tier of daemon 'gpu' (per pool)")
    p.add_argument("--cpu-bytes", type=int, default=96 << 20, help="CPU tier of each daemon (per pool)")
    p.add_argument("--profile", choices=("auto", "always", "never"), default=None,
                   help="profile the client and a daemon: auto = when a target is missed (default auto; never with --quick)")
    p.add_argument("--sections", default="lookup,restore", help="comma-separated subset of lookup,restore")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None,
                   help="write results here (default bench/results/protocol-cpu.json; --quick writes only with --json)")
    p.add_argument("--quick", action="store_true", help="a short smoke run (~1 min)")
    p.add_argument("--_echo-server", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._echo_server:
        return echo_server(args._echo_server)
    q = args.quick
    args.lookups = args.lookups if args.lookups is not None else (300 if q else 5000)
    args.reps = args.reps if args.reps is not None else (8 if q else 100)
    args.profile = args.profile if args.profile is not None else ("never" if q else "auto")
    args.sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    if args.sections - {"lookup", "restore"}:
        p.error(f"unknown sections: {sorted(args.sections - {'lookup', 'restore'})}")

    # SIGTERM ends the run through the same cleanup as an error.
    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.perf_counter()
    res: dict = {"machine": protocol_machine_info(), "quick": q,
                 "args": {k: (str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set) else v)
                          for k, v in vars(args).items() if not k.startswith("_")},
                 "targets": dict(lookup_vs_redis_max=TARGET_LOOKUP_VS_REDIS, lookup_vs_echo_max=TARGET_LOOKUP_VS_ECHO,
                                 lookup_vs_echo_max_issue36=TARGET_LOOKUP_VS_ECHO_TYPED,
                                 shm_vs_memcpy_min=TARGET_SHM_VS_MEMCPY, inline_vs_zmq_min=TARGET_INLINE_VS_ZMQ)}
    env: dict = {"daemons": {}, "clients": []}
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-protocol-"))
    rc = 0
    try:
        run_all(args, res, workdir, env)
    except BaseException:
        rc = 1
        raise
    finally:
        cleanup(env, res)
        shutil.rmtree(workdir, ignore_errors=True)
        if rc == 0 and res.get("cleanup_errors"):
            rc = 1
    res["wall_s"] = time.perf_counter() - t_start
    res["machine"]["loadavg_at_end"] = loadavg()
    print(report(res))
    print(f"\nload average: {loadavg_text(res['machine']['loadavg_at_start'])} at start, "
          f"{loadavg_text(res['machine']['loadavg_at_end'])} at end "
          f"({res['machine']['cpu_count']} CPUs); daemons exited with {res['exit_status']}")
    path = args.json if args.json is not None else (None if q else DEFAULT_JSON)
    if path is not None:
        write_json(res, path, wall_s=res["wall_s"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
