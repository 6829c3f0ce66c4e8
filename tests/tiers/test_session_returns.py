"""The return model of the ``+session`` wrapper (``kvtier.tiers.policies.session_returns``): a life
table of stream returns, and the hit density (returns per second of cache time) it implies."""

from __future__ import annotations

import pytest

from kvtier.tiers.policies.session_returns import (AGE_EDGES_S, HALF_LIFE_STREAMS, NUM_BUCKETS, NUM_CLASSES,
                                                   ReturnModel, age_bucket, stream_class)


def silences(model: ReturnModel, cls: int, count: int, *, return_s: float | None = None,
             evicted_s: float | None = None) -> None:
    """``count`` silences of class ``cls`` in the cache, each ending with a return after ``return_s`` or
    with the eviction of the stream's blocks after ``evicted_s`` (neither: it outlives the table)."""
    for _ in range(count):
        model.on_request(cls)
        end_s = return_s if return_s is not None else evicted_s
        last = age_bucket(end_s) if end_s is not None else NUM_BUCKETS - 1
        for k in range(1, last + 1):
            model.on_age(cls, k)
        if return_s is not None:
            model.on_return(cls, last)
        elif evicted_s is not None:
            model.on_evict(cls, last)


def test_age_buckets_are_a_geometric_grid_from_zero() -> None:
    assert AGE_EDGES_S[0] == 0.0 and AGE_EDGES_S[1] == 1.0 and AGE_EDGES_S[-1] == 2.0 ** 14
    assert [age_bucket(x) for x in (0.0, 0.99, 1.0, 1.5, 2.0, 1e9)] == [0, 0, 1, 2, 3, NUM_BUCKETS - 1]


def test_classes_are_distinct_and_in_range() -> None:
    seen = {stream_class(g, f, p, o) for g in (None, 0.5, 3.0, 100.0, 1e6) for f in (False, True) for p in (False, True)
            for o in (0, 300, 5000)}
    assert len(seen) == 60 and all(0 <= c < NUM_CLASSES for c in seen)


def test_without_output_reports_the_classes_are_those_of_gap_and_fork_alone() -> None:
    for g in (None, 0.5, 100.0):
        assert stream_class(g, True, False) == stream_class(g, True, False, 0) == stream_class(g, True, False, 255)
        assert stream_class(g, True, False, 256) != stream_class(g, True, False, 255)
        assert stream_class(g, True, False, 1024) != stream_class(g, True, False, 1023)


def test_nothing_learned_means_no_preference() -> None:
    model = ReturnModel()
    model.refresh()
    assert {model.density(c, k) for c in range(NUM_CLASSES) for k in range(NUM_BUCKETS)} == {0.0}
    assert model.typical_density() == 0.0


def test_a_class_that_returns_every_10_s_is_worth_about_a_tenth_of_a_return_per_second() -> None:
    model = ReturnModel()
    fast, slow = stream_class(10.0, False, False), stream_class(100.0, False, False)
    silences(model, fast, 200, return_s=10.0)
    silences(model, slow, 200, return_s=100.0)
    model.refresh()
    assert model.density(fast, 0) == pytest.approx(1 / 10, rel=0.3)
    assert model.density(slow, 0) == pytest.approx(1 / 100, rel=0.3)
    # the average stream lies between them
    assert model.density(slow, 0) < model.typical_density() < model.density(fast, 0)


def test_hits_per_second_of_cache_life_lhd() -> None:
    model = ReturnModel()
    cls = stream_class(10.0, False, False)
    silences(model, cls, 80, return_s=10.0)
    silences(model, cls, 20, evicted_s=60.0)  # a fifth never came back: the cache let them go at 60 s
    model.refresh()
    # 0.8 hits over 0.8 x 10 s + 0.2 x 60 s of cache life, up to the bucket grid
    assert model.density(cls, 0) == pytest.approx(0.8 / 20.0, rel=0.25)
    # past the ages this class ever came back at, keeping it brings nothing
    assert model.density(cls, age_bucket(30.0)) == 0.0


