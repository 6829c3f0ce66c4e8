"""`kvtier replay --nodes N`: several simulated nodes, each with its own tiers, sharing one remote tier.

Each node is a ``TieredPool`` in bookkeeping mode (``data=False``), built as
``kvtier.tools.replay.core`` builds its one pool (same GPU and CPU capacities and
policy per node, clean-ahead off), and each request is replayed on exactly one
node with the single-node replay's accounting (``replay.ACCOUNTING``). The
remote tier is a ``SimulatedRemoteTier``: keys only, one exact LRU over all
nodes' blocks, the way a Redis server with ``maxmemory`` and
``maxmemory-policy allkeys-lru`` evicts.

Three runs on the same trace and the same node assignment:

- **local**: the N nodes, no remote tier: each node alone.
- **global**: the same N nodes sharing one remote tier. The pool's remote
  integration is unchanged: lookups continue past the CPU tier into the
  remote tier (hits counted as ``remote``), remote hits are fetched into the
  node's CPU tier, and blocks a node's CPU tier evicts are written back. So
  the remote tier is a shared *victim* cache: node B sees a block node A
  computed only once A's CPU tier has evicted it.
- **one global cache**: a reference, one node with N times the GPU and CPU
  capacity serving every request (what a perfectly shared cache of the same
  total size would do).

Plus the infinite-cache bound (``kvtier.tools.belady``), which no node
count changes.

Node assignment (the trace names no node), by ``assign_nodes``:

- ``hash`` (default): a hash (xxh3-64) of the request's first block that is
  *not hot*, modulo N. A block is hot when more than 1/N of the trace's
  requests contain it: a shared system prompt. Block keys are prefix-chained,
  so the hot blocks are a leading run and hashing the first other block is
  hashing the prefix up to it: a conversation's later turns, which extend
  the earlier ones, land on the node of its first turn (prefix affinity, as
  a router keyed on the prompt would do). A request made only of hot blocks
  (or with no full block) has nothing to be sticky about and goes
  round-robin. Why not the first block: on the Mooncake conversation trace
  every request starts with the same block, so hashing it sends all
  traffic to one node (``first-block``, kept to show that).
- ``round-robin``: request i goes to node i mod N (no affinity).
- ``first-block``: a hash of block 0 (the naive rule).

The hot set is computed from the whole trace up front: it stands for a
router configured with the deployment's common prefixes, not an online
detector.

Differences from a real deployment, all on purpose: requests are serial
(one at a time over all nodes, in trace order), so a remote write-back is
visible to the very next request (the real write-back is asynchronous and
may be dropped under load); Redis's LRU is approximate (sampled), the
stand-in's is exact; the stand-in's capacity is in blocks, not bytes.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvtier.tools.replay.core import ACCOUNTING, ReplayConfig
from kvtier.tools.replay.progress import progress_bar
from kvtier.tools.traces import Request

__all__ = [
    "ASSIGN_RULES",
    "DEFAULT_ASSIGN",
    "MOONCAKE_REFERENCE",
    "NODES_ACCOUNTING",
    "NodesConfig",
    "SimulatedRemoteTier",
    "assign_nodes",
    "compare",
    "hot_keys",
    "run_nodes",
]

ASSIGN_RULES = ("hash", "round-robin", "first-block")
DEFAULT_ASSIGN = "hash"

# Mooncake FAST'25 (section 5.2 / Fig. 9), the figure issue 9 compares with:
# 10 prefill nodes, 3M tokens of cache each, conversation trace.
MOONCAKE_REFERENCE = {
    "source": "Mooncake FAST'25, conversation trace, 10 prefill nodes x 3M tokens of cache each",
    "local_hit_rate": 0.17,
    "global_hit_rate": 0.375,
}

NODES_ACCOUNTING = [
    "Each request is replayed on one node with the single-node accounting; requests are serial over all "
    "nodes, in trace order.",
    "local: N independent nodes (GPU + CPU tier each), no remote tier.",
    "global: the same nodes sharing one remote tier (exact LRU of remote_blocks keys, like Redis allkeys-lru); "
    "lookups continue into it (hits counted as remote), hits are fetched into the node's CPU tier, blocks a "
    "CPU tier evicts are written back (a victim cache).",
    "one global cache: one node with N x the GPU and CPU blocks serving every request.",
    "hash assignment: xxh3-64 of the first block that more than 1/N of the requests do not share, mod N; "
    "requests with no such block go round-robin.",
]

_PRESENT = object()  # what the stand-in's fetch returns for a present block (the pool only checks for None)


class SimulatedRemoteTier:
    """A bookkeeping stand-in for ``kvtier.tiers.remote.tier.RemoteTier``: keys only, no bytes.

    Contract (``kvtier.tiers.remote.RemoteStore``, as a replay needs it):

    - ``capacity_blocks``: how many keys it holds at most (None: unbounded;
      0: holds nothing). When a write would exceed it, the least recently
      used keys are evicted first, as Redis does with ``maxmemory`` and
      ``allkeys-lru`` (exactly, where Redis samples).
    - ``exists_prefix(hashes) -> int``: the number of leading hashes held.
      Does not touch: Redis's EXISTS does not update a key's LRU clock.
    - ``fetch(hashes) -> list[object | None]``: a placeholder for each held
      hash, None for each absent one; each held hash becomes most recently
      used (GET touches).
    - ``write_back(key, data, copy=True) -> bool``: inserts ``key`` (``data``
      is ignored; None in bookkeeping mode) or, if held, makes it most
      recently used (a SET of an existing key). False only when the capacity
      is 0. Synchronous: visible to the next call.
    - ``stats() -> dict``: counters named as ``RemoteTier``'s where they mean
      the same, plus ``used_blocks``, ``capacity_blocks``, ``evictions``.
    """

    def __init__(self, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.counters: dict[str, int] = {
            "exists_calls": 0,
            "exists_blocks": 0,
            "exists_hit_blocks": 0,
            "remote_hits": 0,
            "remote_misses": 0,
            "writes_done": 0,
            "writes_present": 0,  # write-backs of a key already held (refreshed, not added)
            "writes_dropped_full": 0,  # capacity 0
            "evictions": 0,
        }

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self) -> list[bytes]:
        """The held keys, least recently used first (for tests)."""
        return list(self._keys)

    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        c = self.counters
        c["exists_calls"] += 1
        c["exists_blocks"] += len(hashes)
        n = 0
        for h in hashes:
            if h not in self._keys:
                break
            n += 1
        c["exists_hit_blocks"] += n
        return n

    def fetch(self, hashes: Sequence[bytes]) -> list[object | None]:
        out: list[object | None] = []
        keys = self._keys
        for h in hashes:
            if h in keys:
                keys.move_to_end(h)
                out.append(_PRESENT)
            else:
                out.append(None)
        hits = sum(1 for x in out if x is not None)
        self.counters["remote_hits"] += hits
        self.counters["remote_misses"] += len(out) - hits
        return out

    def write_back(self, key: bytes, data: Any = None, copy: bool = True) -> bool:
        c = self.counters
        if self.capacity_blocks == 0:
            c["writes_dropped_full"] += 1
            return False
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            c["writes_present"] += 1
        else:
            keys[key] = None
            if self.capacity_blocks is not None and len(keys) > self.capacity_blocks:
                keys.popitem(last=False)
                c["evictions"] += 1
        c["writes_done"] += 1
        return True

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.counters)
        s.update(used_blocks=len(self._keys), capacity_blocks=self.capacity_blocks, available=True,
                 mode="simulated")
        return s

    @property
    def available(self) -> bool:
        return True  # in-process: never unreachable

    def close(self, timeout_s: float = 5.0) -> bool:
        return True  # nothing queued: writes are synchronous


# ---- node assignment -------------------------------------------------------------------


def hot_keys(requests: Sequence[Request], nodes: int) -> frozenset[bytes]:
    """Keys contained in more than ``len(requests) / nodes`` requests (none when ``nodes`` <= 1).

    Such a key cannot be a routing key: hashing it would send more than one
    node's fair share of the traffic to a single node.
    """
    if nodes <= 1:
        return frozenset()
    per_key: Counter[bytes] = Counter()
    for req in requests:
        per_key.update(set(req.keys))  # a key repeated inside one request counts once
    limit = len(requests) / nodes
    return frozenset(key for key, n in per_key.items() if n > limit)


def _node_of_key(key: bytes, nodes: int) -> int:
    import xxhash

    # xxh3, not hash(): Python salts bytes hashes per process, and the
    # assignment must be the same in every run.
    return xxhash.xxh3_64_intdigest(key) % nodes


def assign_nodes(requests: Sequence[Request], nodes: int, rule: str = DEFAULT_ASSIGN,
                 hot: frozenset[bytes] | None = None) -> list[int]:
    """The node (0 .. nodes-1) of each request under ``rule`` (see the module docstring). Deterministic.

    ``hot``: the keys ``hash`` skips (default ``hot_keys(requests, nodes)``).
    """
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if rule not in ASSIGN_RULES:
        raise ValueError(f"unknown assignment {rule!r} (choose from {', '.join(ASSIGN_RULES)})")
    if rule == "round-robin":
        return [i % nodes for i in range(len(requests))]
    if hot is None:
        hot = hot_keys(requests, nodes) if rule == "hash" else frozenset()
    out: list[int] = []
    rr = 0  # round-robin counter for requests without a routing key
    for req in requests:
        key = next((k for k in req.keys if k not in hot), None) if rule == "hash" else (
            req.keys[0] if req.keys else None)
        if key is None:
            out.append(rr % nodes)
            rr += 1
        else:
            out.append(_node_of_key(key, nodes))
    return out


# ---- the replay ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodesConfig:
    """N nodes of ``node`` each; the remote tier's capacity (None: unbounded) for the global run."""

    nodes: int
    node: ReplayConfig
    remote_blocks: int | None
    assign: tuple[str, ...] = (DEFAULT_ASSIGN,)
    write_through: bool = False  # also replay the write-through what-if (run_nodes)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.remote_blocks is not None and self.remote_blocks < 0:
            raise ValueError(f"remote_blocks must be >= 0, got {self.remote_blocks}")
        if not self.assign:
            raise ValueError("no assignment rule given")
        for rule in self.assign:
            if rule not in ASSIGN_RULES:
                raise ValueError(f"unknown assignment {rule!r} (choose from {', '.join(ASSIGN_RULES)})")


