"""``kvtier replay --hints`` and ``--retain-s``: the trace's ``session`` field reaches the policy as
``RequestHints``, sweeps and plots carry one curve per policy and hint set, and on a trace where
knowing the sessions provably helps, ``+session`` turns it into hits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.tools import cli
from kvtier.tools.replay import ReplayConfig, replay
from kvtier.tools.replay.core import request_hints
from kvtier.tools.traces import Request, TraceError, load_trace

BLOCK = 4


def agent_trace() -> list[dict]:
    """Two fast sessions that call back every 10 s and thirty slow ones that call back every 100 s
    (three of them in each 10 s), each asking for its own 4-block chain again and again. The cache
    (4 GPU + 8 CPU blocks) holds about two chains. Between two requests of a fast session, 16 other blocks
    are asked for, so recency keeps nothing that returns (LRU: no hits at all once warm); an order
    by expected next use keeps the two fast sessions: 8 of every 20 blocks hit."""
    lines: list[dict] = []

    def ask(session: int, t_s: float) -> None:
        ids = [session * 10 + i for i in range(4)]
        lines.append({"timestamp": int(t_s * 1000), "input_length": 4 * BLOCK, "output_length": 1,
                      "hash_ids": ids, "session": session, "subagent": int(session == 1)})

    for step in range(100):
        t = step * 10.0
        ask(0, t)
        ask(1, t + 1)
        for j in range(3):
            ask(2 + (step * 3 + j) % 30, t + 2 + j)
    return lines


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hints") / "agents.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in agent_trace()))
    return path


def rate(trace: Path, policy: str, hints: str, retain_s: float = 0.0) -> float:
    reqs = load_trace(trace, BLOCK)
    return replay(reqs, ReplayConfig(4, 8, policy, BLOCK, 64, hints, retain_s)).block_hit_rate()


def test_the_reader_keeps_session_and_subagent(trace: Path) -> None:
    reqs = load_trace(trace, BLOCK)
    assert {r.session for r in reqs} == set(range(32)) and [r.subagent for r in reqs[:3]] == [False, True, False]
    h = request_hints(reqs[0], ReplayConfig(2, 4, "chain+session", BLOCK, 64, "session"))
    assert h is not None and h.session == str(reqs[0].session).encode() and h.at_s == reqs[0].timestamp / 1000
    assert request_hints(reqs[0], ReplayConfig(2, 4, "chain", BLOCK, 64, "none")) is None
    ttl = request_hints(reqs[0], ReplayConfig(2, 4, "chain", BLOCK, 64, "none", 30.0))
    assert ttl is not None and ttl.session is None and ttl.retain_s == 30.0 and ttl.output_tokens == 0
    assert h.output_tokens == 0  # "session": the key alone
    out = request_hints(reqs[0], ReplayConfig(2, 4, "chain+session", BLOCK, 64, "session+output"))
    assert out is not None and out.session == h.session and out.output_tokens == reqs[0].output_length == 1


def test_bad_session_fields_are_named(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 4, "hash_ids": [1], "subagent": 2}\n')
    with pytest.raises(TraceError, match="subagent"):
        load_trace(p, BLOCK)
    p.write_text('{"timestamp": 0, "input_length": 4, "hash_ids": [1], "session": -1}\n')
    with pytest.raises(TraceError, match="session"):
        load_trace(p, BLOCK)


@pytest.mark.parametrize("inner", ["chain", "lru"])
def test_session_hints_raise_the_hit_rate_where_sessions_tell_what_returns(trace: Path, inner: str) -> None:
    without = rate(trace, f"{inner}+session", "none")
    assert without == rate(trace, inner, "none")  # no hints: exactly the wrapped policy
    with_hints = rate(trace, f"{inner}+session", "session")
    assert with_hints > 0.35 and with_hints > without + 0.1, (without, with_hints)
    # Every answer here is one token long: the output class says nothing new.
    assert rate(trace, f"{inner}+session", "session+output") == with_hints
    if inner == "lru":
        assert without == 0.0  # recency keeps nothing that returns
    assert rate(trace, inner, "session") == without  # a policy without hints support ignores them


def test_cli_sweep_with_and_without_hints(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    rc = cli.main(["replay", str(trace), "--block-size", str(BLOCK), "--gpu-blocks", "4", "--cpu-blocks", "4,8",
                   "--sweep", "--policies", "chain,chain+session", "--hints", "none,session", "--jobs", "1",
                   "--json", str(out), "--plot", str(png), "-q"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "chain+session [session]" in text and "chain [session]" in text
    s = json.loads(out.read_text())
    assert s["hint_sets"] == ["none", "session"] and len(s["points"]) == 8
    assert png.stat().st_size > 1000


def test_cli_retain_s_what_if(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cli.main(["replay", str(trace), "--block-size", str(BLOCK), "--gpu-blocks", "4", "--cpu-blocks", "8",
              "--policy", "lru+session", "--retain-s", "60", "--json", str(out), "-q", "--no-belady"])
    r = json.loads(out.read_text())
    assert r["config"]["retain_s"] == 60.0 and r["config"]["hints"] == "none"


@pytest.mark.parametrize(
    "args, match",
    [
        (["--hints", "none,session"], "need --sweep"),
        (["--nodes", "2", "--hints", "session"], "--nodes does not take"),
    ],
)
def test_cli_hint_errors(trace: Path, args: list[str], match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        cli.main(["replay", str(trace), "--block-size", str(BLOCK), "-q", *args])


@pytest.mark.parametrize(
    "args, match",
    [
        (["--hints", "sessions"], "unknown hint set 'sessions'"),
        (["--retain-s", "-1"], "--retain-s must be a finite number >= 0"),
        (["--retain-s", "inf"], "--retain-s must be a finite number >= 0"),
        (["--retain-s", "soon"], "not a number of seconds"),
    ],
)
def test_cli_hint_argument_errors(trace: Path, args: list[str], match: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["replay", str(trace), "--block-size", str(BLOCK), "-q", *args])
    assert match in capsys.readouterr().err


def test_help_names_the_hint_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["replay", "--help"])
    text = capsys.readouterr().out
    assert "--hints" in text and "--retain-s" in text and "chain+session" in text
