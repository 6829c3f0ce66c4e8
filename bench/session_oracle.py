"""How far is ``chain+session`` from the same policy with a perfect return model?

Replays a trace with session hints twice, side by side, through the real
bookkeeping pool (``kvtier replay``'s accounting): once with ``chain+session``
as it is, once with its stream ranking replaced by an oracle that knows when
each stream comes back (the time of the session's next request that extends
this request's root block; a stream whose return has passed without one
ranks last). Everything else is the policy's own: streams, tail-first order,
spares, admission. The gap between the two is what a better return model
could win; the oracle's own gap to Belady is what the structure leaves.

    python bench/session_oracle.py ../shared/traces/claude_code_even.jsonl.gz

prints a table and writes bench/results/session-oracle.json.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures as cf
import json
import multiprocessing as mp
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies.base import EvictionPolicy
from kvtier.tiers.policies.session import SessionWrapper
from kvtier.tiers.pool import PoolSpec, TieredPool
from kvtier.tools.replay.core import ReplayConfig, request_hints
from kvtier.tools.traces import Request, load_trace

RESULTS = Path(__file__).resolve().parent / "results"
NEVER_S = float("inf")


def next_returns(requests: Sequence[Request]) -> dict[tuple[bytes, float, bytes], float]:
    """(session, at_s, root key) of each request -> when that session next asks for that root."""
    by_root: dict[tuple[bytes, bytes], list[float]] = defaultdict(list)
    for req in requests:
        if req.session is not None and req.keys:
            by_root[str(req.session).encode(), req.keys[0]].append(req.timestamp / 1000.0)
    out: dict[tuple[bytes, float, bytes], float] = {}
    for (session, root), times in by_root.items():
        for i, at_s in enumerate(times):
            later = bisect.bisect_right(times, at_s, lo=i)
            out[session, at_s, root] = times[later] if later < len(times) else NEVER_S
    return out


class OracleSession(SessionWrapper):
    """``+session`` ranking each stream by its true next return (a bench instrument, not a policy)."""

    def __init__(self, inner: EvictionPolicy, returns: dict[tuple[bytes, float, bytes], float]) -> None:
        super().__init__(inner)
        self.returns = returns
        self._next_s: dict[int, float] = {}  # id(stream) -> its next return
        self._asked_s = NEVER_S

    def _take_hints(self, keys: Sequence[bytes], hints: RequestHints) -> None:
        if keys:
            self._asked_s = self.returns.get((hints.session or b"", hints.at_s, keys[0]), NEVER_S)
        super()._take_hints(keys, hints)

    def _stream_for(self, session: bytes, keys: Sequence[bytes]) -> Any:
        s = super()._stream_for(session, keys)
        self._next_s[id(s)] = self._asked_s
        return s

    def _rank_of(self, s: Any) -> tuple[int, int, int, float]:
        next_s = self._next_s.get(id(s), NEVER_S)
        if next_s < self.now_s:  # it came back as another stream (a fork): this one is done
            next_s = NEVER_S
        return (0, 0, 2, -next_s)


def run(requests: Sequence[Request], config: ReplayConfig, oracle: bool) -> dict[str, Any]:
    returns = next_returns(requests) if oracle else {}
    wrap = (lambda policy, cpu: OracleSession(policy, returns)) if oracle else None  # noqa: E731
    pool = TieredPool(PoolSpec("oracle", config.block_size, config.block_bytes), cpu_blocks=config.cpu_blocks,
                      policy="chain" if oracle else config.policy, transfer=None, data=False,
                      clean_ahead_blocks=0, policy_wrapper=wrap)
    pool.attach_gpu(num_blocks=config.gpu_blocks)
    g, bs = config.gpu_blocks, config.block_size
    t0 = time.perf_counter()
    for req in requests:  # kvtier replay's loop (tools/replay/core.py)
        keys, hints = req.keys, request_hints(req, config)
        if len(keys) <= g:
            pool.allocate("r", keys, len(keys) * bs, count=True, hints=hints)
        else:
            pool.lookup(keys, count=True, hints=hints)
            pool.allocate("r", keys[:g], g * bs, count=False)
        pool.free("r")
    s = pool.stats()
    hits = s["hit_blocks_gpu"] + s["hit_blocks_cpu"]
    return {"ranking": "oracle: true next return" if oracle else "return model (chain+session)",
            "block_hit_rate": hits / s["looked_up_blocks"], "hit_blocks": hits,
            "looked_up_blocks": s["looked_up_blocks"], "demotions": s["demotions"],
            "seconds": round(time.perf_counter() - t0, 1)}


_REQUESTS: Sequence[Request] = ()


def _point(args: tuple[ReplayConfig, bool]) -> dict[str, Any]:
    return run(_REQUESTS, *args)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a trace with session fields (e.g. ../shared/traces/claude_code_even.jsonl.gz)")
    ap.add_argument("--gpu-blocks", type=int, default=976, help="GPU tier blocks (default 976: 500k tokens)")
    ap.add_argument("--cpu-blocks", type=int, default=7812, help="CPU tier blocks (default 7812: 4M tokens)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--json", default=str(RESULTS / "session-oracle.json"), help="where to write the results")
    args = ap.parse_args(argv)
    global _REQUESTS
    _REQUESTS = list(load_trace(args.trace, 512, limit=args.limit))
    if not any(r.session is not None for r in _REQUESTS):
        print(f"{args.trace}: no request has a session field; this bench needs session hints", file=sys.stderr)
        return 2
    config = ReplayConfig(args.gpu_blocks, args.cpu_blocks, "chain+session", hints="session")
    print(f"{len(_REQUESTS):,} requests; GPU {config.gpu_blocks} + CPU {config.cpu_blocks} blocks; "
          "two replays side by side (about 2 minutes each on 2 cores)", file=sys.stderr)
    ctx = mp.get_context("fork")
    with cf.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        rows = list(ex.map(_point, [(config, False), (config, True)]))
    print(f"{'ranking':<32} {'block hit rate':>14} {'demotions':>11} {'seconds':>8}")
    for r in rows:
        print(f"{r['ranking']:<32} {r['block_hit_rate']:>14.4f} {r['demotions']:>11,} {r['seconds']:>8}")
    out = {"trace": args.trace, "requests": len(_REQUESTS), "config": {"gpu_blocks": config.gpu_blocks,
           "cpu_blocks": config.cpu_blocks, "block_size": config.block_size, "hints": "session"}, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
