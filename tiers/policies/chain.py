"""A chain-aware, self-tuning CPU-tier policy: ``"chain"`` (hit density learned from every request).

Idea
----
A KV block is worth keeping in proportion to its *hit density*: the hits it
is expected to bring per unit of cache space-time from now on. The hit
density of a block depends on what kind of block it is and on how long ago it
was last used, and on LLM traffic that dependence is strong and not monotone:
in a multi-turn conversation the next turn comes only after the model has
answered and the user has read and typed, so a block just used is almost
never reused in the next few seconds, then is likely to be reused for a few
minutes, then is probably dead. LRU ranks by recency alone and so keeps
exactly the blocks that cannot be reused yet, and lets go of those whose
turn is coming.

This policy learns, online, for each *class* of block, the distribution of
the time until a block of that class is used again (the "gap"), and ranks
resident blocks by the hit density that distribution gives at the block's
current age. It is LHD's ranking (N. Beckmann, H. Chen, A. Cidon, "LHD:
Improving Cache Hit Rate by Maximizing Hit Density", NSDI 2018) with one
difference that matters: ``learn`` shows the policy every block
every request asks for, resident or not, so the gap distributions are
learned from the whole request stream, not only from what the cache happened
to keep (a cache learning from its own hits cannot learn that a block it
always evicts at age 300 would have been reused at age 400).

Classes use what the prefix chains tell about a block when it is used:

- ``turns``: how many requests the chain has served so far -- the largest use
  count among the request's blocks that are not shared hubs (a hub is a block
  seen with two different successors, e.g. a system prompt many
  conversations start with). A conversation at its 5th turn is more likely to
  have a 6th than a one-off prompt is to get a second. Bucketed 1..5+.
- ``uses``: how many requests used this block (1..4+).
- ``new``: how many blocks the request added to the chain (log2 buckets):
  a small addition to a chain is a conversational turn, a large fresh
  document is often read once.

Time is counted in requests (``learn`` calls), not seconds.

Ranking. For a class with gap histogram ``h[b]`` (gaps in bucket ``b`` of
``bucket_width`` requests, up to ``horizon`` requests) and ``g`` uses not
followed by a reuse within the horizon, a block of age bucket ``a`` that is
held until it is reused or reaches the horizon brings ``H(a) = sum_{b>=a}
h[b]`` hits and occupies ``L(a) = sum_{b>=a} h[b]·(b-a+½) + g·(B-a)`` bucket
units of space-time, both per block of that class that is still unused at
age ``a``. Its hit density is ``H(a)/L(a)``. ``victims()`` yields resident
blocks lowest density first; among equal densities, older first, and within
one request's blocks the deepest first, so a chain loses its tail before its
head (prefix-stop hits make a block worthless without its ancestors).

Admission. When the tier is full, a demoted block is admitted only if its
hit density is at least that of the blocks being evicted (an EWMA of the
densities of recent victims): caching it would only push out something
better. This is Belady's bypass, estimated. It also saves the device-to-host
copy.

Learning. Each use of a block is remembered (time, class) until the block is
used again (its gap goes into its class's histogram) or ``horizon`` requests
pass (it counts as not reused). Uses still pending are censored
observations: the gap distribution is the Kaplan-Meier estimate, so a class
is not judged only by the uses that have already come back. Outcomes are
kept per epoch of ``horizon`` requests of birth, and the last ``epochs``
epochs are used, so the policy follows a changing workload. A class with
fewer than ``min_samples`` observations borrows the pooled statistics of all
classes. Densities are re-estimated every ``bucket_width`` requests (until
the first estimate every block ranks the same, so the order is oldest
first: FIFO).

Assumptions: ``learn`` is called once per request (the pool calls it for a
counted lookup or allocation); a second call for the same request would read
as a reuse after zero requests (follow-ups, ``request.counted`` False, are
not requests: ignored). Hub detection needs the keys of a
request in chain order, as the pool passes them.

Measured (``kvtier replay``, GPU 195 / CPU 5,859 blocks of 512 tokens): block
hit rate 0.187 on the Mooncake conversation trace (LRU 0.151, LRU+admit2
0.184, Belady 0.371) and 0.347 on the synthetic one (LRU 0.327, LRU+admit2
0.338, Belady 0.572). The features above carry little information about
which blocks come back (an offline fit of the same classes to the whole
trace, i.e. knowing the future statistics, reaches 0.204 on conversation),
so the gap to Belady is mostly unpredictability, not tuning.

Cost: ``learn`` O(len(keys)), about 0.5 µs per key measured (the
counts are buffered and folded into the statistics with numpy at each
re-estimate), in steps of ``chunk_keys`` keys. ``on_insert``/``on_remove``/``admit`` O(1);
``victims()`` walks a cached order of groups (one group per class and
``bucket_width`` window of last use), re-sorted every ``bucket_width``
requests (O(G log G), G <= classes × horizon/bucket_width).

Memory: metadata for each resident block and for each block used within
the last ``horizon`` requests, but for at most ``history_keys`` of the
latter (default ``max(HISTORY_KEYS_PER_BLOCK × capacity, MIN_HISTORY_KEYS)``:
64 per CPU-tier block, at least 4,096; about 280 bytes each), whatever the
traffic: a flood of never-seen keys (lookups of blocks nobody stores) cannot
grow it past the pool's share. Past the bound the oldest uses are forgotten
first (within one request, the deepest first), as if their horizon had
passed, except that they count as censored, not as "not reused": their
pending counts are withdrawn without an outcome. A forgotten block that
comes back is a new sighting. One request's own keys are held while it is
recorded, however many (up to the protocol's limit per request), and
trimmed after. The per-request use lists hold each use once (8 bytes);
uses made stale by a later use of the same block are compacted away once
they outnumber the live ones plus the bound, and the buffered counts are
folded into the arrays past ``FOLD_KEYS`` of them. ``stats().remembered_keys`` is
the number of blocks with metadata.

The bound changes no decision on the shared traces at the sizes above: the
peak of blocks used within the horizon is 69,120 on the conversation trace
(11.8 per CPU-tier block at 5,859 blocks), 40,147 on the synthetic one and
84,968 on Claude Code's (10.9 at 7,812 blocks). It does below ~1,080
CPU-tier blocks (conversation) or ~1,330 (Claude Code). Measured (``kvtier
replay``, block hit rate, bound then none): conversation at 976 blocks (500k
tokens) 0.0764 against 0.0784 (46,378 uses forgotten). At 32 per block
instead of 64: conversation at 1,953 blocks (1M tokens) 0.1047 against
0.1067, Claude Code (GPU 976 blocks) at 1,953 blocks 0.2984 against 0.2957;
hence 64, which leaves both unchanged at 1M tokens.

Without ``learn`` calls (a store-only client), every block is one
class at age 0 and the policy degrades to FIFO with admit-all.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from kvtier.tiers.policies.base import ALL_KEYS, EvictionPolicy, PolicyRequest, PolicyStats

__all__ = ["HISTORY_KEYS_PER_BLOCK", "MIN_HISTORY_KEYS", "ChainPolicy"]

# Blocks remembered for their uses (not resident), per CPU-tier block, and at least this many: a
# measured 11.8 per block on the conversation trace at docs/results.md's sizes, 10.9 on Claude Code's.
HISTORY_KEYS_PER_BLOCK = 64
MIN_HISTORY_KEYS = 1 << 12
# Buffered count changes past which they are folded into the arrays at the end of a request (one
# long request would otherwise hold a Python int per key until the next re-estimate).
FOLD_KEYS = 1 << 16


class _Meta:
    """What the policy remembers about one block."""

    __slots__ = ("key", "last", "cls", "uses", "child", "hub", "depth", "group")

    def __init__(self, key: bytes) -> None:
        self.key = key  # its key in ``_meta`` (the per-request use lists hold the record, not the key)
        self.last = -1  # request time of the last use
        self.cls = 0  # class at the last use
        self.uses = 0  # requests that used it (while remembered)
        self.child: bytes | None = None  # first successor seen
        self.hub = False  # seen with two different successors
        self.depth = 0  # position in its request at the last use
        self.group: tuple[int, int] | None = None  # resident: its group key


_TURN_BUCKETS = 5
_USE_BUCKETS = 4
_NEW_BUCKETS = 8  # 0, 1, 2-3, 4-7, ..., 64+


def _class_of(turns: int, uses: int, new: int) -> int:
    t = min(turns, _TURN_BUCKETS) - 1
    u = min(uses, _USE_BUCKETS) - 1
    n = min(new.bit_length(), _NEW_BUCKETS - 1)
    return (t * _USE_BUCKETS + u) * _NEW_BUCKETS + n


_NUM_CLASSES = _TURN_BUCKETS * _USE_BUCKETS * _NEW_BUCKETS


class ChainPolicy(EvictionPolicy):
    """Hit density learned from every request, by chain-derived class. See the module docstring."""

    name = "chain"
    num_classes = _NUM_CLASSES
    REFRESH = 1  # re-estimate the densities every REFRESH buckets of requests

    def classify(self, turns: int, uses: int, new: int) -> int:
        """The class of a block at a use: the ``turns`` of its chain, its ``uses``, the request's
        ``new`` blocks. Returns 0 .. num_classes-1.

        A subclass may refine it, but a feature must not rank a block above its ancestors (depth
        does, and costs 3 points on the conversation trace): a block whose parent was evicted
        is worth nothing under prefix-stop hits."""
        return _class_of(turns, uses, new)

    def __init__(self, capacity_blocks: int, *, horizon: int = 4096, bucket_width: int = 32,
                 epochs: int = 3, min_samples: float = 200.0, admission: bool = True,
                 history_keys: int | None = None) -> None:
        super().__init__(capacity_blocks)
        if bucket_width < 1 or horizon < bucket_width or horizon % bucket_width:
            raise ValueError("need bucket_width >= 1 and horizon a multiple of bucket_width")
        if epochs < 2:
            raise ValueError(f"epochs must be >= 2, got {epochs}")
        if history_keys is None:
            history_keys = max(HISTORY_KEYS_PER_BLOCK * capacity_blocks, MIN_HISTORY_KEYS)
        if history_keys < 0:
            raise ValueError(f"history_keys must be >= 0, got {history_keys}")
        self.history_keys = history_keys
        self.horizon = horizon
        self.width = bucket_width
        self.nb = horizon // bucket_width
        self.epochs = epochs
        self.min_samples = min_samples
        self.admission = admission
        self.now = 0
        self._meta: dict[bytes, _Meta] = {}
        # Uses not yet resolved, one entry per request: (time, the records of the blocks it used). A
        # record is live there while its `last` is that time; a later use or a forgetting leaves a
        # stale entry behind, skipped (and compacted away past `_entries` > 2 × `_history` + bound).
        self._pending: deque[tuple[int, list[_Meta]]] = deque()
        self._history = 0  # blocks with a use pending (`last` >= 0): at most history_keys between requests
        self._entries = 0  # entries in the lists of `_pending`, live or stale
        self.forgotten_uses = 0  # uses forgotten before their horizon, to keep history_keys
        nb = self.nb
        # Outcomes of the uses born in each retained epoch (ring of `epochs` slots of `horizon` requests):
        # reuse gaps by bucket, and uses not reused within the horizon. A slot is zeroed when its
        # epoch falls out.
        self._hist = np.zeros((epochs, self.num_classes, nb))
        self._gone = np.zeros((epochs, self.num_classes))
        # Uses still pending, by class and window of birth; window w is column w % (epochs * nb),
        # so an epoch's windows are the columns of its slot above.
        self._columns = epochs * nb
        self._pend = np.zeros((self.num_classes, self._columns))
        # Changes to those arrays, applied vectorized by `_fold` before they are read or zeroed: a
        # numpy scalar update per key cost more than the rest of the per-key work together.
        self._born: list[int] = []  # flat indices into _pend of new uses
        self._censored: list[int] = []  # flat indices into _pend of forgotten uses (no outcome)
        # Resolved uses, each packed by `_outcome` into one int: its class, its time of birth modulo
        # the retained span (`_ring`) and its gap (up to `horizon`, hence the radix `_span`).
        self._outcomes: list[int] = []
        self._ring = epochs * horizon
        self._span = horizon + 1
        self._epoch = 0
        self._density: list[list[float]] = [[0.0] * nb for _ in range(self.num_classes)]
        # Resident blocks, grouped by (window of last use, class); a group's keys map to depth.
        self._groups: dict[tuple[int, int], dict[bytes, int]] = {}
        self._order: list[tuple[float, int, int, int]] = []  # (density, window, class, 0) sorted
        self._resident = 0
        self._victim_density = 0.0  # EWMA of the densities of evicted blocks
        self._evictions_seen = 0

    # ---- learning -------------------------------------------------------------------

    def learn(self, request: PolicyRequest, chunk_keys: int = ALL_KEYS) -> Iterator[None]:
        """Learn a counted request in steps of at most ``chunk_keys`` keys (see ``EvictionPolicy``); a
        follow-up teaches nothing. Drained in one go it yields a few times per request, which costs well
        under a microsecond.

        Steps: the key pass (metadata, successors, use counts), the per-key pass (outcome of the
        previous use, class, group), the expiry of the uses made ``horizon`` requests ago, then
        the re-estimate. Between steps the request is half-recorded: the keys passed so far carry
        this request's time, the others do not yet; groups and the resident count are consistent
        at every step. ``keys`` must not change until the generator is exhausted.

        Closed (or dropped) before it is exhausted, a started request is finished right there,
        in one go: a use counted in one pass and not the other would unbalance the counts."""
        if chunk_keys < 1:
            raise ValueError(f"chunk_keys must be >= 1, got {chunk_keys}")
        if not request.counted:
            return
        steps = self._record_steps(request.keys, chunk_keys)
        try:
            for _ in steps:
                yield
        finally:
            for _ in steps:  # empty unless the owner stopped early
                pass

    def _record_steps(self, keys: Sequence[bytes], chunk_keys: int) -> Iterator[None]:
        self.now += 1
        now = self.now
        if now // self.horizon != self._epoch:
            self._new_epoch(now // self.horizon)
        meta = self._meta
        # The request's uses, as parallel lists rather than a tuple per key: fewer objects for the
        # garbage collector, whose passes over them cost as much as the rest of the work.
        used: list[_Meta] = []
        lasts: list[int] = []  # time of each one's previous use, or -1
        # Queued now, filled below: the request's uses expire together, `horizon` requests on.
        self._pending.append((now, used))

        # Key pass: what is new, who follows whom (hubs), and the chain's turns: the largest use
        # count among the blocks that are not hubs. A block's hub flag is final once its successor
        # in this request is seen (a block is passed once per request), so it is counted then.
        new = 0
        turns = 1
        prev: _Meta | None = None
        for start in range(0, len(keys), chunk_keys):
            for key in keys[start:start + chunk_keys]:
                m = meta.get(key)
                if m is None:
                    m = meta[key] = _Meta(key)
                    new += 1
                elif m.last == now:
                    continue  # the same block twice in one request: once is enough
                if prev is not None:
                    if prev.child is None:
                        prev.child = key
                    elif prev.child != key:
                        prev.hub = True
                    if not prev.hub and prev.uses > turns:
                        turns = prev.uses
                used.append(m)
                lasts.append(m.last)
                m.last = now
                m.uses += 1
                prev = m
            yield
        if prev is not None and not prev.hub and prev.uses > turns:
            turns = prev.uses
        self._history += lasts.count(-1)  # blocks whose use was not pending before
        self._entries += len(used)

        # Per-key pass. `turns` and `new` are the request's, so a class depends on the key only
        # through its use count: classify once per distinct count (classify is pure).
        classes: dict[int, int] = {}
        ring, span, num_classes, columns = self._ring, self._span, self.num_classes, self._columns
        born_at = now // self.width % columns  # this window's column in _pend; + class * columns
        born, outcomes = self._born, self._outcomes
        for start in range(0, len(used), chunk_keys):
            for depth in range(start, min(start + chunk_keys, len(used))):
                m = used[depth]
                last = lasts[depth]
                if last >= 0:
                    # Reused after now - last requests: `_outcome`, inlined. Uses expire after
                    # `horizon` requests (below), so the gap is at most `horizon`, and the use was
                    # born in a retained epoch (at least two are).
                    outcomes.append((last % ring * num_classes + m.cls) * span + now - last)
                u = m.uses
                cls = classes.get(u)
                if cls is None:
                    cls = classes[u] = self.classify(turns, u, new)
                m.cls = cls
                m.depth = depth
                born.append(cls * columns + born_at)
                g = m.group
                if g is not None:
                    self._ungroup(m.key, g)
                    self._group(m.key, m)
            yield

        # The uses made `horizon` requests ago that saw no reuse: count them, forget idle blocks.
        pending, horizon = self._pending, self.horizon
        limit = now - horizon
        while pending and pending[0][0] <= limit:
            t, expired = pending.popleft()
            self._entries -= len(expired)
            for start in range(0, len(expired), chunk_keys):
                for m in expired[start:start + chunk_keys]:
                    if m.last != t:
                        continue  # used again since (already counted), or forgotten
                    outcomes.append(self._outcome(m.cls, t, horizon))
                    m.last = -1  # outcome recorded: a later use is a new sighting, not a gap
                    self._history -= 1
                    if m.group is None:
                        del meta[m.key]
                yield

        if self._history > self.history_keys:
            yield from self._forget_oldest(chunk_keys)
        if self._entries > 2 * self._history + self.history_keys:
            yield from self._compact(chunk_keys)
        if len(self._born) + len(self._outcomes) + len(self._censored) > FOLD_KEYS:
            self._fold()

        if now % self.width == 0:
            if now % (self.width * self.REFRESH) == 0:
                self._recompute()  # re-sorts too
            else:
                self._resort()  # ages moved on by one bucket

    def _forget_oldest(self, chunk_keys: int) -> Iterator[None]:
        """Forget pending uses, oldest first (within a request the deepest first), until at most
        ``history_keys`` blocks have one: censored, not counted as "not reused". In steps of
        ``chunk_keys`` entries; the counts are right at each step."""
        pending, meta, censored = self._pending, self._meta, self._censored
        columns, width = self._columns, self.width
        while self._history > self.history_keys:
            t, uses = pending[0]
            born_at = t // width % columns
            pop, forget = uses.pop, censored.append
            excess = self._history - self.history_keys
            forgotten = popped = 0
            while uses and forgotten < excess and popped < chunk_keys:
                m = pop()
                popped += 1
                if m.last != t:
                    continue
                forget(m.cls * columns + born_at)
                m.last = -1
                forgotten += 1
                if m.group is None:
                    del meta[m.key]
            if not uses:
                pending.popleft()
            self._history -= forgotten
            self._entries -= popped
            self.forgotten_uses += forgotten
            yield

    def _compact(self, chunk_keys: int) -> Iterator[None]:
        """Drop the stale entries of the use lists (blocks used again since, or forgotten), a list at a
        time in steps of about ``chunk_keys`` entries (a list changes only once it is filtered whole)."""
        for t, uses in self._pending:
            kept: list[_Meta] = []
            for start in range(0, len(uses), chunk_keys):
                kept.extend(m for m in uses[start:start + chunk_keys] if m.last == t)
                yield
            self._entries -= len(uses) - len(kept)
            uses[:] = kept


    def _outcome(self, cls: int, born: int, gap: int) -> int:
        """The use of a block of class ``cls`` at time ``born`` was followed by a reuse after ``gap``
        requests (``horizon``: not within the horizon), packed in one int for ``_outcomes``. The
        per-key pass inlines it."""
        return (born % self._ring * self.num_classes + cls) * self._span + gap

    def _fold(self) -> None:
        """Apply the buffered births and outcomes to the arrays. Counts are whole numbers, exact in
        floats, so the order of the additions does not matter."""
        if self._born:
            np.add.at(self._pend.reshape(-1), self._born, 1.0)  # reshape of a contiguous array: a view
            self._born.clear()
        if self._censored:
            np.add.at(self._pend.reshape(-1), self._censored, -1.0)
            self._censored.clear()
        if self._outcomes:
            packed = np.array(self._outcomes, dtype=np.int64)
            self._outcomes.clear()
            use, gap = np.divmod(packed, self._span)
            born, cls = np.divmod(use, self.num_classes)  # time of birth modulo epochs * horizon
            np.add.at(self._pend, (cls, born // self.width), -1.0)
            slot = born // self.horizon
            reused = gap < self.horizon
            np.add.at(self._hist, (slot[reused], cls[reused], gap[reused] // self.width), 1.0)
            np.add.at(self._gone, (slot[~reused], cls[~reused]), 1.0)

    def _new_epoch(self, epoch: int) -> None:
        """Forget the outcomes of uses born ``epochs`` epochs ago or earlier."""
        self._fold()  # buffered changes may belong to a slot about to be zeroed
        for e in range(self._epoch + 1, epoch + 1):
            slot = e % self.epochs
            self._hist[slot] = 0.0
            self._gone[slot] = 0.0
            self._pend[:, slot * self.nb:(slot + 1) * self.nb] = 0.0
        self._epoch = epoch

    def _recompute(self) -> None:
        """Kaplan-Meier estimate of each class's reuse-gap distribution, then hit densities."""
        self._fold()
        nb = self.nb
        hist = self._hist.sum(axis=0)  # (classes, nb)
        gone = self._gone.sum(axis=0)  # (classes,)
        # Pending uses of age A (buckets) are known to have survived buckets 0..A-1; ages beyond
        # the horizon count as nb. The columns of the last nb windows hold ages 0..nb-1; the
        # others hold older windows or future ones of this epoch (zeroed, nothing born yet).
        survived = np.empty((self.num_classes, nb + 1))
        survived[:, :nb] = self._pend[:, (self.now // self.width - np.arange(nb)) % self._columns]
        survived[:, nb] = self._pend.sum(axis=1) - survived[:, :nb].sum(axis=1)
        # pend_beyond[c, b] = pending uses with age > b
        pend_beyond = np.cumsum(survived[:, ::-1], axis=1)[:, ::-1][:, 1:]
        samples = hist.sum(axis=1) + gone + pend_beyond[:, 0] + survived[:, 0]
        pooled = samples.sum()
        small = samples < self.min_samples
        # Classes with too few samples borrow the pooled statistics. The estimate below works row by
        # row, so it runs on the distinct rows only (each class with its own statistics, then the
        # pooled row) and the small classes share the pooled result: most classes are small, and
        # this is most of the cost of a re-estimate.
        row_of = np.arange(self.num_classes)  # class -> its row below
        if small.any() and pooled > 0:
            own = np.flatnonzero(~small)
            row_of[own] = np.arange(len(own))
            row_of[small] = len(own)
            hist = np.vstack([hist[own], hist.sum(axis=0)])
            gone = np.append(gone[own], gone.sum())
            pend_beyond = np.vstack([pend_beyond[own], pend_beyond.sum(axis=0)])
        resolved_beyond = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # reuses with gap bucket >= b
        at_risk = resolved_beyond + gone[:, None] + pend_beyond
        with np.errstate(divide="ignore", invalid="ignore"):
            hazard = np.where(at_risk > 0, hist / at_risk, 0.0)
        alive = np.cumprod(np.concatenate([np.ones((len(hist), 1)), 1.0 - hazard], axis=1), axis=1)
        p = alive[:, :-1] * hazard  # probability of the reuse falling in bucket b
        never = alive[:, -1]  # not reused within the horizon
        # Hit density at age a: sum_{b>=a} p[b] / (sum_{b>=a} p[b](b-a+1/2) + never(nb-a)).
        hits = np.cumsum(p[:, ::-1], axis=1)[:, ::-1]
        later = hits - p + never[:, None]  # still unused after bucket a
        life = np.cumsum((later + 0.5 * p)[:, ::-1], axis=1)[:, ::-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            density = np.where(life > 0, hits / life, 0.0)
        rows = density.tolist()  # plain lists: indexed once per ranking decision
        self._density = [rows[r] for r in row_of.tolist()]
        self._resort()

    # ---- ranking -----------------------------------------------------------------------

    def _score(self, window: int, cls: int) -> float:
        age = self.now // self.width - window
        return self._density[cls][min(max(age, 0), self.nb - 1)]

    def _resort(self) -> None:
        self._order = sorted((self._score(w, c), w, c, 0) for (w, c) in self._groups)

    def _group(self, key: bytes, m: _Meta) -> None:
        g = (m.last // self.width if m.last >= 0 else self.now // self.width, m.cls)
        keys = self._groups.get(g)
        if keys is None:
            keys = self._groups[g] = {}
            bisect.insort(self._order, (self._score(*g), g[0], g[1], 0))
        keys[key] = m.depth
        m.group = g

    def _ungroup(self, key: bytes, g: tuple[int, int]) -> None:
        keys = self._groups[g]
        del keys[key]
        if not keys:
            del self._groups[g]  # its entry in _order is skipped until the next re-sort

    def on_insert(self, key: bytes) -> None:
        m = self._meta.get(key)
        if m is None:
            m = self._meta[key] = _Meta(key)
        if m.group is not None:
            return
        self._group(key, m)
        self._resident += 1


    def on_remove(self, key: bytes) -> None:
        m = self._meta.get(key)
        if m is None or m.group is None:
            return
        g = m.group
        score = self._score(*g)
        self._victim_density = score if self._evictions_seen == 0 else 0.9 * self._victim_density + 0.1 * score
        self._evictions_seen += 1
        self._ungroup(key, g)
        m.group = None
        self._resident -= 1
        if m.last < 0:
            del self._meta[key]

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        # on_access adds nothing: learn already saw the use.
        if not self.admission or self._resident < self.capacity_blocks or self._evictions_seen == 0:
            return [True] * len(keys)
        meta, width, bar, score = self._meta, self.width, self._victim_density, self._score
        answers = []
        for key in keys:
            m = meta.get(key)
            answers.append(m is None or m.last < 0 or score(m.last // width, m.cls) >= bar)
        return answers

    def victims(self) -> Iterator[bytes]:
        groups = self._groups
        done: set[tuple[int, int]] = set()  # a re-created group can be listed twice until the re-sort
        for _, w, c, _ in list(self._order):
            keys = groups.get((w, c))
            if keys and (w, c) not in done:
                done.add((w, c))
                # Deepest first: a chain loses its tail before its head.
                yield from sorted(keys, key=keys.__getitem__, reverse=True)

    def stats(self) -> PolicyStats:
        return PolicyStats(self._resident, len(self._meta))
