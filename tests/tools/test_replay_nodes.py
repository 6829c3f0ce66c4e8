"""Tests for `kvtier replay --nodes`: the simulated remote tier, node assignment, the multi-node replay, CLI.

The counts asserted on hand-made traces are worked out by hand in the
docstrings, not copied from a run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tools import cli
from kvtier.tools.replay import ReplayConfig, replay
from kvtier.tools.replay.nodes import (
    NodesConfig,
    SimulatedRemoteTier,
    assign_nodes,
    compare,
    hot_keys,
    run_nodes,
)
from kvtier.tools.traces import Request, load_trace, mooncake_key

DATA = Path(__file__).parent / "data"
HAND = DATA / "hand_mooncake.jsonl"
REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "traces" / "sample.jsonl"


def k(i: int) -> bytes:
    return mooncake_key(i)


def req(*ids: int, block_size: int = 4) -> Request:
    """A request whose full blocks are ``ids`` (chained ids, as in a Mooncake trace)."""
    return Request(0.0, len(ids) * block_size, 0, tuple(k(i) for i in ids))


def ids(keys: list[bytes]) -> list[int]:
    return [int.from_bytes(x, "little") for x in keys]


# ---- SimulatedRemoteTier -------------------------------------------------------------------


def test_remote_lru_evicts_least_recently_written() -> None:
    r = SimulatedRemoteTier(2)
    assert all(r.write_back(k(i), None) for i in (1, 2, 3))
    assert ids(r.keys()) == [2, 3] and r.stats()["evictions"] == 1
    assert r.exists_prefix([k(2), k(3)]) == 2 and r.exists_prefix([k(1), k(2)]) == 0


def test_remote_fetch_touches_exists_does_not() -> None:
    r = SimulatedRemoteTier(2)
    r.write_back(k(1))
    r.write_back(k(2))
    assert r.fetch([k(1), k(9)])[0] is not None and r.fetch([k(9)]) == [None]  # GET: 1 is now most recent
    r.write_back(k(3))
    assert ids(r.keys()) == [1, 3]  # 2 went, not 1
    assert r.exists_prefix([k(1)]) == 1  # EXISTS: no touch, 1 stays least recent
    r.write_back(k(4))
    assert ids(r.keys()) == [3, 4]
    s = r.stats()
    assert (s["remote_hits"], s["remote_misses"], s["evictions"], s["used_blocks"]) == (1, 2, 2, 2)


def test_remote_rewrite_refreshes_and_exists_stops_at_first_absent() -> None:
    r = SimulatedRemoteTier(2)
    r.write_back(k(1))
    r.write_back(k(2))
    r.write_back(k(1))  # a SET of a held key: most recent again, not added twice
    r.write_back(k(3))
    assert ids(r.keys()) == [1, 3] and r.stats()["writes_present"] == 1
    assert r.exists_prefix([k(1), k(2), k(3)]) == 1  # 3 is held but 2 is not: the prefix ends at 2
    assert r.fetch([k(1), k(2), k(3)])[1] is None


def test_remote_capacity_zero_and_unbounded() -> None:
    none = SimulatedRemoteTier(0)
    assert none.write_back(k(1)) is False and len(none) == 0 and none.stats()["writes_dropped_full"] == 1
    big = SimulatedRemoteTier()
    for i in range(10_000):
        big.write_back(k(i))
    assert len(big) == 10_000 and big.stats()["evictions"] == 0 and big.stats()["capacity_blocks"] is None
    with pytest.raises(ValueError):
        SimulatedRemoteTier(-1)


# ---- assignment ---------------------------------------------------------------------------


def test_round_robin_assignment() -> None:
    reqs = [req(1, 2)] * 7
    assert assign_nodes(reqs, 3, "round-robin") == [0, 1, 2, 0, 1, 2, 0]
    assert assign_nodes(reqs, 1, "hash") == [0] * 7


def test_hash_assignment_is_pinned_and_sticky() -> None:
    """2 nodes, 6 requests: block 0 is in all 6 (> 6/2): hot, skipped; block 1 is in 3 (not > 3).
    Conversation a is [0,1], [0,1,2], [0,1,2,3]; b is [0,5], [0,5,6]; [0] alone has no routing key and
    goes round-robin (the first such request: node 0). A conversation's node is xxh3-64 of its first
    non-hot block mod 2; the values are pinned: the rule must not depend on the process's hash salt."""
    reqs = [req(0, 1), req(0, 5), req(0, 1, 2), req(0), req(0, 5, 6), req(0, 1, 2, 3)]
    assert hot_keys(reqs, 2) == {k(0)}
    got = assign_nodes(reqs, 2, "hash")
    assert got == [1, 0, 1, 0, 0, 1]  # a on node 1, b on node 0, [0] round-robin -> node 0
    assert got == assign_nodes(reqs, 2, "hash", hot=frozenset({k(0)}))
    first = assign_nodes(reqs, 2, "first-block")
    assert len(set(first)) == 1  # every request starts with block 0: all on one node
    # 3 nodes: block 1 is now hot too (3 > 6/3), so a routes by block 2 and its first turn [0,1] is
    # round-robin; a's turns that contain block 2 still share a node.
    three = assign_nodes(reqs, 3, "hash")
    assert three[2] == three[5] and three[1] == three[4]


