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
alone. Per stream the wrapper keeps its latest chain (the keys of its latest
request, and which are resident), its latest silence (the gap before its
latest request), whether it was forked and whether another stream was
forked off it, how many tokens its latest request generated (as the engine
reports it, ``hints.output_tokens``; 0 when not reported), and the age of
its current silence (``hints.at_s`` is the clock).

Hints marked ``continues`` (the pool marks a store's, and an allocation's
that repeats its lookup) are about a request already recorded: the stream
that owns their first block, else the session's latest stream (a request's
generated blocks follow its chain), takes the new blocks onto its chain and
the new output count, priority and retention; no return is counted and the
silence goes on (``_follow_up``). A store that matches no stream counts as
a request.

What a stream's cached blocks are worth comes from a return model learned
online (``session_returns.ReturnModel``): LHD's hit density (Beckmann et
al., NSDI 2018) per stream, i.e. the chance that it comes back before the
cache lets it go, per second of cache time that costs, given its class
(latest silence, forked, parent, output length) and how long it has been silent. The model
learns from every stream's silences: when they ended with a return, and, for
streams with cached blocks, when they ended with the last block evicted (a
spare evicted here while the GPU tier holds its block, below, is not gone);
silences still running count as far as they got. Once a stream has come
back, its own returns count too: its return hazard is its own, shrunk
towards its class's (``ReturnModel.own_densities``), so it is ranked by its
own habit as it shows one. So "think and tool time", "a sub-agent is done
once it reports back" and "a session gone quiet for longer than it ever did
is finished" are learned from the traffic, not written in as thresholds.

Eviction order (``victims()``), best victim first:

1. *orphans*: hinted blocks whose stream was forgotten (``max_streams``) or
   that left their stream's latest chain;
2. *spares*: a stream's blocks restored into the GPU tier that it still
   holds (``on_access(promoted=True)`` until ``on_gpu_drop``), the latest promoted first.
   Evicting one costs no hit: the GPU tier demotes the block again when it
   evicts it, and that demotion is admitted or not by the rank below, like
   any other (``spares.Spares``);
3. streams in rank order; each stream's resident blocks deepest first (a
   chain loses its tail before its head). The rank, lowest evicted first, is
   ``(retained, priority, band, density)``:
   - ``retained``: 1 while the stream's ``retain_s`` runs (see below);
   - ``priority``: the latest request's ``hints.priority`` (higher later);
   - ``band``: 0 for a stream worth less than the average stream
     (``ReturnModel.typical_density``), 2 otherwise;
   - ``density``: its hit density now;
4. blocks no hinted request named (*unhinted*) sit at rank ``(0, 0, 1)``:
   after the streams of priority <= 0 worth less than average, before the
   others; among themselves in the wrapped policy's order. So a session that
   said nothing is treated as the wrapped policy treats it, and a session
   the application named is kept while it is worth more than an average one.

A stream's rank changes only when it makes a request, when its silence
crosses an age bucket edge (an event: geometric edges, so O(log age) events
per silence), when its retention ends, and when the model is refreshed
(every ``REFRESH_REQUESTS`` requests; all ranked streams are re-ranked).

Measured (``kvtier replay claude_code_even --gpu-tokens 500k --cpu-tokens 4M``,
block hit rate; docs/results.md, "Hints from the application"): 0.6679 with
``--hints session+output``, 0.6599 with ``--hints session``, chain 0.5934,
Belady 0.7808; each stream ranked by its true next return, 0.7590
(``bench/session_oracle.py``). The variants measured on the way, and why each
constant is what it is, are in docs/design-notes.md ("chain+session").

``retain_s``: a request's stream is retained until ``at_s + retain_s``: its
blocks go only after every block that is not retained. The retained blocks
are bounded to half the capacity: past it, the oldest retention is dropped
first (a client cannot pin the cache with TTLs).

Admission (``admit``), once the tier is full: a hinted block is admitted only
if it ranks above the current first victim (a stream's block whose own stream
is the first victim only if it is shallower than that stream's deepest
resident block); an orphan is not admitted. Unhinted blocks: the wrapped
policy's ``admit``.

