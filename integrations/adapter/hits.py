"""Which prefix of a request kvtierd can serve, in every KV-cache group (vLLM's rules for a hit).

Contract
========

``find_hits(call, groups, queries) -> list[Hit]`` runs on an adapter's
background thread, for a batch of requests whose lookups were queued
together (vLLM's: ``kvtier.integrations.vllm.scheduler``). It looks up and pins, in kvtierd, the
blocks each request's hit needs, and returns per query:

- ``Hit.blocks``: the longest hit ``n`` (blocks from block 0, at most the
  query's ``max_blocks``) for which kvtierd holds, in every group ``g``,
  blocks ``[g.first_needed_block(n), n)``: vLLM's own rule for a hit in its
  prefix cache (``HybridKVCacheCoordinator.find_longest_cache_hit``).
  Full-attention groups need the whole prefix, so their held prefix bounds
  ``n``; a sliding-window group needs only the blocks of the window at
  ``n``, so only those are asked for, pinned, and later loaded.
- ``Hit.pinned``: every key kvtierd pinned for it (under the query's tag),
  in all groups; ``Hit.tiers``: the tier of each block ``[0, n)`` of the
  first full-attention group (empty for an engine without one).
- ``Hit.lost``: a round's answers did not come back (a timeout, a restart):
  kvtierd may hold pins of the query's tag that ``pinned`` does not list.
- ``Hit.refusals``: errors kvtierd answered for the query's lookups (the
  query's hit is 0 then).

Rounds, each one pipelined batch (``Client.lookup_many``) for all queries:
(1) the full-attention groups' prefixes; (2) the windows at the candidate
hit, the shortest full-group prefix; (3) only for a query whose window at
(2) missed a block: the windows at the hit that ends at that block, once.
A query still missing a block has no hit. An engine of one full-attention
group runs round 1 only: one lookup per request, as before groups.

``call`` is ``DaemonLink.call``: ``None`` when kvtierd cannot answer. Never
raises for kvtierd's failures; a lost round is a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.client.client import Client
from kvtier.client.protocol import Hints, KvtierError
from kvtier.integrations.adapter.groups import KvGroup

T = TypeVar("T")
Call = Callable[[Callable[[Client], T]], "T | None"]


@dataclass(slots=True)
class HitQuery:
    keys: Callable[[bytes, int], list[bytes]]  # (group domain, n) -> the group's keys of blocks [0, n)
    max_blocks: int
    hints: Hints | None
    tag: str


@dataclass(slots=True)
class Hit:
    blocks: int = 0
    pinned: list[bytes] = field(default_factory=list)
    tiers: Sequence[str] = ()
    lost: bool = False
    refusals: list[KvtierError] = field(default_factory=list)


@dataclass(slots=True)
class _Ask:
    query: int  # index into the queries
    keys: list[bytes]


def find_hits(call: Call[Any], groups: Sequence[KvGroup], queries: Sequence[HitQuery]) -> list[Hit]:
    """The hits of ``queries`` (see the contract)."""
    hits = [Hit() for _ in queries]
    prefix_groups = [g for g in groups if not g.is_window]
    window_groups = [g for g in groups if g.is_window]
    # (1) Full attention: the held prefix of each group; the shortest bounds the hit.
    candidate = [q.max_blocks for q in queries]
    if prefix_groups:
        asks = [_Ask(i, q.keys(g.domain, q.max_blocks)) for i, q in enumerate(queries) for g in prefix_groups
                if q.max_blocks > 0]
        held = _round(call, queries, asks, hits)
        candidate = [0] * len(queries)
        per_query: dict[int, list[int]] = {}
        for ask, tiers in zip(asks, held):
            per_query.setdefault(ask.query, []).append(len(tiers))
            if ask.keys and len(per_query[ask.query]) == 1:
                hits[ask.query].tiers = tiers  # the first full group's: the hit's tiers
        for i, counts in per_query.items():
            candidate[i] = min(counts)
    # (2), (3) Sliding windows: the window at the candidate, and once more at a shorter one.
    todo = [i for i in range(len(queries)) if candidate[i] > 0] if window_groups else []
    for _ in range(2):
        if not todo:
            break
        asks = []
        for i in todo:
            n = candidate[i]
            asks += [_Ask(i, queries[i].keys(g.domain, n)[g.first_needed_block(n):n]) for g in window_groups]
        held = _round(call, queries, asks, hits)
        retry: dict[int, int] = {}
        for ask, tiers, g in zip(asks, held, [g for _ in todo for g in window_groups]):
            if len(tiers) < len(ask.keys):
                # The hit may end at the first block missing, at most.
                end = g.first_needed_block(candidate[ask.query]) + len(tiers)
                retry[ask.query] = min(retry.get(ask.query, end), end)
        for i, end in retry.items():
            candidate[i] = end if end < candidate[i] else 0
        todo = [i for i in retry if candidate[i] > 0]
    for i in todo:
        candidate[i] = 0  # still missing a window block after the second try
    for i, hit in enumerate(hits):
        hit.blocks = 0 if hit.refusals or hit.lost else candidate[i]
        hit.tiers = list(hit.tiers[:hit.blocks])
    return hits


def _round(call: Call[Any], queries: Sequence[HitQuery], asks: list[_Ask], hits: list[Hit]) -> list[Sequence[str]]:
    """One pipelined batch of pinned lookups: the tiers held of each ask (empty where it failed)."""
    if not asks:
        return []
    keys = [a.keys for a in asks]
    hints = [queries[a.query].hints for a in asks]
    tags = [queries[a.query].tag for a in asks]
    answers = call(lambda c: c.lookup_many(keys, pin=True, hints=hints, pin_tags=tags))
    out: list[Sequence[str]] = []
    for j, ask in enumerate(asks):
        hit = hits[ask.query]
        answer = answers[j] if answers is not None else None
        if answer is None:
            hit.lost = True
            out.append(())
        elif isinstance(answer, KvtierError):
            hit.refusals.append(answer)
            out.append(())
        else:
            hit.pinned += ask.keys[:len(answer)]
            out.append(answer)
    return out