def test_hot_keys_threshold() -> None:
    reqs = [req(0, 1), req(0, 2), req(0, 1), req(7)]
    assert hot_keys(reqs, 2) == {k(0)}  # 3 of 4 > 2; block 1 is in 2 of 4, not more than 4/2
    assert hot_keys(reqs, 4) == {k(0), k(1)}  # more than 1 request
    assert hot_keys(reqs, 1) == frozenset()
    with pytest.raises(ValueError):
        assign_nodes(reqs, 2, "random")


# ---- the replay -----------------------------------------------------------------------------

SHARE = [req(1, 2), req(3, 4), req(5, 6), req(1, 2), req(1, 2)]
SHARE_NODES = [0, 0, 0, 1, 1]  # A = node 0, B = node 1
SMALL = ReplayConfig(gpu_blocks=2, cpu_blocks=2, policy="lru", block_size=4, block_bytes=100)


def test_two_nodes_share_a_prefix_through_the_remote_tier() -> None:
    """GPU 2, CPU 2 blocks per node, LRU. A runs [1,2], [3,4], [5,6]; then B runs [1,2] twice.

    A: [1,2] miss 2. [3,4] miss 2, evicts 2 then 1 (a chain's tail first) -> CPU A [2,1].
    [5,6] miss 2, evicts 4,3 -> demoted; CPU A is full: evicts 2 then 1 -> written back: remote [2,1].
    B: [1,2] is in no tier of B; the remote run is 2 -> fetched into CPU B (touching 1 then 2: remote
    [1,2]), restored: remote 2.
    B: [1,2] again: gpu 2. Totals: 10 looked up, gpu 2, remote 2, miss 6; 4 demotions (A), 2 restores
    (B), 2 CPU evictions and write-backs (A).
    Local (no remote): B's first [1,2] misses: gpu 2, miss 8.
    """
    remote = SimulatedRemoteTier()
    g = run_nodes(SHARE, SMALL, SHARE_NODES, 2, remote=remote)
    assert g["hit_blocks"] == {"gpu": 2, "cpu": 0, "remote": 2, "total": 4}
    assert (g["looked_up_blocks"], g["miss_blocks"]) == (10, 6)
    assert (g["demotions"], g["restores"], g["cpu_evictions"], g["remote_write_backs"]) == (4, 2, 2, 2)
    a, b = g["per_node"]
    assert (a["requests"], a["looked_up_blocks"], a["hit_blocks"]["total"]) == (3, 6, 0)
    assert b["hit_blocks"] == {"gpu": 2, "cpu": 0, "remote": 2, "total": 4}
    assert ids(remote.keys()) == [1, 2]
    s = g["remote"]
    assert (s["writes_done"], s["remote_hits"], s["exists_hit_blocks"]) == (2, 2, 2)
    assert g["block_hit_rate"]["remote"] == pytest.approx(2 / 10)
    assert g["token_hit_rate"]["total"] == pytest.approx(4 * 4 / 40)

    local = run_nodes(SHARE, SMALL, SHARE_NODES, 2)
    assert local["hit_blocks"] == {"gpu": 2, "cpu": 0, "remote": 0, "total": 2}
    assert local["miss_blocks"] == 8 and "remote" not in local


