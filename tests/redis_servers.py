"""Moved to ``kvtier.testing.redis_servers``; this file stays only for the benchmarks that load it by path.

bench/remote.py and bench/protocol_servers.py load ``tests/redis_servers.py``
with ``importlib.util.spec_from_file_location``; once they import
``kvtier.testing.redis_servers`` this file goes. Tests import the module
itself.
"""

from __future__ import annotations

from kvtier.testing.redis_servers import (  # noqa: F401
    MISSING_REASON,
    REDIS_CLI,
    REDIS_SERVER,
    RedisClusterProcs,
    RedisServer,
    free_port,
    have_redis,
)

__all__ = ["MISSING_REASON", "REDIS_CLI", "REDIS_SERVER", "RedisClusterProcs", "RedisServer", "free_port", "have_redis"]
