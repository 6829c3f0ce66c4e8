"""Block hashing: the content keys of kvtier's KV-cache blocks.

Contract
========

A sequence of token ids is cut into blocks of ``block_size`` consecutive
tokens. Only FULL blocks get a key; a trailing partial block gets none. The key
of block ``i`` (counting from 0 at the first token of the sequence) is a
16-byte ``bytes`` value chained over everything before it::

    key[i] = H(key[i-1] if i > 0 else ROOT,  tokens of block i,  extra keys of block i)

so two blocks share a key only if their whole prefixes (tokens and extra keys)
are equal. Extra keys of block ``i``:

* the LoRA adapter id of the request (on every block; ``None`` = no adapter);
* every multimodal item that overlaps the block's token range, as the item's
  hash together with the item's start position RELATIVE to the block's first
  token (negative when the item began in an earlier block);
* the request's ``cache_salt``, on block 0 only. It is enough there: every
  later key depends on key[0] through the chain.

The value of a key is defined by the byte encoding below, never by Python's
``hash()``, so it is identical in every process, run and machine, and a client
written in another language can compute it.

Encoding (version 1)
====================

Hash functions ``H`` (a pool uses one; keys of different algorithms never mix):

* ``"xxh3_128"`` (default): XXH3 128-bit, seed 0, the 16-byte canonical
  (big-endian) digest, i.e. ``XXH128_canonicalFromHash(XXH3_128bits(msg))``.
* ``"sha256"``: SHA-256, first 16 bytes of the 32-byte digest. Recommended
  where tenants share a daemon: XXH3 is not collision resistant, so a crafted
  collision could cross a salt boundary.

``ROOT = H(b"kvtier/block-hash/v1")`` (the 20 ASCII bytes, nothing else),
computed with the pool's ``H``. It stands in for the parent of block 0 and
carries the version tag: a future encoding starts from a different tag, so its
keys cannot silently coincide with version 1 keys.

The message hashed for one block is the concatenation of::

    parent   16 bytes   key of the previous block, or ROOT for block 0
    count     4 bytes   number of tokens in the block (= block_size),
                        unsigned 32-bit little-endian
    tokens  8*count     each token id as a signed 64-bit little-endian integer
                        (ids must lie in 0 .. 2**63-1)
    extra   rest        MessagePack encoding of a 3-element array
                        [lora_id, mm, salt]

``parent`` and ``tokens`` have fixed sizes given by ``count``, so the message
splits unambiguously. ``extra`` is encoded canonically:

* MessagePack integers use the shortest encoding of their value (positive
  fixint, uint8/16/32/64 for values >= 0; negative fixint, int8/16/32/64 for
  values < 0); strings use str (fixstr/str8/16/32, shortest, UTF-8); byte
  strings use bin (bin8/16/32, shortest); arrays use fixarray/array16/32,
  shortest. No maps, floats or extension types appear.
* ``lora_id``: nil, an integer in -2**63 .. 2**64-1, or a str. ``1`` and
  ``"1"`` are different ids; ``None`` and ``0`` are different too.
* ``mm``: an array (possibly empty) of 2-element arrays ``[item_hash,
  rel_offset]``, one per multimodal item that overlaps the block, where
  ``item_hash`` is bin (a str item hash is first encoded as its UTF-8 bytes)
  and ``rel_offset = item.offset - block_index * block_size`` is an integer.
  An item covering absolute token positions ``[offset, offset + length)``
  overlaps block ``b`` when ``offset < (b+1)*block_size`` and
  ``offset + length > b*block_size``. The pairs are sorted ascending by
  ``rel_offset``, ties by ``item_hash`` compared bytewise; duplicates stay.
* ``salt``: on block 0, the cache salt as bin (a str salt is first encoded as
  its UTF-8 bytes); nil on every other block, and nil when there is no salt.
  An empty salt (``""`` or ``b""``) means no salt, as in vLLM: it isolates
  nothing, and treating it as a tenant of its own would only split the cache.

Example: a block with no LoRA, no multimodal item and no salt has
``extra = 93 c0 90 c0``.

Derived keys
============

One prefix may have several kinds of KV: a hybrid model's KV-cache groups
(full-attention layers, sliding-window layers) each hold their own bytes
for the same tokens. ``BlockHasher.derive(keys, domain)`` gives the keys of
the same blocks in ``domain`` (non-empty bytes naming the kind), so that
kinds never share a key::

    derived = H(DERIVE_TAG || u32le(len(domain)) || domain || key)

with ``DERIVE_TAG = b"kvtier/derived-key/v1"`` and ``H`` the pool's. A
derived key names a whole prefix as its key does.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

from kvtier.client.protocol import HASH_ALGOS  # the wire schema owns the names

__all__ = [
    "ENCODING_VERSION",
    "HASH_ALGOS",
    "HASH_BYTES",
    "ROOT_TAG",
    "BlockHasher",
    "MultiModalItem",
    "hash_token_blocks",
]

HASH_BYTES = 16
ENCODING_VERSION = 1
ROOT_TAG = b"kvtier/block-hash/v1"
DERIVE_TAG = b"kvtier/derived-key/v1"

# Explicit byte order: numpy's native int64 is big-endian on s390x and friends,
# and the keys must not depend on the host.
_TOKEN_DTYPE = np.dtype("<i8")
_TOKEN_MAX = 2**63 - 1
_LORA_MIN = -(2**63)
_LORA_MAX = 2**64 - 1  # the widest integers MessagePack can carry


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _sha256_128(data: bytes) -> bytes:
    # Truncated to 128 bits so every algorithm yields the same fixed-size key
    # (index entries, wire frames); collision resistance is still ~2**64 work
    # (birthday bound), far beyond what a cache can be made to hold.
    return hashlib.sha256(data).digest()[:HASH_BYTES]


_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": _xxh3_128,
    "sha256": _sha256_128,
}


def _as_int(value: Any, what: str) -> int:
    # operator.index accepts numpy integers but refuses floats and strings;
    # bool is an int subclass and almost always a caller's mistake here.
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def _as_bytes(value: Any, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be bytes or str, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal input (image, audio clip, ...) placed in the token sequence.

    ``item_hash`` identifies the item's content (computed by the engine's
    frontend); a str is accepted and stored as its UTF-8 bytes. ``offset`` is
    the absolute position of the item's first placeholder token in the whole
    sequence and ``length`` the number of tokens it occupies.
    """

    item_hash: bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        item_hash = _as_bytes(self.item_hash, "MultiModalItem.item_hash")
        if not item_hash:
            raise ValueError("MultiModalItem.item_hash must not be empty")
        offset = _as_int(self.offset, "MultiModalItem.offset")
        length = _as_int(self.length, "MultiModalItem.length")
        if offset < 0:
            raise ValueError(f"MultiModalItem.offset must be >= 0, got {offset}")
        if length < 1:
            raise ValueError(f"MultiModalItem.length must be >= 1, got {length}")
        # Frozen dataclass: normalising in place needs object.__setattr__.
        object.__setattr__(self, "item_hash", item_hash)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "length", length)


