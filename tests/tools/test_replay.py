"""Tests for `kvtier replay`: trace readers, the replay accounting, bounds, sweep, CLI.

The hand-made traces under ``data/`` are worked through step by step in the
comments of the tests that use them; the numbers asserted are those worked
out by hand, not copied from a run.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.client.hashing import BlockHasher
from kvtier.tools import cli
from kvtier.tools.belady import belady, infinite_cache
from kvtier.tiers.units import parse_count as parse_size
from kvtier.tools.replay import ReplayConfig, replay, sweep
from kvtier.tools.traces import Request, TraceError, load_trace, mooncake_key

DATA = Path(__file__).parent / "data"
HAND = DATA / "hand_mooncake.jsonl"
TOKENS = DATA / "hand_tokens.jsonl"
REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "traces" / "sample.jsonl"
SHARED = Path("/work/shared/traces")
SHARED_TRACES = [SHARED / "mooncake_conversation_trace.jsonl", SHARED / "mooncake_synthetic_trace.jsonl"]


def k(i: int) -> bytes:
    return mooncake_key(i)


def counters(res) -> dict:
    return {
        "looked_up": res.looked_up_blocks,
        "gpu": res.hit_blocks_gpu,
        "cpu": res.hit_blocks_cpu,
        "miss": res.miss_blocks,
        "demotions": res.demotions,
        "restores": res.restores,
        "cpu_evictions": res.cpu_evictions,
        "truncated_requests": res.truncated_requests,
        "truncated_blocks": res.truncated_blocks,
    }


# ---- reference model for the cross-check ------------------------------------------------


def simple_lru_hits(requests: Sequence[Request], capacity: int) -> int:
    """ONE LRU cache of ``capacity`` blocks with the replay's accounting, written from scratch.

    Per request: the longest cached prefix hits (prefix-stop). Then the first
    ``capacity`` blocks are "allocated": the hit ones leave the LRU order
    (they are in use), the least recently used blocks are evicted until the
    request's blocks fit, and the blocks go back most-recent last-to-first,
    i.e. block 0 ends up most recently used (vLLM frees a request's blocks
    last to first onto the tail of the free queue).
    """
    od: OrderedDict[bytes, None] = OrderedDict()
    hits = 0
    for req in requests:
        keys = req.keys
        n_hit = 0
        for key in keys:
            if key not in od:
                break
            n_hit += 1
        hits += n_hit
        cached = keys[:capacity]
        for key in cached[:n_hit]:
            del od[key]
        while len(od) + len(cached) > capacity:
            od.popitem(last=False)
        for key in reversed(cached):
            od[key] = None
    return hits


# ---- trace readers -------------------------------------------------------------------------


def test_mooncake_reader_keeps_full_blocks_only() -> None:
    reqs = load_trace(HAND, block_size=4)
    assert len(reqs) == 7  # the blank line is skipped
    assert reqs[0].keys == (k(1), k(2))  # input 10 = 2 full blocks; id 3 is the partial one
    assert reqs[3].keys == (k(1), k(2), k(4))  # 13 tokens -> 3 full blocks, id 7 partial
    assert reqs[6].keys == (k(5), k(6), k(11), k(12))
    assert reqs[1].timestamp == 10 and reqs[1].input_length == 12 and reqs[1].output_length == 5
    assert k(7) == (7).to_bytes(16, "little")


def test_token_reader_uses_kvtier_hashing() -> None:
    reqs = load_trace(TOKENS, block_size=4)
    toks = [json.loads(line)["token_ids"] for line in TOKENS.read_text().splitlines()]
    hasher = BlockHasher(4)
    for req, t in zip(reqs, toks):
        assert list(req.keys) == hasher.hash_blocks(t)
        assert req.input_length == len(t)
    assert reqs[1].keys[:2] == reqs[0].keys  # shared 8-token prefix
    assert reqs[3].keys == reqs[1].keys


def test_gzip_trace_reads_the_same(tmp_path: Path) -> None:
    gz = tmp_path / "trace.data"  # detected by magic bytes, not the name
    with gzip.open(gz, "wb") as f:
        f.write(HAND.read_bytes())
    assert load_trace(gz, 4) == load_trace(HAND, 4)


@pytest.mark.parametrize(
    "line, match",
    [
        ("not json", "not JSON"),
        ('{"input_length": 4}', "hash_ids"),
        ('{"input_length": 12, "hash_ids": [1]}', "only 1 hash_ids"),
        ('{"input_length": 4, "hash_ids": [-1]}', "not an integer"),
        ('{"hash_ids": [1]}', "missing 'input_length'"),
        ('{"token_ids": "abc"}', "must be a list"),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, line: str, match: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input_length": 4, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=match) as exc:
        load_trace(p, 4)
    assert ":2:" in str(exc.value)


# ---- replay on hand-made traces ------------------------------------------------------------


def test_hand_trace_two_tier_lru() -> None:
    """GPU 3 blocks, CPU 4 blocks, LRU, block size 4. Worked by hand.

    Notation: GPU free queue head..tail as slot(hash); CPU LRU order first..last.
    R1 [1,2]       miss 2. Slots 0,1 get 1,2; freed 2 then 1: queue [s2(-), s1(2), s0(1)].
    R2 [1,2,4]     gpu 2 (1,2), miss 1 (4). s2 (no hash) gets 4: queue [s2(4), s1(2), s0(1)].
    R3 [5,6]       miss 2. Evicts 4 and 2 -> demoted: CPU [4,2]. queue [s0(1), s1(6), s2(5)].
    R4 [1,2,4]     gpu 1 (1), cpu 2 (2,4) -> restored; CPU hits recorded tail first, 4 then 2
                   (as vLLM frees): CPU [4,2]. Evicts 6 and 5 -> demoted into the 2 free slots:
                   CPU [4,2,6,5]. queue [s2(4), s1(2), s0(1)].
    R5 [8,9,10]    miss 3. Evicts 4, 2 (CPU holds them: no copy) and 1 -> demoted,
                   CPU full: evicts 4. CPU [2,6,5,1]. queue [s0(10), s1(9), s2(8)].
    R6 [1,2]       cpu 2 (1, 2): the head 1 and 2 behind it both survived. CPU hits 2 then 1.
                   Evicts 10, 9 -> demoted, CPU evicts 6 and 5 (2 and 1 are being restored).
                   CPU [2,1,10,9]. queue [s2(8), s1(2), s0(1)].
    R7 [5,6,11,12] 4 blocks > 3 GPU blocks: all looked up, miss 4 (5 and 6 were evicted);
                   only [5,6,11] allocated. Evicts 8 -> demoted, 2 and 1 (held, no copy);
                   CPU evicts 2. truncated: 1 request, 1 block.
    """
    res = replay(load_trace(HAND, 4), ReplayConfig(gpu_blocks=3, cpu_blocks=4, policy="lru", block_size=4,
                                                   block_bytes=1000))
    assert counters(res) == {
        "looked_up": 19,
        "gpu": 3,
        "cpu": 4,
        "miss": 12,
        "demotions": 8,
        "restores": 4,
        "cpu_evictions": 4,
        "truncated_requests": 1,
        "truncated_blocks": 1,
    }
    assert res.hit_blocks + res.miss_blocks == res.looked_up_blocks
    assert res.requests == 7 and res.input_tokens == 10 + 12 + 8 + 13 + 12 + 8 + 16
    assert res.block_hit_rate() == pytest.approx(7 / 19)
    assert res.block_hit_rate("gpu") == pytest.approx(3 / 19)
    assert res.token_hit_rate("cpu") == pytest.approx(4 * 4 / 79)
    assert res.bytes_gpu_to_cpu == 8000 and res.bytes_cpu_to_gpu == 4000


def test_hand_trace_gpu_only() -> None:
    """Same trace, GPU 3 blocks, no CPU tier: R2 hits 1,2; R4 hits 1 (2 was evicted by R3); R6 misses
    (R5 evicted everything); R7 misses. 3 hits of 19, equal to a plain LRU of 3 blocks."""
    reqs = load_trace(HAND, 4)
    res = replay(reqs, ReplayConfig(3, 0, "lru", 4))
    assert (res.hit_blocks_gpu, res.hit_blocks_cpu, res.miss_blocks) == (3, 0, 16)
    assert res.demotions == 0 and res.restores == 0
    assert simple_lru_hits(reqs, 3) == 3


def test_hand_token_trace() -> None:
    """Token ids, block size 4, GPU 2, CPU 2 (LRU). a0,a1 = A's blocks, b2 = B's third block, c0 = C's.
    A [a0,a1] miss 2. B [a0,a1,b2] (3 > 2 GPU blocks): gpu 2, miss 1, truncated. C [c0]: miss 1,
    evicts a1 -> CPU [a1]. D [a0,a1,b2]: gpu 1, cpu 1, miss 1, truncated; evicts c0 -> CPU [a1,c0]."""
    res = replay(load_trace(TOKENS, 4), ReplayConfig(2, 2, "lru", 4))
    assert (res.hit_blocks_gpu, res.hit_blocks_cpu, res.miss_blocks, res.looked_up_blocks) == (3, 1, 5, 9)
    assert (res.demotions, res.restores, res.truncated_requests, res.truncated_blocks) == (2, 1, 2, 2)


def test_hand_bounds() -> None:
    """Infinite: R2 2, R4 3, R6 2, R7 2 (5,6 seen in R3) = 9.
    Belady, 3 blocks: R1 caches 1,2; R2 hits 2 and caches 4; R3's 5,6 are next used by R7, later than
    everything held: bypassed; R4 hits 3; R5 replaces 4 (never used again) by 8; R6 hits 2; R7 0 = 7."""
    reqs = load_trace(HAND, 4)
    inf = infinite_cache(reqs, 4)
    assert (inf.hit_blocks, inf.looked_up_blocks) == (9, 19)
    assert belady(reqs, 3, 4).hit_blocks == 7
    assert belady(reqs, 0, 4).hit_blocks == 0
    assert belady(reqs, 100, 4).hit_blocks == 9  # large enough: the infinite bound


# ---- cross-checks on generated and shared traces --------------------------------------------


@st.composite
def chained_traces(draw) -> list[Request]:
    """Prefix-chained traces: each request extends, repeats or branches off an earlier one, or starts anew."""
    n = draw(st.integers(1, 40))
    reqs: list[list[int]] = []
    next_id = 0
    for _ in range(n):
        if reqs and draw(st.booleans()):
            base = draw(st.sampled_from(reqs))
            keep = draw(st.integers(0, len(base)))
            keys = base[:keep]
        else:
            keys = []
        extra = draw(st.integers(0 if keys else 1, 6))
        keys = keys + list(range(next_id, next_id + extra))
        next_id += extra
        reqs.append(keys)
    return [Request(float(i), 4 * len(r) + 1, 0, tuple(k(x) for x in r)) for i, r in enumerate(reqs)]


@settings(max_examples=150, deadline=None)
@given(chained_traces(), st.integers(1, 12))
def test_gpu_only_equals_single_lru(reqs: list[Request], capacity: int) -> None:
    res = replay(reqs, ReplayConfig(capacity, 0, "lru", 4))
    assert res.hit_blocks_gpu == simple_lru_hits(reqs, capacity)
    assert res.hit_blocks + res.miss_blocks == res.looked_up_blocks


@settings(max_examples=100, deadline=None)
@given(chained_traces(), st.integers(1, 8), st.integers(0, 30), st.sampled_from(["lru", "arc", "lru+admit2"]))
def test_bounds_hold(reqs: list[Request], gpu: int, cpu: int, policy: str) -> None:
    res = replay(reqs, ReplayConfig(gpu, cpu, policy, 4))
    inf = infinite_cache(reqs, 4)
    assert res.hit_blocks + res.miss_blocks == res.looked_up_blocks
    assert res.hit_blocks <= inf.hit_blocks
    assert belady(reqs, gpu + cpu, 4).hit_blocks <= inf.hit_blocks


@settings(max_examples=100, deadline=None)
@given(chained_traces())
def test_unbounded_cpu_reaches_the_infinite_bound(reqs: list[Request]) -> None:
    longest = max(len(r.keys) for r in reqs)
    res = replay(reqs, ReplayConfig(max(longest, 1), 10_000, "lru", 4))
    assert res.hit_blocks == infinite_cache(reqs, 4).hit_blocks


@pytest.fixture(scope="module", params=SHARED_TRACES, ids=lambda p: p.stem)
def shared_trace(request) -> list[Request]:
    if not request.param.exists():
        pytest.skip(f"{request.param} not present")
    return load_trace(request.param, 512)


def test_shared_gpu_only_lru_equals_single_lru(shared_trace: list[Request]) -> None:
    for capacity in (195, 1000):
        res = replay(shared_trace, ReplayConfig(capacity, 0, "lru"))
        assert res.hit_blocks_gpu == simple_lru_hits(shared_trace, capacity)


def test_shared_bounds(shared_trace: list[Request]) -> None:
    inf = infinite_cache(shared_trace)
    # GPU tier larger than any request, CPU tier that never fills: every block seen before hits.
    res = replay(shared_trace, ReplayConfig(400, 200_000, "lru"))
    assert res.hit_blocks == inf.hit_blocks and res.cpu_evictions == 0
    two_tier = replay(shared_trace, ReplayConfig(195, 5859, "lru"))
    bel = belady(shared_trace, 195 + 5859)
    assert simple_lru_hits(shared_trace, 195) < two_tier.hit_blocks < bel.hit_blocks <= inf.hit_blocks
    assert simple_lru_hits(shared_trace, 6054) <= bel.hit_blocks


def test_conversation_trace_replays_within_a_minute() -> None:
    path = SHARED_TRACES[0]
    if not path.exists():
        pytest.skip(f"{path} not present")
    reqs = load_trace(path)
    res = replay(reqs, ReplayConfig(195, 5859, "lru"))
    assert res.seconds < 60
    assert res.requests == 12031 and res.looked_up_blocks == 276_491


# ---- sweep, plots, command line ---------------------------------------------------------------


def test_sweep_points_and_bounds() -> None:
    reqs = load_trace(HAND, 4)
    out = sweep(reqs, gpu_blocks=3, cpu_blocks=[0, 4], policies=["lru", "arc"], block_size=4, jobs=1,
                progress=False)
    assert len(out["points"]) == 4
    by = {(p["config"]["policy"], p["config"]["cpu_blocks"]): p for p in out["points"]}
    assert by["lru", 4]["hit_blocks"] == {"gpu": 3, "cpu": 4, "total": 7}
    assert by["lru", 0]["hit_blocks"]["total"] == 3
    assert [b["capacity_blocks"] for b in out["belady"]] == [3, 7]
    assert out["belady"][0]["hit_blocks"] == 7
    assert out["infinite"]["hit_blocks"] == 9


def test_sweep_in_processes_matches_serial() -> None:
    reqs = load_trace(HAND, 4)
    kw = dict(gpu_blocks=3, cpu_blocks=[0, 2, 4], policies=["lru", "s3fifo"], block_size=4, progress=False)
    a, b = sweep(reqs, jobs=1, **kw), sweep(reqs, jobs=2, **kw)
    strip = lambda s: [{**p, "seconds": 0} for p in s["points"]]  # noqa: E731
    assert strip(a) == strip(b) and a["belady"] == b["belady"]


def test_cli_replay_json_and_plot(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = cli.main(["replay", str(HAND), "--block-size", "4", "--gpu-blocks", "3", "--cpu-blocks", "4", "--policy", "lru",
                   "--block-bytes", "1KB", "--json", str(out), "--plot", str(png), "-q"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "hit cpu" in text and "bound belady" in text
    r = json.loads(out.read_text())
    assert r["hit_blocks"] == {"gpu": 3, "cpu": 4, "total": 7}
    assert r["miss_blocks"] == 12 and r["looked_up_blocks"] == 19
    assert r["bytes"] == {"gpu_to_cpu": 8000, "cpu_to_gpu": 4000}
    assert r["bounds"]["infinite"]["hit_blocks"] == 9 and r["bounds"]["belady"]["capacity_blocks"] == 7
    assert r["accounting"] and r["config"]["policy"] == "lru"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_counts_are_decimal_and_bytes_are_kvtierds(tmp_path: Path) -> None:
    """One word, one meaning: 1k tokens is 1,000 tokens; 1k bytes is 1,024 bytes, as kvtierd reads it."""
    out = tmp_path / "r.json"
    cli.main(["replay", str(TOKENS), "--block-size", "4", "--gpu-tokens", "1k", "--cpu-blocks", "1k",
              "--block-bytes", "1k", "--json", str(out), "-q"])
    c = json.loads(out.read_text())["config"]
    assert (c["gpu_blocks"], c["cpu_blocks"], c["block_bytes"]) == (250, 1000, 1024)
    with pytest.raises(SystemExit):
        cli.main(["replay", str(TOKENS), "--block-bytes", "8 GiBs"])
    with pytest.raises(SystemExit):
        cli.main(["replay", str(TOKENS), "--gpu-tokens", "1.5"])


def test_cli_tokens_capacities(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    # 8 tokens = 2 blocks of 4 on the GPU, 9 tokens = 2 blocks on the CPU (rounded down).
    cli.main(["replay", str(TOKENS), "--block-size", "4", "--gpu-tokens", "8", "--cpu-tokens", "9", "--json",
              str(out), "-q"])
    r = json.loads(out.read_text())
    assert (r["config"]["gpu_blocks"], r["config"]["cpu_blocks"]) == (2, 2)
    assert r["hit_blocks"] == {"gpu": 3, "cpu": 1, "total": 4}


def test_cli_sweep(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    rc = cli.main(["replay", str(HAND), "--block-size", "4", "--gpu-blocks", "3", "--cpu-blocks", "0,2,4",
                   "--sweep", "--policies", "lru,lru+admit2", "--jobs", "1", "--json", str(out), "--plot",
                   str(png), "-q"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "lru+admit2" in text and "infinite cache" in text
    s = json.loads(out.read_text())
    assert s["cpu_blocks"] == [0, 2, 4] and len(s["points"]) == 6
    assert png.stat().st_size > 1000


def test_cli_json_to_stdout(capsys) -> None:
    cli.main(["replay", str(HAND), "--block-size", "4", "--gpu-blocks", "3", "--cpu-blocks", "4", "--json", "-",
              "-q", "--no-belady"])
    r = json.loads(capsys.readouterr().out)
    assert r["hit_blocks"]["total"] == 7 and "belady" not in r["bounds"]


@pytest.mark.parametrize(
    "args, match",
    [
        (["--policy", "nope"], "unknown eviction policy"),
        (["--cpu-blocks", "1,2"], "need --sweep"),
        (["--gpu-blocks", "0"], "at least one block"),
        (["--policies", "lru+admit2"], "--policies lists the policies of a --sweep"),  # was ignored silently
    ],
)
def test_cli_errors(args: list[str], match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        cli.main(["replay", str(HAND), "--block-size", "4", *args])


def test_cli_bad_trace(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"foo": 1}\n')
    with pytest.raises(SystemExit, match="t.jsonl:1"):
        cli.main(["replay", str(p), "-q"])
    with pytest.raises(SystemExit, match="No such file"):
        cli.main(["replay", str(tmp_path / "missing.jsonl"), "-q"])


def test_cli_without_command_prints_help(capsys) -> None:
    assert cli.main([]) == 2
    assert "replay" in capsys.readouterr().err


def test_parse_size() -> None:
    assert parse_size("3M") == 3_000_000 and parse_size("100k") == 100_000 and parse_size("195") == 195
    assert parse_size("1.5M") == 1_500_000 and parse_size("64Ki") == 65536
    for bad in ("", "x", "1.00001k", "-1"):
        with pytest.raises(Exception):
            parse_size(bad)


def test_sample_trace_ships_and_replays(tmp_path: Path) -> None:
    assert SAMPLE.exists(), "examples/traces/sample.jsonl must ship with the repository"
    reqs = load_trace(SAMPLE)
    assert 200 <= len(reqs) <= 1000
    out = tmp_path / "r.json"
    assert cli.main(["replay", str(SAMPLE), "--json", str(out), "-q"]) == 0
    r = json.loads(out.read_text())
    assert r["requests"] == len(reqs) and r["hit_blocks"]["total"] > 0


def test_console_script_is_registered() -> None:
    exe = shutil.which("kvtier")
    if exe is None:
        pytest.skip("kvtier console script not installed")
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert eps.get("kvtier") == "kvtier.tools.cli:main"
