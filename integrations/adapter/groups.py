"""An engine's KV-cache groups as kvtier holds them, and which of a group's blocks a hit needs.

Contract
========

An engine may split its layers into KV-cache groups, each with its own
block table (vLLM's hybrid KV-cache manager: all layers of one attention
type and window in one group). A block id names memory in one group at a
time. The engine's adapter describes each group as a ``KvGroup`` at
start-up (vLLM's: ``kvtier.integrations.vllm.groups.kv_groups``) and raises
``UnsupportedLayout`` for a group kvtier cannot hold; everything after that
(``hits.find_hits``, the planes, the keys) reads only ``KvGroup``.

- ``KvGroup.domain``: what the group's keys are derived with
  (``BlockHasher.derive``), so no two groups share a key; empty for an
  engine of one group (its keys are the request's).
- ``KvGroup.first_needed_block(hit_blocks)``: the first block of this group
  a hit of ``hit_blocks`` blocks needs: 0 for full attention; for a sliding
  window, the blocks wholly before the window of the hit's next token are
  skipped (vLLM's rule, ``SlidingWindowManager.get_num_skipped_tokens``,
  with ``retained_tokens`` below the window). A hit needs blocks
  ``[first_needed_block(n), n)`` of every group.

Imports no engine.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedLayout(ValueError):
    """An engine whose KV cache kvtier cannot hold: raised at start-up, naming the part."""


@dataclass(frozen=True, slots=True)
class KvGroup:
    index: int  # the engine's group id (vLLM: the position in KVCacheBlocks.get_block_ids())
    kind: str  # "full" (MLA included) or "sliding_window"
    layer_names: tuple[str, ...]  # its layers' KV tensors, in the order their bytes make a block
    block_size: int  # tokens per block
    block_bytes: int  # bytes of one block of this group on this rank (every layer)
    window_tokens: int | None = None  # sliding window, tokens; None: the whole prefix
    retained_tokens: int = 0  # tokens kept below the window (vLLM: extra_retained_tokens)
    domain: bytes = b""  # keys are derived with it (BlockHasher.derive); b"": the request's keys

    @property
    def is_window(self) -> bool:
        return self.window_tokens is not None

    def first_needed_block(self, hit_blocks: int) -> int:
        """The first block of this group a hit of ``hit_blocks`` blocks needs (see the contract)."""
        if self.window_tokens is None:
            return 0
        skipped_tokens = max(0, hit_blocks * self.block_size - self.window_tokens + 1 - self.retained_tokens)
        return min(hit_blocks, skipped_tokens // self.block_size)

    def describe(self) -> str:
        """For pool names and logs: ``full`` or ``swa128`` (window in tokens)."""
        return "full" if self.window_tokens is None else f"swa{self.window_tokens}"
