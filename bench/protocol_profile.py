"""bench/protocol.py section 3: where a request's time goes, when a target is missed (``--profile``).

- Decomposition: serial lookups and restores (every plane, both block
  sizes) against the unprofiled daemon ``gpu``, each call's round trip
  beside the daemon's own handling time per request (its
  ``request_seconds_total``: receipt to reply handed to ZMQ, copies
  included); the rest is the client and the transport.
- Client: cProfile of this process over the same lookups and restores.
- Daemon: a third kvtierd started under a cProfile launcher
  (``protocol_servers.ProfiledDaemon``); SIGUSR1 cuts its loop
  thread's profile into one phase per lookup/restore run, so each phase is
  read per request with the idle poll left out; its copy worker threads'
  profile is read once for the whole run.
- The in-process lookup and copy paths (``protocol_paths``).
- A lookup's round trip hop by hop beside the raw echo's, from stamps on
  both sides of every socket call (``protocol_hops``).

py-spy is not used: at useful rates it falls seconds behind on a 2-core VM.
cProfile inflates Python-heavy code: read shares and relative sizes, not
absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol_common import LOOKUP_HASHES, SPECS, PoolClient, request_counters
from protocol_hops import lookup_hops, report_hops
from protocol_paths import copy_path_breakdown, lookup_path_breakdown, report_paths
from protocol_servers import REPO, ProfiledDaemon
from report import percentile, progress, table


def top_functions(stats: pstats.Stats, n: int, sort: str = "tottime") -> list[dict[str, Any]]:
    """The ``n`` functions with the most self (or cumulative) time, with paths shortened to the package."""
    rows = []
    total = stats.total_tt or 1e-12
    for (file, line, func), (cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        short = file
        for marker in ("/site-packages/", "/lib/python3", str(REPO) + "/"):
            if marker in short:
                short = short.split(marker, 1)[1]
        rows.append(dict(func=f"{short}:{line}({func})", ncalls=nc, tottime_s=tt, cumtime_s=ct,
                         tottime_share=tt / total))
    key = "tottime_s" if sort == "tottime" else "cumtime_s"
    rows.sort(key=lambda r: r[key], reverse=True)
    return rows[:n]


def profile_table(rows: list[dict[str, Any]], title: str, per_call_div: int) -> str:
    """A client profile as printed: microseconds per operation (``per_call_div`` operations profiled)."""
    body = [[r["func"][:90], f"{r['ncalls']}", f"{r['tottime_s'] / per_call_div * 1e6:.1f}",
             f"{r['cumtime_s'] / per_call_div * 1e6:.1f}", f"{100 * r['tottime_share']:.1f}%"] for r in rows]
    return table(["function", "ncalls", "self us/op", "cum us/op", "self %"], body, title)

def decompose(client: Any, op: str, fn: Callable[[], Any], n: int) -> dict[str, float]:
    """Client round trip vs the daemon's own handling time (its request_seconds_total: from
    receiving the request to handing the reply to ZMQ, copies included) over ``n`` serial calls."""
    for _ in range(3):
        fn()
    n0, s0 = request_counters(client, op)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    n1, s1 = request_counters(client, op)
    daemon_us = (s1 - s0) / max(1.0, n1 - n0) * 1e6
    mean_us = statistics.fmean(ts) * 1e6
    return dict(calls=n, rtt_p50_us=percentile(ts, 0.5) * 1e6, rtt_mean_us=mean_us, daemon_mean_us=daemon_us,
                rest_mean_us=mean_us - daemon_us)


def phase_profile(path: Path, n_requests: int, n: int = 20) -> dict[str, Any]:
    """A loop-thread phase: the top functions by self time, idle polling left out, per request."""
    st = pstats.Stats(str(path))
    rows = top_functions(st, n + 5)
    idle = sum(r["tottime_s"] for r in top_functions(st, 10_000) if r["func"].endswith("(poll)"))
    busy = st.total_tt - idle
    rows = [dict(r, us_per_request=r["tottime_s"] / n_requests * 1e6, cum_us_per_request=r["cumtime_s"] / n_requests * 1e6,
                 share_of_busy=r["tottime_s"] / busy if busy > 0 else 0.0)
            for r in rows if not r["func"].endswith("(poll)")][:n]
    return dict(requests=n_requests, busy_s=busy, busy_us_per_request=busy / n_requests * 1e6, top=rows)


def run_profiles(args: argparse.Namespace, env: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Where the time goes: client/daemon split (unprofiled), cProfile of the client and of a
    profiled daemon phase by phase, and the daemon's host copy path in-process."""
    out: dict = {"note": "cProfile inflates Python-heavy code: read shares and relative sizes, not absolute times"}
    n_lookup = 300 if args.quick else 2000
    n_restore = 5 if args.quick else 30

    progress("profile: client round trip vs daemon handling time (unprofiled daemon 'gpu')")
    dec: dict = {}
    lc = env["lookup_client"].client
    dec["lookup 256"] = decompose(lc, "lookup", lambda: lc.lookup(env["lookup_hashes"]), n_lookup)
    for name, _bb, batch, _ in SPECS:
        pc = env["specs"][name]["clients"]["gpu"]
        h = env["specs"][name]["hashes"][:batch]
        c, sl = pc.client, pc.slots
        for plane, fn in (("inline", lambda: c.restore(h)), ("shm", lambda: c.restore(h, slots=sl)),
                          ("kv", lambda: c.restore(h, slots=sl, reg="slab")),
                          ("kv-vllm", lambda: c.restore(h, slots=sl, reg="vllm"))):
            dec[f"restore {name} {plane}"] = decompose(c, "restore", fn, n_restore)
    out["decomposition"] = dec

    pd = ProfiledDaemon(workdir, "prof", gpu_bytes=args.gpu_bytes, cpu_bytes=args.cpu_bytes)
    d = env["daemons"]["prof"] = pd.daemon
    progress("profile: starting a kvtierd under cProfile")
    d.spawn()
    client_prof: dict = {}
    daemon_prof: dict = {}
    pcs: list[PoolClient] = []
    try:
        spec0 = SPECS[0]
        pc = PoolClient(d, spec0, env["specs"][spec0[0]]["hashes"], env["specs"][spec0[0]]["data"], store_n=LOOKUP_HASHES)
        pcs.append(pc)
        hashes = env["lookup_hashes"]
        for _ in range(50):
            pc.client.lookup(hashes)
        pd.rotate_profile()  # phase 0: set-up
        progress(f"profile: {n_lookup} lookups")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n_lookup):
            pc.client.lookup(hashes)
        prof.disable()
        client_prof["lookup"] = dict(calls=n_lookup, top=top_functions(pstats.Stats(prof), 15))
        daemon_prof["lookup"] = phase_profile(pd.rotate_profile(), n_lookup)
        for spec in SPECS:
            name, bb, batch, _ = spec
            if spec is not spec0:
                pc = PoolClient(d, spec, env["specs"][name]["hashes"], env["specs"][name]["data"], store_n=batch)
                pcs.append(pc)
            h = env["specs"][name]["hashes"][:batch]
            c, sl = pc.client, pc.slots
            for plane, call in (("inline", lambda: c.restore(h)), ("shm", lambda: c.restore(h, slots=sl)),
                                ("kv", lambda: c.restore(h, slots=sl, reg="slab")),
                                ("kv-vllm", lambda: c.restore(h, slots=sl, reg="vllm"))):
                progress(f"profile: restore {name} {plane}")
                for _ in range(3):
                    call()
                pd.rotate_profile()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(n_restore):
                    call()
                prof.disable()
                key = f"restore {name} {plane}"
                client_prof[key] = dict(calls=n_restore, top=top_functions(pstats.Stats(prof), 12))
                daemon_prof[key] = phase_profile(pd.rotate_profile(), n_restore)
    finally:
        for pc in pcs:
            pc.close()
        rc = d.stop()
        del env["daemons"]["prof"]
    out["client"] = client_prof
    out["daemon_exit_status"] = rc
    out["daemon_loop"] = daemon_prof
    if pd.prof_workers.exists():
        st = pstats.Stats(str(pd.prof_workers))
        rows = [r for r in top_functions(st, 30) if "SimpleQueue" not in r["func"]]
        out["daemon_copy_threads"] = dict(total_s=st.total_tt, top=rows[:15])
    progress("profile: lookup path, in-process")
    out["lookup_path"] = lookup_path_breakdown(env["lookup_hashes"], 300 if args.quick else 2000)
    progress("profile: host copy path, in-process")
    out["copy_path"] = {spec[0]: copy_path_breakdown(spec, 10 if args.quick else 40) for spec in SPECS}
    out["lookup_hops"] = lookup_hops(args, env, workdir)
    return out




