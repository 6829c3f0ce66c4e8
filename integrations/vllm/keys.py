"""kvtier block keys of a vLLM request, extended as the request grows.

Keys are kvtier's canonical chained hashes (``kvtier.client.hashing``) of the
token ids, with the request's extra keys: its LoRA adapter (by name, which
is stable across processes, unlike vLLM's per-process integer id), its
multimodal items (vLLM's content identifier and placeholder range) and its
``cache_salt``. They are NOT vLLM's own block hashes, which are seeded per
process: two vLLM processes, a restarted one, or another node compute the
same keys for the same prefix, which is what lets them share kvtierd.

A hybrid model's KV-cache groups each hold their own bytes for the same
tokens: a group's keys are the request's keys derived with the group's
domain (``BlockHasher.derive``, ``groups.KvGroup.domain``), so groups never
share a key; an engine of one group uses the request's keys as they are.

After ``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``,
e.g. after a weight update) the engine's keys also carry an epoch: 16 random
bytes folded into block 0's salt, so no key from before the reset is ever
asked for or stored again by that engine (``scheduler.py`` says why random).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.client.hashing import BlockHasher, MultiModalItem

if TYPE_CHECKING:
    from vllm.v1.request import Request


class RequestKeys:
    """The keys of one request's full blocks, hashed on demand and kept."""

    __slots__ = ("_hasher", "_request", "_keys", "_extra", "_derived")

    def __init__(self, hasher: BlockHasher, request: Request, epoch: bytes | None = None) -> None:
        self._hasher = hasher
        self._request = request
        self._keys: list[bytes] = []
        self._extra = _extra_keys(request, epoch)
        self._derived: dict[bytes, list[bytes]] = {}  # domain -> keys of that group, as far as derived

    def upto(self, num_blocks: int) -> list[bytes]:
        """Keys of blocks ``[0, num_blocks)``; fewer when the request has fewer full blocks."""
        have = len(self._keys)
        if num_blocks > have:
            bs = self._hasher.block_size
            tokens = self._request.all_token_ids[have * bs: num_blocks * bs]
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


EPOCH_SALT_PREFIX = b"kvtier-epoch:"


def _extra_keys(request: Request, epoch: bytes | None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extra["lora_id"] = str(lora.lora_name)
    salt = getattr(request, "cache_salt", None)
    if epoch is not None:
        # The hashing spec has no epoch field; block 0's salt chains it into
        # every key. The epoch is random, so no user salt can forge it.
        user = salt.encode() if isinstance(salt, str) else bytes(salt or b"")
        extra["cache_salt"] = EPOCH_SALT_PREFIX + epoch + b"\0" + user
    elif salt:
        extra["cache_salt"] = salt
    items = []
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        items.append(MultiModalItem(str(feature.identifier), int(pos.offset), int(pos.length)))
    if items:
        extra["mm_items"] = items
    return extra
