"""One report from several runs of bench/peers.py: their records side by side, then re-summarized.

Contract
========

``merge(runs, round_offsets)`` takes the JSON of runs made with the same
prompt arguments (``--seed``, ``--prefix-tokens``, ``--suffix-tokens``,
``--reps``, ``--convs``, ``--turns``, ``--doc-tokens``, ``--user-tokens``,
``--reply-tokens``, ``--answer-tokens``) and returns one run's JSON: every
record, phase mark, engine and sidecar of each, its rounds shifted by that
run's offset, its systems in ``bench/peers.py``'s order, and ``merged_from``
saying which file gave which systems and rounds (a run stopped early counts:
its ``.partial.json`` holds what it measured). Runs whose prompt arguments
differ raise ``ValueError`` and nothing is written: their records would not be
the same prompts. Answers are checked by prompt digest, so a recompute in one
run is the reference of every system in the others.

Why it exists: on a shared 2-core machine one run of every system and phase
can outlast the time a session has; a run cut short keeps what it measured,
and the rest runs afterwards (or beside it) under the same arguments. The
merged report says so: a ratio between two systems of two runs is a ratio
between two moments of the machine's load, which the records' ``load1`` show.

Usage::

    python bench/peers_merge.py OUT.json RUN.json[@ROUND_OFFSET] ...
    python bench/peers.py --report-only OUT.json --markdown
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PROMPT_ARGS = ("seed", "prefix_tokens", "suffix_tokens", "reps", "convs", "turns", "doc_tokens", "user_tokens",
               "reply_tokens", "answer_tokens")
ORDER = ("kvtier", "lmcache", "native", "example", "prefix_cache", "recompute")


def merge(runs: list[tuple[str, dict[str, Any]]], round_offsets: list[int]) -> dict[str, Any]:
    """``runs``: (file name, JSON) pairs; the first gives the model, machine and arguments of the result."""
    if not runs or len(runs) != len(round_offsets):
        raise ValueError("one round offset per run, and at least one run")
    want = {k: runs[0][1]["args"].get(k) for k in PROMPT_ARGS}
    for name, run in runs[1:]:
        got = {k: run["args"].get(k) for k in PROMPT_ARGS}
        if got != want:
            diff = {k: (want[k], got[k]) for k in PROMPT_ARGS if want[k] != got[k]}
            raise ValueError(f"{name}: prompt arguments differ from {runs[0][0]}'s: {diff}")
    out = json.loads(json.dumps(runs[0][1]))
    out.update(records=[], phases=[], engines=[], sidecars=[], merged_from=[])
    systems: dict[str, Any] = {}
    for (name, run), off in zip(runs, round_offsets):
        run = json.loads(json.dumps(run))
        for item in run["records"] + run["phases"] + run["sidecars"]:
            if isinstance(item.get("round"), int):
                item["round"] += off
        measured = sorted({r["system"] for r in run["records"]}, key=ORDER.index)
        rounds = sorted({r["round"] for r in run["records"]})
        out["merged_from"].append({"file": name, "systems_measured": measured, "rounds": rounds,
                                   "partial": name.endswith(".partial.json"), "args": run["args"],
                                   "machine": run["machine"], "wall_s": run.get("wall_s")})
        for s in measured:
            systems[s] = run["systems"][s]
        for key in ("records", "phases", "engines", "sidecars"):
            out[key] += run[key]
    out["systems"] = {s: systems[s] for s in ORDER if s in systems}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the merged JSON (then: bench/peers.py --report-only OUT)")
    p.add_argument("runs", nargs="+", help="a run's JSON, optionally @N to shift its rounds by N")
    a = p.parse_args(argv)
    runs, offs = [], []
    for spec in a.runs:
        path, _, off = spec.partition("@")
        runs.append((Path(path).name, json.loads(Path(path).read_text())))
        offs.append(int(off) if off else 0)
    try:
        merged = merge(runs, offs)
    except ValueError as e:
        raise SystemExit(f"peers_merge: {e}") from None
    a.out.write_text(json.dumps(merged, indent=1))
    print(f"wrote {a.out}: " + "; ".join(f"{m['file']} -> {','.join(m['systems_measured'])} rounds {m['rounds']}"
                                         for m in merged["merged_from"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