_TIERS = ("gpu", "cpu", "remote", "total")


def _summary(stats: Sequence[dict[str, Any]], requests: Sequence[int], input_tokens: Sequence[int],
             block_size: int) -> dict[str, Any]:
    """Counters summed over nodes, rates, and a compact per-node breakdown."""
    tot: dict[str, int] = Counter()
    for s in stats:
        for name in ("looked_up_blocks", "hit_blocks_gpu", "hit_blocks_cpu", "hit_blocks_remote", "miss_blocks",
                     "demotions", "demotions_not_admitted", "restores", "cpu_evictions", "remote_write_backs"):
            tot[name] += s[name]
    hits = {t: tot["hit_blocks_" + t] for t in _TIERS[:3]}
    hits["total"] = sum(hits.values())
    looked_up, tokens = tot["looked_up_blocks"], sum(input_tokens)
    # Every looked-up block is a hit in exactly one tier or a miss: the pool's counting, checked.
    assert hits["total"] + tot["miss_blocks"] == looked_up, (hits, tot)
    per_node = []
    for s, n_req, n_tok in zip(stats, requests, input_tokens):
        h = s["hit_blocks_gpu"] + s["hit_blocks_cpu"] + s["hit_blocks_remote"]
        per_node.append({
            "requests": n_req,
            "input_tokens": n_tok,
            "looked_up_blocks": s["looked_up_blocks"],
            "hit_blocks": {"gpu": s["hit_blocks_gpu"], "cpu": s["hit_blocks_cpu"],
                           "remote": s["hit_blocks_remote"], "total": h},
            "block_hit_rate": h / s["looked_up_blocks"] if s["looked_up_blocks"] else 0.0,
        })
    return {
        "requests": sum(requests),
        "input_tokens": tokens,
        "looked_up_blocks": looked_up,
        "hit_blocks": hits,
        "miss_blocks": tot["miss_blocks"],
        "block_hit_rate": {t: hits[t] / looked_up if looked_up else 0.0 for t in _TIERS},
        "token_hit_rate": {t: hits[t] * block_size / tokens if tokens else 0.0 for t in _TIERS},
        "demotions": tot["demotions"],
        "demotions_not_admitted": tot["demotions_not_admitted"],
        "restores": tot["restores"],
        "cpu_evictions": tot["cpu_evictions"],
        "remote_write_backs": tot["remote_write_backs"],
        "per_node": per_node,
    }


