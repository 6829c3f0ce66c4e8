"""Offline bounds on a trace's block hit rate: the infinite cache and Belady's MIN.

Both use the replay's hit accounting (``kvtier.tools.replay``): requests are
taken one at a time in trace order; a request's full blocks hit in order until
the first block the cache does not hold (prefix-stop); the rest are misses.

- **Infinite cache**: every block seen in an earlier request is held. A block
  hits iff it and every block before it in the request were seen before. No
  capacity, no policy can do better.
- **Belady** (MIN, with bypass): ONE cache of ``capacity`` blocks (for a
  two-tier configuration: GPU + CPU blocks together) that knows the future.
  After a request's lookup, each of its blocks, first to last, is given the
  priority (index of the next request that contains it, its position in the
  request); a block no later request contains gets "never". A block not yet
  held is inserted if there is a free slot, or if some held block has a
  larger priority (that one is evicted); otherwise it is not cached
  (bypass). The position breaks ties in favour of a chain's head: every
  request that contains a block contains all the blocks before it, so a
  parent's next use is never later than its child's, and the held set stays
  prefix-closed -- no capacity is spent on a block whose parent is gone.
  This is Belady's MIN applied block by block. With prefix-stop hits it is
  a strong offline reference, not a proof of optimality (an optimal policy
  could, say, trade one long chain for several short ones by request-level
  value); no online policy in this repository beats it.

Cost: infinite O(blocks); Belady O(blocks · log capacity) with a lazy heap.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BoundResult", "infinite_cache", "belady", "next_uses"]


@dataclass(slots=True)
class BoundResult:
    name: str
    capacity_blocks: int | None  # None: infinite
    looked_up_blocks: int
    hit_blocks: int
    input_tokens: int
    block_size: int

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.looked_up_blocks if self.looked_up_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_blocks * self.block_size / self.input_tokens if self.input_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "capacity_blocks": self.capacity_blocks,
            "looked_up_blocks": self.looked_up_blocks,
            "hit_blocks": self.hit_blocks,
            "block_hit_rate": self.block_hit_rate,
            "token_hit_rate": self.token_hit_rate,
        }


def _keys(requests: Sequence[Any]) -> list[Sequence[Hashable]]:
    return [r.keys for r in requests]


def infinite_cache(requests: Sequence[Any], block_size: int = 512) -> BoundResult:
    """Hit rate of a cache that never forgets (prefix-stop accounting)."""
    seen: set[Hashable] = set()
    hits = looked = tokens = 0
    for req in requests:
        keys = req.keys
        looked += len(keys)
        tokens += req.input_length
        k = 0
        for key in keys:
            if key not in seen:
                break
            k += 1
        hits += k
        seen.update(keys[k:])
    return BoundResult("infinite", None, looked, hits, tokens, block_size)


def next_uses(requests: Sequence[Any]) -> list[list[int]]:
    """``out[i][j]``: index of the next request after ``i`` holding request i's block j, or ``len(requests)``."""
    never = len(requests)
    last: dict[Hashable, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        keys = requests[i].keys
        out[i] = [last.get(key, never) for key in keys]
        for key in keys:
            last[key] = i
    return out


def belady(requests: Sequence[Any], capacity_blocks: int, block_size: int = 512,
           nxt: list[list[int]] | None = None) -> BoundResult:
    """Belady's MIN with bypass for one cache of ``capacity_blocks`` (see the module docstring)."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    if nxt is None:
        nxt = next_uses(requests)
    held: dict[Hashable, tuple[int, int]] = {}  # key -> its current priority (next use, position)
    heap: list[tuple[int, int, int, Hashable]] = []  # (-next, -pos, tiebreak, key): max priority first
    seq = 0
    hits = looked = tokens = 0
    for i, req in enumerate(requests):
        keys = req.keys
        looked += len(keys)
        tokens += req.input_length
        k = 0
        for key in keys:
            if key not in held:
                break
            k += 1
        hits += k
        if capacity_blocks == 0:
            continue
        for pos, key in enumerate(keys):
            prio = (nxt[i][pos], pos)
            if key in held:
                held[key] = prio
            else:
                while len(held) >= capacity_blocks:
                    neg_next, neg_pos, _, victim = heap[0]
                    if held.get(victim) != (-neg_next, -neg_pos):
                        heapq.heappop(heap)  # stale entry
                        continue
                    if (-neg_next, -neg_pos) <= prio:
                        break  # every held block is needed sooner: bypass
                    heapq.heappop(heap)
                    del held[victim]
                if len(held) >= capacity_blocks:
                    continue
                held[key] = prio
            seq += 1
            heapq.heappush(heap, (-prio[0], -prio[1], seq, key))
        if len(heap) > 4 * capacity_blocks + 1024:
            heap = [(-p[0], -p[1], n, key) for n, (key, p) in enumerate(held.items())]
            heapq.heapify(heap)
            seq = len(heap)
    return BoundResult("belady", capacity_blocks, looked, hits, tokens, block_size)
