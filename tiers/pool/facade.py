"""A pool: one KV layout with its GPU tier, its CPU tier, and the copies between them.

The pool turns the block manager's decisions into copies: blocks the GPU
tier evicts are demoted into the CPU tier, CPU-tier hits are restored into
GPU slots, and clients store and load blocks by hash. It is the only thing
the daemon and the tools use of ``kvtier.tiers``.

Threading: a pool is driven by one thread (the daemon's loop, a tool, a
test). Copies run on a transfer engine; their results are applied only in
``poll()``, on that thread, so the pool needs no locks.

Contract:

- ``lookup(hashes)`` -> tiers of the longest prefix held by any tier, one
  ``Tier`` per block, a block counted for the first tier that holds it
  (GPU, then CPU). No side effect but counters and policy learning.
- ``pin(owner, hashes)`` pins that prefix (GPU: ref count; CPU: pin count)
  so nothing evicts it until ``unpin``/``unpin_all``; returns its tiers.
- ``allocate / append / free`` (engine-managed mode) follow the block
  manager; CPU-tier hits are restored into the new slots and the returned
  ``Op`` completes only when those bytes (and any demotion that had to
  vacate a slot) are in place.
- ``store(hashes, src, src_slots)`` copies new blocks into the GPU tier
  (or the CPU tier when no GPU tier is attached) and leaves them cached and
  evictable; blocks already held are not copied again.
- Protected keys: a store never evicts a key it names to make room for its
  other keys, in either tier, nor does the clean-ahead that follows it (also
  when that runs in ``poll()`` as the store's op completes): its present
  blocks stay where they are, in place in the free queue. Room is made from
  other blocks only; where there is not enough, the store raises ``NoSpace``
  and changes nothing. So a store that succeeds leaves every key it named
  held: a prefix stored whole stays reachable as a prefix. Blocks fetched
  from the remote tier likewise evict none of the request they belong to.
  (An engine allocation keeps vLLM's rule instead: its hits are referenced
  before anything is evicted; a block of its chain past the hit run may be
  evicted, and the request then computes it into a block of its own.)
- ``restore(hashes, dst, dst_slots)`` copies the longest held prefix out.
- ``borrow(hashes)`` lends the longest held prefix without copying it: views
  of the tiers' own host memory, held (not evicted, not overwritten) until
  ``Borrowed.release()``. It returns None, changing nothing, where a view
  would be unsafe or impossible (device memory, a write in flight, a remote
  tier to consult); callers then ``restore`` into a buffer of their own.
- Every mutating call plans first: a call that raises (``NoSpace``,
  ``PoolError``) changed nothing. A copy that fails later fails its ``Op``
  (``Op.error``) and undoes what the op set up (e.g. a restored block's hash
  is withdrawn), never anything else.
- Safety: a GPU slot is never handed out, overwritten or freed while a copy
  touches it; CPU slots likewise (see ``CpuTier``).
- Clean-ahead: after each call the pool demotes, in the background and at
  low priority, the cached blocks nearest the head of the free queue, so
  that an allocation in steady state finds them already in the CPU tier and
  waits for no device-to-host copy.
- Remote tier (optional, ``remote=RemoteTier``): lookups continue past the
  CPU tier with one pipelined existence probe; allocate/restore fetch the
  remote run into the CPU tier (checksummed; a bad or missing value ends the
  prefix there) and go on as CPU hits, attributed to ``remote``; blocks the
  CPU tier evicts are written back asynchronously (dropped, never waited
  for, when the remote tier is slow or down). The fetch is one pipelined
  round trip on the caller's thread, bounded by the remote tier's timeout.
- Bookkeeping mode (``data=False``): no bytes and no transfer engine; every
  copy is complete at once. Trace replay uses it to drive the same code.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.tiers.block_manager import Block, BlockManager, Evicted, NoFreeBlocks
from kvtier.tiers.cpu_tier import CpuEntry, CpuTier, CpuTierFull
from kvtier.tiers.eviction import make_policy
from kvtier.tiers.layout import BlockLayout
from kvtier.tiers.transfer import CopyKind, Transfer, TransferEngine, TransferError

log = logging.getLogger(__name__)

# Keys a yielding learn() records between two checks of its should_yield: at
# about 0.5 us a key, a reply waits at most ~20 us behind bookkeeping.
LEARN_CHUNK_KEYS = 32
_DONE = object()


class Tier(str, enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    REMOTE = "remote"


@dataclass(slots=True)
class Borrowed:
    """A held prefix lent in place (``TieredPool.borrow``): ``views`` are uint8 arrays over tier
    memory whose concatenation is the blocks in order. Call ``release`` once, on the pool's
    thread, when nothing reads them any more."""

    tiers: list[Tier]
    views: list[Any]
    release: Callable[[], None]


class PoolError(ValueError):
    """A request that contradicts the pool's state or its layout."""


class NoSpace(RuntimeError):
    """The GPU tier cannot give the blocks asked for (nothing changed)."""


class NotFound(KeyError):
    """A block or request that the pool does not hold."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A pool's identity: blocks of different pools never mix."""

    name: str
    block_size: int  # tokens per block
    block_bytes: int
    extra: tuple[tuple[str, Any], ...] = ()  # model, dtype, geometry, tp rank ... (compared for equality)