def run_nodes(requests: Sequence[Request], node: ReplayConfig, assignment: Sequence[int], nodes: int, *,
              remote: SimulatedRemoteTier | None = None, write_through: bool = False,
              progress: Any = None) -> dict[str, Any]:
    """Replay ``requests`` on ``nodes`` bookkeeping pools, request i on node ``assignment[i]``.

    Every pool has ``node``'s capacities and policy and, when given, the shared
    ``remote`` tier. ``write_through`` (a what-if the pool does not
    implement): after each request, the blocks it computed (its misses that
    were allocated) are also written to the remote tier at once, not only
    when a CPU tier evicts them. Returns ``_summary``'s dict (plus
    ``remote``: its stats).
    ``progress``: an object with ``update(n)``, called once per request, or None.
    """
    from kvtier.tiers.pool import PoolSpec, TieredPool

    if len(assignment) != len(requests):
        raise ValueError(f"{len(assignment)} node numbers for {len(requests)} requests")
    pools = []
    for i in range(nodes):
        pool = TieredPool(PoolSpec("replay", node.block_size, node.block_bytes), cpu_blocks=node.cpu_blocks,
                          policy=node.policy, transfer=None, data=False, clean_ahead_blocks=0, remote=remote)
        pool.attach_gpu(num_blocks=node.gpu_blocks)
        pools.append(pool)
    n_requests = [0] * nodes
    n_tokens = [0] * nodes
    g, bs = node.gpu_blocks, node.block_size
    rid = "r"  # one request at a time: the id can be reused once freed
    for req, i in zip(requests, assignment):
        pool = pools[i]
        n_requests[i] += 1
        n_tokens[i] += req.input_length
        keys = req.keys
        n = len(keys)
        # The single-node replay's step (replay.replay, accounting 4 and 5).
        if n <= g:
            op = pool.allocate(rid, keys, n * bs, count=True)
        else:
            pool.lookup(keys, count=True)
            op = pool.allocate(rid, keys[:g], g * bs, count=False)
        pool.free(rid)
        if write_through and remote is not None:
            for key in keys[len(op.result["tiers"]) : g]:
                remote.write_back(key, None)
        if progress is not None:
            progress.update(1)
    out = _summary([p.stats() for p in pools], n_requests, n_tokens, bs)
    out["truncated_requests"] = sum(1 for r in requests if len(r.keys) > g)
    if remote is not None:
        out["remote"] = remote.stats()
    return out