def test_a_stream_that_outlives_the_table_without_returning_is_worth_almost_nothing() -> None:
    model = ReturnModel()
    cls = stream_class(10.0, False, False)
    silences(model, cls, 80, return_s=10.0)
    silences(model, cls, 20)  # never evicted, never back: hours of cache for nothing
    model.refresh()
    assert model.density(cls, 0) < 0.01


def test_evictions_before_the_return_lower_the_chance_of_a_hit() -> None:
    model_a, model_b = ReturnModel(), ReturnModel()
    cls = stream_class(10.0, False, False)
    silences(model_a, cls, 100, return_s=10.0)
    silences(model_b, cls, 100, return_s=10.0)
    silences(model_b, cls, 100, evicted_s=5.0)  # as many that the cache let go before they came back
    model_a.refresh()
    model_b.refresh()
    assert model_b.density(cls, 0) < 0.75 * model_a.density(cls, 0)


def test_returns_are_learned_from_every_stream_evictions_from_cached_ones() -> None:
    model = ReturnModel()
    cls = stream_class(10.0, False, False)
    for _ in range(100):  # never cached: they still show the class comes back every 10 s
        model.on_request(cls, cached=False)
        for k in range(1, age_bucket(10.0) + 1):
            model.on_age(cls, k, cached=False)
        model.on_return(cls, age_bucket(10.0))
    model.refresh()
    assert model.density(cls, 0) == pytest.approx(1 / 10, rel=0.3)
    assert sum(model.cached_at_risk[cls]) == 0.0 and sum(model.at_risk[cls]) > 100


def test_a_sparse_class_borrows_the_pooled_hazard() -> None:
    model = ReturnModel()
    common, rare = stream_class(10.0, False, False), stream_class(10.0, True, True)
    silences(model, common, 200, return_s=10.0)
    silences(model, rare, 1, return_s=10.0)
    model.refresh()
    assert model.density(rare, 0) == pytest.approx(model.density(common, 0), rel=0.2)


def test_counts_halve_once_enough_streams_were_seen() -> None:
    model = ReturnModel()
    cls = stream_class(10.0, False, False)
    silences(model, cls, int(HALF_LIFE_STREAMS) + 1, return_s=10.0)
    before = model.at_risk[cls][0]
    model.refresh()
    assert model.at_risk[cls][0] == before / 2 and model.returned[cls][age_bucket(10.0)] == pytest.approx(before / 2)


def test_a_stream_with_no_returns_of_its_own_is_worth_its_class() -> None:
    model = ReturnModel()
    cls = stream_class(10.0, False, False)
    silences(model, cls, 80, return_s=10.0)
    silences(model, cls, 20, evicted_s=60.0)
    model.refresh()
    none = [0] * NUM_BUCKETS
    assert model.own_densities(cls, none) == [model.density(cls, k) for k in range(NUM_BUCKETS)]


def test_a_stream_is_ranked_by_its_own_habit_once_it_showed_one() -> None:
    model = ReturnModel()
    cls = stream_class(10.0, False, False)
    silences(model, cls, 200, return_s=10.0)  # its class comes back after 10 s or not at all
    silences(model, cls, 50, evicted_s=300.0)
    model.refresh()
    slow = [0] * NUM_BUCKETS
    slow[age_bucket(100.0)] = 3
    # three returns after 100 s already pull it below its class; three hundred make it a 100-s stream
    assert model.own_densities(cls, slow)[0] < 0.8 * model.density(cls, 0)
    slow[age_bucket(100.0)] = 300
    assert model.own_densities(cls, slow)[0] == pytest.approx(1 / 100, rel=0.3)
    # and past the ages its class comes back at, its own habit still says it will
    assert model.own_densities(cls, slow)[age_bucket(30.0)] > 0.0 == model.density(cls, age_bucket(30.0))


def test_every_refresh_moves_the_version() -> None:
    model = ReturnModel()
    before = model.version
    model.refresh()
    model.refresh()
    assert model.version == before + 2
