"""GPU-tier block manager with vLLM-v1 automatic-prefix-caching semantics.

The manager owns N block records (ids ``0..N-1``, created at start-up) and
decides which block slot holds which cached block. It moves no bytes: the
tiered pool (``kvtier.tiers.pool``) turns its decisions into copies.

Semantics (vLLM v1's automatic prefix caching, as its design doc "Automatic
Prefix Caching" describes it, docs.vllm.ai/en/latest/design/prefix_caching.html):

- A block is *cached* when it carries a hash. The index maps a hash to the
  first-inserted live copy; later copies of the same hash (duplicates) are
  allowed and become the indexed copy if the first one is evicted.
- Free blocks (ref count 0) sit in an intrusive doubly linked free queue,
  in id order at start-up. Allocation pops the head. A popped block that
  carries a hash is *evicted*: the hash leaves the index and the caller gets
  an ``Evicted`` record so it can demote the bytes before reusing the slot.
- A hit on a block with ref count 0 removes it from the queue ("touch").
- Freeing walks a request's blocks last to first; a block whose ref count
  reaches 0 goes to the tail, keeping its hash, so the tail of a prefix is
  evicted before its head.
- Plan, then apply: an operation that raises changes nothing.

Public API (tests, the pool and the tools use only this):

Request-oriented (engine-managed mode):
    allocate(request_id, block_hashes, num_tokens) -> Allocation
        Hits the longest cached prefix of ``block_hashes`` (the hashes of the
        request's full blocks, in order), allocates the remaining blocks for
        ``num_tokens`` tokens and commits every new full block at once.
        Raises NoFreeBlocks (nothing changed) if the blocks are not there; a
        request's own hits are never evicted to make room for it.
    append(request_id, num_new_tokens, new_block_hashes) -> Allocation
        Grows a running request; ``new_block_hashes`` are the hashes of the
        blocks that became full with these tokens (exactly those).
    free(request_id, valid_tokens=None) -> None
        Releases the blocks last to first. ``valid_tokens`` (a request that
        failed part-way): blocks past that many tokens lose their hash.
    block_table(request_id) -> list[int]

Primitives (store mode, pins, clean-ahead):
    longest_cached_prefix(hashes) -> list[Block]   # no side effects
    get_cached(block_hash) -> Block | None
    touch(blocks)            ref +1, leaving the free queue at 0 -> 1
    allocate_blocks(n, protected=None) -> (blocks, evicted)
                             ref 1 each, from the head of the free queue;
                             free blocks carrying a hash in ``protected`` are
                             passed over (they stay where they are, cached);
                             NoFreeBlocks (nothing changed) if fewer than n
                             others are free
    num_free_unprotected(protected) -> int   what allocate_blocks(n, protected) can give
    commit(block, block_hash)
    release(blocks)          ref -1 in the order given; 0 -> queue tail
    iter_free()              free blocks from the head (next evicted first)
    discard_hash(block)      withdraw a hash whose bytes never arrived
    evict_free_cached() -> list[Evicted]   drop every unreferenced cached block

Observer: ``key_observer``, when set, is told ``added(hash)`` when a hash
enters the index and ``removed(hash)`` when its last live block loses it (a
duplicate coming or going changes nothing): the pool's key journal
(``kvtier.tiers.pool.journal``).

Errors: NoFreeBlocks for capacity, KeyError for an unknown request id,
ValueError for input that contradicts the request's state.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Protocol


class KeyObserver(Protocol):
    def added(self, key: bytes) -> None: ...
    def removed(self, key: bytes) -> None: ...


# Hashes a prefix lookup maps at once (see longest_cached_prefix).
_PREFIX_CHUNK = 64


class NoFreeBlocks(RuntimeError):
    """An allocation asked for more blocks than the free queue can give."""


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    block_hash: bytes | None = None
    ref_cnt: int = 0
    prev_free: Block | None = None
    next_free: Block | None = None


@dataclass(slots=True)
class Evicted:
    """A cached block popped for reuse: its bytes are still in the slot.

    Not frozen: a frozen dataclass's __init__ goes through object.__setattr__
    and costs ~3x as much, once per evicted block on the allocation hot path.
    Treat it as read-only.
    """

    block_id: int
    block_hash: bytes


@dataclass(slots=True)
class Allocation:
    request_id: str
    block_ids: list[int]  # the request's whole block table after the call
    num_hit_blocks: int  # leading blocks that were GPU-tier hits (allocate only)
    new_block_ids: list[int]  # allocated by this call, in table order
    evicted: list[Evicted] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    blocks: list[Block]
    num_tokens: int
    num_committed: int  # leading blocks that carry their hash


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with sentinels: O(1) everywhere."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise NoFreeBlocks("free queue is empty")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            nxt = block.next_free
            yield block
            block = nxt

    def __len__(self) -> int:
        return self.num_free


class BlockManager:
    """See the module docstring for the contract."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._index: dict[bytes, Block] = {}
        # Later live copies of a hash, first-inserted first. Rare, so kept
        # apart to keep the per-block metadata small.
        self._duplicates: dict[bytes, list[Block]] = {}
        self._requests: dict[str, _Request] = {}
        self.key_observer: KeyObserver | None = None

    # ---- queries -------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def get_cached(self, block_hash: bytes) -> Block | None:
        return self._index.get(block_hash)

    def longest_cached_prefix(self, hashes: Sequence[bytes]) -> list[Block]:
        if not self.enable_caching:
            return []
        # Lookups run on the daemon's loop for every request. itemgetter maps a
        # whole chunk in one C call and raises KeyError at the first miss:
        # no per-hash Python and no None check on a chunk that hits (256
        # fresh hashes all held: 15.4 -> 12.2 us on the 2-core VM, most of
        # the rest hashing the keys). A chunk that misses is walked again
        # one hash at a time to its first miss; chunks bound that rework.
        index = self._index
        get = index.get
        hits: list[Block] = []
        for start in range(0, len(hashes), _PREFIX_CHUNK):
            chunk = hashes[start : start + _PREFIX_CHUNK]
            if len(chunk) > 1:  # itemgetter of one key returns the value, not a tuple
                try:
                    hits += itemgetter(*chunk)(index)
                    continue
                except KeyError:
                    pass
            for key in chunk:
                block = get(key)
                if block is None:
                    return hits
                hits.append(block)
        return hits

    def iter_free(self) -> Iterator[Block]:
        return iter(self.free_queue)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._request(request_id).blocks]

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # ---- primitives ----------------------------------------------------

    # The hot paths below (touch, allocate_blocks, release, allocate's commits)
    # inline the FreeBlockQueue link updates and the common case of commit and
    # _drop_hash: a method call per block is most of their cost in CPython.
    # FreeBlockQueue's methods stay the reference for what they do.

    def touch(self, blocks: Iterable[Block]) -> None:
        fq = self.free_queue
        removed = 0
        try:
            for block in blocks:
                if block.ref_cnt == 0:
                    prev, nxt = block.prev_free, block.next_free
                    if prev is None or nxt is None:
                        raise ValueError(f"block {block.block_id} is not in the free queue")
                    prev.next_free = nxt
                    nxt.prev_free = prev
                    block.prev_free = block.next_free = None
                    removed += 1
                block.ref_cnt += 1
        finally:
            fq.num_free -= removed

    def num_free_unprotected(self, protected: Collection[bytes]) -> int:
        """Free blocks that ``allocate_blocks(n, protected)`` may take: those carrying no protected hash."""
        taken = 0
        if protected:
            index, dups = self._index, self._duplicates
            for block_hash in protected if isinstance(protected, (set, frozenset)) else set(protected):
                block = index.get(block_hash)
                if block is None:
                    continue
                taken += block.ref_cnt == 0
                for dup in dups.get(block_hash, ()):
                    taken += dup.ref_cnt == 0
        return self.free_queue.num_free - taken

    def allocate_blocks(self, n: int, protected: Collection[bytes] | None = None
                        ) -> tuple[list[Block], list[Evicted]]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if protected:
            return self._allocate_blocks_protected(n, protected)
        fq = self.free_queue
        if n > fq.num_free:
            raise NoFreeBlocks(f"need {n} free blocks, {fq.num_free} available")
        index, dups = self._index, self._duplicates
        blocks: list[Block] = []
        evicted: list[Evicted] = []
        head = fq._head
        block = head.next_free
        for _ in range(n):  # unlink the first n blocks of the queue in one walk
            assert block is not None
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block_hash = block.block_hash
            if block_hash is not None:
                evicted.append(Evicted(block.block_id, block_hash))
                if block_hash in dups:
                    self._drop_hash(block)
                else:  # the only live copy of the hash, hence the indexed one
                    del index[block_hash]
                    block.block_hash = None
                    if self.key_observer is not None:
                        self.key_observer.removed(block_hash)
            block.ref_cnt = 1
            blocks.append(block)
            block = nxt
        assert block is not None
        head.next_free = block
        block.prev_free = head
        fq.num_free -= n
        return blocks, evicted

    def _allocate_blocks_protected(self, n: int, protected: Collection[bytes]) -> tuple[list[Block], list[Evicted]]:
        """``allocate_blocks`` passing over the free blocks that carry a protected hash.

        The caller names keys it is about to rely on (a store's present
        blocks): evicting one of them to make room for the others would
        break the very prefix the call reports as held. Those blocks keep
        their place in the free queue (no touch: their recency is unchanged).
        """
        protected = protected if isinstance(protected, (set, frozenset)) else set(protected)
        available = self.num_free_unprotected(protected)
        if n > available:
            raise NoFreeBlocks(f"need {n} free blocks, {available} available "
                               f"({self.free_queue.num_free - available} free ones hold protected hashes)")
        # Plan: the first n unprotected blocks from the head. Then apply.
        chosen: list[Block] = []
        for block in self.free_queue:
            if len(chosen) == n:
                break
            if block.block_hash is None or block.block_hash not in protected:
                chosen.append(block)
        assert len(chosen) == n
        fq = self.free_queue
        evicted: list[Evicted] = []
        for block in chosen:
            fq.remove(block)
            if block.block_hash is not None:
                evicted.append(Evicted(block.block_id, block.block_hash))
                self._drop_hash(block)
            block.ref_cnt = 1
        return chosen, evicted

    def commit(self, block: Block, block_hash: bytes) -> None:
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already committed")
        if not self.enable_caching:
            return
        block.block_hash = block_hash
        if block_hash not in self._index:
            self._index[block_hash] = block
            if self.key_observer is not None:
                self.key_observer.added(block_hash)
        else:
            self._duplicates.setdefault(block_hash, []).append(block)

    def release(self, blocks: Iterable[Block]) -> None:
        fq = self.free_queue
        tail = fq._tail
        added = 0
        try:
            for block in blocks:
                ref_cnt = block.ref_cnt
                if ref_cnt <= 0:
                    raise ValueError(f"block {block.block_id} released more often than referenced")
                block.ref_cnt = ref_cnt = ref_cnt - 1
                if ref_cnt == 0:  # to the queue tail
                    last = tail.prev_free
                    assert last is not None
                    last.next_free = block
                    block.prev_free = last
                    block.next_free = tail
                    tail.prev_free = block
                    added += 1
        finally:
            fq.num_free += added

    def discard_hash(self, block: Block) -> None:
        """Withdraw a block's hash (its bytes never arrived); the block stays where it is."""
        if block.block_hash is not None:
            self._drop_hash(block)

    def evict_free_cached(self) -> list[Evicted]:
        evicted = []
        for block in self.free_queue:
            if block.block_hash is not None:
                evicted.append(Evicted(block.block_id, block.block_hash))
                self._drop_hash(block)
        return evicted

    def _drop_hash(self, block: Block) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        block.block_hash = None
        dups = self._duplicates.get(block_hash)
        if self._index.get(block_hash) is block:
            if dups:
                self._index[block_hash] = dups.pop(0)
                if not dups:
                    del self._duplicates[block_hash]
            else:
                del self._index[block_hash]
                if self.key_observer is not None:
                    self.key_observer.removed(block_hash)
        elif dups is not None:
            dups.remove(block)
            if not dups:
                del self._duplicates[block_hash]

    # ---- requests (engine-managed mode) ----------------------------------

    def allocate(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int) -> Allocation:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has blocks; use append or free it first")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        num_full = num_tokens // self.block_size
        if len(block_hashes) != num_full:
            raise ValueError(
                f"{num_tokens} tokens make {num_full} full blocks of {self.block_size}, got {len(block_hashes)} hashes"
            )
        hits = self.longest_cached_prefix(block_hashes)
        num_hits = len(hits)
        num_needed = -(-num_tokens // self.block_size) - num_hits
        # Hits still in the free queue are about to leave it: they are not
        # available to this request's new blocks.
        available = self.free_queue.num_free - sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed > available:
            raise NoFreeBlocks(f"request {request_id!r} needs {num_needed} new blocks, {available} available")
        self.touch(hits)
        new, evicted = self.allocate_blocks(num_needed)
        if self.enable_caching:
            # commit() inlined: the new blocks were just allocated, so none carries a hash.
            index, observer = self._index, self.key_observer
            for block, block_hash in zip(new, block_hashes[num_hits:]):
                block.block_hash = block_hash
                if block_hash in index:
                    self._duplicates.setdefault(block_hash, []).append(block)
                else:
                    index[block_hash] = block
                    if observer is not None:
                        observer.added(block_hash)
        self._requests[request_id] = _Request(hits + new, num_tokens, num_full)
        new_ids = [b.block_id for b in new]
        return Allocation(request_id, [b.block_id for b in hits] + new_ids, num_hits, new_ids, evicted)

    def append(self, request_id: str, num_new_tokens: int, new_block_hashes: Sequence[bytes]) -> Allocation:
        req = self._request(request_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        total = req.num_tokens + num_new_tokens
        num_full = total // self.block_size
        if len(new_block_hashes) != num_full - req.num_committed:
            raise ValueError(
                f"appending {num_new_tokens} tokens fills {num_full - req.num_committed} blocks, "
                f"got {len(new_block_hashes)} hashes"
            )
        num_needed = -(-total // self.block_size) - len(req.blocks)
        if num_needed > self.free_queue.num_free:
            raise NoFreeBlocks(
                f"request {request_id!r} needs {num_needed} new blocks, {self.free_queue.num_free} available"
            )
        new, evicted = self.allocate_blocks(num_needed)
        req.blocks.extend(new)
        for pos, block_hash in enumerate(new_block_hashes, start=req.num_committed):
            self.commit(req.blocks[pos], block_hash)
        req.num_tokens = total
        req.num_committed = num_full
        return Allocation(request_id, [b.block_id for b in req.blocks], 0, [b.block_id for b in new], evicted)

    def free(self, request_id: str, *, valid_tokens: int | None = None) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        if valid_tokens is not None:
            # Committed at once when full (vLLM semantics), but the engine never
            # wrote these: no later request may hit them.
            for block in req.blocks[valid_tokens // self.block_size :]:
                self.discard_hash(block)
        self.release(reversed(req.blocks))

    def _request(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        return req