def test_remote_capacity_limits_the_sharing() -> None:
    """Same trace, remote capacity 1 block: A writes back 2 then 1, so 2 is evicted and 1 stays.
    B's first [1,2]: remote 1 (block 1), miss 1; 1 restore. Capacity 0: nothing is shared (gpu 2, miss 8)."""
    g = run_nodes(SHARE, SMALL, SHARE_NODES, 2, remote=SimulatedRemoteTier(1))
    assert g["hit_blocks"] == {"gpu": 2, "cpu": 0, "remote": 1, "total": 3}
    assert (g["miss_blocks"], g["restores"], g["remote"]["evictions"]) == (7, 1, 1)
    z = run_nodes(SHARE, SMALL, SHARE_NODES, 2, remote=SimulatedRemoteTier(0))
    assert z["hit_blocks"]["total"] == 2 and z["miss_blocks"] == 8 and z["remote_write_backs"] == 0


def test_write_through_shares_before_eviction() -> None:
    """A runs [1,2], then B runs [1,2]; A's GPU tier keeps [1,2], so nothing is evicted.
    Write-back on CPU eviction (the pool): the remote tier never sees [1,2], B misses 2.
    Write-through what-if: A's computed blocks reach the remote tier at once, B hits remote 2."""
    reqs, where = [req(1, 2), req(1, 2)], [0, 1]
    back = run_nodes(reqs, SMALL, where, 2, remote=SimulatedRemoteTier())
    assert back["hit_blocks"]["remote"] == 0 and back["miss_blocks"] == 4
    through = run_nodes(reqs, SMALL, where, 2, remote=SimulatedRemoteTier(), write_through=True)
    assert through["hit_blocks"]["remote"] == 2 and through["miss_blocks"] == 2


@pytest.mark.parametrize("path, block_size, gpu, cpu", [(HAND, 4, 3, 4), (SAMPLE, 512, 40, 200)])
def test_one_node_without_remote_is_the_single_node_replay(path: Path, block_size: int, gpu: int,
                                                           cpu: int) -> None:
    reqs = load_trace(path, block_size)
    cfg = ReplayConfig(gpu, cpu, "lru", block_size, 100)
    one = replay(reqs, cfg)
    got = run_nodes(reqs, cfg, [0] * len(reqs), 1)
    assert got["hit_blocks"] == {"gpu": one.hit_blocks_gpu, "cpu": one.hit_blocks_cpu, "remote": 0,
                                 "total": one.hit_blocks}
    assert (got["looked_up_blocks"], got["miss_blocks"], got["demotions"], got["restores"]) == (
        one.looked_up_blocks, one.miss_blocks, one.demotions, one.restores)
    assert got["truncated_requests"] == one.truncated_requests


_chains = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=6), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(paths=_chains, nodes=st.integers(1, 4), remote_blocks=st.sampled_from([None, 0, 1, 3, 8]),
       policy=st.sampled_from(["lru", "chain"]), seed=st.integers(0, 1000))
def test_counters_add_up(paths: list[list[int]], nodes: int, remote_blocks: int | None, policy: str,
                         seed: int) -> None:
    """Random chained requests (a request's ids are the prefix-closed path of choices), random nodes:
    every looked-up block is a hit in one tier or a miss, per node and in total."""
    reqs = []
    for p in paths:
        chain, node_id = [], 0
        for choice in p:
            node_id = node_id * 7 + choice + 1  # prefix-chained: equal id at position i iff equal prefixes
            chain.append(node_id)
        reqs.append(req(*chain))
    where = [(i * 31 + seed) % nodes for i in range(len(reqs))]
    cfg = ReplayConfig(2, 3, policy, 4, 100)
    for remote in (None, SimulatedRemoteTier(remote_blocks)):
        out = run_nodes(reqs, cfg, where, nodes, remote=remote)
        h = out["hit_blocks"]
        assert h["gpu"] + h["cpu"] + h["remote"] + out["miss_blocks"] == out["looked_up_blocks"]
        assert out["looked_up_blocks"] == sum(len(r.keys) for r in reqs)
        assert sum(n["looked_up_blocks"] for n in out["per_node"]) == out["looked_up_blocks"]
        assert sum(n["hit_blocks"]["total"] for n in out["per_node"]) == h["total"]
        if remote is None or remote_blocks == 0:
            assert h["remote"] == 0


