"""Token-id helpers for engine mode: a request's block-hash chain, continued as its tokens arrive.

Contract
========

``Client.allocate_tokens(req, token_ids)`` hashes a new request's full
blocks here and keeps a ``TokenChain``; ``Client.append_tokens(req,
new_token_ids)`` continues the chain so that every block gets the hash it
would have had if all tokens had come at once (``BlockHasher.hash_blocks``
with ``parent`` and ``start_block``).

- ``TokenChain.start(hasher, token_ids, hash_kwargs) -> (hashes, chain)``:
  the hashes of the full blocks of ``token_ids`` and the chain after them.
- ``chain.extend(hasher, new_token_ids) -> (new_hashes, tokens)``: the
  hashes of the blocks the new tokens complete, and the tokens to hand back
  to ``advance``. It changes nothing: the client advances the chain only
  once the daemon has accepted ``append`` (a failed call leaves it as it
  was).
- ``chain.advance(block_size, num_new_tokens, new_hashes, tokens)``: record
  an accepted ``extend``.

Pure bookkeeping: no I/O, no errors of its own (``hash_kwargs`` errors are
``BlockHasher``'s). The session drops every chain when the daemon forgets the
session (``kvtier.client.session``), since the requests go with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.hashing import BlockHasher

__all__ = ["TokenChain"]


@dataclass
class TokenChain:
    """What append_tokens needs to continue a request's hash chain."""

    num_tokens: int
    parent: bytes | None  # hash of the last full block, None before the first
    pending: list[int]  # tokens of the trailing partial block
    hash_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, hasher: BlockHasher, token_ids: Sequence[int],
              hash_kwargs: dict[str, Any]) -> tuple[list[bytes], TokenChain]:
        tokens = list(token_ids)
        hashes = hasher.hash_blocks(tokens, **hash_kwargs)
        chain = cls(len(tokens), hashes[-1] if hashes else None, tokens[len(hashes) * hasher.block_size:], hash_kwargs)
        return hashes, chain

    def extend(self, hasher: BlockHasher, new_token_ids: Sequence[int]) -> tuple[list[bytes], list[int]]:
        bs = hasher.block_size
        tokens = self.pending + list(new_token_ids)
        start_block = (self.num_tokens - len(self.pending)) // bs
        new_hashes = hasher.hash_blocks(tokens, parent=self.parent, start_block=start_block,
                                        **self.hash_kwargs) if len(tokens) >= bs else []
        return new_hashes, tokens

    def advance(self, block_size: int, num_new_tokens: int, new_hashes: list[bytes], tokens: list[int]) -> None:
        self.num_tokens += num_new_tokens
        if new_hashes:
            self.parent = new_hashes[-1]
        self.pending = tokens[len(new_hashes) * block_size:]
