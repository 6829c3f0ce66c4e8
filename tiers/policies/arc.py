"""The ``"arc"`` eviction policy.

``"arc"`` -- ``ARCPolicy``
    Adaptive Replacement Cache, N. Megiddo and D. S. Modha, "ARC: A
    Self-Tuning, Low Overhead Replacement Cache", USENIX FAST 2003.
    Resident lists T1 (seen once recently) and T2 (seen at least twice), ghost
    lists B1/B2 of keys recently evicted from T1/T2, and a target size ``p``
    for T1 that ghost hits move: a re-inserted B1 ghost raises ``p`` (recency
    was under-provisioned), a B2 ghost lowers it. ``victims()`` applies the
    paper's REPLACE rule (T1's LRU end if ``len(T1) > p``, else T2's) over
    and over, counting T1 down as it yields from it, until both lists are
    spent. ``on_remove`` of a resident key always moves it to its ghost list:
    the tier calls it for evictions and explicit drops alike, and a dropped
    key that comes back is still a useful signal.
    Bounds as in the paper: ``|T1|+|B1| <= c`` and ``|T1|+|T2|+|B1|+|B2| <= 2c``.
    Differences from the paper: ``p`` is adapted in ``on_insert``, after the
    tier already chose its victim, so adaptation lags one eviction; REPLACE's
    tie case (``|T1| == p`` and the incoming key is in B2) is ignored because
    ``victims()`` does not know the incoming key.
    Cost: O(1) per ``on_insert``/``on_hit``/``on_remove`` (OrderedDicts);
    ``victims()`` is O(k) to the k-th key.

The notes every policy of this package shares (how the tier's calls map onto
the classic algorithms) are in ``kvtier.tiers.policies``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.tiers.policies.base import EvictionPolicy


__all__ = ["ARCPolicy"]


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03). See the module docstring."""

    name = "arc"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        # Every list is ordered LRU first, MRU last.
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p: float = 0.0

    @property
    def p(self) -> float:
        """ARC's current target size for T1, in [0, capacity]."""
        return self._p

    @property
    def ghosts(self) -> int:
        """Number of ghost keys held (|B1| + |B2|)."""
        return len(self._b1) + len(self._b2)

    def on_insert(self, key: bytes) -> None:
        if key in self._t1 or key in self._t2:
            self.on_hit(key)
            return
        c = self.capacity_blocks
        if key in self._b1:
            # A recency ghost came back: T1 was too small. The step is larger
            # when B1 is the smaller ghost list, i.e. the rarer signal.
            delta = 1.0 if len(self._b1) >= len(self._b2) else len(self._b2) / len(self._b1)
            self._p = min(self._p + delta, float(c))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            delta = 1.0 if len(self._b2) >= len(self._b1) else len(self._b1) / len(self._b2)
            self._p = max(self._p - delta, 0.0)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def on_hit(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def victims(self) -> Iterator[bytes]:
        return self._replace_order(self._p)

    def _replace_order(self, p: float) -> Iterator[bytes]:
        # Successive REPLACEs: shrink T1 while it is above its target. p does
        # not move on eviction, only T1's length does. Falling back to T1
        # when T2 is spent covers p == c (the paper would pick an empty T2).
        t1, t2 = iter(self._t1), iter(self._t2)
        n1, n2 = len(self._t1), len(self._t2)
        while n1 or n2:
            if n1 and (n1 > p or not n2):
                n1 -= 1
                yield next(t1)
            else:
                n2 -= 1
                yield next(t2)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def remembered_keys(self) -> int:
        return len(self) + self.ghosts

    def _trim_ghosts(self) -> None:
        # Ghosts only ever shrink to restore the paper's bounds; resident keys
        # are the tier's to evict, so if residents alone break a bound (a tier
        # holding more than capacity_blocks) the ghosts just run empty.
        c = self.capacity_blocks
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        resident = len(self._t1) + len(self._t2)
        while (self._b1 or self._b2) and resident + len(self._b1) + len(self._b2) > 2 * c:
            # B2 first: the paper drops B2's LRU when the directory is full.
            (self._b2 if self._b2 else self._b1).popitem(last=False)