def _norm_lora(lora_id: Any) -> int | str | None:
    if lora_id is None or isinstance(lora_id, str):
        return lora_id
    value = _as_int(lora_id, "lora_id")
    if not _LORA_MIN <= value <= _LORA_MAX:
        raise ValueError(f"lora_id {value} does not fit in 64 bits")
    return value


def _norm_salt(cache_salt: Any) -> bytes | None:
    if cache_salt is None:
        return None
    salt = _as_bytes(cache_salt, "cache_salt")
    return salt or None


def _norm_parent(parent: Any) -> bytes | None:
    if parent is None:
        return None
    if not isinstance(parent, (bytes, bytearray, memoryview)):
        raise TypeError(f"parent must be {HASH_BYTES} bytes or None, got {type(parent).__name__}")
    parent = bytes(parent)
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent must be exactly {HASH_BYTES} bytes, got {len(parent)}")
    return parent


def _norm_mm_items(mm_items: Any) -> list[MultiModalItem]:
    if isinstance(mm_items, (MultiModalItem, str, bytes)):
        raise TypeError("mm_items must be a sequence of MultiModalItem, not a single item")
    items = []
    for item in mm_items:
        if isinstance(item, MultiModalItem):
            items.append(item)
        elif isinstance(item, tuple) and len(item) == 3:
            items.append(MultiModalItem(*item))
        else:
            raise TypeError(
                "mm_items entries must be MultiModalItem or (item_hash, offset, length), "
                f"got {item!r}"
            )
    return items


def _encode_extra(lora_id: int | str | None, mm_keys: list[tuple[bytes, int]], salt: bytes | None) -> bytes:
    # mm_keys must already be normalised; sorting here makes the order in which
    # a caller listed its items irrelevant to the key.
    mm_keys.sort(key=lambda k: (k[1], k[0]))
    return msgpack.packb([lora_id, [list(k) for k in mm_keys], salt], use_bin_type=True)


