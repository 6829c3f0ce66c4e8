"""Reporting shared by the bench scripts: progress lines, text tables, machine facts, JSON output.

It measures nothing itself. Every bench script records the same facts about
the machine it ran on (so numbers are compared only between runs on one
machine) and prints the same kind of table; this module is the one copy.
Scripts import it as ``import report`` (``python bench/<script>.py`` puts
``bench/`` first on ``sys.path``). It imports nothing from kvtier, so
``bench/gpu.py`` can use it on a machine without kvtier installed.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GIT_TIMEOUT_S = 20.0


def progress(msg: str, *, tag: str = "bench", end: str = "\n") -> None:
    """A status line on stderr (stdout carries the tables); ``end=""`` overwrites it in place on a terminal."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\x1b[K[{tag}] {msg}{end}")
    else:
        sys.stderr.write(f"[{tag}] {msg}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------
# Tables and numbers
# ---------------------------------------------------------------------------


def table(headers: list[str], rows: list[list[str]], title: str) -> str:
    """``title``, then the columns: the first left-aligned, the others right-aligned (numbers)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([title, fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def yes(met: bool) -> str:
    """A target's verdict; a miss in capitals so it stands out in a table."""
    return "yes" if met else "NO"


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, linearly interpolated between neighbours; nan when empty."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------


def run_text(*argv: str, cwd: Path | None = REPO) -> str | None:
    """A command's stripped stdout, or None when it is missing or fails (a fact left out, not an error)."""
    try:
        return subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, check=True,
                              timeout=GIT_TIMEOUT_S).stdout.strip()
    except Exception:
        return None


def git(*args: str) -> str | None:
    """``git ARGS`` in the repository: its output, or None outside a checkout."""
    return run_text("git", *args)


def utc_now() -> str:
    """The time a run started, UTC, to the second (ISO 8601)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def loadavg() -> tuple[float, float, float] | None:
    """The 1/5/15-minute load average (None where the OS has none): how shared the machine was."""
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def machine_info(*, processor: bool = False, **dirty: Any) -> dict[str, Any]:
    """What every result records about its machine and checkout, in this order: host and platform
    (``processor=True`` adds ``platform.processor()``), CPUs, Python, the start time, the git commit,
    then ``dirty`` (the caller's keys saying whether the measured code differs from that commit:
    others edit the checkout concurrently), then the load average at start. Callers add their
    own facts after these and end with ``memory_facts()``."""
    info: dict[str, Any] = dict(hostname=socket.gethostname(), platform=platform.platform(),
                                machine=platform.machine())
    if processor:
        info["processor"] = platform.processor()
    info.update(
        cpu_count=os.cpu_count(),
        cpu_affinity=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        python=sys.version.split()[0], implementation=platform.python_implementation(),
        timestamp=utc_now(),
        git_commit=git("rev-parse", "--short", "HEAD"),
        **dirty,
        loadavg_at_start=loadavg(),
    )
    return info


def cpu_model_facts() -> dict[str, str | None]:
    """``{"cpu_model": name}`` from /proc/cpuinfo (None when it names none), or nothing without it."""
    try:
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        return {}
    return {"cpu_model": models[0] if models else None}


def memory_facts() -> dict[str, int]:
    """``{"memory_total": bytes}``, or nothing without psutil."""
    try:
        import psutil

        return {"memory_total": psutil.virtual_memory().total}
    except Exception:
        return {}


def loadavg_text(load: Sequence[float] | None) -> str:
    """A load average as printed under a result table: ``0.52 0.61 0.70``."""
    return "n/a" if load is None else " ".join(f"{x:.2f}" for x in load)


# ---------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------


def shown_path(path: Path) -> Path:
    """``path`` relative to the repository when it lies inside it (shorter to read), else as given."""
    return path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path


def write_json(result: dict[str, Any], path: Path, *, wall_s: float | None = None, indent: int = 2) -> None:
    """Write ``result`` to ``path`` (folders made; anything JSON cannot hold as its str) and say so on
    stdout, with the run's wall time when given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent, default=str) + "\n")
    took = f" ({wall_s:.0f}s)" if wall_s is not None else ""
    print(f"\nwrote {shown_path(path)}{took}")
