"""A tier below the CPU tier. The contract, the ``RemoteStore`` protocol, is what the pool needs of it.

Implementations: ``kvtier.tiers.remote.tier.RemoteTier`` (Redis / Valkey,
real bytes) and ``kvtier.tools.replay.nodes.SimulatedRemoteTier`` (keys
only, for replays). The pool (``kvtier.tiers.pool``) calls them from its
own thread:

- ``exists_prefix(hashes) -> int``: how many leading hashes the store holds.
  A store it cannot reach answers 0 (a miss), never raises.
- ``fetch(hashes) -> list[payload | None]``: each hash's block bytes (a
  buffer of ``block_bytes``; any placeholder in bookkeeping mode), None where
  absent or unreadable. Never raises for a missing block or a store that is
  down.
- ``write_back(key, data, copy=True) -> bool``: queue one block (``data``
  None in bookkeeping mode); False when it was dropped (full, down, closed).
  Never blocks the caller.
- ``stats() -> dict``: counters, including ``available``.
- ``available``: whether the store is reachable now (the daemon's
  ``health`` and metrics report it).
- ``close(timeout_s) -> bool``: send what is queued for up to ``timeout_s``,
  then stop; True if nothing queued was lost.

The package's modules, one concept each (none imports redis until a tier
connects; this one imports nothing at all):

- ``tier``: ``RemoteTier``, the Redis / Valkey store: keys, lookups, fetches, counters.
- ``connection``: which client, reconnect backoff, health pings.
- ``writer``: the write-back queue and its threads.
- ``values``: the value format on the server and its MAC checks.
- ``url``: ``parse_url``, the schemes kvtier accepts (``SCHEMES``).
- ``settings``: ``RemoteTierSettings`` and ``RemoteTierError``.
- ``secret``: the deployment's secret file (``kvtier keygen --remote-secret``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["RemoteStore"]


class RemoteStore(Protocol):
    @property
    def available(self) -> bool: ...

    def exists_prefix(self, hashes: Sequence[bytes]) -> int: ...

    def fetch(self, hashes: Sequence[bytes]) -> Sequence[Any]: ...

    def write_back(self, key: bytes, data: Any, *, copy: bool = True) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self, timeout_s: float = 5.0) -> bool: ...
