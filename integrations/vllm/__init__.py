"""kvtier under vLLM: ``KvtierConnector``, a KV connector for vLLM's V1 engine.

vLLM is pointed at this package (``kv_connector_module_path``) and reads
``KvtierConnector`` from it; only that attribute imports vLLM (PEP 562), so
the parts that do not need it (``worker``, and the engine-free half,
``kvtier.integrations.adapter``) import without it. See ``connector.py``
for how vLLM is pointed at it and ``docs/vllm.md`` for the whole story.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.integrations.vllm.connector import KvtierConnector

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvtierConnector":
        from kvtier.integrations.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
