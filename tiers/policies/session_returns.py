"""What are a silent stream's cached blocks worth? A return model learned online, for ``+session``.

Contract
========

``ReturnModel`` estimates, for a stream of requests whose blocks are cached
and that has been silent for ``age_s`` seconds, the *hit density* of keeping
them: hits per second of cache time from now on,

    density(age) = P(it comes back before the cache lets it go | silent for age)
                   / E[seconds until it comes back or is let go | silent for age],

the quantity LHD ranks by (Beckmann et al., "LHD: Improving Cache Hit Rate
by Maximizing Hit Density", NSDI 2018), here per stream rather than per
object: under prefix-stop hits the blocks of a stream are worth what its next
request is worth, so they share one density. As in LHD a life in the cache
ends with a hit (the stream comes back while cached) or an eviction (its
last cached block goes), so a stream that never comes back costs what the
cache actually keeps it, not forever.

It is a discrete life table. Ages fall into buckets with geometric edges
(``AGE_EDGES_S``: 0, 1 s, 1.4 s, 2 s, ... 2**14 s; the last bucket is open).
Streams fall into classes (``stream_class``): the length of the stream's
latest silence (log2 buckets: think and tool time repeat, a stream that came
back in seconds tends to again), whether it was forked off another stream
(a sub-agent usually ends when it returns its result), whether another was
forked off it (its main agent waits for the sub-agent; a compacted context
is never asked for again), and the output length of its latest request, as
the engine reports it (``RequestHints.output_tokens``; factor-4 buckets:
< 256 tokens, < 1024, more; not reported counts as the first): the answer's
generation is part of the silence that follows. Main-agent requests of the
Claude Code trace: the next request came after 8 s or more (10th percentile)
following < 256 output tokens, after 44 s or more following >= 2048. Per
class and bucket it counts

- ``at_risk``: silences that reached that age (the caller reports each
  request, ``on_request``, and each bucket edge a silence crosses, ``on_age``),
  and ``cached_at_risk``: those of streams with blocks in the cache then;
- ``returned``: silences that ended with a request at an age in that bucket;
- ``evicted``: silences that ended with the stream's last cached block evicted.

The return hazard of bucket ``k`` is ``returned / at_risk`` over every
stream: when a stream comes back is its own habit, whether we cached it or
not, and learning it from cached streams only would never learn the habit of
a stream the cache gave up early (measured: a slower start and 0.005 less on
the Claude Code trace). The eviction hazard is ``evicted / cached_at_risk``,
the cache's own doing. A silence still running simply stops being counted
(censoring, as in any life table). Sparse classes borrow strength from the pooled
hazards of every class (a prior worth ``PRIOR_STREAMS`` silences), and
counts halve once ``HALF_LIFE_STREAMS`` silences started, so the model
follows a workload that drifts. Nothing here is fitted to a trace: the edges
are a geometric grid, the prior and the half-life are round numbers.

Streams of one class still differ in habit (one user thinks longer than
another; one repository's tests run slower), and a stream that came back
often has shown its own. ``own_densities(cls, own_returns)`` ranks such
a stream by its own life table: the caller keeps, per stream, how many of its
silences ended in each bucket, and its return hazard is its own, shrunk
towards its class's with a prior worth ``OWN_PRIOR_SILENCES`` silences, the
way a sparse class borrows from the pool. The eviction hazard stays the
class's: it is the cache's doing, not the stream's.

``refresh()`` recomputes the density table (O(classes x buckets)); the
caller decides when (the wrapper: every ``REFRESH_REQUESTS`` requests, and at
powers of two before that) and re-ranks its streams afterwards.
``density(cls, bucket)`` is a table lookup, ``own_densities`` O(buckets)
(``version`` counts refreshes, so a caller may cache its row); ``typical_density()`` is the
pooled density at age 0, the average stream's worth. Before anything was
learned every density is 0.0 (no preference).
"""

from __future__ import annotations

import bisect

__all__ = ["AGE_EDGES_S", "NUM_CLASSES", "OUTPUT_EDGES_TOKENS", "ReturnModel", "stream_class"]

