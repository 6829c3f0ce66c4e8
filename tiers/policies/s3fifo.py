"""The ``"s3fifo"`` eviction policy.

``"s3fifo"`` -- ``S3FIFOPolicy``
    S3-FIFO, J. Yang, Y. Zhang, Z. Qiu, Y. Yue, K. V. Rashmi, "FIFO queues are
    all you need for cache eviction", ACM SOSP 2023. A small FIFO S (10% of
    the capacity) filters one-hit wonders, a main FIFO M holds the rest, and a
    ghost FIFO G (as many keys as M's share) remembers keys evicted from S.
    Each resident key has a 2-bit use counter (capped at 3). New keys enter S,
    keys found in G enter M. Eviction takes from S while S holds at least its
    share (S's head moves to M if it was used since insertion), else from M
    (M's head goes back to M's tail with its counter decremented if it is
    non-zero). ``victims()`` does those moves for the first victim eagerly,
    before it yields anything, and replays the algorithm on a lazy scratch
    copy for the following ones, so the iterator never changes state.
    Differences from the paper: each eviction is one step (the tier's), and
    the choice between S and M is re-made after every promotion
    (the paper's evictS keeps draining S in the same call, and may evict
    from M as a side effect of promoting into a full M); any key leaving S
    goes to G, used or not, since a key that left S still used is the very
    kind G exists to let back into M.
    Cost: amortized O(1) per operation -- each promotion is paid for by the
    insertion that put the key in S, each M reinsertion by the hit that raised
    its counter. ``victims()`` is O(1) to the first key after settling; later
    keys cost what the replay does, which is the same bound but not
    remembered between calls: if the tier keeps skipping a pinned head while
    M is all hot, each walk past it redoes up to one lap of M per counter
    unit (O(n)), as LRU redoes its walk past pinned keys.

The notes every policy of this package shares (how the tier's calls map onto
the classic algorithms) are in ``kvtier.tiers.policies``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from kvtier.tiers.policies.base import EvictionPolicy


__all__ = ["S3FIFOPolicy"]


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23). See the module docstring.

    ``small_ratio`` is S's share of the capacity; ``move_to_main_threshold``
    is the use count (since insertion) at which S's head is promoted to M
    rather than evicted.
    """

    name = "s3fifo"
    MAX_FREQ = 3

    def __init__(self, capacity_blocks: int, small_ratio: float = 0.1, move_to_main_threshold: int = 1) -> None:
        super().__init__(capacity_blocks)
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        if not 1 <= move_to_main_threshold <= self.MAX_FREQ:
            raise ValueError(f"move_to_main_threshold must be in [1, {self.MAX_FREQ}], got {move_to_main_threshold}")
        # At least one slot for S whenever there is any capacity, or a tiny
        # cache would send every newcomer straight to M's queue.
        self.small_target = max(1, round(capacity_blocks * small_ratio)) if capacity_blocks > 0 else 0
        self.ghost_capacity = capacity_blocks - self.small_target
        self._threshold = move_to_main_threshold
        # Queues map key -> use counter, oldest (head) first.
        self._small: OrderedDict[bytes, int] = OrderedDict()
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()

    @property
    def ghosts(self) -> int:
        """Number of ghost keys held (|G|)."""
        return len(self._ghost)

    def freq(self, key: bytes) -> int | None:
        """The use counter of a resident key, None if not resident."""
        if key in self._small:
            return self._small[key]
        return self._main.get(key)

    def on_insert(self, key: bytes) -> None:
        if key in self._small or key in self._main:
            self.on_hit(key)
        elif key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def on_hit(self, key: bytes) -> None:
        if key in self._small:
            self._small[key] = min(self._small[key] + 1, self.MAX_FREQ)
        elif key in self._main:
            self._main[key] = min(self._main[key] + 1, self.MAX_FREQ)

    def on_remove(self, key: bytes) -> None:
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None
            while len(self._ghost) > self.ghost_capacity:
                self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)

    def victims(self) -> Iterator[bytes]:
        # Settle now, not inside the generator: the tier may stop iterating
        # anywhere, and state must be final before it calls on_remove.
        self._settle()
        return self._replay()

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def remembered_keys(self) -> int:
        return len(self) + self.ghosts

    def _settle(self) -> None:
        """Run S3-FIFO's promotions until a queue head is a true victim.

        Idempotent once settled: a second call without intervening changes
        does no work.
        """
        small, main = self._small, self._main
        while True:
            if small and (len(small) >= self.small_target or not main):
                key, freq = next(iter(small.items()))
                if freq < self._threshold:
                    return
                # Promotion keeps the counter (as in the paper's listing), so
                # a hot key also gets its extra laps around M.
                del small[key]
                main[key] = freq
                continue
            if not main:
                return
            key, freq = next(iter(main.items()))
            if freq == 0:
                return
            del main[key]
            main[key] = freq - 1

    def _replay(self) -> Iterator[bytes]:
        # The same loop as _settle, yielding each victim as if evicted, on a
        # scratch M made of the real M's items (read in order, never written)
        # followed by a local tail for what would be appended. S is only
        # ever popped at its head, so reading it in order is enough. The
        # choice between S and M depends on sizes only, tracked here.
        small_items, small_left = iter(self._small.items()), len(self._small)
        main_items, main_real_left = iter(self._main.items()), len(self._main)
        main_tail: deque[tuple[bytes, int]] = deque()
        while small_left or main_real_left or main_tail:
            main_left = main_real_left + len(main_tail)
            if small_left and (small_left >= self.small_target or not main_left):
                key, freq = next(small_items)
                small_left -= 1
                if freq >= self._threshold:
                    main_tail.append((key, freq))
                    continue
                yield key
                continue
            if main_real_left:
                key, freq = next(main_items)
                main_real_left -= 1
            else:
                key, freq = main_tail.popleft()
            if freq:
                main_tail.append((key, freq - 1))
                continue
            yield key