def _pack_tokens(token_ids: Any) -> np.ndarray:
    """Validate token ids and return them as a little-endian int64 array."""
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    try:
        # Torch CPU tensors, numpy arrays, lists, tuples and array.array all go
        # through the buffer/array protocols here without a Python-level loop.
        arr = np.asarray(token_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(
            f"token_ids could not be read as an integer array ({exc}); "
            "pass a list, tuple, numpy array or CPU tensor of ints"
        ) from None
    except OverflowError:
        arr = np.asarray(list(token_ids), dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if arr.dtype.kind not in "iu" and isinstance(token_ids, (list, tuple)):
        # numpy turns [2**63, 1] into float64 and [1, "a"] into strings; look
        # at the original elements so the error names the offending one.
        arr = np.empty(len(token_ids), dtype=object)
        arr[:] = token_ids
    if arr.dtype == object:
        # Only reached for unusual inputs (huge Python ints, None, mixed
        # types), so a per-element check is affordable and gives exact errors.
        values = [_as_int(t, f"token_ids[{i}]") for i, t in enumerate(arr.tolist())]
        for i, v in enumerate(values):
            if not 0 <= v <= _TOKEN_MAX:
                raise ValueError(f"token_ids[{i}] = {v} is outside 0..2**63-1")
        return np.array(values, dtype=_TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.min() < 0:
        i = int(np.argmax(arr < 0))
        raise ValueError(f"token ids must be >= 0, got token_ids[{i}] = {int(arr[i])}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.max() > _TOKEN_MAX:
        i = int(np.argmax(arr > _TOKEN_MAX))
        raise ValueError(f"token_ids[{i}] = {int(arr[i])} is outside 0..2**63-1")
    return arr.astype(_TOKEN_DTYPE, copy=False)


class BlockHasher:
    """Computes the chained 16-byte keys of full blocks (see the module docstring)."""

    __slots__ = ("_block_size", "_algo", "_digest", "_root", "_count_prefix")

    def __init__(self, block_size: int, algo: str = "xxh3_128") -> None:
        block_size = _as_int(block_size, "block_size")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if block_size > 0xFFFFFFFF:
            raise ValueError(f"block_size must fit in 32 bits, got {block_size}")
        if algo not in _DIGESTS:
            raise ValueError(f"unknown hash algo {algo!r}; choose one of {', '.join(HASH_ALGOS)}")
        self._block_size = block_size
        self._algo = algo
        self._digest = _DIGESTS[algo]
        self._root = self._digest(ROOT_TAG)
        self._count_prefix = struct.pack("<I", block_size)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def algo(self) -> str:
        return self._algo

    @property
    def root(self) -> bytes:
        """The stand-in parent of block 0: ``H(ROOT_TAG)``."""
        return self._root

    def __repr__(self) -> str:
        return f"BlockHasher(block_size={self._block_size}, algo={self._algo!r})"

    def hash_block(
        self,
        parent: bytes | None,
        block_tokens: Sequence[int],
        extra: tuple | None = None,
    ) -> bytes:
        """One step of the chain: the key of one full block.

        ``parent`` is the previous block's key, or None for block 0 (ROOT is
        used). ``extra`` is ``(lora_id, mm_keys, cache_salt)`` where
        ``mm_keys`` is a sequence of ``(item_hash, rel_offset)`` pairs for the
        items overlapping this block (any order; None or empty for none);
        ``extra=None`` means no extra keys at all. The caller is
        responsible for passing the salt on block 0 only; ``hash_blocks`` does
        all of this for a whole sequence.
        """
        parent = _norm_parent(parent)
        tokens = _pack_tokens(block_tokens)
        if tokens.size != self._block_size:
            raise ValueError(
                f"a block must hold exactly block_size={self._block_size} tokens, got {tokens.size}"
            )
        if extra is None:
            lora_id, mm_keys, salt = None, [], None
        else:
            if not isinstance(extra, tuple) or len(extra) != 3:
                raise TypeError("extra must be None or a tuple (lora_id, mm_keys, cache_salt)")
            lora_id = _norm_lora(extra[0])
            mm_keys = []
            for key in extra[1] or ():
                if not isinstance(key, (tuple, list)) or len(key) != 2:
                    raise TypeError(f"mm_keys entries must be (item_hash, rel_offset) pairs, got {key!r}")
                mm_keys.append((_as_bytes(key[0], "item_hash"), _as_int(key[1], "rel_offset")))
            salt = _norm_salt(extra[2])
        return self._digest(
            b"".join(
                (
                    self._root if parent is None else parent,
                    self._count_prefix,
                    tokens.tobytes(),
                    _encode_extra(lora_id, mm_keys, salt),
                )
            )
        )

    def derive(self, keys: Sequence[bytes], domain: bytes) -> list[bytes]:
        """The keys of the same blocks in ``domain`` (see "Derived keys"); ValueError for an empty domain."""
        domain = _as_bytes(domain, "domain")
        if not domain:
            raise ValueError("domain must not be empty: the keys of no domain are the keys themselves")
        prefix = DERIVE_TAG + struct.pack("<I", len(domain)) + domain
        digest = self._digest
        return [digest(prefix + _norm_parent(k)) for k in keys]  # type: ignore[operator]

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        parent: bytes | None = None,
        lora_id: int | str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        cache_salt: str | bytes | None = None,
        start_block: int = 0,
    ) -> list[bytes]:
        """Keys of the full blocks of ``token_ids``; a trailing partial block gets none.

        To hash a whole sequence, call with the defaults for ``parent`` and
        ``start_block``. To continue a chain already hashed up to block
        ``k - 1``, pass ``parent`` = that block's key and ``start_block=k``
        (``token_ids[0]`` then sits at absolute position ``k * block_size``).
        The two must agree: ``parent`` is required exactly when
        ``start_block > 0``, so a forgotten ``start_block`` cannot silently
        misplace multimodal items.

        ``mm_items`` offsets are absolute positions in the whole sequence;
        items outside the blocks of this call are ignored, so a caller may pass
        the request's full item list on every call. ``cache_salt`` only enters
        block 0; in a continuation (``start_block > 0``) it is ignored because
        the parent already carries it, so passing the request's salt on every
        call is correct.
        """
        parent = _norm_parent(parent)
        start_block = _as_int(start_block, "start_block")
        if start_block < 0:
            raise ValueError(f"start_block must be >= 0, got {start_block}")
        if start_block > 0 and parent is None:
            raise ValueError(
                f"start_block={start_block} continues a chain: pass parent= the key of block {start_block - 1}"
            )
        if start_block == 0 and parent is not None:
            raise ValueError(
                "parent given with start_block=0: block 0 has no parent; pass start_block= "
                "the absolute index of token_ids[0]'s block"
            )
        lora = _norm_lora(lora_id)
        salt = _norm_salt(cache_salt)
        items = _norm_mm_items(mm_items)

        tokens = _pack_tokens(token_ids)
        bs = self._block_size
        n_blocks = tokens.size // bs
        if n_blocks == 0:
            return []
        data = tokens[: n_blocks * bs].tobytes()

        # Blocks with neither a multimodal item nor the salt share one extra
        # encoding; only the others are encoded individually.
        special: dict[int, list[tuple[bytes, int]]] = {}
        if salt is not None and start_block == 0:
            special[0] = []
        for item in items:
            lo = max(item.offset // bs, start_block)
            hi = min((item.offset + item.length - 1) // bs + 1, start_block + n_blocks)
            for b in range(lo, hi):
                special.setdefault(b - start_block, []).append((item.item_hash, item.offset - b * bs))
        base_extra = _encode_extra(lora, [], None)
        extras = {
            i: _encode_extra(lora, keys, salt if i == 0 and start_block == 0 else None)
            for i, keys in special.items()
        }

        digest = self._digest
        prefix = self._count_prefix
        key = self._root if parent is None else parent
        stride = 8 * bs
        out: list[bytes] = []
        for i in range(n_blocks):
            key = digest(b"".join((key, prefix, data[i * stride : (i + 1) * stride], extras.get(i, base_extra))))
            out.append(key)
        return out


def hash_token_blocks(token_ids: Sequence[int], block_size: int, **kwargs: Any) -> list[bytes]:
    """One-shot ``BlockHasher(block_size, algo).hash_blocks(token_ids, **rest)``.

    ``algo`` may be given among ``kwargs``; everything else is passed to
    :meth:`BlockHasher.hash_blocks`.
    """
    algo = kwargs.pop("algo", "xxh3_128")
    return BlockHasher(block_size, algo).hash_blocks(token_ids, **kwargs)