# Bucket k holds ages in [AGE_EDGES_S[k], AGE_EDGES_S[k + 1]); the last is open-ended.
AGE_EDGES_S: tuple[float, ...] = (0.0,) + tuple(2.0 ** (i / 2) for i in range(29))  # 1 s .. 2**14 s
NUM_BUCKETS = len(AGE_EDGES_S)
_GAP_CLASSES = 14  # no return yet; then the latest silence in log2 buckets: < 2 s, 2-4 s, ..., >= 2**12 s
# The latest request's output tokens: < 256, < 1024, more (0, not reported, falls in the first). Chosen
# on half of the Claude Code file's sessions against log2 buckets from 128 (numbers in session.py).
OUTPUT_EDGES_TOKENS = (256, 1024)
NUM_CLASSES = 4 * _GAP_CLASSES * (len(OUTPUT_EDGES_TOKENS) + 1)  # x forked x parent x output
PRIOR_STREAMS = 4.0
# A stream's own returns outweigh its class's hazard after this many. The one constant here chosen
# by measurement: the best of 4, 8, 16 and 32 on half of the Claude Code file's sessions, checked on
# the other half (numbers in tiers/policies/session.py).
OWN_PRIOR_SILENCES = 16.0
HALF_LIFE_STREAMS = 4096.0
REFRESH_REQUESTS = 128


def stream_class(last_gap_s: float | None, forked: bool, parent: bool, output_tokens: int = 0) -> int:
    """The class of a stream whose latest silence lasted ``last_gap_s`` (None: no return yet), that was
    forked off another stream or not, that another stream was forked off or not, and whose latest
    request generated ``output_tokens`` (0: not reported). Without output reports every class is
    one of the first ``4 * _GAP_CLASSES``: the classes, and the model, are those of gap and fork alone."""
    c = 0 if last_gap_s is None else min(max(1, int(last_gap_s).bit_length()), _GAP_CLASSES - 1)
    c += (_GAP_CLASSES if forked else 0) + (2 * _GAP_CLASSES if parent else 0)
    return c + 4 * _GAP_CLASSES * bisect.bisect_right(OUTPUT_EDGES_TOKENS, output_tokens)


def age_bucket(age_s: float) -> int:
    """The bucket of a silence of ``age_s`` seconds."""
    return max(0, bisect.bisect_right(AGE_EDGES_S, age_s) - 1)


def _width_s(bucket: int) -> float:
    if bucket + 1 < NUM_BUCKETS:
        return AGE_EDGES_S[bucket + 1] - AGE_EDGES_S[bucket]
    return AGE_EDGES_S[bucket]  # the open bucket counts as one more doubling, then the stream is gone


