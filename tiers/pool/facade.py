"""TieredPool: one KV layout with its GPU tier, its CPU tier, and the copies between them.

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
  so nothing evicts it until ``unpin``/``unpin_all``; returns its tiers. A
  remote run is fetched into the CPU tier first and pinned there.
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
  waits for no device-to-host copy. ``clean_when_idle()``, called by a
  caller with nothing else to do, goes deeper (``idle_clean_blocks``): a
  long request's allocation after a pause then waits for no demotion either.
- Remote tier (optional, ``remote=RemoteTier``): lookups continue past the
  CPU tier with one pipelined existence probe; allocate/restore/pin fetch the
  remote run into the CPU tier (checksummed; a bad or missing value ends the
  prefix there) and go on as CPU hits, attributed to ``remote``; blocks the
  CPU tier evicts are written back asynchronously (dropped, never waited
  for, when the remote tier is slow or down). The fetch is one pipelined
  round trip on the caller's thread, bounded by the remote tier's timeout.
- Disk tier (optional, ``disk=DiskTier``): below the CPU tier, above the
  remote tier (``lower`` is the ordered list of the tiers below the CPU
  tier). Lookups continue past the CPU tier through the disk tier's
  in-memory index, then the remote tier; allocate/restore/pin read disk
  runs straight into reserved CPU slots (in parallel, checksums verified; a
  bad or unreadable block ends the prefix there) and go on as CPU hits,
  attributed to ``disk``. Blocks the CPU tier evicts are handed to every
  lower tier (the disk tier queues them for its writer thread, the remote
  tier for its own). The disk tier admits what the CPU policy's
  ``+admit2`` rule admits (a second sighting), everything without it. The
  read is on the caller's thread. ``clear`` clears the disk tier too (it is
  the pool's own; the remote tier is shared and left alone). Needs
  ``data=True``.
- Bookkeeping mode (``data=False``): no bytes and no transfer engine; every
  copy is complete at once. Trace replay uses it to drive the same code.
- Key journal (optional, ``journal_events=N``): ``journal`` records the keys
  the pool starts and stops holding, its last N events (``journal.py``), for
  the daemon's ``events`` verb.
- Persistent CPU tier (optional): ``attach_arena(arena)``, right after
  construction with ``cpu_storage=arena.layout``, makes the CPU tier
  restart-safe and adopts the blocks a previous process left in the arena
  (``adoption.py``: served only once their checksums verify; ``poll()``
  applies the background verdicts). ``demote_cached(timeout_s)``, before a
  clean stop, copies the GPU tier's cached blocks the CPU tier lacks into
  it (as its policy admits them), so they outlive the process too.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.tiers.block_manager import BlockManager
from kvtier.tiers.copy_types import CopyKind, TransferEngine
from kvtier.tiers.cpu_tier import CpuTier
from kvtier.tiers.hints import RequestHints
from kvtier.tiers.policies import EvictionPolicy, make_policy
from kvtier.tiers.policies.admit2 import AdmissionWrapper, SecondSightingAdmission
from kvtier.tiers.policies.base import find_wrapped
from kvtier.tiers.pool_defaults import DEFAULT_CLEAN_AHEAD_BLOCKS, DEFAULT_POLICY
from kvtier.tiers.pool.adoption import Adoption
from kvtier.tiers.pool.base import Borrowed, Held, PoolError, PoolSpec, Tier
from kvtier.tiers.pool.copies import CopyScheduler, Op
from kvtier.tiers.pool.counters import Counters
from kvtier.tiers.pool.demotion import Demoter
from kvtier.tiers.pool.engine import EngineMode
from kvtier.tiers.pool.learning import LEARN_CHUNK_KEYS, LearningQueue
from kvtier.tiers.pool.lending import Lender
from kvtier.tiers.pool.journal import REMOVED, KeyJournal
from kvtier.tiers.pool.pins import Pins
from kvtier.tiers.pool.polling import Poller
from kvtier.tiers.pool.resolve import Resolver, WriteBack
from kvtier.tiers.pool.state import PoolState
from kvtier.tiers.pool.store import StoreMode
from kvtier.tiers.pool.verb_part import VerbCollaborators

if TYPE_CHECKING:
    from kvtier.tiers.disk_tier import DiskTier
    from kvtier.blocks.layout import BlockLayout
    from kvtier.tiers.persistent_arena import PersistentArena
    from kvtier.tiers.remote import RemoteStore

# Blocks one idle-time clean-ahead call demotes at most (one batched copy: 256 MiB of 1 MiB blocks).
IDLE_CLEAN_BATCH_BLOCKS = 256

# Wraps the CPU tier's eviction policy as the pool is built (the daemon's
# tenant quotas): gets the policy made from ``policy`` and the CPU tier it orders.
WrapPolicy = Callable[[EvictionPolicy, CpuTier], EvictionPolicy]


class TieredPool:
    """See the module docstring.

    The facade over the pool's parts (``kvtier.tiers.pool``'s modules): the
    tiers (``bm``, ``cpu``, ``remote``; code outside ``kvtier.tiers`` uses the
    properties and methods instead), the copy scheduler, prefix resolution,
    pins, policy learning and demotion. The verbs' bodies live in ``engine``,
    ``store`` and ``lending``. It builds the parts, handing each the
    collaborators it uses (and the ``PoolState`` where it reads the GPU
    tier), and forwards to them; no part holds the facade, so the pool's
    object graph has no cycle and a dropped pool is freed by reference count.
    """

    def __init__(
        self,
        spec: PoolSpec,
        *,
        cpu_blocks: int,
        policy: str = DEFAULT_POLICY,
        transfer: TransferEngine | None = None,
        data: bool = True,
        cpu_storage: BlockLayout | None = None,
        enable_caching: bool = True,
        clean_ahead_blocks: int = DEFAULT_CLEAN_AHEAD_BLOCKS,
        idle_clean_blocks: int | None = None,
        remote: RemoteStore | None = None,
        disk: DiskTier | None = None,
        defer_learning: bool = False,
        policy_wrapper: WrapPolicy | None = None,
        journal_events: int = 0,
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
        self._state = state = PoolState(spec.name, clean_ahead_blocks)
        # None: the GPU tier's size, at most half the CPU tier (see clean_when_idle).
        self.idle_clean_blocks = idle_clean_blocks
        # (block, hash) pairs the idle pass asked the CPU tier about: a refusal is not asked again
        # (a policy's or a tenant quota's refusals are counted), nor a block in flight twice.
        self._idle_asked: set[tuple[int, bytes]] = set()
        # History-based policies learn from every request (hundreds of
        # microseconds for a long one); a server defers that until its replies
        # are out and calls learn() between requests.
        self.defer_learning = defer_learning
        self.cpu = CpuTier(cpu_blocks, make_policy(policy, cpu_blocks), cpu_storage if data else None)
        if policy_wrapper is not None:
            self.cpu.policy = policy_wrapper(self.cpu.policy, self.cpu)
        self.remote = remote  # kvtier.tiers.remote.RemoteStore (RemoteTier, replay's stand-in) or None
        if disk is not None and not data:
            raise ValueError("a disk tier needs a pool that moves bytes (data=True)")
        self.disk = disk
        # The tiers below the CPU tier, in the order lookups and fetches try them.
        self.lower: tuple[tuple[Tier, Any], ...] = tuple(
            (tier, store) for tier, store in ((Tier.DISK, disk), (Tier.REMOTE, remote)) if store is not None)
        if disk is not None and disk.admission is None:
            disk.admission = second_sighting(self.cpu.policy)
        cpu = self.cpu
        self.counters = counters = Counters()
        self._copies = copies = CopyScheduler(data=data, transfer=transfer, counters=counters)
        self._resolve = resolver = Resolver(state, cpu, counters, lower=self.lower, enable_caching=enable_caching)
        self._pins = Pins(state, cpu)
        self._learning = learning = LearningQueue(cpu, defer=defer_learning)
        self._demoter = demoter = Demoter(state, cpu, copies, counters)
        self._poller = poller = Poller(copies, demoter)
        shared = VerbCollaborators(state, cpu, copies, resolver, demoter, learning, counters)
        self._engine = EngineMode(shared, poller, enable_caching=enable_caching)
        self._store = StoreMode(shared, poller, block_bytes=spec.block_bytes, data=data)
        self._lender = Lender(shared, block_bytes=spec.block_bytes, data=data,
                              consults_remote=remote is not None and enable_caching,
                              disk=disk if enable_caching else None)
        # Which keys the pool started and stopped holding, for routers (journal.py); 0: none kept.
        self.journal = KeyJournal(journal_events) if journal_events > 0 else None
        if self.journal is not None:
            cpu.key_observer = self.journal.observer(state.gpu_has)
        if self.lower:
            # In bookkeeping mode (replay) the remote tier is a stand-in that
            # tracks keys only: fetch returns placeholders, write_back gets None.
            cpu.on_evict = WriteBack(cpu.storage, counters, disk=disk, remote=remote)
        self.adoption: Adoption | None = None

    # ---- the shared state, as attributes -------------------------------------------------

    @property
    def bm(self) -> BlockManager | None:
        """The GPU tier's block manager (None without a GPU tier)."""
        return self._state.bm

    @property
    def gpu(self) -> BlockLayout | None:
        """The GPU tier's memory (None without one, or in bookkeeping mode)."""
        return self._state.gpu

    @property
    def clean_ahead_blocks(self) -> int:
        return self._state.clean_ahead_blocks

    @clean_ahead_blocks.setter
    def clean_ahead_blocks(self, blocks: int) -> None:
        self._state.clean_ahead_blocks = blocks

    @property
    def idle_clean_pending(self) -> bool:
        """Set by every call's clean-ahead, cleared when the idle pass is done."""
        return self._state.idle_clean_pending

    # ---- persistence (adoption.py) ---------------------------------------------

    def attach_arena(self, arena: PersistentArena, wakeup: Callable[[], None] | None = None) -> None:
        """Make the CPU tier restart-safe in ``arena`` and adopt what it holds (see the contract)."""
        if self.adoption is not None:
            raise PoolError(f"pool {self.spec.name!r} already has an arena")
        self.adoption = self._poller.adoption = Adoption(self.cpu, arena, self.journal, name=self.spec.name,
                                                         wakeup=wakeup)

    def demote_cached(self, timeout_s: float) -> int:
        """Before a clean stop: demote the GPU tier's cached blocks the CPU tier lacks; returns how many
        demotions were submitted (the call waits for them up to ``timeout_s``)."""
        if self.bm is None or not self.data or self.cpu.capacity_blocks == 0:
            return 0
        deadline_s = time.monotonic() + timeout_s
        asked: set[tuple[int, bytes]] = set()  # each block asked once, demoted or refused
        submitted = 0
        while time.monotonic() < deadline_s:
            found, n = self._demoter.clean_ahead(depth_blocks=self.bm.num_blocks,
                                                 max_blocks=IDLE_CLEAN_BATCH_BLOCKS, asked=asked)
            submitted += n
            if not found:
                break
        self.wait_idle(max(0.0, deadline_s - time.monotonic()))
        return submitted

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
        bm = BlockManager(num_blocks, self.spec.block_size, enable_caching=self.enable_caching)
        if self.journal is not None:
            bm.key_observer = self.journal.observer(_cpu_has(self.cpu))
        self._state.bm = bm
        self._state.gpu = self._copies.gpu = layout

    def detach_gpu(self, timeout_s: float = 10.0) -> None:
        """Drop the GPU tier (its memory is going away); the CPU tier stays."""
        if self.bm is None:
            return
        self.wait_idle(timeout_s)
        self._pins.detach_gpu()
        held = [b.block_hash for b in self.bm.blocks if b.block_hash is not None]
        self._state.bm = None
        self._demoter.dropped(held)
        if self.journal is not None:
            for key in dict.fromkeys(held):  # duplicates once
                if not self.cpu.peek(key):
                    self.journal.record(REMOVED, key)
        self._state.gpu = None
        self._copies.detach_gpu()

    # ---- capacity and contents (what the daemon reads) ------------------------------

    @property
    def gpu_blocks(self) -> int:
        """The GPU tier's blocks (0 without one)."""
        return self.bm.num_blocks if self.bm is not None else 0

    @property
    def cpu_blocks(self) -> int:
        """The CPU tier's capacity in blocks."""
        return self.cpu.capacity_blocks

    @property
    def policy(self) -> EvictionPolicy:
        """The CPU tier's eviction policy (as wrapped by ``policy_wrapper``)."""
        return self.cpu.policy

    def holds(self, key: bytes) -> bool:
        """Whether some local tier holds ``key``: cached in the GPU tier, or in the CPU tier (also while written)."""
        return self._resolve.holds(key)

    def cpu_spill(self, hashes: Sequence[bytes]) -> int:
        """How many blocks a ``store`` of ``hashes`` would put into the CPU tier now (its split)."""
        return self._store.cpu_spill(hashes)

    # ---- lookups, pins and policy learning --------------------------------------------

    def lookup(self, hashes: Sequence[bytes], *, count: bool = True, hints: RequestHints | None = None) -> list[Tier]:
        resolve = self._resolve
        tiers = resolve.held_tiers(hashes)
        tiers += resolve.lower_tiers(hashes, len(tiers))
        if count:
            self.counters.count_request(hashes, tiers)
            self._learning.note(hashes, is_lookup=True, hints=hints)
        return tiers

    def _held_prefix(self, hashes: Sequence[bytes]) -> Held:
        """``Resolver.held_prefix`` (bench/protocol.py times it on its own)."""
        return self._resolve.held_prefix(hashes)

    def pin(self, owner: str, hashes: Sequence[bytes]) -> list[Tier]:
        # With lower tiers their runs are fetched into the CPU tier and pinned
        # there: a pin the remote tier cannot honour (its server evicts at will)
        # would be no pin, and a lookup that pins would lose every remote hit.
        held = self._resolve.held_with_lower(hashes)
        self._pins.pin(owner, hashes, held)
        return [tier for tier, _ in held]

    def unpin(self, owner: str, hashes: Sequence[bytes]) -> int:
        n = self._pins.unpin(owner, hashes)
        self._demoter.clean_ahead()
        return n

    def unpin_all(self, owner: str) -> int:
        n = self._pins.unpin_all(owner)
        self._demoter.clean_ahead()
        return n

    def num_pinned(self) -> int:
        return len(self._pins)

    def learn(self, should_yield: Callable[[], bool] | None = None, *, chunk_keys: int = LEARN_CHUNK_KEYS) -> bool:
        """Feed the requests counted so far to the policy (see ``defer_learning``); True when none is left.

        With ``should_yield``, recording goes in steps of about ``chunk_keys``
        keys and stops as soon as it returns True: a server asks it whether a
        request or a finished copy is waiting, so a 256-block request's
        bookkeeping (~100 us of Python) never sits in front of the next
        reply. The policy may then be left with one request half recorded,
        which its contract allows (``EvictionPolicy.learn``).
        """
        return self._learning.learn(should_yield, chunk_keys=chunk_keys)

    @property
    def learn_backlog_keys(self) -> int:
        """Keys counted but not yet recorded (a request counts until fully recorded)."""
        return self._learning.backlog_keys

    # ---- engine-managed mode (engine.py) ----------------------------------------------

    def allocate(self, request_id: str, hashes: Sequence[bytes], num_tokens: int, *, count: bool = True,
                 hints: RequestHints | None = None) -> Op:
        return self._engine.allocate(request_id, hashes, num_tokens, count=count, hints=hints)

    def append(self, request_id: str, num_new_tokens: int, new_hashes: Sequence[bytes]) -> Op:
        return self._engine.append(request_id, num_new_tokens, new_hashes)

    def free(self, request_id: str, *, valid_tokens: int | None = None) -> None:
        """Release a request; ``valid_tokens`` (a request that failed part-way):
        blocks past that many tokens never got their K/V, so their hashes go."""
        self._engine.free(request_id, valid_tokens=valid_tokens)

    def block_table(self, request_id: str) -> list[int]:
        return self._state.require_gpu().block_table(request_id)

    # ---- store mode (store.py, lending.py) ----------------------------------------------

    def store(self, hashes: Sequence[bytes], src: BlockLayout | None, src_slots: Sequence[int], *,
              hints: RequestHints | None = None, read_by_ns: int | None = None) -> Op:
        op = self._store.store(hashes, src, src_slots, read_by_ns=read_by_ns)
        if hints is not None:
            self._learning.note_hints(hashes, hints)  # only once the store is planned: a refused one says nothing
        return op

    def restore(self, hashes: Sequence[bytes], dst: BlockLayout | None, dst_slots: Sequence[int], *,
                count: bool = True, start_by_ns: int | None = None, max_blocks: int | None = None) -> Op:
        return self._store.restore(hashes, dst, dst_slots, count=count, start_by_ns=start_by_ns,
                                   max_blocks=max_blocks)

    def borrow(self, hashes: Sequence[bytes], *, max_views: int | None = None,
               cpu_only: bool = False, with_views: bool = True) -> Borrowed | None:
        """Views of the longest held prefix, for a sender that reads it in place (see the contract
        and ``lending``). One view per run of consecutive slots in one tier; with ``max_views``, a
        prefix scattered over more runs than that is declined (None, nothing changed). Counted like
        a restore. ``with_views=False``: the same hold and ``slots``, ``views`` left empty (a lend
        hands out slots only)."""
        return self._lender.borrow(hashes, max_views=max_views, cpu_only=cpu_only, with_views=with_views)

    # ---- maintenance ---------------------------------------------------------------------

    def clear(self) -> int:
        """Drop every cached block no one holds (no demotion); returns the count."""
        dropped = 0
        if self.bm is not None:
            gone = self.bm.evict_free_cached()
            self._demoter.dropped([ev.block_hash for ev in gone])
            dropped += len(gone)
        dropped += self.cpu.clear()
        if self.disk is not None:
            dropped += self.disk.clear()
        return dropped

    def clear_matching(self, match: Callable[[bytes], bool], cpu_keys: Iterable[bytes]) -> int:
        """``clear`` for some keys: the GPU tier's unused cached blocks whose key ``match``-es, and the
        unused entries of ``cpu_keys`` in the CPU tier, and those being written whose key ``match``-es
        (no demotion); returns the count."""
        dropped = 0
        bm = self.bm
        if bm is not None:
            # Blocks in the free queue are unreferenced; their hash goes.
            gone = []
            for block in list(bm.iter_free()):
                if block.block_hash is not None and match(block.block_hash):
                    gone.append(block.block_hash)
                    bm.discard_hash(block)
            self._demoter.dropped(gone)
            dropped += len(gone)
        # Writes in flight are not in cpu_keys (the policy learns a key when its write lands).
        writing = [key for key in self.cpu.writing() if match(key)]
        if self.disk is not None:
            dropped += self.disk.clear(match)
        return dropped + self.cpu.discard(itertools.chain(cpu_keys, writing))

    def poll(self, wait_s: float = 0.0) -> list[Op]:
        """Apply finished copies; returns the ops that completed (``polling``)."""
        return self._poller.poll(wait_s)

    def clean_when_idle(self, batch_blocks: int = IDLE_CLEAN_BATCH_BLOCKS) -> bool:
        """Idle time's clean-ahead; True when it has nothing to do until the next call.

        Demotes, at low priority, the cached blocks the CPU tier lacks among
        the first ``idle_clean_blocks`` of the free queue, ``batch_blocks``
        per call and only while no copy is in flight, so a caller with nothing
        else to do (the daemon's loop between requests) can call it every
        turn. Why: clean-ahead keeps 64 blocks clean, and a request of 16k
        tokens evicts 1,000; on an H100 such an allocation after a pause
        first demoted ~450 MiB, most of its restore's time (bench/ttft.py).
        The inclusive CPU tier would take these blocks when the GPU tier
        evicted them anyway; the CPU tier's policy admits them or not, as
        then. A block is asked about once while it keeps its slot and hash;
        ``clean_ahead_blocks = 0`` turns this pass off too.
        """
        state = self._state
        if not state.idle_clean_pending or self.bm is None or not self.data or self.clean_ahead_blocks <= 0:
            return True  # clean_ahead_blocks = 0 turns clean-ahead off, this pass too
        if self._copies.busy:
            return False
        depth = self.idle_clean_blocks
        if depth is None:
            depth = min(self.bm.num_blocks, self.cpu.capacity_blocks // 2)
        if len(self._idle_asked) > 2 * self.bm.num_blocks:
            self._idle_asked.clear()  # stale pairs of reused blocks: forget them all, ask once more
        found, submitted = self._demoter.clean_ahead(depth_blocks=depth, max_blocks=batch_blocks,
                                                     asked=self._idle_asked)
        if found < batch_blocks or submitted == 0:
            state.idle_clean_pending = False  # the scan reached the depth, or the CPU tier took none
        return not state.idle_clean_pending

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        return self._poller.wait_idle(timeout_s)

    @property
    def busy(self) -> bool:
        return self._copies.busy

    def stats(self) -> dict[str, Any]:
        bm = self.bm
        s: dict[str, Any] = self.counters.as_dict()
        s.update(
            gpu_blocks=bm.num_blocks if bm else 0,
            gpu_free_blocks=bm.num_free_blocks if bm else 0,
            gpu_cached_blocks=bm.num_cached_blocks if bm else 0,
            cpu_blocks=self.cpu.capacity_blocks,
            cpu_used_blocks=len(self.cpu),
            cpu_evictions=self.cpu.evictions,
            cpu_full_failures=self.cpu.full_failures,
            cpu_not_admitted=self.cpu.not_admitted,
            policy_keys=self.cpu.policy.stats().remembered_keys,
            cpu_adopted_blocks=self.cpu.adopted_blocks,
            cpu_adoption_dropped_blocks=self.cpu.adoption_dropped_blocks,
            cpu_adoption_pending_blocks=self.cpu.adoption_pending_blocks,
            cpu_persistent=self.adoption is not None,
            pinned_blocks=self.num_pinned(),
            copies_in_flight=len(self._copies),
            block_bytes=self.spec.block_bytes,
        )
        if self.journal is not None:
            s["held_blocks"] = self.journal.held
        if self.remote is not None:
            s["remote"] = self.remote.stats()
        if self.disk is not None:
            s["disk"] = self.disk.stats()
        if self.transfer is not None:
            for kind in CopyKind:
                s[f"bytes_{kind.value}"] = self.transfer.bytes_by_kind[kind]
                s[f"seconds_{kind.value}"] = round(self.transfer.seconds_by_kind[kind], 6)
        return s

    def close(self, timeout_s: float = 10.0) -> None:
        self.wait_idle(timeout_s)
        if self.adoption is not None:
            self.adoption.stop()


def _cpu_has(cpu: CpuTier) -> Callable[[bytes], bool]:
    """Whether the CPU tier holds a key, for the GPU tier's journal observer. Weak: the CPU tier's own
    observer reaches the GPU tier (``PoolState.gpu_has``), and a strong reference back would make a cycle.
    The journal asks while a tier changes: an adopted block is not verified (or dropped) here."""
    ref = weakref.ref(cpu)

    def cpu_has(key: bytes) -> bool:
        tier = ref()
        return tier is not None and tier.peek(key)

    return cpu_has


def second_sighting(policy: EvictionPolicy) -> SecondSightingAdmission | None:
    """The ``+admit2`` rule of ``policy`` (wrapped anywhere inside it), for a lower tier's admission; None without it."""
    found = find_wrapped(policy, AdmissionWrapper)
    return SecondSightingAdmission(found) if found is not None else None
