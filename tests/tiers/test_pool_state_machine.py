"""Stateful property test: random engine-mode and store-mode traffic on a tiny TieredPool.

Hypothesis drives allocate / append / free / store / restore / pin / unpin /
clear / poll / settle (and operations whose copies fail) on a pool with real bytes: a
GPU-tier stand-in slab of 9 blocks, a CPU tier of 5, and clean-ahead on, so
eviction and demotion happen on almost every step.

Copies are real, but run on a stepped transfer engine: they complete only
when a rule runs them (per priority class, in order), so copies stay in
flight across steps, completion orders are explored, and every failure
replays exactly. Some allocations are left in flight and may be freed before
their restore lands (or fails), as an engine giving up on a request would.

The model is plain Python: ``model`` maps a block hash to the bytes that were
stored or computed for it. The engine "computes" a block by writing
``content(hash)`` into each newly allocated miss block once its allocation
completes; a store sends ``content(hash)`` too. So any byte any tier ever
hands back can be checked against the model.

After every step: ref counts are never negative and never below what live
requests and pins hold (exactly that once idle); the free queue is a
consistent doubly linked list holding exactly the ref-0 blocks; the index
maps each hash to a block carrying it and every hash-carrying block is
indexed or a duplicate; every cached GPU block and every ready CPU entry
with no copy in flight holds its model bytes; the CPU tier never exceeds
its capacity; no two copies in flight touch the same slot where one of them
writes; replaying the key journal's events gives exactly the keys the tiers
hold (a key never stored twice or removed unheld). After ``settle`` (every
copy run and polled) nothing is left busy.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.client.hashing import BlockHasher
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import NoSpace, Op, PoolSpec, Tier, TieredPool
from kvtier.tiers.pool.journal import REMOVED, STORED
from kvtier.tiers.transfer import CopyKind, TransferError
from tests.stepped_engine import SteppedEngine

BS = 2  # tokens per block
BB = 40  # bytes per block
GPU_BLOCKS = 9
CPU_BLOCKS = 5
CLEAN_AHEAD = 2
JOURNAL_EVENTS = 100_000  # more than a run makes: the invariant reads every event
POISON = 0xA7
OWNERS = ("o1", "o2")
MAX_REQUESTS = 2  # live engine requests at once
MAX_PINS = 3  # pinned blocks at once (a pin call may take up to 3)

HASHER = BlockHasher(BS)

# Prefixes of a few documents that share beginnings (plus a random tail now and
# then), over a binary alphabet: requests share, diverge and come back.
DOCS = (
    (0, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0),
    (0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 1, 0),  # shares 2 blocks with the first
    (1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1),
    (1, 1, 0, 0, 1, 0, 0, 1, 1, 0, 1, 0),  # shares 3 blocks with the third
)


def _doc_prefix(min_len: int) -> st.SearchStrategy[list[int]]:
    return st.builds(
        lambda d, n, tail: list(DOCS[d][:n]) + tail,
        st.integers(0, len(DOCS) - 1),
        st.integers(min_len, len(DOCS[0])),
        st.lists(st.integers(0, 1), max_size=3) | st.just([]),
    )


token_lists = _doc_prefix(1)
full_token_lists = _doc_prefix(BS)


def content(key: bytes) -> torch.Tensor:
    seed = int.from_bytes(key[:8], "little") ^ int.from_bytes(key[8:], "little")
    return torch.randint(0, 256, (BB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = SteppedEngine()
        self.gpu = BlockLayout.contiguous(GPU_BLOCKS, BB)
        self.gpu.slab().fill_(POISON)
        self.cpu_storage = BlockLayout.contiguous(CPU_BLOCKS, BB)
        self.cpu_storage.slab().fill_(POISON)
        self.pool = TieredPool(PoolSpec("sm", BS, BB), cpu_blocks=CPU_BLOCKS, policy="lru", transfer=self.engine,
                               cpu_storage=self.cpu_storage, clean_ahead_blocks=CLEAN_AHEAD,
                               journal_events=JOURNAL_EVENTS)
        self.pool.attach_gpu(self.gpu)
        # What a reader of the key journal (a router) believes the pool holds, and where it read up to.
        self.journal_view: set[bytes] = set()
        self.journal_cursor = 0
        self.bm = self.pool.bm
        self.model: dict[bytes, torch.Tensor] = {}
        # rid -> (tokens, block table)
        self.requests: dict[str, tuple[list[int], list[int]]] = {}
        # owner -> [(tier, hash, block id or None)]
        self.pins: dict[str, list[tuple[Tier, bytes, int | None]]] = {o: [] for o in OWNERS}
        self.pending_restores: list[tuple] = []
        # Allocations whose copies may still be in flight: rid -> (op, hashes, table).
        # Only all-hit allocations stay pending (nothing for the engine to compute).
        self.pending_allocs: dict[str, tuple[Op, list[bytes], list[int]]] = {}
        self.ids = itertools.count()
        self.garbage = torch.Generator().manual_seed(3)

    def teardown(self) -> None:
        self.engine.close()

    # ---- driving copies --------------------------------------------------------------------

    def finish(self, op: Op) -> Op:
        """Run copies until ``op`` is done: the whole high-priority queue, low ones one by one."""
        for _ in range(500):
            if op.done:
                return op
            if not self.engine.run(True, 1_000_000):
                self.engine.run(False, 1)
            self.pool.poll()
        raise AssertionError(f"{op.name} never completed")

    def drain(self) -> None:
        for _ in range(100):
            if not self.pool.busy and not self.engine.queued:
                return
            self.engine.run(True, 1_000_000)
            self.engine.run(False, 1_000_000)
            self.pool.poll()
        raise AssertionError("the pool never became idle")

    # ---- helpers --------------------------------------------------------------------------

    def learn(self, key: bytes) -> torch.Tensor:
        data = content(key)
        self.model[key] = data
        return data

    def compute(self, table: list[int], hashes: list[bytes], first: int, num_tokens: int) -> None:
        """The engine writes the KV of blocks ``first..``: model bytes when full, garbage when partial."""
        num_full = num_tokens // BS
        for pos in range(first, len(table)):
            if pos < num_full:
                self.gpu.slab()[table[pos]] = self.learn(hashes[pos])
            else:
                self.gpu.slab()[table[pos]] = torch.randint(0, 256, (BB,), dtype=torch.uint8, generator=self.garbage)

    def snapshot(self) -> tuple:
        bm = self.bm
        return (
            [b.block_id for b in bm.iter_free()],
            [(b.ref_cnt, b.block_hash) for b in bm.blocks],
            {k: b.block_id for k, b in bm._index.items()},
            {k: [b.block_id for b in d] for k, d in bm._duplicates.items()},
            {k: (e.slot, e.pins, e.readers, e.ready) for k, e in self.pool.cpu._entries.items()},
            list(self.pool.cpu.policy.victims()),
            sorted(bm.request_ids()),
            {o: [(t, obj.block_id if t is Tier.GPU else obj.key, k) for t, obj, k in p] for o, p in self.pool._pins.by_owner.items()},
            self.gpu.slab().clone(),
            self.cpu_storage.slab().clone(),
        )

    def assert_unchanged(self, before: tuple) -> None:
        after = self.snapshot()
        for i, (a, b) in enumerate(zip(before, after)):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"a refused call changed bytes (part {i})"
            else:
                assert a == b, f"a refused call changed state part {i}: {a} -> {b}"

    def check_restore(self, op, dst: BlockLayout, slots: list[int], hashes: list[bytes]) -> None:
        assert op.done
        if op.error is not None:
            assert isinstance(op.error, TransferError)
            return
        tiers = op.result["tiers"]
        for i, key in enumerate(hashes):
            got = dst.slab()[slots[i]]
            if i < len(tiers):
                assert key in self.model, "a hit on a hash that was never stored or computed"
                assert torch.equal(got, self.model[key]), f"restored block {i} ({tiers[i]}) differs from the model"
            else:
                assert bool((got == POISON).all()), "a missed block's slot was written"

    def reap_restores(self) -> None:
        still = []
        for item in self.pending_restores:
            if item[0].done:
                self.check_restore(*item)
            else:
                still.append(item)
        self.pending_restores = still

    # ---- engine-managed mode ---------------------------------------------------------------

    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(tokens=token_lists)
    def allocate(self, tokens: list[int]) -> None:
        self.do_allocate(tokens)

    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(d=st.integers(0, len(DOCS) - 1), extra=st.integers(0, BS))
    def allocate_warm(self, d: int, extra: int) -> None:
        """Allocate the document prefix with the most CPU-tier blocks: the restore path."""
        self.do_allocate(self.warm_tokens(d) + [1] * extra)

    def warm_tokens(self, d: int) -> list[int]:
        best = list(DOCS[d])
        best_cpu = 0
        for doc in DOCS:
            for n in range(BS, len(doc) + 1, BS):
                tiers = self.pool.lookup(HASHER.hash_blocks(doc[:n]), count=False)
                if tiers.count(Tier.CPU) > best_cpu:
                    best, best_cpu = list(doc[:n]), tiers.count(Tier.CPU)
        return best

    def do_allocate(self, tokens: list[int]) -> None:
        rid = f"r{next(self.ids)}"
        hashes = HASHER.hash_blocks(tokens)
        before = self.snapshot()
        try:
            op = self.pool.allocate(rid, hashes, len(tokens))
        except NoSpace:
            self.assert_unchanged(before)
            return
        self.finish(op)
        if op.error is not None:
            # Only injected failures (of this op's copies or of a copy a GPU hit waited for).
            assert isinstance(op.error, TransferError) and "injected" in str(op.error)
            assert not self.bm.has_request(rid), "a failed allocation left its request behind"
            return
        table = op.result["block_ids"]
        assert len(table) == -(-len(tokens) // BS) and len(set(table)) == len(table)
        held = len(op.result["tiers"])
        for pos in range(held):  # hits are in place once the op is done
            assert hashes[pos] in self.model
            assert torch.equal(self.gpu.slab()[table[pos]], self.model[hashes[pos]]), f"hit {pos} not in place"
        self.compute(table, hashes, held, len(tokens))
        self.requests[rid] = (list(tokens), list(table))

    @precondition(lambda self: bool(set(self.requests) - set(self.pending_allocs)))
    @rule(data=st.data(), more=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def append(self, data, more: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(set(self.requests) - set(self.pending_allocs))))
        tokens, table = self.requests[rid]
        new_tokens = tokens + more
        all_hashes = HASHER.hash_blocks(new_tokens)
        committed = len(tokens) // BS
        before = self.snapshot()
        try:
            op = self.pool.append(rid, len(more), all_hashes[committed:])
        except NoSpace:
            self.assert_unchanged(before)
            return
        self.finish(op)
        assert op.error is None, op.error
        new_table = op.result["block_ids"]
        assert new_table[: len(table)] == table  # append-only
        # The old partial block (if any) and every new block: computed now.
        self.compute(new_table, all_hashes, committed, len(new_tokens))
        self.requests[rid] = (new_tokens, list(new_table))

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def free(self, data) -> None:
        """Free a request; a pending one is given up while its copies are in flight."""
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.pool.free(rid)
        del self.requests[rid]
        assert not self.bm.has_request(rid)

    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(d=st.integers(0, len(DOCS) - 1), fail=st.booleans())
    def allocate_async(self, d: int, fail: bool) -> None:
        """Allocate a fully held prefix (GPU and CPU hits) and do not wait for its restore."""
        tokens = self.warm_tokens(d)
        held = self.allocation_hits(HASHER.hash_blocks(tokens))
        if held == 0:
            return
        tokens = tokens[: held * BS]
        hashes = HASHER.hash_blocks(tokens)
        rid = f"r{next(self.ids)}"
        try:
            op = self.pool.allocate(rid, hashes, len(tokens))
        except NoSpace:
            return
        assert len(op.result["tiers"]) == len(hashes)
        table = list(op.result["block_ids"])
        if fail:  # the restore of its CPU hits will fail, whenever it runs
            self.engine.doomed_restore_slots |= {table[i] for i, t in enumerate(op.result["tiers"]) if t == "cpu"}
        self.requests[rid] = (list(tokens), table)
        self.pending_allocs[rid] = (op, hashes, table)
        self.reconcile()

    def allocation_hits(self, hashes: list[bytes]) -> int:
        """How many leading blocks an allocation finds held: the GPU run, then the CPU run
        (a GPU-only block after the GPU run ends the prefix: it may be the one evicted)."""
        n = len(self.bm.longest_cached_prefix(hashes))
        while n < len(hashes) and self.pool.cpu.get_ready(hashes[n]) is not None:
            n += 1
        return n

    def reconcile(self) -> None:
        """Settle the model with pending allocations that completed."""
        for rid, (op, hashes, table) in list(self.pending_allocs.items()):
            if not op.done:
                continue
            del self.pending_allocs[rid]
            if op.error is not None:
                assert isinstance(op.error, TransferError)
                assert not self.bm.has_request(rid), "a failed allocation left its request behind"
                self.requests.pop(rid, None)
            elif rid in self.requests:
                for pos, key in enumerate(hashes):
                    assert torch.equal(self.gpu.slab()[table[pos]], self.model[key]), f"{rid} block {pos} not in place"

    # ---- store mode -------------------------------------------------------------------------

    @rule(tokens=full_token_lists, start=st.integers(0, 3))
    def store(self, tokens: list[int], start: int) -> None:
        hashes = HASHER.hash_blocks(tokens)[start : start + 3]
        if not hashes:
            return
        src = BlockLayout.contiguous(len(hashes), BB)  # one buffer per op: it is read asynchronously
        for i, key in enumerate(hashes):
            src.slab()[i] = content(key)
        before = self.snapshot()
        try:
            op = self.pool.store(hashes, src, list(range(len(hashes))))
        except NoSpace:
            self.assert_unchanged(before)
            return
        for key in hashes:
            self.learn(key)
        assert op.result["stored"] + op.result["present"] == len(hashes)
        lost = [key for key in hashes if self.bm.get_cached(key) is None and self.pool.cpu.get(key) is None]
        assert not lost, f"the store evicted {len(lost)} keys of its own call"

    @rule(n=st.integers(1, 3))
    def flood(self, n: int) -> None:
        """Store unrelated blocks: pushes the documents' blocks out of the GPU tier."""
        self.flooded = getattr(self, "flooded", 0) + 1
        self.store(list(itertools.chain.from_iterable((7, self.flooded, i) for i in range(n)))[: n * BS], 0)

    @rule(tokens=full_token_lists)
    def restore(self, tokens: list[int]) -> None:
        hashes = HASHER.hash_blocks(tokens)
        dst = BlockLayout.contiguous(len(hashes) + 1, BB)
        dst.slab().fill_(POISON)
        slots = list(range(len(hashes), 0, -1))  # reversed, slot 0 never used
        op = self.pool.restore(hashes, dst, slots)
        for t in op.result["tiers"][: len(hashes)]:
            assert t in ("gpu", "cpu")
        self.pending_restores.append((op, dst, slots, hashes))

    @rule(tokens=full_token_lists)
    def lookup(self, tokens: list[int]) -> None:
        hashes = HASHER.hash_blocks(tokens)
        tiers = self.pool.lookup(hashes)
        assert len(tiers) <= len(hashes)
        for key, tier in zip(hashes, tiers):
            assert key in self.model
            if tier is Tier.GPU:
                assert self.bm.get_cached(key) is not None
            else:
                assert self.pool.cpu.get_ready(key) is not None

    # ---- pins -------------------------------------------------------------------------------

    @precondition(lambda self: sum(map(len, self.pins.values())) < MAX_PINS)
    @rule(owner=st.sampled_from(OWNERS), tokens=full_token_lists)
    def pin(self, owner: str, tokens: list[int]) -> None:
        hashes = HASHER.hash_blocks(tokens)[:3]
        tiers = self.pool.pin(owner, hashes)
        for key, tier in zip(hashes, tiers):
            if tier is Tier.GPU:
                block = self.bm.get_cached(key)
                assert block is not None and block.ref_cnt >= 1
                self.pins[owner].append((tier, key, block.block_id))
            else:
                entry = self.pool.cpu.get_ready(key)
                assert entry is not None and entry.pins >= 1
                self.pins[owner].append((tier, key, None))

    @rule(owner=st.sampled_from(OWNERS), tokens=full_token_lists)
    def unpin(self, owner: str, tokens: list[int]) -> None:
        hashes = HASHER.hash_blocks(tokens)[:3]
        expected = 0
        mine = self.pins[owner]
        for key in reversed(hashes):
            for i in range(len(mine) - 1, -1, -1):
                if mine[i][1] == key:
                    del mine[i]
                    expected += 1
                    break
        assert self.pool.unpin(owner, hashes) == expected

    @rule(owner=st.sampled_from(OWNERS))
    def unpin_all(self, owner: str) -> None:
        assert self.pool.unpin_all(owner) == len(self.pins[owner])
        self.pins[owner] = []

    # ---- maintenance ------------------------------------------------------------------------

    @rule(some=st.booleans())
    def clear(self, some: bool) -> None:
        """Drop what nobody holds, at any point, copies in flight or not; ``some``: only keys of even
        first byte, as a tenant's clear (``clear_matching``, with the ready CPU keys it names)."""
        pool, cpu = self.pool, self.pool.cpu

        def match(key: bytes) -> bool:
            return not some or key[0] % 2 == 0

        if some:
            pool.clear_matching(match, [k for k, e in cpu._entries.items() if e.ready and match(k)])
        else:
            pool.clear()
        for b in self.bm.iter_free():
            assert b.block_hash is None or not match(b.block_hash), f"free block {b.block_id} kept its hash"
        for key, e in cpu._entries.items():
            if match(key):
                assert e.pins or e.readers or (not e.ready and e.discarded), "clear left an unheld CPU entry"

    # ---- copies -----------------------------------------------------------------------------

    @rule()
    def poll(self) -> None:
        self.pool.poll()

    @rule(n=st.integers(1, 3))
    def progress_high(self, n: int) -> None:
        """Some high-priority copies finish; the pool learns it at the next poll."""
        self.engine.run(True, n)

    @rule(n=st.integers(1, 3))
    def progress_low(self, n: int) -> None:
        """Some low-priority copies finish; the pool learns it at the next poll."""
        self.engine.run(False, n)

    @rule()
    def settle(self) -> None:
        self.drain()
        self.check_idle()

    @rule(kind=st.sampled_from([CopyKind.RESTORE, CopyKind.STORE, CopyKind.LOAD, CopyKind.DEMOTE]),
          tokens=full_token_lists, what=st.sampled_from(["allocate", "store", "restore", "flood"]))
    def faulty(self, kind: CopyKind, tokens: list[int], what: str) -> None:
        """One operation during which every copy of ``kind`` submitted fails (other ops'
        deferred copies included); the pool must stay consistent."""
        self.engine.failing = {kind}
        try:
            if what == "allocate":
                if len(self.requests) < MAX_REQUESTS:
                    self.do_allocate(self.warm_tokens(tokens[0] + 2 * tokens[1]))
            elif what == "store":
                self.store(tokens, 0)
            elif what == "restore":
                self.restore(tokens)
            else:
                self.flood(3)
        finally:
            self.engine.failing = set()

    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(d=st.integers(0, len(DOCS) - 1))
    def failing_restore_allocate(self, d: int) -> None:
        """Allocate the warmest document prefix while restores fail: the undo path."""
        self.engine.failing = {CopyKind.RESTORE}
        try:
            self.do_allocate(self.warm_tokens(d))
        finally:
            self.engine.failing = set()

    # ---- checks -----------------------------------------------------------------------------

    def expected_refs(self) -> Counter:
        self.reconcile()
        refs: Counter = Counter()
        for _, table in self.requests.values():
            refs.update(table)
        for pins in self.pins.values():
            refs.update(bid for tier, _, bid in pins if tier is Tier.GPU)
        return refs

    def check_idle(self) -> None:
        pool = self.pool
        copies = pool._copies
        assert not pool.busy and not copies.inflight and not copies.deferred
        assert not copies.gpu_busy, f"GPU blocks still marked busy: {sorted(copies.gpu_busy)}"
        assert not copies.cpu_writes, f"CPU slots still marked written: {sorted(copies.cpu_writes)}"
        for e in pool.cpu._entries.values():
            assert e.ready and e.readers == 0, "a CPU entry is still being written or read"
        self.reap_restores()
        assert not self.pending_restores
        refs = self.expected_refs()  # reconciles pending allocations
        assert not self.pending_allocs
        for b in self.bm.blocks:
            assert b.ref_cnt == refs[b.block_id], f"block {b.block_id}: ref {b.ref_cnt}, expected {refs[b.block_id]}"
        # Every cached block's bytes, now that nothing is in flight.
        for b in self.bm.blocks:
            if b.block_hash is not None:
                assert torch.equal(self.gpu.slab()[b.block_id], self.model[b.block_hash])

    @invariant()
    def ref_counts(self) -> None:
        refs = self.expected_refs()
        for b in self.bm.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref count {b.ref_cnt}"
            assert b.ref_cnt >= refs[b.block_id], f"block {b.block_id} lost references"
        for rid, (_, table) in self.requests.items():
            assert self.bm.block_table(rid) == table

    @invariant()
    def free_queue(self) -> None:
        q = self.bm.free_queue
        walked = []
        node = q._head
        while node.next_free is not q._tail:
            nxt = node.next_free
            assert nxt is not None, "free queue chain broken"
            assert nxt.prev_free is node, f"asymmetric free-queue links at block {nxt.block_id}"
            walked.append(nxt.block_id)
            node = nxt
            assert len(walked) <= GPU_BLOCKS, "cycle in the free queue"
        assert q._tail.prev_free is node
        assert len(walked) == q.num_free == self.bm.num_free_blocks
        assert len(set(walked)) == len(walked), "a block is in the free queue twice"
        for b in self.bm.blocks:
            if b.ref_cnt == 0:
                assert b.block_id in walked, f"free block {b.block_id} is not in the free queue"
            else:
                assert b.block_id not in walked, f"block {b.block_id} (ref {b.ref_cnt}) is in the free queue"

    @invariant()
    def index(self) -> None:
        bm = self.bm
        for key, b in bm._index.items():
            assert b.block_hash == key, f"index: {key.hex()} -> block {b.block_id} with another hash"
        for key, dups in bm._duplicates.items():
            assert dups and key in bm._index
            for d in dups:
                assert d.block_hash == key and d is not bm._index[key]
        for b in bm.blocks:
            if b.block_hash is not None:
                assert bm._index.get(b.block_hash) is b or b in bm._duplicates.get(b.block_hash, []), (
                    f"block {b.block_id} carries a hash that is neither indexed nor a duplicate"
                )

    @invariant()
    def cpu_tier(self) -> None:
        cpu = self.pool.cpu
        assert len(cpu) <= CPU_BLOCKS
        slots = [e.slot for e in cpu._entries.values()] + cpu._free_slots
        assert sorted(slots) == list(range(CPU_BLOCKS)), "CPU slots leaked or shared"
        assert set(cpu.policy.victims()) == {k for k, e in cpu._entries.items() if e.ready}
        pinned = Counter(key for pins in self.pins.values() for tier, key, _ in pins if tier is Tier.CPU)
        for key, n in pinned.items():
            entry = cpu.get(key)
            assert entry is not None and entry.pins == n, "a pinned CPU entry was evicted or lost a pin"

    @invariant()
    def journal_replays_to_what_the_pool_holds(self) -> None:
        events, self.journal_cursor, lost = self.pool.journal.since(self.journal_cursor, JOURNAL_EVENTS)
        assert not lost
        for kind, key in events:
            if kind == STORED:
                assert key not in self.journal_view, f"{key.hex()} stored twice without a removal"
                self.journal_view.add(key)
            else:
                assert kind == REMOVED and key in self.journal_view, f"{key.hex()} removed while not held"
                self.journal_view.remove(key)
        held = set(self.bm._index) | set(self.pool.cpu._entries)
        assert self.pool.journal.held == len(held) == self.pool.stats()["held_blocks"]
        assert self.journal_view == held, (
            f"journal says {sorted(k.hex() for k in self.journal_view ^ held)} wrongly"
        )

    @invariant()
    def cpu_writes_match_unready_entries(self) -> None:
        """A CPU entry is not ready exactly while an unfinished copy into its slot is tracked."""
        writes = self.pool._copies.cpu_writes
        unready = {e.slot for e in self.pool.cpu._entries.values() if not e.ready}
        assert unready == set(writes), f"unready CPU slots {sorted(unready)}, tracked writes {sorted(writes)}"
        for slot, copy in writes.items():
            assert not copy.finished and copy.dst is self.cpu_storage and slot in copy.dst_slots

    @invariant()
    def bytes_match_the_model(self) -> None:
        busy = self.pool._copies.gpu_busy
        for b in self.bm.blocks:
            if b.block_hash is not None and b.block_id not in busy:
                assert b.block_hash in self.model
                assert torch.equal(self.gpu.slab()[b.block_id], self.model[b.block_hash]), (
                    f"GPU block {b.block_id} does not hold its hash's bytes"
                )
        for key, e in self.pool.cpu._entries.items():
            if e.ready:
                assert torch.equal(self.cpu_storage.slab()[e.slot], self.model[key]), "CPU entry bytes differ"
        self.reap_restores()

    @invariant()
    def nothing_in_flight_overlaps(self) -> None:
        """No two copies in flight touch one slot where either writes it."""
        seen: dict[tuple[int, int], list[tuple[int, bool]]] = {}
        for n, copy in enumerate(self.pool._copies.inflight.values()):
            for layout, slots, write in ((copy.src, copy.src_slots, False), (copy.dst, copy.dst_slots, True)):
                for s in slots:
                    for other, other_write in seen.get((id(layout), s), []):
                        assert other == n or not (write or other_write), (
                            f"copies in flight conflict on slot {s} of {'GPU' if layout is self.gpu else 'a layout'}"
                        )
                    seen.setdefault((id(layout), s), []).append((n, write))


TestPoolStateMachine = PoolMachine.TestCase
TestPoolStateMachine.settings = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