class ReturnModel:
    """Online life table of stream returns and the hit density it implies. See the module docstring."""

    def __init__(self) -> None:
        self.at_risk = [[0.0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self.cached_at_risk = [[0.0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self.returned = [[0.0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self.evicted = [[0.0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self._table = [[0.0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self._pooled_table = [0.0] * NUM_BUCKETS
        self._return_hazard = [[0.0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self._evict_hazard = [[0.0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self.version = 0  # bumped by every refresh: densities computed before it are stale

    def on_request(self, cls: int, cached: bool = True) -> None:
        """A stream of class ``cls`` made a request: it is at risk of returning from age 0."""
        self.at_risk[cls][0] += 1.0
        if cached:
            self.cached_at_risk[cls][0] += 1.0

    def on_age(self, cls: int, bucket: int, cached: bool = True) -> None:
        """A silent stream of class ``cls`` reached ``bucket`` (its lower edge) without a request."""
        self.at_risk[cls][bucket] += 1.0
        if cached:
            self.cached_at_risk[cls][bucket] += 1.0

    def on_return(self, cls: int, bucket: int) -> None:
        """A stream of class ``cls`` came back after a silence in ``bucket``."""
        self.returned[cls][bucket] += 1.0

    def on_evict(self, cls: int, bucket: int) -> None:
        """A silent stream of class ``cls`` lost its last cached block in ``bucket``: its blocks' life
        in the cache ended without a hit."""
        self.evicted[cls][bucket] += 1.0

    def density(self, cls: int, bucket: int) -> float:
        return self._table[cls][bucket]

    def own_densities(self, cls: int, own_returns: list[int]) -> list[float]:
        """``density(cls, k)`` for every bucket ``k``, for one stream with a history of its own:
        ``own_returns[k]`` of its earlier silences ended with a return in bucket ``k``. Its return
        hazard in bucket ``k`` is its own (returns there over its silences that reached ``k``), shrunk
        towards its class's with a prior worth ``OWN_PRIOR_SILENCES`` silences; its eviction hazard is
        its class's (the cache's doing, not the stream's). With no own returns it is its class's row.
        O(NUM_BUCKETS); valid until the next ``refresh``."""
        rh = self._return_hazard[cls]
        m = OWN_PRIOR_SILENCES
        hazard = [0.0] * NUM_BUCKETS
        reached = 0  # its silences that reached bucket k: those that ended there or later
        for k in range(NUM_BUCKETS - 1, -1, -1):
            reached += own_returns[k]
            hazard[k] = (own_returns[k] + m * rh[k]) / (reached + m)
        return _densities(hazard, self._evict_hazard[cls])

    def typical_density(self) -> float:
        """The density of an average stream over its whole silence: the pooled class at age 0, i.e.
        returns per second of silence, all streams together. The wrapper ranks blocks no hinted
        request named at this value: a stream below it is worth less than an average one."""
        return self._pooled_table[0]

    def refresh(self) -> None:
        """Recompute the density table from the counts, then age the counts."""
        def pooled(rows: list[list[float]]) -> list[float]:
            return [sum(rows[c][k] for c in range(NUM_CLASSES)) for k in range(NUM_BUCKETS)]

        risk_pooled = pooled(self.at_risk)
        cached_pooled = pooled(self.cached_at_risk)
        ret_hazard = [r / n if n > 0 else 0.0 for r, n in zip(pooled(self.returned), risk_pooled)]
        ev_hazard = [e / n if n > 0 else 0.0 for e, n in zip(pooled(self.evicted), cached_pooled)]
        self._pooled_table = _densities(ret_hazard, ev_hazard)
        m = PRIOR_STREAMS
        for c in range(NUM_CLASSES):
            risk, cached, ret, ev = self.at_risk[c], self.cached_at_risk[c], self.returned[c], self.evicted[c]
            if not any(risk) and not any(ret) and not any(ev):
                # Nothing seen in this class (most output classes without output reports): the prior is all.
                self._return_hazard[c], self._evict_hazard[c] = ret_hazard, ev_hazard
                self._table[c] = self._pooled_table
                continue
            rh = [(ret[k] + m * ret_hazard[k]) / (risk[k] + m) for k in range(NUM_BUCKETS)]
            eh = [(ev[k] + m * ev_hazard[k]) / (cached[k] + m) for k in range(NUM_BUCKETS)]
            self._return_hazard[c], self._evict_hazard[c] = rh, eh
            self._table[c] = _densities(rh, eh)
        self.version += 1
        if risk_pooled[0] > HALF_LIFE_STREAMS:
            for rows in (self.at_risk, self.cached_at_risk, self.returned, self.evicted):
                for row in rows:
                    for k in range(NUM_BUCKETS):
                        row[k] *= 0.5


def _densities(return_hazard: list[float], evict_hazard: list[float]) -> list[float]:
    """Per bucket: P(a return before the eviction) / E[seconds in the cache until either], by backward
    recursion (LHD's hit density). A life that ends inside a bucket counts half of it."""
    out = [0.0] * NUM_BUCKETS
    p_hit, life_s = 0.0, 0.0
    for k in range(NUM_BUCKETS - 1, -1, -1):
        hit = min(max(return_hazard[k], 0.0), 1.0)
        end = min(hit + max(evict_hazard[k], 0.0), 1.0)
        p_hit = hit + (1.0 - end) * p_hit
        life_s = _width_s(k) * (1.0 - end / 2) + (1.0 - end) * life_s
        out[k] = p_hit / life_s if life_s > 0 else 0.0
    return out
