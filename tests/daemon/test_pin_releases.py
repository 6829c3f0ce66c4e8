"""PinReleases: a pinning request under a released tag is stale when sent before the release; memory is bounded."""

from __future__ import annotations

from kvtier.daemon.clients.pin_releases import PinReleases


def test_only_requests_sent_before_the_latest_release_of_the_same_sessions_tag_are_stale() -> None:
    r = PinReleases()
    r.release("a" * 32, "req-1", 10)
    assert r.stale("a" * 32, "req-1", 9) and not r.stale("a" * 32, "req-1", 10) and not r.stale("a" * 32, "req-1", 11)
    assert not r.stale("b" * 32, "req-1", 9)  # another session's tag of the same name
    assert not r.stale("a" * 32, "req-2", 9)
    r.release("a" * 32, "req-1", 5)  # an older release read late moves nothing back
    assert r.stale("a" * 32, "req-1", 9)
    r.release("a" * 32, "req-1", 20)
    assert r.stale("a" * 32, "req-1", 19)
    long_tag = "\U0001f600" * 256
    r.release("a" * 32, long_tag, 7)
    assert r.stale("a" * 32, long_tag, 6) and len(r) == 2


def test_the_oldest_releases_are_forgotten_past_the_bound() -> None:
    r = PinReleases(max_entries=3)
    for i in range(10):
        r.release("s" * 32, f"t{i}", 100 + i)
    assert len(r) == 3
    assert not r.stale("s" * 32, "t0", 1)  # forgotten: a request that late pins as before
    assert r.stale("s" * 32, "t9", 1)
    r.release("s" * 32, "t7", 200)  # released again: the newest now
    r.release("s" * 32, "t10", 300)
    assert r.stale("s" * 32, "t7", 150) and not r.stale("s" * 32, "t8", 1)