def compare(requests: Sequence[Request], config: NodesConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """Local, global and one-global-cache runs (module docstring) for each assignment rule, plus bounds."""
    from kvtier.tools.belady import infinite_cache

    t0 = time.perf_counter()
    n, node = config.nodes, config.node
    runs = (3 if config.write_through else 2) * len(config.assign) + 1
    bar = progress_bar(len(requests) * runs, "replay", progress)
    try:
        hot = hot_keys(requests, n)
        by_rule: dict[str, Any] = {}
        for rule in config.assign:
            assignment = assign_nodes(requests, n, rule, hot if rule == "hash" else None)
            local = run_nodes(requests, node, assignment, n, progress=bar)
            remote = SimulatedRemoteTier(config.remote_blocks)
            glob = run_nodes(requests, node, assignment, n, remote=remote, progress=bar)
            per_node = Counter(assignment)
            by_rule[rule] = {
                "requests_per_node": {"min": min(per_node.get(i, 0) for i in range(n)),
                                      "max": max(per_node.values(), default=0)},
                "local": local,
                "global": glob,
            }
            if config.write_through:
                by_rule[rule]["global_write_through"] = run_nodes(
                    requests, node, assignment, n, remote=SimulatedRemoteTier(config.remote_blocks),
                    write_through=True, progress=bar)
        one = replace(node, gpu_blocks=node.gpu_blocks * n, cpu_blocks=node.cpu_blocks * n)
        single = run_nodes(requests, one, [0] * len(requests), 1, progress=bar)
        del single["per_node"]
    finally:
        bar.close()
    bs = node.block_size
    return {
        "nodes": n,
        "node": asdict(node),
        "remote_blocks": config.remote_blocks,
        "remote_tokens": None if config.remote_blocks is None else config.remote_blocks * bs,
        "hot_blocks": len(hot),
        "write_through": config.write_through,
        "assign": by_rule,
        "one_global_cache": {"config": asdict(one), **single},
        "infinite": infinite_cache(requests, bs).to_dict(),
        "mooncake_reference": MOONCAKE_REFERENCE,
        "seconds": round(time.perf_counter() - t0, 3),
        "accounting": ACCOUNTING + NODES_ACCOUNTING,
    }
