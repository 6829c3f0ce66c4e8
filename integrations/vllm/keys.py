"""kvtier block keys of a vLLM request, extended as the request grows (``adapter.keys.PrefixKeys``).

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
from kvtier.integrations.adapter.keys import PrefixKeys, epoch_salt

if TYPE_CHECKING:
    from vllm.v1.request import Request


class RequestKeys(PrefixKeys):
    """The keys of one vLLM request's full blocks (``PrefixKeys`` over its ``all_token_ids``)."""

    __slots__ = ()

    def __init__(self, hasher: BlockHasher, request: Request, epoch: bytes | None = None) -> None:
        super().__init__(hasher, lambda: request.all_token_ids, _extra_keys(request, epoch))


def _extra_keys(request: Request, epoch: bytes | None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extra["lora_id"] = str(lora.lora_name)
    salt = getattr(request, "cache_salt", None)
    if epoch is not None:
        extra["cache_salt"] = epoch_salt(epoch, salt)
    elif salt:
        extra["cache_salt"] = salt
    items = []
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        items.append(MultiModalItem(str(feature.identifier), int(pos.offset), int(pos.length)))
    if items:
        extra["mm_items"] = items
    return extra