def test_pool_fetch_of_a_cpu_held_block() -> None:
    """Block 2 is in the CPU tier, block 1 is not; both are in the remote tier. Allocating [1,2] fetches
    block 1 from the remote tier and takes block 2 from the CPU tier (not fetched twice)."""
    from kvtier.tiers.pool import PoolSpec, TieredPool

    remote = SimulatedRemoteTier()
    pool = TieredPool(PoolSpec("t", 4, 100), cpu_blocks=4, policy="lru", transfer=None, data=False,
                      clean_ahead_blocks=0, remote=remote)
    pool.store([k(2)], None, [0])  # no GPU tier yet: lands in the CPU tier
    pool.attach_gpu(num_blocks=4)
    remote.write_back(k(1))
    remote.write_back(k(2))
    op = pool.allocate("r", [k(1), k(2)], 8)
    assert op.result["tiers"] == ["remote", "cpu"]
    assert remote.stats()["remote_hits"] == 1  # block 2 came from the CPU tier, not fetched again


# ---- compare and CLI -------------------------------------------------------------------------


def test_compare_runs_local_global_and_one_cache() -> None:
    reqs = load_trace(HAND, 4)
    cfg = NodesConfig(2, ReplayConfig(3, 4, "lru", 4, 100), remote_blocks=8, assign=("hash", "round-robin"),
                      write_through=True)
    r = compare(reqs, cfg, progress=False)
    assert set(r["assign"]) == {"hash", "round-robin"}
    for d in r["assign"].values():
        assert set(d) == {"requests_per_node", "local", "global", "global_write_through"}
        assert d["local"]["hit_blocks"]["remote"] == 0
        assert d["local"]["looked_up_blocks"] == d["global"]["looked_up_blocks"] == 19
    one = r["one_global_cache"]
    assert (one["config"]["gpu_blocks"], one["config"]["cpu_blocks"]) == (6, 8)
    assert r["infinite"]["hit_blocks"] == 9  # test_replay.test_hand_bounds
    with pytest.raises(ValueError):
        NodesConfig(0, ReplayConfig(3, 4), None)
    with pytest.raises(ValueError):
        NodesConfig(2, ReplayConfig(3, 4), None, assign=("nope",))


def test_cli_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nodes.json"
    rc = cli.main(["replay", str(HAND), "--block-size", "4", "--gpu-blocks", "3", "--cpu-blocks", "4",
                   "--policy", "lru", "--nodes", "2", "--assign", "hash,round-robin", "--json", str(out), "-q"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "local, hash" in text and "global (+remote), round-robin" in text and "one global cache" in text
    assert "Mooncake" in text
    r = json.loads(out.read_text())
    assert r["nodes"] == 2 and r["remote_blocks"] == 8  # default: the nodes' CPU tiers together
    assert r["node"]["policy"] == "lru" and r["mooncake_reference"]["global_hit_rate"] == 0.375
    cli.main(["replay", str(HAND), "--block-size", "4", "--gpu-blocks", "3", "--cpu-blocks", "4", "--nodes", "3",
              "--remote-tokens", "unbounded", "--json", str(out), "-q"])
    r = json.loads(out.read_text())
    assert r["remote_blocks"] is None and list(r["assign"]) == ["hash"]
    cli.main(["replay", str(HAND), "--block-size", "4", "--gpu-blocks", "3", "--nodes", "2",
              "--remote-tokens", "20", "--json", str(out), "-q"])
    assert json.loads(out.read_text())["remote_blocks"] == 5


@pytest.mark.parametrize("extra, match", [
    (["--remote-tokens", "1M"], "need --nodes"),
    (["--nodes", "2", "--sweep"], "does not combine"),
    (["--nodes", "0"], ">= 1"),
])
def test_cli_nodes_errors(extra: list[str], match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        cli.main(["replay", str(HAND), "--block-size", "4", "--gpu-blocks", "3", *extra])


def test_cli_bad_assign(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["replay", str(HAND), "--nodes", "2", "--assign", "random"])
    assert "unknown assignment" in capsys.readouterr().err
