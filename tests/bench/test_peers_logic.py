"""bench/peers.py without engines: its prompts, its answer check and its verdicts on the targets.

The benchmark itself takes an hour and more (vLLM engines on 2 cores), so
the suite does not run it; what decides its tables is plain code and is
checked here: every turn's prompt extends the previous one (else no cache
could serve a conversation), a salted probe is judged against the
recompute of the same tokens, and a target is "met" exactly when kvtier's
number is on the right side of every other system's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))  # at the end: first, bench/vllm.py would shadow vLLM

import peers  # noqa: E402
from peers_workloads import Tokens, conversations, single_prefix, turn_major, turn_prompt  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 4), turns=st.integers(1, 4), doc=st.integers(1, 300), user=st.integers(1, 40),
       reply=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_every_turn_extends_the_previous_one(n: int, turns: int, doc: int, user: int, reply: int, seed: int) -> None:
    convs = conversations(Tokens(seed, 8192), n, turns, doc, user, reply)
    sent = turn_major(convs, turns, "multi", 3)
    assert [(c, t) for c, t, _ in sent] == [(c, t) for t in range(1, turns + 1) for c in range(n)]
    for conv in convs:
        prev = turn_prompt(conv, 1, "x", 3).tokens
        assert prev == conv.document + conv.users[0]
        for t in range(2, turns + 2):
            cur = turn_prompt(conv, t, "x", 3).tokens
            assert cur[:len(prev)] == prev
            assert len(cur) == len(prev) + reply + user
            prev = cur
    again = conversations(Tokens(seed, 8192), n, turns, doc, user, reply)
    assert [c.document for c in again] == [c.document for c in convs]


def test_single_prefix_prompts_share_the_prefix_and_differ_after_it() -> None:
    s = single_prefix(Tokens(0, 8192), 256, 32, 3)
    prompts = [s.first, *s.reps, *s.hits]
    assert all(p.tokens[:256] == s.prefix and len(p.tokens) == 288 for p in prompts)
    assert len({tuple(p.tokens) for p in prompts}) == len(prompts)
    assert len({p.key() for p in prompts}) == len(prompts)


def record(system: str, phase: str, pid: str, key: str, answer: list[int], *, ttft_s: float = 0.1,
           e2e_s: float = 0.2, cached: int = 0, prompt: int = 100, round_no: int = 0) -> dict:
    return {"system": system, "phase": phase, "pid": pid, "key": key, "answer": answer, "ttft_s": ttft_s,
            "e2e_s": e2e_s, "cached_tokens": cached, "prompt_tokens": prompt, "round": round_no, "load1": 1.0,
            "breakdown": {}}


def test_answers_are_checked_against_the_recompute_of_the_same_tokens() -> None:
    recs = [record("recompute", "single", "single/r0", "k0", [5]),
            record("recompute", "multi", "multi/c0/t1", "k1", [1, 2, 3]),
            record("kvtier", "single", "single/r0", "k0", [5]),
            record("kvtier", "salt", "salt/other", "k0", [6]),  # same tokens as single/r0, another answer
            record("kvtier", "multi", "multi/c0/t1", "k1", [1, 2, 4]),  # the first token right, the third not
            record("kvtier", "pair", "pair/c0/t1", "k9", [7])]  # no reference
    s = peers.summarize(recs, [], ["kvtier", "recompute"])
    by_pid = {r["pid"]: r for r in recs if r["system"] == "kvtier"}
    assert by_pid["single/r0"]["same_answer"] is True
    assert by_pid["salt/other"]["same_answer"] is False
    assert by_pid["multi/c0/t1"]["same_answer"] is False and by_pid["multi/c0/t1"]["same_first_token"] is True
    assert by_pid["pair/c0/t1"]["same_answer"] is None
    assert s["kvtier"]["single"]["same_answer"] == "1/1"
    assert s["kvtier"]["multi"]["same_answer"] == "0/1"
    assert s["kvtier"]["pair"]["same_answer"] is None
    assert s["kvtier"]["salt"]["same_answer"] == [False]


def test_salt_isolation_is_judged_on_the_other_salts_probe() -> None:
    recs = [record("lmcache", "salt", "salt/other", "k", [1], cached=1024),
            record("lmcache", "salt", "salt/same", "k2", [1], cached=1024),
            record("kvtier", "salt", "salt/other", "k", [1], cached=0),
            record("kvtier", "salt", "salt/same", "k2", [1], cached=1024)]
    s = peers.summarize(recs, [], ["kvtier", "lmcache"])
    assert s["kvtier"]["salt"]["isolated"] is True
    assert s["lmcache"]["salt"]["isolated"] is False
    assert s["lmcache"]["salt"]["other_salt_cached_tokens"] == [1024]


def summary_with(single: dict[str, float], multi_total: dict[str, float], multi_ttft: dict[str, list[float]],
                 pair_cached: dict[str, int]) -> dict:
    recs = []
    for system, ms in single.items():
        recs.append(record(system, "single", "single/r0", "a", [1], ttft_s=ms / 1e3))
    for system, total in multi_total.items():
        ttfts = multi_ttft[system]
        for i, t in enumerate(ttfts):
            recs.append(record(system, "multi", f"multi/c{i}/t{1 + i % 2}", f"m{i}", [1], ttft_s=t / 1e3,
                               e2e_s=total / len(ttfts)))
    for system, cached in pair_cached.items():
        recs.append(record(system, "pair", "pair/c0/t2", "p", [1], cached=cached, prompt=1000))
    systems = sorted(set(single) | set(multi_total) | set(pair_cached))
    return peers.summarize(recs, [], systems)


def test_targets_met_only_when_kvtier_is_on_the_right_side_of_every_other() -> None:
    s = summary_with(single={"kvtier": 100, "lmcache": 101, "native": 120, "prefix_cache": 96},
                     multi_total={"kvtier": 10.0, "lmcache": 11.0, "recompute": 50.0},
                     multi_ttft={"kvtier": [1, 2, 3], "lmcache": [1, 2, 4], "recompute": [9, 9, 9]},
                     pair_cached={"kvtier": 900, "lmcache": 899, "native": 0})
    t = peers.targets(s)
    assert t["single_ttft_le_every_peer"]["met"] is True
    assert t["single_ttft_le_1.05x_prefix_cache"]["met"] is True  # 100 / 96 = 1.042
    assert t["multi_total_le_every_other"]["met"] is True
    assert t["multi_ttft_p90_le_every_other"]["met"] is True
    assert t["multi_later_turns_total_le_every_other (info)"]["met"] is True
    assert t["pair_hit_rate_above_every_other"]["met"] is True

    s = summary_with(single={"kvtier": 100, "lmcache": 99, "prefix_cache": 95},
                     multi_total={"kvtier": 10.0, "native": 9.9},
                     multi_ttft={"kvtier": [1, 2, 3], "native": [1, 2, 2]},
                     pair_cached={"kvtier": 900, "lmcache": 900})
    t = peers.targets(s)
    assert t["single_ttft_le_every_peer"]["met"] is False
    assert t["single_ttft_le_1.05x_prefix_cache"]["met"] is False  # 100 / 95 = 1.053
    assert t["multi_total_le_every_other"]["met"] is False
    assert t["multi_ttft_p90_le_every_other"]["met"] is False
    assert t["pair_hit_rate_above_every_other"]["met"] is False  # equal is not above


@pytest.mark.timeout(120)
def test_without_lmcache_the_error_says_how_to_set_it_up(tmp_path: Path) -> None:
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('lmcache'))"],
                           capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "None":
        pytest.skip("this interpreter has LMCache")
    out = subprocess.run([sys.executable, str(BENCH / "peers.py"), "--systems", "kvtier,lmcache",
                          "--json", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=100)
    assert out.returncode != 0
    assert "pip install --no-deps lmcache==0.5.6" in out.stderr and "--peers-python" in out.stderr
    assert not (tmp_path / "x.json").exists()


def run_json(systems: list[str], records: list[dict], **args: object) -> dict:
    base = {k: "0" for k in ("seed", "prefix_tokens", "suffix_tokens", "reps", "convs", "turns", "doc_tokens",
                             "user_tokens", "reply_tokens", "answer_tokens")}
    return {"args": base | {k: str(v) for k, v in args.items()}, "machine": {}, "systems": {s: {"name": s} for s in systems},
            "records": records,
            "phases": [{"system": s, "phase": "single", "round": 0, "load_before": [1.0]} for s in systems],
            "engines": [], "sidecars": [{"round": 0, "system": s} for s in systems], "wall_s": 1.0}


def test_merged_runs_keep_their_rounds_apart_and_share_one_reference() -> None:
    import peers_merge

    main = run_json(["kvtier", "lmcache", "native"],  # stopped early: native never measured
                    [record("kvtier", "single", "single/r0", "k0", [5], ttft_s=0.1),
                     record("lmcache", "single", "single/r0", "k0", [6], ttft_s=0.3)])
    again = run_json(["lmcache", "kvtier"], [record("kvtier", "single", "single/r0", "k0", [5], ttft_s=0.2),
                                             record("lmcache", "single", "single/r0", "k0", [5], ttft_s=0.5)])
    ref = run_json(["recompute"], [record("recompute", "single", "single/r0", "k0", [5])])
    out = peers_merge.merge([("main.partial.json", main), ("again.json", again), ("ref.json", ref)], [0, 1, 0])
    assert list(out["systems"]) == ["kvtier", "lmcache", "recompute"]  # native: no record, not a system
    assert [m["rounds"] for m in out["merged_from"]] == [[0], [1], [0]]
    assert [m["partial"] for m in out["merged_from"]] == [True, False, False]
    assert sorted(r["round"] for r in out["records"] if r["system"] == "kvtier") == [0, 1]
    assert main["records"][0]["round"] == 0  # the inputs are left alone
    s = peers.summarize(out["records"], out["phases"], list(out["systems"]))
    assert s["kvtier"]["single"]["rounds"] == 2 and s["kvtier"]["single"]["same_answer"] == "2/2"
    assert s["lmcache"]["single"]["same_answer"] == "1/2"  # the reference came from a third run
    assert s["kvtier"]["single"]["ttft_ms_median"] == pytest.approx(150.0)


def test_runs_of_other_prompts_are_not_merged() -> None:
    import peers_merge

    a = run_json(["kvtier"], [record("kvtier", "single", "single/r0", "k0", [5])], convs=3)
    b = run_json(["recompute"], [record("recompute", "single", "single/r0", "k0", [5])], convs=4)
    with pytest.raises(ValueError, match="convs"):
        peers_merge.merge([("a.json", a), ("b.json", b)], [0, 0])