Without hints (no ``learn`` of a request with hints) no stream exists and every
call is the wrapped policy's: the same victims in the same order, the same
admission answers (tests: the golden digests of ``chain``).

Ownership: a block belongs to the stream whose request named it last (a
shared system prompt moves to the latest user); a block named again by an
unhinted request keeps its stream.

Cost: ``learn`` with hints O(len(keys) + log S + buckets) (S: streams with
resident blocks; the stream's own density row is recomputed), a follow-up
O(len(keys) + log S) (its blocks are appended, the chain is not rebuilt), plus a refresh
every ``REFRESH_REQUESTS`` requests: O(classes x buckets + S x buckets + S
log S); each age event O(log S); ``on_insert``/``on_remove``
O(1) plus the wrapped policy's, and O(log S) when a stream gains
its first or loses its last resident block; ``admit`` O(log S)
amortized per batch plus O(1) per key;
``on_access``/``on_gpu_drop`` O(len(keys)) plus the wrapped policy's. ``victims()`` lists the spares
(at most the GPU tier's blocks), then walks the streams in rank order with a
heap (O(log S) per stream visited) and each stream's chain from a cursor
that only moves down between requests (amortized O(1) per block). With
unhinted blocks resident beside hinted ones, it walks the wrapped policy's
order and skips the hinted keys in it (the wrapped policy cannot filter):
O(hinted keys ranked before) in that mixed case only.

Memory, bounded by the capacity whatever the traffic (a new session per
request, chains of the protocol's 65,536 keys): at most ``max_streams``
stream records (default ``max(1024, capacity)``; two rows of 30 buckets
once a stream came back); the keys of every stream's latest chain together
at most ``chain_keys`` (default ``max(CHAIN_KEYS_PER_BLOCK × capacity,
MIN_CHAIN_KEYS)``: 64 per CPU-tier block, at least 16,384; about 220 bytes a
key with its owner entry), a single chain cut to its first ``chain_keys``
keys (its head: prefix-stop hits), past which the least recently active
streams other than the one just recorded are forgotten as past
``max_streams``; ownership entries for those keys and for resident orphans;
at most 4 queued events per stream plus 1,024 (an event of an earlier
silence, of a forgotten stream, or of a retention since extended or cut,
changes nothing: they are dropped); spares at most the capacity; and the
model's tables (168 classes x 30 buckets). A forgotten stream's record may
outlive it in stale events and spares, its chain does not. Claude Code
(``claude_code_even``, GPU 976 blocks) holds 280,675 chain keys at its peak
(1,021 streams): the bound changes nothing at 7,812 CPU-tier blocks (4M
tokens); at 3,906 blocks it forgets 155 streams and every decision stays
the same (block hit rate 0.5122 with ``--hints session``, as without the
bound); at 1,953 blocks it forgets 626 streams, 0.3644 against 0.3634.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies.base import ALL_KEYS, EvictionPolicy, PolicyRequest, PolicyStats, PolicyWrapper
from kvtier.tiers.policies.rank_order import Rank, RankOrder
from kvtier.tiers.policies.session_returns import (AGE_EDGES_S, NUM_BUCKETS, REFRESH_REQUESTS, ReturnModel, age_bucket,
                                                   stream_class)
from kvtier.tiers.policies.spares import Spares

__all__ = ["CHAIN_KEYS_PER_BLOCK", "MIN_CHAIN_KEYS", "SessionWrapper"]

# The keys of all streams' latest chains together, per CPU-tier block of the wrapped policy, and at
# least this many. Claude Code (claude_code_even, 4M tokens of CPU tier): 280,675 at the peak, 36
# per block, from 1,021 streams.
CHAIN_KEYS_PER_BLOCK = 64
MIN_CHAIN_KEYS = 1 << 14
# Events in the heap past which the stale ones are dropped: 4 per stream plus this many.
_EVENTS_SLACK = 1024

# Rank tuple: (retained, priority, band, x). Unhinted blocks sit at band 1 of (0, 0).
_BAND_BELOW_AVERAGE = 0
_BAND_UNHINTED = 1
_BAND_ABOVE_AVERAGE = 2
_UNHINTED_RANK: Rank = (0, 0, _BAND_UNHINTED, 0.0)

@dataclass(slots=True, eq=False)
class _Stream:
    """One chain of requests of a session (each extends the one before; see the module docstring)."""

    ident: tuple[bytes, bytes]  # (session, a serial number)
    last_at_s: float = 0.0
    requests: int = 0
    last_gap_s: float | None = None  # the silence before its latest request (a fork: its parent's)
    priority: int = 0
    retain_until_s: float = 0.0
    chain: list[bytes] = field(default_factory=list)  # the keys of its latest request (at most chain_keys)
    cursor: int = -1  # no resident block of its chain lies deeper than this
    resident_blocks: int = 0
    above_blocks: int = 0  # its spares evicted here while the GPU tier still holds them
    rank: Rank = _UNHINTED_RANK
    heap_seq: int = -1  # the sequence number of its live entry in the rank order; -1: not in it
    forked: bool = False  # it was forked off another stream
    parent: bool = False  # another stream was forked off it
    output_tokens: int = 0  # what its latest request generated, as reported (0: not reported)
    cls: int = 0  # its class in the return model
    age_bucket: int = 0  # the age bucket of its current silence
    age_epoch: int = 0  # age events of an earlier silence carry an older epoch; -1: forgotten
    own_returns: list[int] | None = None  # its silences that ended with a return, per age bucket
    densities_for: tuple[int, int, int] = (-1, -1, -1)  # (model version, requests, class) of ``densities``
    densities: list[float] | None = None  # its hit density per age bucket, from its own returns


class SessionWrapper(PolicyWrapper):
    """Session-aware eviction around any policy. See the module docstring."""

    name = "session"

    def __init__(self, inner: EvictionPolicy, *, max_streams: int | None = None, admission: bool = True,
                 chain_keys: int | None = None) -> None:
        super().__init__(inner)
        self.admission = admission
        self.model = ReturnModel()
        self._requests_seen = 0
        self.max_streams = max_streams if max_streams is not None else max(1024, inner.capacity_blocks)
        if chain_keys is None:
            chain_keys = max(CHAIN_KEYS_PER_BLOCK * inner.capacity_blocks, MIN_CHAIN_KEYS)
        if chain_keys < 1:
            raise ValueError(f"chain_keys must be >= 1, got {chain_keys}")
        self.chain_keys = chain_keys
        self._chain_entries = 0  # keys of every stream's chain together: at most chain_keys
        self.forgotten_streams = 0  # streams forgotten to keep chain_keys (not max_streams)
        self.retained_cap_blocks = inner.capacity_blocks // 2
        self.now_s = float("-inf")
        self._streams: OrderedDict[tuple[bytes, bytes], _Stream] = OrderedDict()  # least recently used first
        self._latest: dict[bytes, _Stream] = {}  # session -> the stream of its latest request
        self._owner: dict[bytes, tuple[_Stream, int]] = {}  # key -> (its stream, depth in the stream's chain)
        self._resident: set[bytes] = set()  # every resident key, hinted or not
        self._hinted_resident = 0  # resident keys with an owner, orphans included
        self._orphans: OrderedDict[bytes, None] = OrderedDict()  # resident hinted keys without a stream
        self.spares: Spares[_Stream] = Spares(inner.capacity_blocks)  # restored blocks the GPU tier holds
        self._order: RankOrder[_Stream] = RankOrder()  # streams with resident blocks, by rank
        # (time the stream's rank may change, seq, stream, its age epoch; -1: a retention's end)
        self._events: list[tuple[float, int, _Stream, int]] = []
        self._retained: OrderedDict[tuple[bytes, bytes], _Stream] = OrderedDict()  # by retention start
        self._retained_blocks = 0
        self._seq = itertools.count()
        self.events_compacted = 0

    # ---- hints and requests ------------------------------------------------------------

    def learn(self, request: PolicyRequest, chunk_keys: int = ALL_KEYS) -> Iterator[None]:
        # The hints now (the contract: when learn is called), the request in the wrapped policy's steps;
        # the wrapped policy gets the request with its hints too.
        if request.hints is not None:
            self._take_hints(request.keys, request.hints)
        return self.inner.learn(request, chunk_keys)

    def _take_hints(self, keys: Sequence[bytes], hints: RequestHints) -> None:
        if not keys:
            return
        if hints.at_s > self.now_s:
            self.now_s = hints.at_s
        self._advance()
        if hints.continues and self._follow_up(keys, hints):
            return
        s = self._stream_for(hints.session or b"", keys)
        self._latest[s.ident[0]] = s
        model = self.model
        if s.requests:  # it came back: a return after a silence of gap_s
            self._streams.move_to_end(s.ident)
            gap_s = max(0.0, hints.at_s - s.last_at_s)
            s.last_gap_s = gap_s
            bucket = age_bucket(gap_s)
            cached = _cached(s)
            for k in range(s.age_bucket + 1, bucket + 1):  # edges crossed since the last _advance
                model.on_age(s.cls, k, cached)
            model.on_return(s.cls, bucket)
            if s.own_returns is None:
                s.own_returns = [0] * NUM_BUCKETS
            s.own_returns[bucket] += 1
        s.requests += 1
        s.last_at_s = max(s.last_at_s, hints.at_s)
        s.priority = hints.priority
        s.output_tokens = hints.output_tokens
        self._start_silence(s)
        self._requests_seen += 1
        n = self._requests_seen
        if n % REFRESH_REQUESTS == 0 or n & (n - 1) == 0:  # and early on at powers of two, to start soon
            model.refresh()
            for other in self._order.live():
                self._rerank(other)
        self._retain(s, hints)
        if len(keys) > self.chain_keys:
            keys = keys[:self.chain_keys]  # a chain longer than the bound keeps its head
        if len(keys) > len(s.chain) or tuple(keys) != tuple(s.chain[:len(keys)]):
            self._take_chain(s, keys)  # a repeat of a prefix keeps the longer chain
            self._bound_chains(s)
        self._bound_retention()
        self._rerank(s)

    def _retain(self, s: _Stream, hints: RequestHints) -> None:
        if hints.retain_s > 0.0:
            until_s = hints.at_s + hints.retain_s
            if until_s > s.retain_until_s:
                if s.retain_until_s <= self.now_s:  # a new retention: it starts now
                    self._retained[s.ident] = s
                    self._retained_blocks += s.resident_blocks
                s.retain_until_s = until_s
                self._push_event((until_s, next(self._seq), s, -1))

    def _follow_up(self, keys: Sequence[bytes], hints: RequestHints) -> bool:
        """Hints that follow a recorded request (``hints.continues``: a store of its blocks, its
        allocation after its lookup): the stream's chain grows by blocks it did not name yet, and its
        output count, priority and retention are updated; no return is counted, no silence restarted.
        The stream is the one owning ``keys[0]`` (a block the request named), else the session's latest
        (blocks it generated: they follow its chain). False when neither exists (a client that stores
        without looking up): the hints then count as a request."""
        session = hints.session or b""
        own = self._owner.get(keys[0])
        if own is not None and own[0] is not _ORPHAN and own[0].ident[0] == session:
            s, depth = own
        else:
            s, depth = self._latest.get(session), -1
            if s is None or s.age_epoch < 0:
                return False
            depth = len(s.chain)
        if depth + len(keys) > len(s.chain) and tuple(s.chain[depth:]) == tuple(keys[:len(s.chain) - depth]):
            self._extend_chain(s, keys[len(s.chain) - depth:])
            self._bound_chains(s)
        s.priority = hints.priority
        self._retain(s, hints)
        if hints.output_tokens and hints.output_tokens != s.output_tokens:
            s.output_tokens = hints.output_tokens
            cls = stream_class(s.last_gap_s, s.forked, s.parent, s.output_tokens)
            if cls != s.cls:  # from now on; the silence so far stays counted where it was, as for a fork
                s.cls = cls
                self.model.on_age(cls, s.age_bucket, _cached(s))
        self._bound_retention()
        self._rerank(s)
        return True

    def _stream_for(self, session: bytes, keys: Sequence[bytes]) -> _Stream:
        """The stream a request continues: the one owning the deepest block of the longest prefix the
        session's streams hold, if the request extends that stream's chain (or repeats a prefix of it).
        Otherwise a new stream: a new root, or a fork (a sub-agent started from a shared prefix, a
        compacted context), which starts in its parent's gap class."""
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
            s.forked = True
            s.last_gap_s = best.last_gap_s
            if not best.parent:  # its class changes from now on; the silence so far stays counted where it was
                best.parent = True
                best.cls = stream_class(best.last_gap_s, best.forked, best.parent, best.output_tokens)
                self._rerank(best)
        self._streams[s.ident] = s
        self._trim_streams()
        return s

    def _start_silence(self, s: _Stream) -> None:
        """The stream just made a request: it is at risk of returning from age 0, in its current class.
        Each age bucket edge it later crosses silent is an event (``_advance``)."""
        s.cls = stream_class(s.last_gap_s, s.forked, s.parent, s.output_tokens)
        self.model.on_request(s.cls, _cached(s))
        s.age_bucket = 0
        s.age_epoch += 1
        self._push_event((s.last_at_s + AGE_EDGES_S[1], next(self._seq), s, s.age_epoch))

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
        self._chain_entries += len(keys) - len(s.chain)
        s.chain = list(keys)  # a copy: the caller's list may change after the call
        s.cursor = deepest

    def _extend_chain(self, s: _Stream, more: Sequence[bytes]) -> None:
        """Append ``more`` to the stream's chain: ``_take_chain(s, chain + more)`` in O(len(more)), since
        the chain it had stays (an engine stores a long request's blocks a few at a time). A chain stops
        growing at ``chain_keys``."""
        owner, resident = self._owner, self._resident
        base = len(s.chain)
        if base + len(more) > self.chain_keys:
            more = more[:max(0, self.chain_keys - base)]
        for i, key in enumerate(more):
            own = owner.get(key)
            if own is not None and own[0] is s:
                continue  # a key twice in one chain: its first depth counts
            if key in resident:
                if own is None:
                    self._hinted_resident += 1
                elif own[0] is _ORPHAN:
                    del self._orphans[key]
                else:
                    self._add_resident(own[0], -1)
                self._add_resident(s, 1)
                s.cursor = max(s.cursor, base + i)
            owner[key] = (s, base + i)
        s.chain.extend(more)
        self._chain_entries += len(more)

    # ---- residency --------------------------------------------------------------------

    def on_insert(self, key: bytes) -> None:
        self.inner.on_insert(key)
        if key in self._resident:
            return
        self._resident.add(key)
        self.spares.landed(key)
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
            self.spares.forget(key)
            del self._orphans[key]
            del self._owner[key]
            return
        self._add_resident(s, -1)
        if not self.spares.evicted(key, s):  # an evicted spare leaves s cached: the GPU tier holds it
            self._life_may_end(s)

    def on_access(self, keys: Sequence[bytes], promoted: bool = False) -> None:
        self.inner.on_access(keys, promoted)
        if not promoted:
            return
        owner, resident, promote = self._owner, self._resident, self.spares.promote
        for key in keys:
            own = owner.get(key)
            if own is not None and own[0] is not _ORPHAN and key in resident:
                promote(key)

    def on_gpu_drop(self, keys: Sequence[bytes]) -> None:
        self.inner.on_gpu_drop(keys)
        if not self.spares.tracked:
            return
        dropped = self.spares.gpu_dropped
        for key in keys:
            s = dropped(key)
            if s is not None:
                self._life_may_end(s)

    def _life_may_end(self, s: _Stream) -> None:
        """A block of ``s`` left the cache: with none left (here or as a spare above), its blocks'
        life in the cache ended without a hit."""
        if not _cached(s) and s.age_epoch >= 0:
            self.model.on_evict(s.cls, s.age_bucket)

    def stats(self) -> PolicyStats:
        inner = self.inner.stats()
        return PolicyStats(inner.resident_keys, len(self._owner) + inner.remembered_keys)

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
            self._order.remove(s)

    # ---- ranking ----------------------------------------------------------------------

    def _rank_of(self, s: _Stream) -> Rank:
        retained = 1 if s.retain_until_s > self.now_s else 0
        density = self._density(s)
        band = _BAND_ABOVE_AVERAGE if density >= self.model.typical_density() else _BAND_BELOW_AVERAGE
        return (retained, s.priority, band, density)

    def _density(self, s: _Stream) -> float:
        """The stream's hit density now: its class's until it came back once, then its own row
        (``ReturnModel.own_densities``), computed again only after a refresh, a request or a new class."""
        if s.own_returns is None:
            return self.model.density(s.cls, s.age_bucket)
        key = (self.model.version, s.requests, s.cls)  # a fork off it changes its class, not its requests
        if s.densities_for != key:
            s.densities_for = key
            s.densities = self.model.own_densities(s.cls, s.own_returns)
        return s.densities[s.age_bucket]

    def _push(self, s: _Stream) -> None:
        self._order.push(s, self._rank_of(s), len(self._streams))

    def _rerank(self, s: _Stream) -> None:
        if s.resident_blocks > 0 and self._rank_of(s) != s.rank:
            self._push(s)

    def _advance(self) -> None:
        """Streams that aged into their next bucket or whose retention ended (``now_s`` moved) change rank."""
        events = self._events
        while events and events[0][0] < self.now_s:
            _, _, s, epoch = heapq.heappop(events)
            if epoch >= 0:
                if epoch != s.age_epoch:
                    continue
                s.age_bucket += 1
                self.model.on_age(s.cls, s.age_bucket, _cached(s))
                if s.age_bucket + 1 < NUM_BUCKETS:
                    self._push_event((s.last_at_s + AGE_EDGES_S[s.age_bucket + 1], next(self._seq), s, epoch))
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
            self._forget(next(iter(self._streams.values())))

    def _bound_chains(self, keep: _Stream) -> None:
        """Forget the least recently active streams but ``keep`` (whose chain just grew) until the chains
        hold at most ``chain_keys`` keys together (``keep``'s alone holds at most that many)."""
        streams = self._streams
        while self._chain_entries > self.chain_keys and len(streams) > 1:
            s = next(iter(streams.values()))
            if s is keep:
                streams.move_to_end(s.ident)
                continue
            self._forget(s)
            self.forgotten_streams += 1

    def _forget(self, s: _Stream) -> None:
        """Forget a stream: its chain's keys go, its resident blocks become orphans."""
        del self._streams[s.ident]
        if s.ident in self._retained:
            del self._retained[s.ident]
            self._retained_blocks -= s.resident_blocks
        owner, resident, orphans = self._owner, self._resident, self._orphans
        for depth, key in enumerate(s.chain):
            own = owner.get(key)
            if own is None or own[0] is not s or own[1] != depth:
                continue
            if key in resident:
                owner[key] = (_ORPHAN, -1)
                orphans[key] = None
            else:
                del owner[key]
        self._chain_entries -= len(s.chain)
        s.chain = []  # stale events and spares may still refer to the record: not to its keys
        s.resident_blocks = 0
        self._order.remove(s)
        s.age_epoch = -1
        if self._latest.get(s.ident[0]) is s:
            del self._latest[s.ident[0]]

    def _push_event(self, event: tuple[float, int, _Stream, int]) -> None:
        """Queue an age or retention event; past 4 per stream (plus a slack) drop the stale ones: age
        events of an earlier silence or of a forgotten stream, retention events other than the one at
        the stream's current ``retain_until_s`` (each live stream keeps at most one of each)."""
        events = self._events
        heapq.heappush(events, event)
        if len(events) > 4 * len(self._streams) + _EVENTS_SLACK:
            events[:] = [e for e in events if _event_live(e)]  # in place: _advance holds the list
            heapq.heapify(events)
            self.events_compacted += 1

    def _stream_keys(self, s: _Stream) -> Iterator[bytes]:
        """A stream's resident blocks, deepest first. The cursor skips the tail already gone."""
        chain, owner, resident, spares = s.chain, self._owner, self._resident, self.spares
        depth = s.cursor
        top = True  # the cursor may drop past non-resident blocks only while none above it is resident
        while depth >= 0:
            key = chain[depth]
            if key in resident:
                own = owner.get(key)
                if own is not None and own[0] is s and own[1] == depth:
                    top = False
                    if key not in spares:  # spares were offered first
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
        orphans = self._orphans
        yield from orphans
        for key in self.spares.victims():
            if key not in orphans:  # a spare that left its stream's chain was offered as an orphan
                yield key
        unhinted_left = len(self._resident) > self._hinted_resident
        for s in self._order:
            if unhinted_left and s.rank > _UNHINTED_RANK:
                unhinted_left = False
                yield from self._unhinted()
            yield from self._stream_keys(s)
        if unhinted_left:
            yield from self._unhinted()

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """One answer per key. No answer changes what the next one reads, so the first victim is found
        once per batch and each stream ranked once; the wrapped policy answers for the unhinted keys,
        in one batch."""
        owner, admitted = self._owner, self.spares.admitted
        if not owner:  # no hints: the wrapped policy's answers
            return self.inner.admit(keys)
        open_door = not self.admission or len(self._resident) < self.capacity_blocks
        bar: tuple[_Stream | None, Rank | None] | None = None
        above: dict[_Stream, bool] = {}  # stream -> whether it ranks above the bar
        answers: list[bool] = []
        unhinted: list[int] = []  # where the wrapped policy answers
        for key in keys:
            own = owner.get(key)
            if own is None:
                unhinted.append(len(answers))
                answers.append(True)
                continue
            s, depth = own
            if open_door:
                yes = True
            elif s is _ORPHAN:
                yes = False
            elif self._orphans:
                yes = True  # something already ranks below every stream
            else:
                if bar is None:
                    bar = self._admission_bar()
                first, head = bar
                if head is None:
                    yes = True
                elif first is s:
                    yes = depth < s.cursor  # its own stream goes first: only if it is not the deepest
                else:
                    yes = above.get(s)  # type: ignore[assignment]
                    if yes is None:
                        yes = above[s] = self._rank_of(s) > head
            if yes:
                admitted(key)
            answers.append(yes)
        if unhinted:
            for i, yes in zip(unhinted, self.inner.admit([keys[i] for i in unhinted])):
                answers[i] = yes
        return answers

    def _admission_bar(self) -> tuple[_Stream | None, Rank | None]:
        """The first stream to go and the rank a full tier's demotion must beat (None: nothing ranked)."""
        first = self._order.first()
        head = first.rank if first is not None else None
        if len(self._resident) > self._hinted_resident and (head is None or _UNHINTED_RANK < head):
            head = _UNHINTED_RANK
        return first, head


# The owner of a hinted resident block whose stream let it go (an older branch, a forgotten stream).
_ORPHAN = _Stream((b"", b""))


def _event_live(event: tuple[float, int, _Stream, int]) -> bool:
    """Whether an event can still change a rank (``_advance`` skips the others, or finds nothing to do)."""
    at_s, _, s, epoch = event
    if s.age_epoch < 0:
        return False  # a forgotten stream
    if epoch >= 0:
        return epoch == s.age_epoch
    return at_s == s.retain_until_s


def _cached(s: _Stream) -> bool:
    """Whether any block of the stream is still cached: here, or as an evicted spare in the GPU tier."""
    return s.resident_blocks > 0 or s.above_blocks > 0