class Op:
    """A pool call whose copies may still be in flight."""

    def __init__(self, pool: TieredPool, name: str, result: Any = None) -> None:
        self._pool = pool
        self.name = name
        self.result = result
        self.error: BaseException | None = None
        self.done = False
        self._waiting: set[_Copy] = set()
        self._on_done: list[Callable[[Op], None]] = []
        self._finalizers: list[Callable[[bool], None]] = []
        # Keys the call protects from eviction (see the contract), also in the
        # clean-ahead poll() runs when the op completes (its finalizers may
        # have released its blocks into the free queue).
        self.protected: frozenset[bytes] = frozenset()

    def wait(self, timeout_s: float | None = None) -> Op:
        """Poll the pool until this op is done (owner thread only)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} still has {len(self._waiting)} copies in flight")
            self._pool.poll(wait_s=0.01)
        return self

    def add_done_callback(self, fn: Callable[[Op], None]) -> None:
        if self.done:
            fn(self)
        else:
            self._on_done.append(fn)

    def _finish(self) -> None:
        ok = self.error is None
        for fin in self._finalizers:
            fin(ok)
        self.done = True
        self._pool._note_completed(self)
        for fn in self._on_done:
            fn(self)


@dataclass(eq=False)
class _Copy:
    """One batched copy, submitted when the copies it must follow are done."""

    kind: CopyKind
    src: BlockLayout | None
    src_slots: list[int]
    dst: BlockLayout | None
    dst_slots: list[int]
    after: set[_Copy] = field(default_factory=set)
    ops: list[Op] = field(default_factory=list)
    on_done: list[Callable[[bool], None]] = field(default_factory=list)
    high_priority: bool = False
    transfer: Transfer | None = None
    finished: bool = False
    error: BaseException | None = None


class TieredPool:
    """See the module docstring."""

    def __init__(
        self,
        spec: PoolSpec,
        *,
        cpu_blocks: int,
        policy: str = "lru",
        transfer: TransferEngine | None = None,
        data: bool = True,
        cpu_storage: BlockLayout | None = None,
        enable_caching: bool = True,
        clean_ahead_blocks: int = 64,
        remote: Any = None,
        defer_learning: bool = False,
    ) -> None:
        if data and transfer is None:
            raise ValueError("a pool that moves bytes needs a transfer engine")
        if data and cpu_storage is None and cpu_blocks > 0:
            raise ValueError("a pool that moves bytes needs CPU storage (see host_memory.allocate_host_slab)")
        if cpu_storage is not None and cpu_storage.block_bytes != spec.block_bytes:
            raise ValueError(f"CPU storage blocks are {cpu_storage.block_bytes} bytes, pool blocks {spec.block_bytes}")
        self.spec = spec
        self.data = data
        self.transfer = transfer
        self.enable_caching = enable_caching
        self.clean_ahead_blocks = clean_ahead_blocks
        # History-based policies learn from every request (hundreds of
        # microseconds for a long one); a server defers that until its replies
        # are out and calls learn() between requests.
        self.defer_learning = defer_learning
        self._to_learn: deque[Sequence[bytes]] = deque()
        self._learning: Iterator[None] | None = None  # the request being recorded, step by step
        self.learn_backlog_keys = 0  # keys counted but not yet recorded
        self.cpu = CpuTier(cpu_blocks, make_policy(policy, cpu_blocks), cpu_storage if data else None)
        self.remote = remote  # kvtier.tiers.remote_tier.RemoteTier or None
        if remote is not None:
            # In bookkeeping mode (replay) the remote tier is a stand-in that
            # tracks keys only: fetch returns placeholders, write_back gets None.
            self.cpu.on_evict = self._write_back
        self.bm: BlockManager | None = None
        self.gpu: BlockLayout | None = None
        # Copies in flight per GPU block: a block listed here is not handed
        # out, overwritten or read before they finish.
        self._gpu_busy: dict[int, set[_Copy]] = {}
        self._cpu_busy: dict[bytes, _Copy] = {}  # pending write into a CPU entry
        self._deferred: list[_Copy] = []
        self._inflight: dict[Transfer, _Copy] = {}
        self._pins: dict[str, list[tuple[Tier, Block | CpuEntry, bytes]]] = {}  # (tier, holder, hash pinned)
        self._completed: list[Op] | None = None  # set while poll() runs
        self._looked_up: list[bytes] | None = None  # hashes of the last counted lookup
        self.counters: dict[str, int] = {
            "lookups": 0,
            "looked_up_blocks": 0,
            "hit_blocks_gpu": 0,
            "hit_blocks_cpu": 0,
            "hit_blocks_remote": 0,
            "miss_blocks": 0,
            "remote_fetch_short": 0,
            "remote_write_backs": 0,
            "demotions": 0,
            "demotions_skipped_clean": 0,
            "demotions_not_admitted": 0,
            "demotions_dropped_full": 0,
            "restores": 0,
            "stores": 0,
            "stores_present": 0,
            "stores_failed": 0,
            "loads": 0,
            "lent_bytes": 0,
            "copy_failures": 0,
        }

    # ---- GPU tier attachment -------------------------------------------------

    def attach_gpu(self, layout: BlockLayout | None = None, *, num_blocks: int | None = None) -> None:
        if self.bm is not None:
            raise PoolError(f"pool {self.spec.name!r} already has a GPU tier")
        if self.data:
            if layout is None:
                raise PoolError("a pool that moves bytes needs a GPU layout")
            if layout.block_bytes != self.spec.block_bytes:
                raise PoolError(f"GPU blocks are {layout.block_bytes} bytes, pool blocks {self.spec.block_bytes}")
            num_blocks = layout.num_blocks
        elif num_blocks is None:
            num_blocks = layout.num_blocks if layout is not None else None
        if not num_blocks:
            raise PoolError("a GPU tier needs at least one block")
        self.bm = BlockManager(num_blocks, self.spec.block_size, enable_caching=self.enable_caching)
        self.gpu = layout

    def detach_gpu(self, timeout_s: float = 10.0) -> None:
        """Drop the GPU tier (its memory is going away); the CPU tier stays."""
        if self.bm is None:
            return
        self.wait_idle(timeout_s)
        for owner, pins in self._pins.items():
            self._pins[owner] = [pin for pin in pins if pin[0] is Tier.CPU]
        self.bm = None
        self.gpu = None
        self._gpu_busy.clear()

    @property
    def has_gpu(self) -> bool:
        return self.bm is not None

    # ---- lookups and pins -------------------------------------------------------

    def _held_prefix(self, hashes: Sequence[bytes], *, gpu_after_cpu: bool = True
                     ) -> list[tuple[Tier, Block | CpuEntry]]:
        """The longest prefix some tier holds, each block from the first tier holding it.

        With ``gpu_after_cpu=False`` (allocation), a block only the GPU tier
        holds after the GPU run has ended ends the prefix: that block sits in
        the free queue and could be the very block the allocation evicts.
        LRU with last-to-first freeing keeps a chain's head at least as recent
        as its tail, so in engine-managed mode that case is rare; in store
        mode (chains stored in batches) the tail often sits in the GPU tier
        behind a demoted head, and lookups and restores take it from there.
        """
        if not self.enable_caching:
            return []
        gpu_run = self.bm.longest_cached_prefix(hashes) if self.bm is not None else []
        held: list[tuple[Tier, Block | CpuEntry]] = [(Tier.GPU, b) for b in gpu_run]
        if len(gpu_run) < len(hashes):
            held += self._held_after(hashes, len(gpu_run), gpu_after_cpu)
        return held

    def _held_after(self, hashes: Sequence[bytes], start: int, gpu_after_cpu: bool
                    ) -> list[tuple[Tier, Block | CpuEntry]]:
        """``_held_prefix`` from ``start`` on, where the leading GPU run has ended."""
        bm = self.bm if gpu_after_cpu else None
        held: list[tuple[Tier, Block | CpuEntry]] = []
        for h in hashes[start:]:
            entry = self.cpu.get_ready(h)
            if entry is not None:
                held.append((Tier.CPU, entry))
                continue
            block = bm.get_cached(h) if bm is not None else None
            if block is None:
                break
            held.append((Tier.GPU, block))
        return held

    def _held_tiers(self, hashes: Sequence[bytes]) -> list[Tier]:
        """The tiers of ``_held_prefix(hashes)``: a lookup's path, which needs no holders."""
        if not self.enable_caching:
            return []
        n = len(self.bm.longest_cached_prefix(hashes)) if self.bm is not None else 0
        tiers = [Tier.GPU] * n
        if n < len(hashes):
            tiers += [tier for tier, _ in self._held_after(hashes, n, True)]
        return tiers

    def _remote_run(self, hashes: Sequence[bytes], start: int) -> int:
        """How many hashes from ``start`` on the remote tier holds (one round trip)."""
        if self.remote is None or start >= len(hashes) or not self.enable_caching:
            return 0
        return self.remote.exists_prefix(hashes[start:])

    def _pull_remote(self, hashes: Sequence[bytes], protected: frozenset[bytes] = frozenset()) -> list[CpuEntry]:
        """Fetch blocks from the remote tier into the CPU tier; the verified prefix only.

        ``protected``: the calling request's keys, which the room made for the
        fetched blocks must not evict.
        """
        assert self.remote is not None
        payloads = self.remote.fetch(hashes)
        good = 0
        while good < len(payloads) and payloads[good] is not None:
            good += 1
        if good < len(hashes):
            self.counters["remote_fetch_short"] += 1
        if good == 0:
            return []
        try:
            entries = self.cpu.reserve(list(hashes[:good]), protected)
        except CpuTierFull:
            return []
        slab = self.cpu.storage.slab() if self.cpu.storage is not None else None
        for entry, payload in zip(entries, payloads):
            if slab is not None:
                slab[entry.slot].numpy()[:] = memoryview(payload)
            self.cpu.commit(entry)
        return entries

    def _held_with_remote(self, hashes: Sequence[bytes], *, gpu_after_cpu: bool = True
                          ) -> list[tuple[Tier, Block | CpuEntry]]:
        """The held prefix with remote runs pulled into the CPU tier.

        Blocks fetched from the remote tier come back as ``(Tier.REMOTE,
        CpuEntry)``: they are CPU-tier entries now, attributed to the remote
        tier. A remote run stops at a block the CPU tier already has (it is
        not fetched twice); the prefix then goes on through the local tiers
        and, past them, through the remote tier again.
        """
        held = self._held_prefix(hashes, gpu_after_cpu=gpu_after_cpu)
        if self.remote is None:
            return held
        bm = self.bm if gpu_after_cpu else None
        # Room made for fetched blocks must evict none of the request's blocks:
        # the CPU hits before them are read-held, the rest protected.
        protected = frozenset(hashes)
        reading = [obj for tier, obj in held if tier is Tier.CPU]
        for e in reading:
            self.cpu.begin_read(e)  # type: ignore[arg-type]
        try:
            while len(held) < len(hashes):
                pos = len(held)
                run = self._remote_run(hashes, pos)
                cut = next((i for i in range(run) if self.cpu.get(hashes[pos + i]) is not None), run)
                entries = self._pull_remote(hashes[pos : pos + cut], protected) if cut else []
                for e in entries:
                    self.cpu.begin_read(e)
                    reading.append(e)
                    held.append((Tier.REMOTE, e))
                if len(entries) < cut:
                    break  # a block missing or bad in the remote tier ends the prefix
                extended = False
                for h in hashes[len(held):]:
                    entry = self.cpu.get_ready(h)
                    block = bm.get_cached(h) if entry is None and bm is not None else None
                    if entry is not None:
                        self.cpu.begin_read(entry)
                        reading.append(entry)
                        held.append((Tier.CPU, entry))
                    elif block is not None:
                        held.append((Tier.GPU, block))
                    else:
                        break
                    extended = True
                if not extended and not entries:
                    break
        finally:
            for e in reading:
                self.cpu.end_read(e)  # type: ignore[arg-type]
        return held

    def _write_back(self, entry: CpuEntry) -> None:
        assert self.remote is not None
        data = None if self.cpu.storage is None else memoryview(self.cpu.storage.slab()[entry.slot].numpy())
        if self.remote.write_back(entry.key, data, copy=True):
            self.counters["remote_write_backs"] += 1

    def _count(self, hashes: Sequence[bytes], tiers: Sequence[Tier], *, is_lookup: bool = False) -> None:
        c = self.counters
        c["lookups"] += 1
        c["looked_up_blocks"] += len(hashes)
        for tier in Tier:
            n = tiers.count(tier)
            if n:
                c["hit_blocks_" + tier.value] += n
        c["miss_blocks"] += len(hashes) - len(tiers)
        # A lookup followed by the allocate (or restore) of the same hashes is
        # one request to the policy: history-based policies would read the
        # second call as a reuse after zero requests. So is a lookup repeated
        # with nothing in between: a scheduler polling a request that waits
        # for room, not a new request.
        if self._looked_up is not None and list(hashes) == self._looked_up:
            if not is_lookup:
                self._looked_up = None
            return
        self._looked_up = list(hashes) if is_lookup else None
        if self.defer_learning:
            self._to_learn.append(hashes)
            self.learn_backlog_keys += len(hashes)
        else:
            self.cpu.policy.record_request(hashes)

    def learn(self, should_yield: Callable[[], bool] | None = None, *, chunk_keys: int = LEARN_CHUNK_KEYS) -> bool:
        """Feed the requests counted so far to the policy (see ``defer_learning``); True when none is left.

        With ``should_yield``, recording goes in steps of about ``chunk_keys``
        keys and stops as soon as it returns True: a server asks it whether a
        request or a finished copy is waiting, so a 256-block request's
        bookkeeping (~100 us of Python) never sits in front of the next
        reply. The policy may then be left with one request half recorded,
        which its contract allows (``EvictionPolicy.record_request_steps``).
        """
        policy = self.cpu.policy
        while True:
            if self._learning is None:
                if not self._to_learn:
                    return True
                if should_yield is None:
                    hashes = self._to_learn.popleft()
                    policy.record_request(hashes)
                    self.learn_backlog_keys -= len(hashes)
                    continue
                # Stays first in the queue (and in the backlog) until recorded.
                self._learning = policy.record_request_steps(self._to_learn[0], chunk_keys)
            elif should_yield is None:
                for _ in self._learning:
                    pass
                self._finish_learning()
            else:
                if should_yield():
                    return False
                if next(self._learning, _DONE) is _DONE:
                    self._finish_learning()

    def _finish_learning(self) -> None:
        self._learning = None
        self.learn_backlog_keys -= len(self._to_learn.popleft())

    def lookup(self, hashes: Sequence[bytes], *, count: bool = True) -> list[Tier]:
        tiers = self._held_tiers(hashes)
        tiers += [Tier.REMOTE] * self._remote_run(hashes, len(tiers))
        if count:
            self._count(hashes, tiers, is_lookup=True)
        return tiers

    def pin(self, owner: str, hashes: Sequence[bytes]) -> list[Tier]:
        held = self._held_prefix(hashes)
        pins = self._pins.setdefault(owner, [])
        for key, (tier, obj) in zip(hashes, held):
            if tier is Tier.GPU:
                assert self.bm is not None and isinstance(obj, Block)
                self.bm.touch([obj])
            else:
                assert isinstance(obj, CpuEntry)
                self.cpu.pin(obj)
            # The hash pinned, not the block's: a failed write may withdraw that.
            pins.append((tier, obj, key))
        return [tier for tier, _ in held]

    def unpin(self, owner: str, hashes: Sequence[bytes]) -> int:
        pins = self._pins.get(owner, [])
        # Each hash asked for (last first) drops the owner's newest pin on it. An
        # index of pin positions per hash keeps this linear: scanning the pins
        # for every hash stalled the caller for minutes at 65536 x 65536.
        positions: dict[bytes, list[int]] = {}
        for i, (_tier, _obj, key) in enumerate(pins):
            positions.setdefault(key, []).append(i)
        dropped: set[int] = set()
        for h in reversed(hashes):
            newest = positions.get(h)
            if newest:
                i = newest.pop()
                self._release_pin(pins[i][0], pins[i][1])
                dropped.add(i)
        if dropped:
            pins[:] = [pin for i, pin in enumerate(pins) if i not in dropped]
        self._clean_ahead()
        return len(dropped)

    def unpin_all(self, owner: str) -> int:
        pins = self._pins.pop(owner, [])
        for tier, obj, _key in reversed(pins):
            self._release_pin(tier, obj)
        self._clean_ahead()
        return len(pins)

    def _release_pin(self, tier: Tier, obj: Block | CpuEntry) -> None:
        if tier is Tier.GPU:
            if self.bm is not None:
                assert isinstance(obj, Block)
                self.bm.release([obj])
        else:
            assert isinstance(obj, CpuEntry)
            self.cpu.unpin(obj)

    def num_pinned(self) -> int:
        return sum(len(p) for p in self._pins.values())

    # ---- engine-managed mode ------------------------------------------------------

    def _require_gpu(self) -> BlockManager:
        if self.bm is None:
            raise PoolError(f"pool {self.spec.name!r} has no GPU tier (register the engine's KV tensors first)")
        return self.bm

    def allocate(self, request_id: str, hashes: Sequence[bytes], num_tokens: int, *, count: bool = True) -> Op:
        bm = self._require_gpu()
        if bm.has_request(request_id):
            raise PoolError(f"request {request_id!r} is already allocated; free it first")
        # Remote blocks land in the CPU tier first (a side effect that survives
        # a failed allocation: the CPU tier is only warmer for it).
        held = self._held_with_remote(hashes, gpu_after_cpu=False)
        num_gpu_prefix = sum(1 for tier, _ in held if tier is Tier.GPU)
        try:
            alloc = bm.allocate(request_id, hashes, num_tokens)
        except NoFreeBlocks as exc:
            raise NoSpace(str(exc)) from None
        except ValueError as exc:
            raise PoolError(str(exc)) from None
        assert alloc.num_hit_blocks == num_gpu_prefix or not self.enable_caching
        tiers = [tier for tier, _ in held]
        if count:
            self._count(hashes, tiers)
        op = Op(self, "allocate", {"block_ids": alloc.block_ids, "tiers": [t.value for t in tiers],
                                   "num_gpu_hits": tiers.count(Tier.GPU), "num_cpu_hits": tiers.count(Tier.CPU),
                                   "num_remote_hits": tiers.count(Tier.REMOTE)})
        cpu_hits = [(obj, alloc.block_ids[pos]) for pos, (tier, obj) in enumerate(held) if tier is not Tier.GPU]
        entries = [e for e, _ in cpu_hits]
        # Hold the CPU entries before anything can reserve CPU slots: the
        # demotions below must not evict the very blocks we restore.
        for e in entries:
            assert isinstance(e, CpuEntry)
            self.cpu.begin_read(e)
            self.cpu.hit(e.key)
        # A GPU hit whose bytes are still being written (another op's restore or
        # store) is only as good as that write: the op fails if it fails.
        for c in self._busy_copies(alloc.block_ids[: alloc.num_hit_blocks], writes_only=True):
            self._attach(op, c)
        vacate = self._vacate(alloc.evicted, op)
        restored_blocks = [dst for _, dst in cpu_hits]
        if cpu_hits:
            copy = self._copy(CopyKind.RESTORE, self._cpu_layout(), [e.slot for e in entries],
                              self.gpu, restored_blocks, after=vacate | self._busy_copies(restored_blocks))
            copy.on_done.append(lambda ok, es=entries: [self.cpu.end_read(e) for e in es])
            self._mark_gpu_busy(copy, restored_blocks)
            self.counters["restores"] += len(cpu_hits)
            self._attach(op, copy)

        # Every block this call committed: restored ones, and misses the engine
        # computes only once the op succeeds.
        committed = [(alloc.block_ids[pos], hashes[pos])
                     for pos in range(alloc.num_hit_blocks, min(len(hashes), len(alloc.block_ids)))]

        def undo_on_failure(ok: bool) -> None:
            if ok or self.bm is None:
                return
            # Withdraw the hashes whose bytes never arrived, also when the
            # request was freed while the copy was in flight.
            for block_id, key in committed:
                if self.bm.blocks[block_id].block_hash == key:
                    self.bm.discard_hash(self.bm.blocks[block_id])
            if self.bm.has_request(request_id):
                self.bm.free(request_id)

        op._finalizers.append(undo_on_failure)
        self._settle(op)
        self._clean_ahead()
        return op

    def append(self, request_id: str, num_new_tokens: int, new_hashes: Sequence[bytes]) -> Op:
        bm = self._require_gpu()
        try:
            alloc = bm.append(request_id, num_new_tokens, new_hashes)
        except NoFreeBlocks as exc:
            raise NoSpace(str(exc)) from None
        except KeyError as exc:
            raise NotFound(str(exc)) from None
        except ValueError as exc:
            raise PoolError(str(exc)) from None
        op = Op(self, "append", {"block_ids": alloc.block_ids, "new_block_ids": alloc.new_block_ids})
        self._vacate(alloc.evicted, op)
        self._settle(op)
        return op

    def free(self, request_id: str, *, valid_tokens: int | None = None) -> None:
        """Release a request; ``valid_tokens`` (a request that failed part-way):
        blocks past that many tokens never got their K/V, so their hashes go."""
        bm = self._require_gpu()
        try:
            bm.free(request_id, valid_tokens=valid_tokens)
        except KeyError as exc:
            raise NotFound(str(exc)) from None
        self._clean_ahead()

    def block_table(self, request_id: str) -> list[int]:
        return self._require_gpu().block_table(request_id)

    # ---- store mode ------------------------------------------------------------------

    def store(self, hashes: Sequence[bytes], src: BlockLayout | None, src_slots: Sequence[int]) -> Op:
        if len(hashes) != len(src_slots):
            raise PoolError(f"{len(hashes)} hashes but {len(src_slots)} source slots")
        if len(set(hashes)) != len(hashes):
            raise PoolError("store got the same hash twice")
        if self.data and (src is None or src.block_bytes != self.spec.block_bytes):
            raise PoolError(f"source blocks must be {self.spec.block_bytes} bytes")
        new = [(h, s) for h, s in zip(hashes, src_slots) if not self._holds(h)]
        op = Op(self, "store", {"stored": len(new), "present": len(hashes) - len(new)})
        if not new:
            self.counters["stores_present"] += len(hashes)
            op._finish()
            return op
        # Every key of the call is protected: making room for the new blocks
        # must not evict the present ones (they are what the reply counts as
        # held, and the chain the new blocks extend).
        protected = op.protected = frozenset(hashes)
        if self.bm is None:
            self._store_cpu(op, new, src, protected)
        else:
            # What the GPU tier cannot take (its free queue, less the present
            # blocks waiting in it, is shorter than the batch) goes straight to
            # the CPU tier: the chain's tail, which is evicted first anyway.
            # CPU first: it is the part that can fail.
            fits = min(len(new), self.bm.num_free_unprotected(protected))
            if fits < len(new):
                self._store_cpu(op, new[fits:], src, protected)
            if fits:
                self._store_gpu(op, new[:fits], src, protected)
        # Counted once the store cannot fail any more: a NoSpace changes nothing
        # but stores_failed.
        self.counters["stores"] += len(new)
        self.counters["stores_present"] += len(hashes) - len(new)
        self._settle(op)
        self._clean_ahead(protected)
        return op

    def _holds(self, h: bytes) -> bool:
        if self.bm is not None and self.bm.get_cached(h) is not None:
            return True
        return self.cpu.get(h) is not None

    def _store_gpu(self, op: Op, new: list[tuple[bytes, int]], src: BlockLayout | None,
                   protected: frozenset[bytes]) -> None:
        bm = self.bm
        assert bm is not None
        try:
            blocks, evicted = bm.allocate_blocks(len(new), protected)
        except NoFreeBlocks as exc:
            self.counters["stores_failed"] += 1
            raise NoSpace(f"GPU tier full: {exc}") from None
        vacate = self._vacate(evicted, op, protected)
        for block, (h, _) in zip(blocks, new):
            bm.commit(block, h)
        dst = [b.block_id for b in blocks]
        copy = self._copy(CopyKind.STORE, src, [s for _, s in new], self.gpu, dst,
                          after=vacate | self._busy_copies(dst))
        self._mark_gpu_busy(copy, dst)
        self._attach(op, copy)

        def release(ok: bool) -> None:
            if self.bm is None:
                return
            if not ok:
                for block in blocks:
                    self.bm.discard_hash(block)
            # Reverse order: the chain's tail sits nearest the head of the free queue.
            self.bm.release(reversed(blocks))

        op._finalizers.append(release)

    def _store_cpu(self, op: Op, new: list[tuple[bytes, int]], src: BlockLayout | None,
                   protected: frozenset[bytes]) -> None:
        try:
            entries = self.cpu.reserve([h for h, _ in new], protected)
        except CpuTierFull as exc:
            self.counters["stores_failed"] += 1
            raise NoSpace(str(exc)) from None
        copy = self._copy(CopyKind.STORE, src, [s for _, s in new], self._cpu_layout(), [e.slot for e in entries])
        self._track_cpu_write(copy, entries)
        self._attach(op, copy)

    def restore(self, hashes: Sequence[bytes], dst: BlockLayout | None, dst_slots: Sequence[int], *,
                count: bool = True) -> Op:
        if len(dst_slots) < len(hashes):
            raise PoolError(f"{len(hashes)} hashes but only {len(dst_slots)} destination slots")
        if self.data and (dst is None or dst.block_bytes != self.spec.block_bytes):
            raise PoolError(f"destination blocks must be {self.spec.block_bytes} bytes")
        held = self._held_with_remote(hashes)
        tiers = [tier for tier, _ in held]
        if count:
            self._count(hashes, tiers)
        op = Op(self, "restore", {"tiers": [t.value for t in tiers]})
        gpu = [(obj, dst_slots[i]) for i, (tier, obj) in enumerate(held) if tier is Tier.GPU]
        cpu = [(obj, dst_slots[i]) for i, (tier, obj) in enumerate(held) if tier is not Tier.GPU]
        if gpu:
            assert self.bm is not None
            blocks = [b for b, _ in gpu]
            self.bm.touch(blocks)
            ids = [b.block_id for b in blocks]
            copy = self._copy(CopyKind.LOAD, self.gpu, ids, dst, [d for _, d in gpu],
                              after=self._busy_copies(ids, writes_only=True))
            self._mark_gpu_busy(copy, ids)
            bm = self.bm
            copy.on_done.append(lambda ok, bl=blocks, bm=bm: bm.release(reversed(bl)) if self.bm is bm else None)
            self._attach(op, copy)
        if cpu:
            entries = [e for e, _ in cpu]
            for e in entries:
                self.cpu.begin_read(e)
                self.cpu.hit(e.key)
            copy = self._copy(CopyKind.LOAD, self._cpu_layout(), [e.slot for e in entries], dst, [d for _, d in cpu])
            copy.on_done.append(lambda ok, es=entries: [self.cpu.end_read(e) for e in es])
            self._attach(op, copy)
        self.counters["loads"] += len(held)
        self._settle(op)
        self._clean_ahead()
        return op

    def borrow(self, hashes: Sequence[bytes], *, max_views: int | None = None) -> Borrowed | None:
        """Views of the longest held prefix, for a sender that reads it in place (see the contract).

        A restore reply sent inline would otherwise copy every block into a
        staging buffer first: 16 MiB costs ~0.9 ms of memcpy before ZMQ moves
        the same bytes again. One view per run of consecutive slots in one
        tier; with ``max_views``, a prefix scattered over more runs than that
        is declined (None, nothing changed). Counted like a restore.
        """
        if not self.data or (self.remote is not None and self.enable_caching):
            return None  # bookkeeping has no bytes; remote blocks are fetched by restore()
        gpu_slab = self.gpu.slab() if self.gpu is not None and self.gpu.is_slab else None
        if gpu_slab is not None and gpu_slab.device.type != "cpu":
            gpu_slab = None
        cpu_layout = self._cpu_layout()
        cpu_slab = cpu_layout.slab() if cpu_layout is not None and cpu_layout.is_slab else None
        held = self._held_prefix(hashes)
        blocks = [obj for tier, obj in held if tier is Tier.GPU]
        entries = [obj for tier, obj in held if tier is Tier.CPU]
        if blocks:
            ids = [b.block_id for b in blocks]  # type: ignore[union-attr]
            if gpu_slab is None or self._busy_copies(ids, writes_only=True):
                return None
        if entries and cpu_slab is None:
            return None
        runs: list[tuple[Any, int, int]] = []  # (slab, first slot, count)
        for tier, obj in held:
            slab, slot = (gpu_slab, obj.block_id) if tier is Tier.GPU else (cpu_slab, obj.slot)  # type: ignore[union-attr]
            if runs and runs[-1][0] is slab and runs[-1][1] + runs[-1][2] == slot:
                runs[-1] = (slab, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((slab, slot, 1))
        if max_views is not None and len(runs) > max_views:
            return None
        # Planned; from here on nothing fails.
        tiers = [tier for tier, _ in held]
        self._count(hashes, tiers)
        bm = self.bm
        if blocks:
            assert bm is not None
            bm.touch(blocks)  # type: ignore[arg-type]
        for e in entries:
            self.cpu.begin_read(e)  # type: ignore[arg-type]
            self.cpu.hit(e.key)  # type: ignore[union-attr]
        self.counters["loads"] += len(held)
        self.counters["lent_bytes"] += len(held) * self.spec.block_bytes
        views = [slab[first : first + n].numpy() for slab, first, n in runs]
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            if blocks and self.bm is bm:
                bm.release(reversed(blocks))  # type: ignore[arg-type, union-attr]
            for e in entries:
                self.cpu.end_read(e)  # type: ignore[arg-type]
            self._clean_ahead()

        return Borrowed(tiers, views, release)

    # ---- maintenance ---------------------------------------------------------------------

    def clear(self) -> int:
        """Drop every cached block no one holds (no demotion); returns the count."""
        dropped = 0
        if self.bm is not None:
            dropped += len(self.bm.evict_free_cached())
        dropped += self.cpu.clear()
        return dropped

    def poll(self, wait_s: float = 0.0) -> list[Op]:
        """Apply finished copies; returns the ops that completed."""
        if wait_s > 0 and self._inflight and self.transfer is not None:
            first = next(iter(self._inflight))
            first.wait(wait_s)
        self._completed = []
        try:
            if self.transfer is not None:
                for transfer in self.transfer.poll():
                    copy = self._inflight.pop(transfer, None)
                    if copy is not None:
                        self._finish_copy(copy, transfer.error)
            self._submit_ready()
            if self._completed:
                # Completed ops may have released blocks into the free queue (as
                # bookkeeping mode does at once, inside the call): demoting them
                # is still part of those calls, so their keys stay protected.
                self._clean_ahead(frozenset().union(*(op.protected for op in self._completed)))
            return self._completed
        finally:
            self._completed = None

    def _note_completed(self, op: Op) -> None:
        if self._completed is not None:
            self._completed.append(op)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._inflight or self._deferred:
            if time.monotonic() >= deadline:
                return False
            self.poll(wait_s=0.01)
        return True

    @property
    def busy(self) -> bool:
        return bool(self._inflight or self._deferred)

    def stats(self) -> dict[str, Any]:
        bm = self.bm
        s: dict[str, Any] = dict(self.counters)
        s.update(
            gpu_blocks=bm.num_blocks if bm else 0,
            gpu_free_blocks=bm.num_free_blocks if bm else 0,
            gpu_cached_blocks=bm.num_cached_blocks if bm else 0,
            cpu_blocks=self.cpu.capacity_blocks,
            cpu_used_blocks=len(self.cpu),
            cpu_evictions=self.cpu.evictions,
            cpu_full_failures=self.cpu.full_failures,
            cpu_not_admitted=self.cpu.not_admitted,
            pinned_blocks=self.num_pinned(),
            copies_in_flight=len(self._inflight) + len(self._deferred),
            block_bytes=self.spec.block_bytes,
        )
        if self.remote is not None:
            s["remote"] = self.remote.stats()
        if self.transfer is not None:
            for kind in CopyKind:
                s[f"bytes_{kind.value}"] = self.transfer.bytes_by_kind[kind]
                s[f"seconds_{kind.value}"] = round(self.transfer.seconds_by_kind[kind], 6)
        return s

    def close(self, timeout_s: float = 10.0) -> None:
        self.wait_idle(timeout_s)

    # ---- demotion ----------------------------------------------------------------------------

    def _vacate(self, evicted: Sequence[Evicted], op: Op, protected: frozenset[bytes] = frozenset()) -> set[_Copy]:
        """Make evicted blocks' slots safe to reuse; returns the copies reuse must follow.

        ``protected``: the calling op's keys, which the demotions' room in the
        CPU tier must not be made from.
        """
        must_follow: set[_Copy] = set()
        urgent: list[Evicted] = []
        urgent_keys: set[bytes] = set()
        for ev in evicted:
            must_follow |= self._busy_copies([ev.block_id])
            if self.cpu.get(ev.block_hash) is not None:
                self.counters["demotions_skipped_clean"] += 1
            elif self.bm is not None and self.bm.get_cached(ev.block_hash) is not None:
                continue  # a duplicate copy still lives in the GPU tier
            elif ev.block_hash in urgent_keys:
                continue  # two copies of one hash evicted at once: one demotion
            else:
                urgent.append(ev)
                urgent_keys.add(ev.block_hash)
        if urgent:
            demote = self._demote(urgent, high_priority=True, protected=protected)
            if demote is not None:
                must_follow.add(demote)
        # The caller writes the reused slots once the op is done: it waits for
        # these copies, but their failure (a lost demotion) is not its failure.
        self._wait_for(op, must_follow)
        return must_follow

    def _demote(self, evicted: Sequence[Evicted], *, high_priority: bool,
                protected: frozenset[bytes] = frozenset()) -> _Copy | None:
        admitted = [ev for ev in evicted if self.cpu.admit(ev.block_hash)]
        self.counters["demotions_not_admitted"] += len(evicted) - len(admitted)
        if not admitted or self.cpu.capacity_blocks == 0:
            self.counters["demotions_dropped_full"] += len(admitted)
            return None
        try:
            entries = self.cpu.reserve([ev.block_hash for ev in admitted], protected)
        except CpuTierFull:
            self.counters["demotions_dropped_full"] += len(admitted)
            return None
        ids = [ev.block_id for ev in admitted]
        copy = self._copy(CopyKind.DEMOTE, self.gpu, ids, self._cpu_layout(), [e.slot for e in entries],
                          after=self._busy_copies(ids, writes_only=True), high_priority=high_priority)
        self._track_cpu_write(copy, entries)
        self._mark_gpu_busy(copy, ids)
        self.counters["demotions"] += len(admitted)
        return copy

    def _clean_ahead(self, protected: frozenset[bytes] = frozenset()) -> None:
        """Demote the cached blocks the next allocations will evict, before they do.

        ``protected``: the keys of the call that runs it (a store), which the
        room made in the CPU tier must not evict.
        """
        if self.bm is None or self.clean_ahead_blocks <= 0 or self.cpu.capacity_blocks == 0:
            return
        dirty: list[Evicted] = []
        for i, block in enumerate(self.bm.iter_free()):
            if i >= self.clean_ahead_blocks:
                break
            h = block.block_hash
            if h is None or self.cpu.get(h) is not None or block.block_id in self._gpu_busy:
                continue
            if self.bm.get_cached(h) is not block:
                continue  # a duplicate: its twin carries the hash
            dirty.append(Evicted(block.block_id, h))
        if dirty:
            copy = self._demote(dirty, high_priority=False, protected=protected)
            if copy is not None:
                self._submit_ready()

    # ---- copy plumbing ----------------------------------------------------------------------

    def _cpu_layout(self) -> BlockLayout | None:
        return self.cpu.storage

    def _copy(self, kind: CopyKind, src: BlockLayout | None, src_slots: Sequence[int], dst: BlockLayout | None,
              dst_slots: Sequence[int], *, after: set[_Copy] | None = None,
              high_priority: bool | None = None) -> _Copy:
        copy = _Copy(kind, src, list(src_slots), dst, list(dst_slots), {c for c in (after or ()) if not c.finished},
                     high_priority=kind.high_priority if high_priority is None else high_priority)
        self._deferred.append(copy)
        return copy

    def _attach(self, op: Op, copy: _Copy) -> None:
        """The op waits for the copy and fails if it fails."""
        op._waiting.add(copy)
        copy.ops.append(op)

    def _wait_for(self, op: Op, copies: set[_Copy]) -> None:
        """The op waits for the copies but does not share their failure."""
        for c in copies:
            if c.finished or c in op._waiting:
                continue
            op._waiting.add(c)
            c.on_done.append(lambda ok, o=op, cc=c: self._release_op(o, cc))

    def _release_op(self, op: Op, copy: _Copy) -> None:
        if copy in op._waiting:
            op._waiting.discard(copy)
            if not op._waiting and not op.done:
                op._finish()

    def _busy_copies(self, block_ids: Sequence[int], *, writes_only: bool = False) -> set[_Copy]:
        found: set[_Copy] = set()
        for b in block_ids:
            for c in self._gpu_busy.get(b, ()):
                if not writes_only or c.dst is self.gpu and b in c.dst_slots:
                    found.add(c)
        return found

    def _mark_gpu_busy(self, copy: _Copy, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self._gpu_busy.setdefault(b, set()).add(copy)

        def unmark(ok: bool) -> None:
            for b in block_ids:
                busy = self._gpu_busy.get(b)
                if busy is not None:
                    busy.discard(copy)
                    if not busy:
                        del self._gpu_busy[b]

        copy.on_done.append(unmark)

    def _track_cpu_write(self, copy: _Copy, entries: list[CpuEntry]) -> None:
        def settle(ok: bool) -> None:
            for e in entries:
                (self.cpu.commit if ok else self.cpu.abort)(e)

        copy.on_done.append(settle)

    def _settle(self, op: Op) -> None:
        """Submit what can go now; finish the op at once if nothing is pending."""
        self._submit_ready()
        if not op._waiting and not op.done:
            op._finish()

    def _submit_ready(self) -> None:
        progress = True
        while progress:
            progress = False
            for copy in list(self._deferred):
                if any(not c.finished for c in copy.after):
                    continue
                self._deferred.remove(copy)
                progress = True
                # Only a failed write into this copy's source slots spoils it; the
                # other dependencies just order the reuse of slots.
                failed = [c for c in copy.after if c.error is not None and c.dst is copy.src
                          and not set(c.dst_slots).isdisjoint(copy.src_slots)]
                if failed:
                    self._finish_copy(copy, TransferError(f"a copy it depends on failed: {failed[0].error}"))
                elif not self.data or not copy.src_slots:
                    self._finish_copy(copy, None)
                else:
                    assert self.transfer is not None and copy.src is not None and copy.dst is not None
                    try:
                        transfer = self.transfer.submit(copy.kind, copy.src, copy.src_slots, copy.dst,
                                                        copy.dst_slots, high_priority=copy.high_priority)
                    except (TransferError, ValueError) as exc:
                        self._finish_copy(copy, exc)
                        continue
                    copy.transfer = transfer
                    self._inflight[transfer] = copy

    def _finish_copy(self, copy: _Copy, error: BaseException | None) -> None:
        copy.finished = True
        copy.error = error
        ok = error is None
        if not ok:
            self.counters["copy_failures"] += 1
            log.warning("%s of %d blocks failed: %s", copy.kind.value, len(copy.src_slots), error)
        for fn in copy.on_done:
            fn(ok)
        for op in copy.ops:
            op._waiting.discard(copy)
            if not ok and op.error is None:
                op.error = error
            if not op._waiting and not op.done:
                op._finish()
