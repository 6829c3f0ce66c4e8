"""The CPU tier: fixed-size slots in one host allocation, evicted by a policy.

Contract (the pool is the only caller; one thread):

- Entries are keyed by block hash. An entry is *ready* once its bytes are
  valid; while the copy that writes it is in flight it is reserved but not
  ready, invisible to lookups and never evicted.
- ``reserve(keys)`` plans slots for new keys: free slots first, then
  victims in the policy's order, skipping entries that are pinned, being
  read, or not ready. If there is not enough room it raises ``CpuTierFull``
  and changes nothing (fail fast, counted; no waiting). Otherwise it evicts
  the chosen victims and returns one not-ready entry per key.
  ``reserve(keys, protected=...)`` never picks a victim whose key is in
  ``protected``: the caller's other keys (a store's present blocks, a
  fetch's whole prefix) that making room must not evict.
- ``commit(entry)`` marks a write finished (the policy learns the key);
  ``abort(entry)`` frees a reserved slot whose write failed.
- ``discard(keys)`` / ``clear()`` drop the evictable entries among the keys
  at once, and mark the unheld ones still being written: their ``commit``
  drops them instead (a clear that lands while a demotion is in flight
  leaves nothing behind). A ``pin``, a read or ``keep(key)`` (a store that
  counts the block as present, an eviction that leaves this copy the only
  one) before then keeps the entry.
- ``begin_read`` / ``end_read`` bracket a copy out of a slot; ``pin`` /
  ``unpin`` bracket a client's hold. Neither kind of entry is evicted.
- ``admit(keys)``: the policy's answers for one batch of demotions, asked
  before any of them is reserved (refusals counted in ``not_admitted``).
- ``accessed(keys, promoted=False)`` / ``gpu_dropped(keys)``: the pool says
  that resident keys were used (``promoted``: restored into the GPU tier),
  and that the GPU tier let keys go; both only inform the policy
  (``EvictionPolicy.on_access``/``on_gpu_drop``).
- ``on_evict(entry)``, when set, is called for each victim just before its
  slot is reused (the remote tier's write-back copies the bytes there); not
  for an adopted victim whose bytes were never verified.
- ``key_observer``, when set, is told ``added(key)`` when ``reserve`` makes an
  entry and ``removed(key)`` when one goes (evicted, discarded, aborted):
  the pool's key journal (``kvtier.tiers.pool.journal``).
- ``storage`` is a ``BlockLayout`` slab of ``capacity_blocks`` rows, or None
  in bookkeeping-only mode (trace replay): then no bytes exist at all.
- Persistence (optional): ``slot_recorder``, when set (a
  ``kvtier.tiers.persistent_arena.PersistentArena``), keeps a restart-safe
  record of which slot holds which key: ``record(slot, key, checksum)`` in
  ``commit`` before the entry is ready (``checksum`` of the bytes, when the
  copy computed it; else the recorder hashes them), ``invalidate(slot)``
  before a slot is handed out for writing and whenever an entry goes. So a
  record exists exactly for the ready entries.
- Adoption: ``adopt([(key, slot), ...])`` takes over blocks a previous
  process left in ``storage`` (``kvtier.tiers.pool.adoption``): ready,
  policy order as given, but *unverified*. ``get`` / ``get_ready`` verify an
  unverified entry first (``slot_recorder.verify``, a checksum of its bytes)
  and drop it if that fails, so no caller ever sees a block that did not
  verify; ``verified(entry, ok)`` applies a verdict reached elsewhere (a
  verifier thread). ``adopted_blocks`` / ``adoption_dropped_blocks`` /
  ``adoption_pending_blocks`` count verified, dropped (failed, or evicted
  before verification) and still unverified adopted blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvtier.tiers.policies.base import EvictionPolicy

if TYPE_CHECKING:
    from kvtier.tiers.block_manager import KeyObserver
    from kvtier.blocks.layout import BlockLayout


class CpuTierFull(RuntimeError):
    """No room can be made without evicting pinned or busy blocks."""


class SlotRecorder(Protocol):
    """Where the CPU tier keeps its restart-safe slot records (see the module docstring)."""

    def record(self, slot: int, key: bytes, checksum: int | None) -> None: ...

    def invalidate(self, slot: int) -> None: ...

    def verify(self, slot: int, key: bytes) -> bool: ...

    def checksums(self, slots: Sequence[int]) -> list[int]: ...


@dataclass(slots=True, eq=False)
class CpuEntry:
    key: bytes
    slot: int
    pins: int = 0
    readers: int = 0
    ready: bool = False
    discarded: bool = False  # dropped by discard while its write was in flight: commit drops it
    verified: bool = True  # False: adopted from a previous process, bytes not checked yet

    @property
    def evictable(self) -> bool:
        return self.ready and self.pins == 0 and self.readers == 0


class CpuTier:
    """See the module docstring."""

    def __init__(self, capacity_blocks: int, policy: EvictionPolicy, storage: BlockLayout | None = None) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        if storage is not None and storage.num_blocks != capacity_blocks:
            raise ValueError(f"storage has {storage.num_blocks} slots, capacity is {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.policy = policy
        self.storage = storage
        self._entries: dict[bytes, CpuEntry] = {}
        self._writing: set[bytes] = set()  # keys reserved and not yet committed or aborted
        # Pop from the end: low slots are reused first, which keeps tests readable.
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))
        self.on_evict: Callable[[CpuEntry], None] | None = None
        self.key_observer: KeyObserver | None = None
        self.slot_recorder: SlotRecorder | None = None
        self.adopted_blocks = 0
        self.adoption_dropped_blocks = 0
        self.adoption_pending_blocks = 0
        self.evictions = 0
        self.full_failures = 0
        self.not_admitted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self._entries.values() if e.pins)

    def get(self, key: bytes) -> CpuEntry | None:
        """The entry for ``key`` in any state (ready or being written); an adopted one once verified."""
        entry = self._entries.get(key)
        if entry is not None and not entry.verified:
            assert self.slot_recorder is not None
            self.verified(entry, self.slot_recorder.verify(entry.slot, entry.key))
            return self._entries.get(key)
        return entry

    def get_ready(self, key: bytes) -> CpuEntry | None:
        entry = self.get(key)
        return entry if entry is not None and entry.ready else None

    def peek(self, key: bytes) -> bool:
        """Whether an entry for ``key`` exists, verified or not, without verifying it (the key journal asks)."""
        return key in self._entries

    def adopt(self, blocks: Iterable[tuple[bytes, int]]) -> list[CpuEntry]:
        """Take over blocks a previous process left in ``storage`` (see the module docstring); returns the
        new, unverified entries. A key already held or a slot not free is skipped."""
        free = set(self._free_slots)
        entries = []
        for key, slot in blocks:
            if key in self._entries or slot not in free:
                continue
            free.discard(slot)
            entry = CpuEntry(key, slot, ready=True, verified=False)
            self._entries[key] = entry
            entries.append(entry)
            self.policy.on_insert(key)
            if self.key_observer is not None:
                self.key_observer.added(key)
        self._free_slots = sorted(free, reverse=True)  # low slots are still reused first
        self.adoption_pending_blocks += len(entries)
        return entries

    def verified(self, entry: CpuEntry, ok: bool) -> None:
        """The verdict on an adopted entry's bytes: kept (``ok``) or dropped; ignored if the entry went."""
        if entry.verified or self._entries.get(entry.key) is not entry:
            return
        if ok:
            entry.verified = True
            self.adoption_pending_blocks -= 1
            self.adopted_blocks += 1
        else:
            self._drop(entry)  # counted there

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """The policy's answers for one batch of demotions, asked before any of them is reserved."""
        answers = self.policy.admit(keys)
        self.not_admitted += answers.count(False)
        return answers

    def reserve(self, keys: Sequence[bytes], protected: Collection[bytes] = ()) -> list[CpuEntry]:
        if len(set(keys)) != len(keys):
            raise ValueError("reserve got the same key twice")
        for key in keys:
            if key in self._entries:
                raise ValueError(f"key {key.hex()} is already in the CPU tier")
        shortfall = len(keys) - len(self._free_slots)
        victims: list[CpuEntry] = []
        if shortfall > 0:
            kept = 0  # evictable, but protected by the caller
            for key in self.policy.victims():
                entry = self._entries[key]
                if entry.evictable:
                    if key in protected:
                        kept += 1
                        continue
                    victims.append(entry)
                    if len(victims) == shortfall:
                        break
            if len(victims) < shortfall:
                self.full_failures += 1
                raise CpuTierFull(
                    f"CPU tier cannot make room for {len(keys)} blocks: {len(self._free_slots)} free, "
                    f"{len(victims)} evictable of {len(self._entries)}"
                    + (f" ({kept} more held for this call)" if kept else "")
                )
        for victim in victims:
            if self.on_evict is not None and victim.verified:  # unverified bytes go nowhere
                self.on_evict(victim)
            self._drop(victim)
            self.evictions += 1
        entries = []
        recorder = self.slot_recorder
        for key in keys:
            entry = CpuEntry(key, self._free_slots.pop())
            if recorder is not None:
                recorder.invalidate(entry.slot)  # before any byte of it is overwritten
            self._entries[key] = entry
            self._writing.add(key)
            entries.append(entry)
            if self.key_observer is not None:
                self.key_observer.added(key)
        return entries

    def commit(self, entry: CpuEntry, checksum: int | None = None) -> None:
        """The write into ``entry``'s slot landed; ``checksum`` is its bytes' (None: the recorder computes it)."""
        if entry.ready or self._entries.get(entry.key) is not entry:
            raise ValueError(f"entry {entry.key.hex()} is not a pending write")
        if entry.discarded:
            self.abort(entry)  # the policy never learnt the key; the observer hears it went
            return
        if self.slot_recorder is not None:
            self.slot_recorder.record(entry.slot, entry.key, checksum)
        self._writing.discard(entry.key)
        entry.ready = True
        self.policy.on_insert(entry.key)

    def abort(self, entry: CpuEntry) -> None:
        if entry.ready or self._entries.get(entry.key) is not entry:
            raise ValueError(f"entry {entry.key.hex()} is not a pending write")
        del self._entries[entry.key]
        self._writing.discard(entry.key)
        self._free_slots.append(entry.slot)
        if self.slot_recorder is not None:
            self.slot_recorder.invalidate(entry.slot)
        if self.key_observer is not None:
            self.key_observer.removed(entry.key)

    def writing(self) -> list[bytes]:
        """The keys whose writes are in flight (reserved, neither committed nor aborted)."""
        return list(self._writing)

    def accessed(self, keys: Sequence[bytes], promoted: bool = False) -> None:
        """Resident ``keys`` were used, in this order (a request's hits tail first); ``promoted``: restored
        into the GPU tier."""
        if keys:
            self.policy.on_access(keys, promoted)

    def gpu_dropped(self, keys: Sequence[bytes]) -> None:
        if keys:
            self.policy.on_gpu_drop(keys)

    def begin_read(self, entry: CpuEntry) -> None:
        entry.readers += 1
        entry.discarded = False  # wanted after all: a discard before its write landed no longer holds

    def end_read(self, entry: CpuEntry) -> None:
        if entry.readers <= 0:
            raise ValueError(f"entry {entry.key.hex()} has no read in flight")
        entry.readers -= 1

    def keep(self, key: bytes) -> None:
        """A caller relies on ``key``'s entry, ready or being written: a discard before its write
        lands no longer holds."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.discarded = False

    def pin(self, entry: CpuEntry) -> None:
        entry.pins += 1
        entry.discarded = False

    def unpin(self, entry: CpuEntry) -> None:
        if entry.pins <= 0:
            raise ValueError(f"entry {entry.key.hex()} is not pinned")
        entry.pins -= 1

    def discard(self, keys: Iterable[bytes]) -> int:
        """Drop the evictable entries among ``keys``, and the unheld ones being written once their
        write lands; returns how many go."""
        dropped = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.pins or entry.readers:
                continue
            if entry.ready:
                self._drop(entry)
            else:
                entry.discarded = True
            dropped += 1
        return dropped

    def clear(self) -> int:
        return self.discard(list(self._entries))

    def _drop(self, entry: CpuEntry) -> None:
        del self._entries[entry.key]
        self.policy.on_remove(entry.key)
        if self.slot_recorder is not None:
            self.slot_recorder.invalidate(entry.slot)  # a later process must not bring it back
        if not entry.verified:  # adopted, never served: it failed verification or went first
            self.adoption_pending_blocks -= 1
            self.adoption_dropped_blocks += 1
        self._free_slots.append(entry.slot)
        if self.key_observer is not None:
            self.key_observer.removed(entry.key)
