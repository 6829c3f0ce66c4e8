"""kvtier block keys of a request, extended as the request grows.

Contract
========

Keys are kvtier's canonical chained hashes (``kvtier.client.hashing``) of
the token ids, with the request's extra keys (``BlockHasher.hash_blocks``'
keywords: LoRA adapter, multimodal items, ``cache_salt``). They are not an
engine's own block hashes, which are often seeded per process: two engine
processes, a restarted one, or another node compute the same keys for the
same prefix, which is what lets them share kvtierd. The engine's adapter
says what the request's extra keys are (vLLM's: ``kvtier.integrations.vllm.keys``).

- ``PrefixKeys(hasher, token_ids, extra)``: ``token_ids()`` returns the
  request's tokens as they are now (they grow as it generates), asked again
  when more blocks are wanted; ``upto(n)`` hashes blocks ``[0, n)`` on demand (fewer
  when the request has fewer full blocks) and keeps them; ``of_group(domain,
  n)`` derives a KV-cache group's keys (``BlockHasher.derive``,
  ``groups.KvGroup.domain``), so groups never share a key; ``b""`` is
  ``upto``.
- ``epoch_salt(epoch, salt)``: after an engine resets its cache (a weight
  update), its keys carry an epoch: random bytes folded into block 0's salt
  ahead of the user's own ``salt``, so no key from before the reset is ever
  asked for or stored again by that engine, and no user salt can forge it.

Imports no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvtier.client.hashing import BlockHasher

EPOCH_SALT_PREFIX = b"kvtier-epoch:"


class PrefixKeys:
    """The keys of one request's full blocks, hashed on demand and kept."""

    __slots__ = ("_hasher", "_tokens", "_keys", "_extra", "_derived")

    def __init__(self, hasher: BlockHasher, token_ids: Callable[[], Sequence[int]], extra: Mapping[str, Any]) -> None:
        self._hasher = hasher
        self._tokens = token_ids
        self._keys: list[bytes] = []
        self._extra = dict(extra)
        self._derived: dict[bytes, list[bytes]] = {}  # domain -> keys of that group, as far as derived

    def upto(self, num_blocks: int) -> list[bytes]:
        """Keys of blocks ``[0, num_blocks)``; fewer when the request has fewer full blocks."""
        have = len(self._keys)
        if num_blocks > have:
            bs = self._hasher.block_size
            tokens = self._tokens()[have * bs: num_blocks * bs]
            parent = self._keys[-1] if have else None
            self._keys += self._hasher.hash_blocks(tokens, parent=parent, start_block=have, **self._extra)
        return self._keys[:num_blocks]

    def of_group(self, domain: bytes, num_blocks: int) -> list[bytes]:
        """Keys of blocks ``[0, num_blocks)`` in the KV-cache group of ``domain`` (b"": ``upto``)."""
        if not domain:
            return self.upto(num_blocks)
        keys = self._derived.setdefault(domain, [])
        if num_blocks > len(keys):
            base = self.upto(num_blocks)
            keys += self._hasher.derive(base[len(keys):], domain)
        return keys[:num_blocks]


def epoch_salt(epoch: bytes, salt: str | bytes | None) -> bytes:
    """Block 0's ``cache_salt`` under ``epoch``, the user's ``salt`` after it."""
    # The hashing spec has no epoch field; block 0's salt chains it into
    # every key. The epoch is random, so no user salt can forge it.
    user = salt.encode() if isinstance(salt, str) else bytes(salt or b"")
    return EPOCH_SALT_PREFIX + epoch + b"\0" + user
