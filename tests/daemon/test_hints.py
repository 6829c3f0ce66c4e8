"""Hints on the wire (feature "hints") against a live kvtierd, and the daemon's bounds on them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvtier.client.client import Client, DaemonError, PoolLayout
from kvtier.client.protocol import FEATURE_HINT_OUTPUT_TOKENS, FEATURE_HINTS, ErrorCode, HintFields, Hints, ProtocolError
from kvtier.daemon.clients import hints as daemon_hints
from kvtier.daemon.clients.retention import Retention
from kvtier.daemon.telemetry.metrics import Counters
from kvtier.tiers.hints import MAX_SESSION_KEY_BYTES

BLOCK_BYTES = 1024
GPU_BLOCKS = 4
CPU_BLOCKS = 16


def layout() -> PoolLayout:
    return PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                      kv_heads=1, head_dim=8, mode="store")


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    return kvtierd_module_factory(gpu_bytes=GPU_BLOCKS * BLOCK_BYTES, cpu_bytes=CPU_BLOCKS * BLOCK_BYTES)


def keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def test_hints_are_announced_and_taken_by_lookup_store_and_the_same_answers_come_back(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "hints-ok", layout()) as c:
        assert FEATURE_HINTS in c.features and FEATURE_HINT_OUTPUT_TOKENS in c.features
        h = Hints(session="conversation-7", retain_s=30.0, priority=3, output_tokens=700)
        ks = keys(1, 3)
        assert c.store(ks, [bytes([i]) * BLOCK_BYTES for i in range(3)], hints=h) == (3, 0)
        assert list(c.lookup(ks + keys(2, 1), hints=h)) == list(c.lookup(ks + keys(2, 1)))
        assert [list(t) for t in c.lookup_many([ks, ks[:1]], hints=[h, None])] == [["gpu"] * 3, ["gpu"]]
        got = c.restore(ks)
        assert bytes(got.data) == b"".join(bytes([i]) * BLOCK_BYTES for i in range(3))


@pytest.mark.parametrize("bad", [{"ttl": 5}, {"retain_s": -1}, {"retain_s": 10**9}, {"priority": 256},
                                 {"priority": -1}, {"session": ""}, {"session": 7}, {"session": "x" * 300},
                                 {"output_tokens": -1}, {"output_tokens": 2**31}, {"output_tokens": 1.5}])
def test_bad_hints_are_invalid_field_and_change_nothing(daemon, bad) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.endpoint, "hints-bad", layout()) as c:
        before = c.stats()["pools"]
        with pytest.raises(DaemonError) as err:
            c._call("lookup", {"hashes": keys(3, 2), "pin": False, "hints": bad})
        assert err.value.code == ErrorCode.INVALID_FIELD
        assert "hints." in str(err.value) or "hints" in str(err.value)
        assert c.stats()["pools"] == before  # not even counted as a lookup


@pytest.mark.parametrize("bad", [dict(retain_s=-1.0), dict(priority=256), dict(session=""), dict(output_tokens=-1)])
def test_the_client_refuses_the_same_hints_before_sending(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError) as err:
        Hints(**bad)
    assert err.value.code == ErrorCode.INVALID_FIELD


def test_output_tokens_reach_the_pool_and_are_not_sent_to_a_daemon_without_the_feature(daemon) -> None:  # type: ignore[no-untyped-def]
    m = Counters()
    h = daemon_hints.request_hints(HintFields(session="k", output_tokens=900), session(), entry(1), 1, m)
    assert h is not None and h.output_tokens == 900 and not h.continues
    with Client(daemon.endpoint, "hints-old", layout()) as c:
        fields = c._with_hints({}, Hints(session="s", output_tokens=900))
        assert fields["hints"] == {"session": "s", "output_tokens": 900}
        c._session.hint_output_tokens = False  # as a daemon that predates the feature left it
        assert c._with_hints({}, Hints(session="s", output_tokens=900))["hints"] == {"session": "s"}
        assert "hints" not in c._with_hints({}, Hints(output_tokens=900))  # nothing left to say


def test_a_session_retains_at_most_its_share_then_loses_only_retain_s(daemon) -> None:  # type: ignore[no-untyped-def]
    share = (GPU_BLOCKS + CPU_BLOCKS) // 2  # one session on the pool
    with Client(daemon.endpoint, "hints-share", layout()) as c:
        refused = c.stats()["daemon"].get("hints_retain_refused_total", 0)
        c.lookup(keys(4, share - 2), hints=Hints(session="s", retain_s=600))
        assert c.stats()["daemon"].get("hints_retain_refused_total", 0) == refused
        tiers = c.lookup(keys(5, 3), hints=Hints(session="s", retain_s=600))  # past the share: soft, no error
        assert list(tiers) == []
        assert c.stats()["daemon"]["hints_retain_refused_total"] == refused + 1


def entry(sessions: int) -> SimpleNamespace:
    return SimpleNamespace(capacity_blocks=GPU_BLOCKS + CPU_BLOCKS, sessions={f"s{i}" for i in range(sessions)})


def session(tenant: str = "") -> SimpleNamespace:
    return SimpleNamespace(tenant=tenant, retained=Retention())


def test_session_keys_are_scoped_to_the_tenant_and_at_s_is_the_daemons_clock() -> None:
    m = Counters()
    a = daemon_hints.request_hints(HintFields(session="k"), session("alice"), entry(1), 1, m, now_s=5.0)
    b = daemon_hints.request_hints(HintFields(session="k"), session("bob"), entry(1), 1, m, now_s=5.0)
    assert a is not None and b is not None and a.session != b.session and a.at_s == 5.0
    assert daemon_hints.request_hints(HintFields(), session(), entry(1), 1, m) is None
    assert daemon_hints.request_hints(None, session(), entry(1), 1, m) is None


def test_retention_is_cut_to_an_hour_and_shared_between_the_pools_sessions() -> None:
    m = Counters()
    s = session()
    h = daemon_hints.request_hints(HintFields(retain_s=86400.0), s, entry(1), 2, m, now_s=0.0)
    assert h is not None and h.retain_s == daemon_hints.MAX_RETAIN_S
    # Four sessions on the pool: a share of (4 + 16) / 2 / 4 = 2 blocks, already held.
    h = daemon_hints.request_hints(HintFields(retain_s=60.0, priority=1), s, entry(4), 1, m, now_s=1.0)
    assert h is not None and h.retain_s == 0.0 and h.priority == 1  # the other hints stay
    # Once the first retention expires, its blocks count no more.
    h = daemon_hints.request_hints(HintFields(retain_s=60.0), s, entry(4), 2, m, now_s=daemon_hints.MAX_RETAIN_S + 1)
    assert h is not None and h.retain_s == 60.0


def test_a_pinned_batch_with_a_256_character_session_is_answered_whole(daemon) -> None:  # type: ignore[no-untyped-def]
    """The batch of issue 32: one request's 256-character session was INTERNAL, and the batch failed with it."""
    with Client(daemon.endpoint, "hints-long", layout()) as c:
        ks = keys(7, 3)
        c.store(ks, bytes(3 * BLOCK_BYTES))
        answers = c.lookup_many([ks, ks, ks], pin=True,
                                hints=[None, Hints(session="x" * 256), Hints(session="\U0001f600" * 256)])
        assert [list(a) for a in answers] == [["gpu"] * 3] * 3  # type: ignore[arg-type]
        assert c.stats()["pools"]["hints-long"]["pinned_blocks"] == 9
        for _ in range(3):
            c.unpin(ks)
        assert c.stats()["pools"]["hints-long"]["pinned_blocks"] == 0


TENANT_NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", fullmatch=True) | st.just("")


@given(tenant=TENANT_NAMES, other=TENANT_NAMES, key=st.text(min_size=1, max_size=256))
@example(tenant="", other="a", key="x" * 256)  # the longest keys: hypothesis rarely draws them
@example(tenant="t" * 64, other="", key="\U0001f600" * 256)
def test_every_valid_session_key_of_every_tenant_makes_a_pool_key_within_the_tiers_bound(tenant: str, other: str,
                                                                                          key: str) -> None:
    m = Counters()
    h = daemon_hints.request_hints(HintFields(session=key), session(tenant), entry(1), 1, m)
    assert h is not None and h.session is not None and 0 < len(h.session) <= MAX_SESSION_KEY_BYTES
    again = daemon_hints.request_hints(HintFields(session=key), session(tenant), entry(1), 1, m)
    assert again is not None and again.session == h.session  # one key, one session
    theirs = daemon_hints.request_hints(HintFields(session=key), session(other), entry(1), 1, m)
    assert theirs is not None and (theirs.session == h.session) == (other == tenant)
