"""The fast inner loop's markers (tests/markers.py): where a test lives says which it gets."""

from __future__ import annotations

import pytest

import kvtier.testing.redis_servers as rs
from kvtier.testing.redis_servers import have_redis
from tests.markers import SLOW_FILES, markers_for


@pytest.mark.parametrize(("path", "expected"), [
    ("tests/stress/test_fuzz.py", {"stress", "slow"}),
    ("tests/stress/test_new_one.py", {"stress", "slow"}),  # a new file in the folder is marked too
    ("tests/integrations/test_vllm_worker.py", {"vllm", "slow"}),
    ("tests/examples/test_vllm_chat.py", {"vllm", "slow"}),
    ("tests/examples/test_a_new_example.py", set()),
    ("tests/tiers/test_block_manager.py", set()),
    ("tests/daemon/test_stress_words_in_a_name.py", set()),  # only the folder makes a stress test
    ("tests/test_plain_install.py", {"slow"}),
])
def test_a_test_is_marked_by_where_it_lives(path: str, expected: set[str]) -> None:
    assert markers_for(path, {}) == expected


@pytest.mark.parametrize("module_globals", [{"rs": rs}, {"have_redis": have_redis}, {"redis_servers": rs}])
def test_a_module_that_uses_the_redis_servers_is_marked_redis(module_globals: dict[str, object]) -> None:
    assert markers_for("tests/tiers/test_a_new_remote.py", module_globals) == {"redis"}
    assert markers_for("tests/integrations/test_vllm_nodes.py", module_globals) == {"redis", "vllm", "slow"}


def test_a_module_without_them_is_not_marked_redis() -> None:
    import json

    assert markers_for("tests/tiers/test_pool.py", {"json": json, "loads": json.loads, "n": 3}) == set()


def test_every_slow_file_exists(request: pytest.FixtureRequest) -> None:
    root = request.config.rootpath
    missing = sorted(p for p in SLOW_FILES if not (root / p).is_file())
    assert not missing, f"tests/markers.py SLOW_FILES names files that are gone: {missing}"


def test_the_suite_marks_its_redis_stress_and_vllm_tests(request: pytest.FixtureRequest) -> None:
    """This session's own items (whatever -m selected): each carries what its place says, slow included."""
    items = request.session.items
    assert items, "the session collected nothing"
    for item in items:
        path = item.path.relative_to(request.config.rootpath).as_posix()
        for name in markers_for(path, vars(item.module) if getattr(item, "module", None) else {}):
            assert item.get_closest_marker(name) is not None, (item.nodeid, name)


@pytest.mark.parametrize(("path", "markexpr", "never"), [
    ("tests/stress/test_fuzz.py", "not slow", True),
    ("tests/stress/test_fuzz.py", "not stress", True),
    ("tests/stress/test_fuzz.py", "stress", False),
    ("tests/stress/test_fuzz.py", "not slow or cuda", False),  # a cuda test in the file would be selected
    ("tests/stress/test_fuzz.py", "not redis", False),
    ("tests/integrations/test_vllm.py", "not vllm and not cuda", True),
    ("tests/integrations/test_vllm.py", "slow and not vllm", True),
    ("tests/tiers/test_pool.py", "not slow", False),  # nothing known from its path: pytest decides per test
    ("tests/tiers/test_policies_chain.py", "not slow", False),  # its own @slow test, and fast ones
    ("tests/test_plain_install.py", "not slow", True),
])
def test_a_file_is_left_uncollected_only_when_no_test_in_it_can_be_selected(path: str, markexpr: str,
                                                                             never: bool) -> None:
    from tests.markers import never_selected

    assert never_selected(path, markexpr) is never
