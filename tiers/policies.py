"""Eviction policies beyond LRU (ARC, S3-FIFO) and admission wrappers; registered on import.

All of them follow the ``EvictionPolicy`` contract of ``kvtier.tiers.eviction``:
the tier, not the policy, decides *when* to evict. It asks ``victims()`` for
resident keys best-victim-first, takes the first ones it may evict (not
pinned, no copy in flight; the CPU tier takes a whole batch from one walk)
and then calls ``on_remove`` for them, followed by ``on_insert`` for the
newcomers. The classic algorithms below are written as "on a miss, evict then
insert"; here that single step is split across those calls, and the
differences that follow are listed with each policy.

Both ``victims()`` below yield, in order, exactly the keys that as many
successive evictions would take (``victims()``, evict the first, repeat) as
long as nothing is skipped, so a batch eviction is the algorithm's own
sequence. A skipped (pinned) key is treated as if it had gone, which keeps
the rest of the order sensible without the policy knowing about pins.

Re-inserting a key that is already resident counts as a use (``on_hit``),
as it does for ``LRUPolicy``. ``on_hit``/``on_remove`` of a key that is not
resident are no-ops.

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

``"<policy>+admit2"`` -- ``AdmissionWrapper``
    Second-sighting admission (the "doorkeeper" idea of TinyLFU, G. Einziger,
    R. Friedman, B. Manes, "TinyLFU: A Highly Efficient Cache Admission
    Policy", ACM ToS 2017, and the "cache on second hit" rule of CDNs, B. M.
    Maggs and R. K. Sitaraman, "Algorithmic Nuggets in Content Delivery", ACM
    SIGCOMM CCR 2015): a key is cached only once it has been seen before, so blocks of
    one-off prompts never displace reused ones. The rule is spelled out on
    the class. The seen-set is a bounded LRU of keys. Everything but
    ``admit`` and ``record_request`` (and its resumable form
    ``record_request_steps``) is delegated to the wrapped policy.
    Cost: O(len(keys)) per ``record_request``, O(1) per ``admit``, plus the
    wrapped policy's costs.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier.tiers.eviction import EvictionPolicy, register_policy, register_wrapper

__all__ = ["ARCPolicy", "S3FIFOPolicy", "AdmissionWrapper"]


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


@dataclass(slots=True)
class _Sighting:
    """What the admission filter remembers about one key."""

    # Distinct requests (record_request calls) that looked the key up.
    requests: int = 0
    # An admit() was rejected while no request had looked the key up: a
    # sighting that no lookup accounts for (e.g. an engine storing blocks
    # it never looked up).
    rejected_unrequested: bool = False


class AdmissionWrapper(EvictionPolicy):
    """Admit a key on its second sighting ("admit2").

    Rule: ``admit(key)`` is True iff, counting only sightings *before* the one
    that produced the block being admitted, the key was seen at least once:

    - at least two distinct requests looked it up (``record_request``): the
      latest lookup is the request that computed the block, the one before it
      is the earlier sighting; or
    - an earlier ``admit(key)`` was rejected while no request had yet looked
      it up. That rejection is itself a sighting (a store no lookup explains),
      so the next ``admit`` of a never-looked-up key passes, and so does the
      next after one lookup.

    A rejection after a lookup adds nothing: it is the same request's block,
    and counting it would let every key in on its first request. A key is
    counted once per ``record_request`` call however often it repeats in it.

    The seen-set is an LRU of at most ``seen_bound`` keys (default
    ``max(4 * capacity, 1024)``); a key that falls out of it starts over. If
    this rule admits, the wrapped policy's ``admit`` has the last word.
    """

    name = "admit2"

    def __init__(self, inner: EvictionPolicy, seen_bound: int | None = None) -> None:
        super().__init__(inner.capacity_blocks)
        if seen_bound is None:
            seen_bound = max(4 * inner.capacity_blocks, 1024)
        if seen_bound < 1:
            raise ValueError(f"seen_bound must be >= 1, got {seen_bound}")
        self.inner = inner
        self.seen_bound = seen_bound
        self._seen: OrderedDict[bytes, _Sighting] = OrderedDict()

    @property
    def tracked(self) -> int:
        """Number of keys in the seen-set."""
        return len(self._seen)

    def admit(self, key: bytes) -> bool:
        sighting = self._touch(key)
        if sighting.requests >= 2 or sighting.rejected_unrequested:
            return self.inner.admit(key)
        if sighting.requests == 0:
            sighting.rejected_unrequested = True
        return False

    def record_request(self, keys: Sequence[bytes]) -> None:
        self._count_request(keys)
        self.inner.record_request(keys)

    def record_request_steps(self, keys: Sequence[bytes], chunk_keys: int = 64) -> Iterator[None]:
        # The seen-set is counted in the first step (cheap next to the wrapped policy's work),
        # then the wrapped policy records in its own steps.
        self._count_request(keys)
        yield from self.inner.record_request_steps(keys, chunk_keys)

    def _count_request(self, keys: Sequence[bytes]) -> None:
        for key in dict.fromkeys(keys):
            self._touch(key).requests += 1

    def on_insert(self, key: bytes) -> None:
        self.inner.on_insert(key)

    def on_hit(self, key: bytes) -> None:
        self.inner.on_hit(key)

    def on_remove(self, key: bytes) -> None:
        self.inner.on_remove(key)

    def victims(self) -> Iterator[bytes]:
        return self.inner.victims()

    def __len__(self) -> int:
        return len(self.inner)

    def _touch(self, key: bytes) -> _Sighting:
        sighting = self._seen.get(key)
        if sighting is None:
            sighting = self._seen[key] = _Sighting()
            # The new record sits at the MRU end, so trimming never drops it.
            while len(self._seen) > self.seen_bound:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(key)
        return sighting


register_policy("arc", ARCPolicy)
register_policy("s3fifo", S3FIFOPolicy)
register_wrapper("admit2", AdmissionWrapper)
