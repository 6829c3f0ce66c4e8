"""The ``"+session"`` policy wrapper: session-aware eviction from request hints (``"chain+session"``).

Idea
----
Under prefix-stop hits the blocks of one conversation or agent live or die
together: the next request of a session asks for its whole latest chain, so
a block is worth exactly what its session's next request is worth, and a
chain that lost its head is worth nothing. An application that names the
session of each request (``RequestHints.session``) tells the cache which
blocks form such a unit; this wrapper ranks the units, not the blocks.

A *stream* is one chain of requests of a session: a request continues the
stream whose latest chain it extends (or repeats a prefix of); one that
diverges inside a stream's chain forks a new stream (a sub-agent started from
a shared prefix, a compacted context), and a new root starts one. An agent
session has several: the main agent and its sub-agents, found from the chains
alone. Per stream the wrapper learns, online, from ``hints.at_s``:

- the gap between its requests (think and tool time), smoothed as TCP
  smooths round-trip times (RFC 6298's ``srtt``, gain 1/8). A stream with no
  gap yet uses the pooled estimate of every stream's gaps (a fork: its
  parent's);
- when it is expected back, ``next_at_s = last_at_s + gap_s``. A stream still
  silent after that is *overdue*: its session has probably finished or gone
  idle (a user away, a sub-agent done), and it loses its place;
- its latest chain (the keys of its latest request) and which are resident.

Eviction order (``victims()``), best victim first:

1. *orphans*: hinted blocks whose stream was forgotten (``max_streams``) or
   that left their stream's latest chain;
2. streams in rank order; each stream's resident blocks deepest first (a
   chain loses its tail before its head). The rank, lowest evicted first, is
   ``(retained, priority, band, x)``:
   - ``retained``: 1 while the stream's ``retain_s`` runs (see below);
   - ``priority``: the latest request's ``hints.priority`` (higher later);
   - ``band`` 0, overdue: ``x = last_at_s``, the longest silent first;
   - ``band`` 2, expected back: ``x = -gap_s``, the slowest first: a block
     of a stream that comes back every ``gap_s`` brings one hit per
     ``gap_s`` of cache time, so its hit density is ``1 / gap_s`` (the
     ranking of LHD, Beckmann et al., NSDI 2018, with the session's own
     rate);
3. blocks no hinted request named (*unhinted*) sit at rank ``(0, 0, 1)``:
   after overdue streams of priority <= 0, before every stream still
   expected back; among themselves in the wrapped policy's order. So a
   session that said nothing is treated as the wrapped policy treats it,
   and a session the application named is kept while it is expected back
   and given up first once it is overdue.

Measured (``kvtier replay claude_code_even --gpu-tokens 500k --cpu-tokens 4M
--hints session``, block hit rate): chain+session 0.6085, chain 0.5934, lru
0.5568, Belady 0.7808 (bench/results/replay-claude_code_even.json). Short of
0.66: an estimated next use is a poor stand-in for the real one when a
quarter of the gaps are over half a minute and one in ten over two.

Alternatives measured on the way (same setting; the early ones with streams
keyed by root and a new stream ranked last rather than first, which cost
about 0.008): ranking expected streams by their next use (Belady's rule
with the next use estimated) 0.560 with RFC 6298's timeout as the overdue
line (0.24 with none: finished sessions are then "due" forever), 0.607 with
the final overdue rule; by rate 0.571, and the later a stream counts as overdue the worse (timeout
``srtt + 8 rttvar`` 0.552, ``+ 4`` 0.571, ``+ 2`` 0.584, ``+ 0.5`` 0.597,
``+ 0`` 0.599); overdue streams by last use rather than expected return
0.600; overdue blocks handed back to the wrapped policy's order 0.600 at
twice the time. Forking streams at divergence rather than keying them by
root: +0.001.

``retain_s``: a request's stream is retained until ``at_s + retain_s``: its
blocks go only after every block that is not retained. The retained blocks
are bounded to half the capacity: past it, the oldest retention is dropped
first (a client cannot pin the cache with TTLs).

Admission (``admit``), once the tier is full: a hinted block is admitted only
if it ranks above the current first victim (a stream's block whose own stream
is the first victim only if it is shallower than that stream's deepest
resident block); an orphan is not admitted. Unhinted blocks: the wrapped
policy's ``admit``.

Without hints (``record_hints`` never called) no stream exists and every
call is the wrapped policy's: the same victims in the same order, the same
admission answers (tests: the golden digests of ``chain``).

Ownership: a block belongs to the stream whose request named it last (a
shared system prompt moves to the latest user); a block named again by an
unhinted request keeps its stream.

Cost: ``record_hints`` O(len(keys) + log S) (S: streams with resident
blocks); ``on_insert``/``on_remove``/``on_hit`` O(1) plus the wrapped
policy's, and O(log S) when a stream gains its first or loses its last
resident block; ``admit`` O(log S) amortized. ``victims()`` walks the
streams in rank order with a heap (O(log S) per stream visited) and each
stream's chain from a cursor that only moves down between requests
(amortized O(1) per block). With unhinted blocks resident beside hinted ones,
it walks the wrapped policy's order and skips the hinted keys in it (the
wrapped policy cannot filter): O(hinted keys ranked before) in that mixed
case only. Memory: one record per stream seen within the last
``max_streams`` streams, one entry per key of a stream's latest chain.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies.base import EvictionPolicy

__all__ = ["SessionWrapper"]

# Rank tuple: (retained, priority, band, x). Unhinted blocks sit at band 1 of (0, 0).
_BAND_OVERDUE = 0
_BAND_UNHINTED = 1
_BAND_EXPECTED = 2
_UNHINTED_RANK: tuple[int, int, int, float] = (0, 0, _BAND_UNHINTED, 0.0)

# RFC 6298's gain for the smoothed round-trip time: a widely used, trace-independent way to
# follow "how long until the next one" as it drifts.
_GAP_GAIN = 0.125


@dataclass(slots=True)
class _GapEstimate:
    """A smoothed gap between requests, in seconds (RFC 6298's smoothed round-trip time)."""

    gap_s: float = 0.0
    samples: int = 0

    def add(self, sample_s: float) -> None:
        self.gap_s = sample_s if self.samples == 0 else self.gap_s + _GAP_GAIN * (sample_s - self.gap_s)
        self.samples += 1


@dataclass(slots=True, eq=False)
class _Stream:
    """One chain of requests of a session (each extends the one before; see the module docstring)."""

    ident: tuple[bytes, bytes]  # (session, a serial number)
    last_at_s: float = 0.0
    requests: int = 0
    gaps: _GapEstimate = field(default_factory=_GapEstimate)
    gap_s: float = float("inf")  # its smoothed gap (the pooled one until it has its own)
    next_at_s: float = float("inf")  # when it is expected back: last_at_s + gap_s
    priority: int = 0
    retain_until_s: float = 0.0
    chain: Sequence[bytes] = ()  # the keys of its latest request
    cursor: int = -1  # no resident block of its chain lies deeper than this
    resident_blocks: int = 0
    rank: tuple[int, int, int, float] = _UNHINTED_RANK
    heap_seq: int = -1  # the seq of its valid entry in the order heap; -1: not in it


class SessionWrapper(EvictionPolicy):
    """Session-aware eviction around any policy. See the module docstring."""

    name = "session"

    def __init__(self, inner: EvictionPolicy, *, max_streams: int | None = None, admission: bool = True) -> None:
        super().__init__(inner.capacity_blocks)
        self.inner = inner
        self.admission = admission
        self.max_streams = max_streams if max_streams is not None else max(1024, inner.capacity_blocks)
        self.retained_cap_blocks = inner.capacity_blocks // 2
        self.now_s = float("-inf")
        self._streams: OrderedDict[tuple[bytes, bytes], _Stream] = OrderedDict()  # least recently used first
        self._pooled = _GapEstimate()  # every stream's gaps: the estimate of a stream with none yet
        self._owner: dict[bytes, tuple[_Stream, int]] = {}  # key -> (its stream, depth in the stream's chain)
        self._resident: set[bytes] = set()  # every resident key, hinted or not
        self._hinted_resident = 0  # resident keys with an owner, orphans included
        self._orphans: OrderedDict[bytes, None] = OrderedDict()  # resident hinted keys without a stream
        self._order: list[tuple[tuple[int, int, int, float], int, _Stream]] = []  # heap by rank, lazy deletion
        self._events: list[tuple[float, int, _Stream]] = []  # (time the stream's rank changes, seq, stream)
        self._retained: OrderedDict[tuple[bytes, bytes], _Stream] = OrderedDict()  # by retention start
        self._retained_blocks = 0
        self._seq = itertools.count()

    # ---- hints and requests ------------------------------------------------------------

    def record_hints(self, keys: Sequence[bytes], hints: RequestHints) -> None:
        self.inner.record_hints(keys, hints)
        if not keys:
            return
        if hints.at_s > self.now_s:
            self.now_s = hints.at_s
        self._advance()
        s = self._stream_for(hints.session or b"", keys)
        if s.requests:
            self._streams.move_to_end(s.ident)
            gap_s = max(0.0, hints.at_s - s.last_at_s)
            s.gaps.add(gap_s)
            self._pooled.add(gap_s)
        s.requests += 1
        s.last_at_s = max(s.last_at_s, hints.at_s)
        s.priority = hints.priority
        est = s.gaps if s.gaps.samples else self._pooled
        if est.samples:
            s.gap_s = est.gap_s
            s.next_at_s = s.last_at_s + est.gap_s
            heapq.heappush(self._events, (s.next_at_s, next(self._seq), s))
        else:  # nothing learned yet: never overdue, ranked slowest (the first to go among the expected)
            s.gap_s, s.next_at_s = float("inf"), float("inf")
        if hints.retain_s > 0.0:
            until_s = hints.at_s + hints.retain_s
            if until_s > s.retain_until_s:
                if s.retain_until_s <= self.now_s:  # a new retention: it starts now
                    self._retained[s.ident] = s
                    self._retained_blocks += s.resident_blocks
                s.retain_until_s = until_s
                heapq.heappush(self._events, (until_s, next(self._seq), s))
        if len(keys) > len(s.chain) or tuple(keys) != tuple(s.chain[:len(keys)]):
            self._take_chain(s, keys)  # a repeat of a prefix keeps the longer chain
        self._bound_retention()
        self._rerank(s)

    def _stream_for(self, session: bytes, keys: Sequence[bytes]) -> _Stream:
        """The stream a request continues: the one owning the deepest block of the longest prefix the
        session's streams hold, if the request extends that stream's chain (or repeats a prefix of it).
        Otherwise a new stream: a new root, or a fork (a sub-agent started from a shared prefix, a
        compacted context), which starts from its parent's gap estimate."""
        best: _Stream | None = None
        matched = -1
        owner = self._owner
        for depth, key in enumerate(keys):
            own = owner.get(key)
            if own is None or own[1] != depth or own[0] is _ORPHAN or own[0].ident[0] != session:
                break
            best, matched = own[0], depth
        if best is not None and matched >= min(len(best.chain), len(keys)) - 1:
            return best
        s = _Stream((session, next(self._seq).to_bytes(8, "little")))
        if best is not None:
            s.gaps = _GapEstimate(best.gaps.gap_s, best.gaps.samples)
            s.last_at_s = best.last_at_s
        self._streams[s.ident] = s
        self._trim_streams()
        return s

    def _take_chain(self, s: _Stream, keys: Sequence[bytes]) -> None:
        """Make ``keys`` the stream's latest chain; blocks of its previous chain left out become orphans."""
        new: dict[bytes, int] = {}
        for depth, key in enumerate(keys):
            new.setdefault(key, depth)  # a key twice in one request: its first depth counts
        owner, resident = self._owner, self._resident
        for depth, key in enumerate(s.chain):
            if key in new:
                continue
            own = owner.get(key)
            if own is None or own[0] is not s or own[1] != depth:
                continue  # another stream (or a later depth) has it now
            if key in resident:
                owner[key] = (_ORPHAN, -1)  # still hinted: _hinted_resident unchanged
                self._orphans[key] = None
                self._add_resident(s, -1)
            else:
                del owner[key]
        deepest = -1
        for key, depth in new.items():
            own = owner.get(key)
            is_resident = key in resident
            if own is not None and own[0] is s:
                if own[1] != depth:
                    owner[key] = (s, depth)
                if is_resident:
                    deepest = max(deepest, depth)
                continue
            if is_resident:
                if own is None:
                    self._hinted_resident += 1  # an unhinted block named by a hinted request
                elif own[0] is _ORPHAN:
                    del self._orphans[key]
                else:
                    self._add_resident(own[0], -1)
                self._add_resident(s, 1)
                deepest = max(deepest, depth)
            owner[key] = (s, depth)
        s.chain = tuple(keys)  # the caller's list may change after the call
        s.cursor = deepest

    def record_request(self, keys: Sequence[bytes]) -> None:
        self.inner.record_request(keys)

    def record_request_steps(self, keys: Sequence[bytes], chunk_keys: int = 64) -> Iterator[None]:
        yield from self.inner.record_request_steps(keys, chunk_keys)

    # ---- residency --------------------------------------------------------------------

    def on_insert(self, key: bytes) -> None:
        self.inner.on_insert(key)
        if key in self._resident:
            return
        self._resident.add(key)
        own = self._owner.get(key)
        if own is None:
            return
        self._hinted_resident += 1
        s, depth = own
        if s is _ORPHAN:
            self._orphans[key] = None
            return
        if depth > s.cursor:
            s.cursor = depth
        self._add_resident(s, 1)

    def on_hit(self, key: bytes) -> None:
        self.inner.on_hit(key)

    def on_remove(self, key: bytes) -> None:
        self.inner.on_remove(key)
        if key not in self._resident:
            return
        self._resident.discard(key)
        own = self._owner.get(key)
        if own is None:
            return
        self._hinted_resident -= 1
        s, _ = own
        if s is _ORPHAN:
            del self._orphans[key]
            del self._owner[key]
            return
        self._add_resident(s, -1)

    def __len__(self) -> int:
        return len(self.inner)

    def _add_resident(self, s: _Stream, delta: int) -> None:
        """A stream gained or lost a resident block: keep the heap and the retained total in step."""
        before = s.resident_blocks
        s.resident_blocks += delta
        if s.retain_until_s > self.now_s and s.ident in self._retained:
            self._retained_blocks += delta
            if delta > 0:
                self._bound_retention()
        if before == 0 and s.resident_blocks > 0:
            self._push(s)
        elif s.resident_blocks == 0:
            s.heap_seq = -1  # its heap entry is skipped from now on

    # ---- ranking ----------------------------------------------------------------------

    def _rank_of(self, s: _Stream) -> tuple[int, int, int, float]:
        retained = 1 if s.retain_until_s > self.now_s else 0
        if self.now_s > s.next_at_s:
            return (retained, s.priority, _BAND_OVERDUE, s.last_at_s)  # the longest silent first
        return (retained, s.priority, _BAND_EXPECTED, -s.gap_s)  # the slowest first

    def _push(self, s: _Stream) -> None:
        s.rank = self._rank_of(s)
        s.heap_seq = next(self._seq)
        heapq.heappush(self._order, (s.rank, s.heap_seq, s))
        # Lazy deletion leaves dead entries; rebuild once they outnumber the live ones.
        if len(self._order) > 2 * len(self._streams) + 64:
            live = [e for e in self._order if e[2].heap_seq == e[1]]
            heapq.heapify(live)
            self._order = live

    def _rerank(self, s: _Stream) -> None:
        if s.resident_blocks > 0 and self._rank_of(s) != s.rank:
            self._push(s)

    def _advance(self) -> None:
        """Streams that became overdue or whose retention ended (``now_s`` moved) change rank."""
        events = self._events
        while events and events[0][0] < self.now_s:
            _, _, s = heapq.heappop(events)
            if s.retain_until_s <= self.now_s and self._retained.pop(s.ident, None) is not None:
                self._retained_blocks -= s.resident_blocks
            self._rerank(s)

    def _bound_retention(self) -> None:
        """At most half the capacity retained: the oldest retention is dropped first."""
        while self._retained_blocks > self.retained_cap_blocks and self._retained:
            _, s = self._retained.popitem(last=False)
            self._retained_blocks -= s.resident_blocks
            s.retain_until_s = min(s.retain_until_s, self.now_s)
            self._rerank(s)

    def _trim_streams(self) -> None:
        """Forget the least recently active stream past ``max_streams``; its resident blocks become orphans."""
        while len(self._streams) > self.max_streams:
            _, s = self._streams.popitem(last=False)
            if s.ident in self._retained:
                del self._retained[s.ident]
                self._retained_blocks -= s.resident_blocks
            for depth, key in enumerate(s.chain):
                own = self._owner.get(key)
                if own is None or own[0] is not s or own[1] != depth:
                    continue
                if key in self._resident:
                    self._owner[key] = (_ORPHAN, -1)
                    self._orphans[key] = None
                else:
                    del self._owner[key]
            s.resident_blocks = 0
            s.heap_seq = -1

    def _first_stream(self) -> _Stream | None:
        order = self._order
        while order and order[0][2].heap_seq != order[0][1]:
            heapq.heappop(order)
        return order[0][2] if order else None

    def _streams_in_order(self) -> Iterator[_Stream]:
        """The heap's live entries, lowest rank first, without popping: a frontier of heap indices."""
        order = self._order
        if not order:
            return
        frontier = [(order[0][0], order[0][1], 0)]
        while frontier:
            _, _, i = heapq.heappop(frontier)
            rank, seq, s = order[i]
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(order):
                    heapq.heappush(frontier, (order[child][0], order[child][1], child))
            if s.heap_seq == seq:
                yield s

    def _stream_keys(self, s: _Stream) -> Iterator[bytes]:
        """A stream's resident blocks, deepest first. The cursor skips the tail already gone."""
        chain, owner, resident = s.chain, self._owner, self._resident
        depth = s.cursor
        top = True  # the cursor may drop past non-resident blocks only while none above it is resident
        while depth >= 0:
            key = chain[depth]
            if key in resident:
                own = owner.get(key)
                if own is not None and own[0] is s and own[1] == depth:
                    top = False
                    yield key
            elif top:
                s.cursor = depth - 1
            depth -= 1

    def _unhinted(self) -> Iterator[bytes]:
        owner = self._owner
        for key in self.inner.victims():
            if key not in owner:
                yield key

    def victims(self) -> Iterator[bytes]:
        if self._hinted_resident == 0:  # no hints: the wrapped policy's order, untouched
            yield from self.inner.victims()
            return
        yield from self._orphans
        unhinted_left = len(self._resident) > self._hinted_resident
        for s in self._streams_in_order():
            if unhinted_left and s.rank > _UNHINTED_RANK:
                unhinted_left = False
                yield from self._unhinted()
            yield from self._stream_keys(s)
        if unhinted_left:
            yield from self._unhinted()

    def admit(self, key: bytes) -> bool:
        own = self._owner.get(key)
        if own is None:
            return self.inner.admit(key)
        if not self.admission or len(self._resident) < self.capacity_blocks:
            return True
        s, depth = own
        if s is _ORPHAN:
            return False
        if self._orphans:
            return True  # something already ranks below every stream
        first = self._first_stream()
        head = first.rank if first is not None else None
        if len(self._resident) > self._hinted_resident and (head is None or _UNHINTED_RANK < head):
            head = _UNHINTED_RANK
        if head is None:
            return True
        if first is s:
            return depth < s.cursor  # its own stream goes first: only if it is not the deepest
        return self._rank_of(s) > head


# The owner of a hinted resident block whose stream let it go (an older branch, a forgotten stream).
_ORPHAN = _Stream((b"", b""))