def report_profile(prof: dict[str, Any]) -> list[str]:
    """Tables 3a-3f, as printed; none when no profile was taken."""
    if not (prof and isinstance(prof, dict) and "decomposition" in prof):
        return []
    parts = []
    rows = [[k, f"{v['rtt_p50_us']:.0f}", f"{v['rtt_mean_us']:.0f}", f"{v['daemon_mean_us']:.0f}",
             f"{v['rest_mean_us']:.0f}"] for k, v in prof["decomposition"].items()]
    parts.append(table(["request (daemon 'gpu', serial)", "RTT p50 us", "RTT mean us", "daemon us",
                        "client+transport us"], rows,
                       "\n3a. Where a request's time goes: daemon = its own request_seconds_total per request "
                       "(receipt to reply handed to ZMQ)"))
    lk_prof = prof["client"].get("lookup")
    if lk_prof:
        rows = [r for r in lk_prof["top"] if not r["func"].endswith("(poll)")][:8]
        parts.append(profile_table(rows, f"\n3b. Client cProfile, {lk_prof['calls']} lookups (per lookup; "
                                         f"waiting in poll left out)", lk_prof["calls"]))
    for key in ("lookup", "restore 256KiB inline", "restore 256KiB shm", "restore 2MiB inline"):
        ph = prof["daemon_loop"].get(key)
        if not ph:
            continue
        rows = [[r["func"][:90], f"{r['ncalls']}", f"{r['us_per_request']:.1f}", f"{r['cum_us_per_request']:.1f}",
                 f"{100 * r['share_of_busy']:.1f}%"] for r in ph["top"][:10]]
        parts.append(table(["function", "ncalls", "self us/req", "cum us/req", "of busy"], rows,
                           f"\n3c. Daemon loop thread cProfile, {key} x {ph['requests']}: "
                           f"{ph['busy_us_per_request']:.0f} us busy per request (idle poll left out)"))
    ct = prof.get("daemon_copy_threads")
    if ct:
        rows = [[r["func"][:90], f"{r['ncalls']}", f"{r['tottime_s'] * 1e3:.1f}", f"{r['cumtime_s'] * 1e3:.1f}"]
                for r in ct["top"][:6]]
        parts.append(table(["function", "ncalls", "self ms", "cum ms"], rows,
                           "\n3d. Daemon copy threads cProfile, whole profiled run (idle queue wait left out)"))
    return parts + report_paths(prof) + report_hops(prof.get("lookup_hops", {}))
