"""`kvtier stats` and `kvtier top` against a live kvtierd, their frame arithmetic, and the default socket rule."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvtier.client.admin import DaemonUnavailable, default_socket, request, resolve_endpoint
from kvtier.client.client import Client, PoolLayout
from kvtier.daemon import config as daemon_config
from kvtier.tools.top import render_frame

BLOCK_BYTES = 512
LAYOUT = PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                    kv_heads=1, head_dim=8)
POOL = "tools"


def kvtier(*args: str, env: Mapping[str, str] | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=None if env is None else {**os.environ, **env})


def h(chain: int, i: int) -> bytes:
    return bytes([chain, i]) * 8


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    d = kvtierd_module_factory(gpu_bytes=8 * BLOCK_BYTES, cpu_bytes=32 * BLOCK_BYTES)
    with Client(d.endpoint, POOL, LAYOUT) as c:
        chain = [h(1, i) for i in range(12)]
        for i in range(0, 12, 4):  # the GPU tier has 8 blocks: the first 4 are demoted
            c.store(chain[i:i + 4], bytes(4 * BLOCK_BYTES))
        c.lookup(chain + [h(9, 0), h(9, 1)])
        c.restore(chain[:4])
        c.lookup([h(9, 2)])
    return d


def pool_stats(endpoint: str) -> dict[str, Any]:
    return request(endpoint, "stats")["pools"][POOL]


# ---- kvtier stats ---------------------------------------------------------------------------------------


def test_stats_json_is_the_stats_verb(daemon) -> None:  # type: ignore[no-untyped-def]
    out = kvtier("stats", "--socket", daemon.endpoint, "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["endpoint"] == daemon.endpoint and got["sessions"] == 0
    p, expected = got["pools"][POOL], pool_stats(daemon.endpoint)
    assert p == expected  # nothing ran in between; stats calls change no pool counter
    assert p["lookups"] == 3 and p["looked_up_blocks"] == 14 + 4 + 1
    hits = p["hit_blocks_gpu"] + p["hit_blocks_cpu"] + p["hit_blocks_remote"]
    assert hits + p["miss_blocks"] == p["looked_up_blocks"]
    assert p["hit_blocks_gpu"] + p["hit_blocks_cpu"] == 12 + 4 and p["miss_blocks"] == 2 + 1
    assert got["daemon"]["requests_total"]["op=store"] == 3


def test_stats_json_for_one_pool_and_an_unknown_pool(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "other", LAYOUT):
        out = kvtier("stats", "--socket", daemon.endpoint, "--json", "--pool", POOL)
        assert out.returncode == 0 and list(json.loads(out.stdout)["pools"]) == [POOL]
    out = kvtier("stats", "--socket", daemon.endpoint, "--pool", "nope")
    assert out.returncode == 1
    assert "kvtier stats: no pool 'nope'" in out.stderr and "'tools'" in out.stderr


def test_stats_table(daemon) -> None:  # type: ignore[no-untyped-def]
    out = kvtier("stats", "--socket", daemon.endpoint, "--pool", POOL)
    assert out.returncode == 0, out.stderr
    p = pool_stats(daemon.endpoint)
    text = out.stdout
    for section in ("HITS", "OCCUPANCY", "COPIES", "EVENTS", "DAEMON"):
        assert section in text
    (hits,) = [line for line in text.splitlines() if line.startswith(f"  {POOL} ") and "%" in line]
    total = p["looked_up_blocks"]
    cells = hits.split()
    assert cells[1:3] == [f"{p['lookups']:,}", f"{total:,}"]
    assert cells[3:5] == [f"{p['hit_blocks_gpu']:,}", f"{100 * p['hit_blocks_gpu'] / total:.1f}%"]
    assert cells[9:11] == [f"{p['miss_blocks']:,}", f"{100 * p['miss_blocks'] / total:.1f}%"]
    # Occupancy's GPU row ends with pinned and held: the 12 stored keys, 4 of them only in the CPU tier.
    (gpu_row,) = [line for line in text.splitlines() if line.startswith(f"  {POOL} ") and " gpu " in line]
    assert p["held_blocks"] == 12 and gpu_row.split()[-2:] == [f"{p['pinned_blocks']:,}", "12"]


def test_stats_opens_no_session(daemon) -> None:  # type: ignore[no-untyped-def]
    before = request(daemon.endpoint, "stats")["daemon"]["requests_total"]
    assert kvtier("stats", "--socket", daemon.endpoint).returncode == 0
    after = request(daemon.endpoint, "stats")["daemon"]["requests_total"]
    assert after.get("op=hello") == before.get("op=hello")


def test_no_daemon_is_a_clear_error(tmp_path: Path) -> None:
    missing = f"ipc://{tmp_path}/missing.sock"
    for sub in ("stats", "top"):
        t0 = time.monotonic()
        out = kvtier(sub, "--socket", missing, *(["--once"] if sub == "top" else []))
        assert out.returncode == 1 and out.stdout == ""
        assert f"kvtier {sub}: no kvtierd at {missing} (no socket file): start it with `kvtierd` or pass --socket" \
            in out.stderr
        assert time.monotonic() - t0 < 20  # no waiting for a file that is not there
    stale = tmp_path / "stale.sock"
    stale.touch()  # a file nobody listens on (a daemon that was SIGKILLed)
    out = kvtier("stats", "--socket", f"ipc://{stale}", "--timeout", "0.3")
    assert out.returncode == 1 and "no kvtierd at" in out.stderr and "start it with `kvtierd`" in out.stderr


def test_kvtier_socket_env_is_the_default(daemon) -> None:  # type: ignore[no-untyped-def]
    out = kvtier("stats", "--json", env={"KVTIER_SOCKET": daemon.endpoint})
    assert out.returncode == 0 and json.loads(out.stdout)["endpoint"] == daemon.endpoint


def test_help() -> None:
    for sub in ("stats", "top"):
        out = kvtier(sub, "--help")
        assert out.returncode == 0 and "--socket" in out.stdout
    assert "stats" in kvtier("--help").stdout and "top" in kvtier("--help").stdout


# ---- kvtier top -----------------------------------------------------------------------------------------


def test_top_once_shows_the_daemons_numbers(daemon) -> None:  # type: ignore[no-untyped-def]
    out = kvtier("top", "--socket", daemon.endpoint, "--once", "--interval", "0.2", "--pool", POOL)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout  # no escape codes with --once
    p = pool_stats(daemon.endpoint)
    total = p["looked_up_blocks"]
    (since,) = [line for line in out.stdout.splitlines() if "since start" in line]
    cells = since.split()
    assert cells[2] == f"{total:,}"
    assert cells[3:7] == [f"{100 * p[k] / total:.1f}%" for k in
                          ("hit_blocks_gpu", "hit_blocks_cpu", "hit_blocks_remote", "miss_blocks")]
    (window,) = [line for line in out.stdout.splitlines()
                 if line.split()[:1] == [POOL] and re.search(r"last \d\.\d s", line)]
    assert window.split()[4:7] == ["0", "0.0/s", "-"]  # nothing looked up in the interval: no rates
    assert f"  {p['cpu_used_blocks']}/{p['cpu_blocks']} " in out.stdout  # occupancy of the CPU tier
    (occupancy,) = [line for line in out.stdout.splitlines() if line.split()[:1] == [POOL] and "/" in line
                    and "%" in line and "last" not in line and "since" not in line]
    # ... pinned, held (the 12 stored keys), copies, sessions
    assert occupancy.split()[-4:-2] == [f"{p['pinned_blocks']:,}", "12"]


def _pool(**kw: float) -> dict[str, Any]:
    base = {"lookups": 0, "looked_up_blocks": 0, "hit_blocks_gpu": 0, "hit_blocks_cpu": 0, "hit_blocks_remote": 0,
            "miss_blocks": 0, "bytes_demote": 0, "bytes_restore": 0, "bytes_store": 0, "bytes_load": 0,
            "gpu_blocks": 10, "gpu_free_blocks": 10, "cpu_blocks": 20, "cpu_used_blocks": 0}
    return {**base, **kw}


def test_top_rates_are_deltas_over_the_time_between_samples() -> None:
    prev = {"pools": {"p": _pool(looked_up_blocks=100, hit_blocks_gpu=50, miss_blocks=50, bytes_store=1000)},
            "daemon": {"requests_total": {"op=lookup": 10}, "lease_expiries_total": 1}, "sessions": 1}
    cur = {"pools": {"p": _pool(looked_up_blocks=300, hit_blocks_gpu=100, hit_blocks_cpu=100, miss_blocks=100,
                                bytes_store=1000 + 4 * 2048, gpu_free_blocks=4, cpu_used_blocks=5)},
           "daemon": {"requests_total": {"op=lookup": 30}, "lease_expiries_total": 3}, "sessions": 2}
    frame = render_frame(prev, cur, 2.0, endpoint="ipc:///x", interval_s=2.0, clock="12:00:00")
    lines = frame.splitlines()
    assert "lease expiries 3 (+2)" in lines[1] and "requests 10.0/s" in lines[1] and "sessions 2" in lines[1]
    (window,) = [line for line in lines if "last 2.0 s" in line and "%" in line]
    # In the window: 200 blocks, gpu 50, cpu 100, miss 50.
    assert window.split()[4:10] == ["200", "100.0/s", "25.0%", "50.0%", "0.0%", "25.0%"]
    (since,) = [line for line in lines if "since start" in line]
    assert since.split()[2:7] == ["300", "33.3%", "33.3%", "0.0%", "33.3%"]
    (bytes_row,) = [line for line in lines if "B/s" in line]
    assert bytes_row.split()[0] == "p" and "4.0 KiB/s" in bytes_row  # 8 KiB stored in 2 s
    assert "6/10 60.0%" in frame and "5/20 25.0%" in frame


def test_top_says_whether_a_standby_covers_a_crash() -> None:
    def frame(daemon: dict) -> str:
        cur = {"pools": {"p": _pool()}, "daemon": daemon, "sessions": 0}
        return render_frame(None, cur, 1.0, endpoint="ipc:///x", interval_s=1.0, clock="12:00:00")

    assert "standby pid 4242   ready: serves at once" in frame({"standby_pid": 4242, "standby_ready": 1})
    assert "standby pid 4243   starting: a crash now is a plain restart" in frame({"standby_pid": 4243, "standby_ready": 0})
    assert "standby none   starting" in frame({"standby_pid": 0, "standby_ready": 0})
    assert "standby" not in frame({})  # a daemon run without one


def test_top_counts_from_zero_after_a_daemon_restart() -> None:
    prev = {"pools": {"p": _pool(looked_up_blocks=1000, hit_blocks_gpu=1000)}, "daemon": {}, "sessions": 0}
    cur = {"pools": {"p": _pool(looked_up_blocks=10, miss_blocks=10)}, "daemon": {}, "sessions": 0}
    frame = render_frame(prev, cur, 1.0, endpoint="ipc:///x", interval_s=1.0, clock="12:00:00")
    (window,) = [line for line in frame.splitlines() if "last 1.0 s" in line and "%" in line]
    assert window.split()[4:6] == ["10", "10.0/s"] and window.split()[-1] == "100.0%"


def test_top_on_a_terminal_quits_cleanly_on_ctrl_c(daemon) -> None:  # type: ignore[no-untyped-def]
    pid, fd = pty.fork()
    if pid == 0:  # the child: kvtier top on a pseudo-terminal
        os.execv(sys.executable, [sys.executable, "-m", "kvtier.tools.cli", "top", "--socket", daemon.endpoint,
                                  "--interval", "0.2"])
    output = b""
    try:
        deadline = time.monotonic() + 30
        while output.count(b"HIT RATE") < 2:  # two frames drawn
            assert time.monotonic() < deadline, output.decode(errors="replace")
            if select.select([fd], [], [], 0.5)[0]:
                output += os.read(fd, 65536)
        os.kill(pid, signal.SIGINT)
        while True:
            if select.select([fd], [], [], 5)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            else:
                break
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, output.decode(errors="replace")
    text = output.decode(errors="replace")
    assert text.startswith("\x1b[?1049h\x1b[?25l")  # alternate screen, cursor hidden
    assert text.endswith("\x1b[?25h\x1b[?1049l")  # both restored on Ctrl-C
    assert "Traceback" not in text and "interrupted" not in text


# ---- where the tools look --------------------------------------------------------------------------------


@pytest.mark.parametrize("environ", [
    {"XDG_RUNTIME_DIR": "/run/user/1234"},
    {"XDG_RUNTIME_DIR": "relative/dir", "TMPDIR": "/var/tmp"},
    {"TMPDIR": "/var/tmp"},
    {"TMPDIR": "not/absolute"},
    {},
])
def test_the_client_default_socket_is_the_daemons(environ: dict[str, str]) -> None:
    for uid in (0, 1000, 987654):
        assert default_socket(environ, uid=uid) == daemon_config.default_socket(environ, uid=uid)


def test_resolve_endpoint_order() -> None:
    env = {"KVTIER_SOCKET": "ipc:///from/env.sock", "XDG_RUNTIME_DIR": "/run/user/5"}
    assert resolve_endpoint("tcp://h:1", env) == "tcp://h:1"
    assert resolve_endpoint(None, env) == "ipc:///from/env.sock"
    assert resolve_endpoint(None, {"KVTIER_SOCKET": "", "XDG_RUNTIME_DIR": "/run/user/5"}) == \
        "ipc:///run/user/5/kvtier/kvtierd.sock"


def test_admin_request_refuses_session_verbs_and_missing_sockets(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        request("ipc:///x", "lookup")
    with pytest.raises(DaemonUnavailable, match="no socket file"):
        request(f"ipc://{tmp_path}/none.sock", "stats")


def test_the_tools_import_no_torch_and_no_daemon() -> None:
    code = ("import sys\n"
            "import kvtier.tools.stats, kvtier.tools.top, kvtier.client.admin\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('kvtier.daemon')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_stats_and_top_show_what_a_restarted_daemon_adopted_and_dropped() -> None:
    from kvtier.tools.stats import format_stats

    adopted = _pool(cpu_adopted_blocks=1200, cpu_adoption_dropped_blocks=3, cpu_adoption_pending_blocks=40)
    fresh = _pool(cpu_adopted_blocks=0, cpu_adoption_dropped_blocks=0, cpu_adoption_pending_blocks=0)
    stats = {"pools": {"llama": adopted, "new": fresh}, "daemon": {}, "sessions": 0}
    for text in (format_stats(stats, "ipc:///x"),
                 render_frame(None, stats, 0.0, endpoint="ipc:///x", interval_s=1.0, clock="12:00:00")):
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("ADOPTED AT START"))
        assert lines[start + 1].split() == ["pool", "adopted", "dropped", "verifying"]
        assert lines[start + 2].split() == ["llama", "1,200", "3", "40"]
        assert not any(line.split()[:1] == ["new"] for line in lines[start:])  # a pool that adopted nothing
    quiet = {"pools": {"new": fresh}, "daemon": {}, "sessions": 0}
    assert "ADOPTED" not in format_stats(quiet, "ipc:///x")


def _disk(**kw: float) -> dict[str, Any]:
    base = {"available": True, "last_error": "", "capacity_blocks": 100, "used_blocks": 40, "disk_hits": 0,
            "bytes_read": 0, "bytes_written": 0, "writes_dropped_full": 0, "writes_dropped_unavailable": 0,
            "writes_not_admitted": 0, "read_errors": 0, "write_errors": 0, "disk_corrupt": 0, "adopted_blocks": 30,
            "torn_records": 1}
    return {**base, **kw}


def test_stats_and_top_show_the_disk_tier_where_a_pool_has_one() -> None:
    from kvtier.tools.stats import format_stats

    prev = {"pools": {"d": _pool(looked_up_blocks=100, hit_blocks_disk=40, miss_blocks=60, disk=_disk()),
                      "plain": _pool()}, "daemon": {}, "sessions": 1}
    cur = {"pools": {"d": _pool(looked_up_blocks=200, hit_blocks_disk=100, miss_blocks=100,
                                disk=_disk(disk_hits=60, bytes_read=60 << 20, bytes_written=1 << 30,
                                           writes_dropped_full=3, write_errors=2, available=False,
                                           last_error="write: [Errno 28] No space left on device")),
                     "plain": _pool()}, "daemon": {}, "sessions": 1}
    text = format_stats(cur, "ipc:///x")
    assert "each is counted once: gpu, cpu, disk, remote or miss" in text
    (hits,) = [line for line in text.splitlines() if line.startswith("  d ") and "%" in line]
    assert hits.split()[7:9] == ["100", "50.0%"]  # the disk column: 100 of 200 looked-up blocks
    (disk_row,) = [line for line in text.splitlines() if line.startswith("  d ") and "DOWN" in line]
    assert "No space left" in disk_row and "40/100" in disk_row and "60.0 MiB" in disk_row and "1.0 GiB" in disk_row
    assert disk_row.split()[-3:] == ["30", "(1", "torn)"]
    (occ,) = [line for line in text.splitlines() if line.split()[:1] == ["disk"]]
    assert occ.split()[1:3] == ["100", "40"]
    frame = render_frame(prev, cur, 2.0, endpoint="ipc:///x", interval_s=2.0, clock="12:00:00")
    assert "DISK TIER" in frame
    (window,) = [line for line in frame.splitlines() if line.split()[:1] == ["d"] and "last 2.0 s" in line]
    assert window.split()[8] == "60.0%"  # 60 of the interval's 100 blocks from the disk tier
    (row,) = [line for line in frame.splitlines() if line.startswith("  d ") and "DOWN" in line]
    assert "60 +60" in row and "3 +3" in row and "60.0 MiB +60.0 MiB" in row
    # Without a disk tier anywhere, no disk column and no disk section.
    plain = {"pools": {"plain": _pool()}, "daemon": {}, "sessions": 0}
    assert "DISK" not in format_stats(plain, "ipc:///x") and "disk" not in format_stats(plain, "ipc:///x")
    assert "DISK" not in render_frame(None, plain, 0.0, endpoint="ipc:///x", interval_s=1.0, clock="12:00:00")
