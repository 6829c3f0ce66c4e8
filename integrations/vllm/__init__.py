"""kvtier under vLLM: ``KvtierConnector``, a KV connector for vLLM's V1 engine.

Importing this package imports vLLM. See ``connector.py`` for how vLLM is
pointed at it and ``docs/vllm.md`` for the whole story.
"""

from kvtier.integrations.vllm.connector import KvtierConnector

__all__ = ["KvtierConnector"]
