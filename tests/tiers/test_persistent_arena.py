"""The persistent CPU tier (tiers/slot_index.py, tiers/persistent_arena.py, tiers/pool/adoption.py).

A "kill" here is what SIGKILL leaves: the files exactly as the process last
wrote them, nothing flushed or closed on its way out (the index's lock goes
with the process: ``index.close()`` stands in for that). The real-process
version, with daemons killed at random instants, is tests/daemon/test_restart.py.

Every block's bytes are ``content(key)``, so whatever a restarted pool hands
back is checked byte for byte.
"""

from __future__ import annotations

import itertools
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.tiers.host_memory import HostMemoryError
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.arena_files import list_arenas, remove_arena
from kvtier.tiers.persistent_arena import ArenaDirectory
from kvtier.tiers.pool import PoolSpec, Tier, TieredPool
from kvtier.tiers.slot_index import (
    HEADER_BYTES,
    RECORD_BYTES,
    SlotIndex,
    SlotIndexBusy,
    SlotIndexFormatError,
    is_held,
)
from kvtier.tiers.transfer import ThreadTransferEngine
from tests.stepped_engine import SteppedEngine

BS = 4
BB = 256
LAYOUT = {"mode": "store", "block_size": BS, "block_bytes": BB, "dtype": "bfloat16", "hash_algo": "xxh3_128"}
ENDPOINT = "ipc:///run/kvtier-test/kvtierd.sock"


def key(i: int, tag: int = 0) -> bytes:
    return struct.pack("<QQ", tag, i)


def content(k: bytes) -> bytes:
    gen = torch.Generator().manual_seed(int.from_bytes(k[:8], "little") * 1_000_003 + int.from_bytes(k[8:], "little"))
    return torch.randint(0, 256, (BB,), dtype=torch.uint8, generator=gen).numpy().tobytes()


def source(keys: list[bytes]) -> BlockLayout:
    src = BlockLayout.contiguous(len(keys), BB)
    for i, k in enumerate(keys):
        src.slab()[i] = torch.frombuffer(bytearray(content(k)), dtype=torch.uint8)
    return src


class Node:
    """One process's pool over one arena directory: open, work, then die (``kill``) or stop (``close``)."""

    def __init__(self, where: Path, slots: int, *, engine: object | None = None, layout: dict | None = None) -> None:
        self.dir = ArenaDirectory(where, ENDPOINT)
        self.arena = self.dir.open("p", layout or LAYOUT, slots, BB, pin=False)
        self.engine = engine or ThreadTransferEngine()
        self.pool = TieredPool(PoolSpec("p", BS, BB), cpu_blocks=slots, policy="lru", transfer=self.engine,
                               cpu_storage=self.arena.layout, journal_events=1000)
        self.pool.attach_arena(self.arena)

    def store(self, keys: list[bytes]) -> None:
        self.pool.store(keys, source(keys), list(range(len(keys)))).wait(10)

    def settle_verification(self) -> None:
        adoption = self.pool.adoption
        assert adoption is not None
        while adoption.busy:
            self.pool.poll(0.01)
        self.pool.poll()

    def served(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """Each key the pool serves, with the bytes a restore of it hands back."""
        out = {}
        for k in keys:
            dst = BlockLayout.contiguous(1, BB)
            op = self.pool.restore([k], dst, [0]).wait(10)
            if op.result["tiers"]:
                assert op.result["tiers"] == [Tier.CPU.value]
                out[k] = dst.slab()[0].numpy().tobytes()
        return out

    def kill(self) -> None:
        """What SIGKILL leaves: the files as they are; the lock goes with the process."""
        self.arena.index.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close(1.0)

    def close(self) -> None:
        self.pool.close()
        self.arena.close()
        self.engine.close(1.0)


def test_slot_index_records_scan_oldest_first_and_a_torn_record_is_counted(tmp_path: Path) -> None:
    index = SlotIndex.create(tmp_path / "x.index", slots=8, block_bytes=BB, identity={"a": 1})
    index.write(5, 7, key(5), 55)
    index.write(2, 9, key(2), 22)
    index.write(3, 8, key(3), 33)
    index.invalidate(3)
    assert [(r.slot, r.seq, r.key, r.checksum) for r in index.scan()[0]] == [(5, 7, key(5), 55), (2, 9, key(2), 22)]
    assert index.checksum_of(5, key(5)) == 55 and index.checksum_of(5, key(6)) is None
    # A kill in the middle of writing slot 2's record: part new, part old.
    raw = bytearray(index._view[HEADER_BYTES + 2 * RECORD_BYTES:HEADER_BYTES + 3 * RECORD_BYTES])
    raw[20] ^= 0xFF
    index._view[HEADER_BYTES + 2 * RECORD_BYTES:HEADER_BYTES + 3 * RECORD_BYTES] = bytes(raw)
    records, torn = index.scan()
    assert [r.slot for r in records] == [5] and torn == 1
    index.events_reserved = 123
    index.close()
    again = SlotIndex.open(tmp_path / "x.index")
    assert again.identity == {"a": 1} and again.slots == 8 and again.events_reserved == 123
    again.close()


def test_slot_index_lock_format_and_damage(tmp_path: Path) -> None:
    path = tmp_path / "x.index"
    index = SlotIndex.create(path, slots=4, block_bytes=BB, identity={"kvtier": "1.0"})
    assert is_held(path)
    with pytest.raises(SlotIndexBusy):
        SlotIndex.open(path)
    index.close()
    assert not is_held(path)
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 99)  # a newer kvtier's format
    path.write_bytes(bytes(raw))
    with pytest.raises(SlotIndexFormatError) as info:
        SlotIndex.open(path)
    assert info.value.found_format == 99 and info.value.identity == {"kvtier": "1.0"}
    raw[8:12] = struct.pack("<I", 1)
    raw[70] ^= 1  # inside the identity: the header checksum fails
    path.write_bytes(bytes(raw))
    with pytest.raises(SlotIndexFormatError, match="damaged"):
        SlotIndex.open(path)


def test_a_killed_pool_is_adopted_byte_exact_and_a_stop_too(tmp_path: Path) -> None:
    node = Node(tmp_path, 64)
    keys = [key(i) for i in range(40)]
    node.store(keys[:30])
    node.pool.cpu.discard(keys[20:25])  # gone before the kill: never brought back
    node.kill()
    node = Node(tmp_path, 64)
    assert node.arena.opened.state == "adopted" and len(node.arena.opened.records) == 25
    assert node.pool.cpu.adoption_pending_blocks == 25
    served = node.served(keys)
    assert served == {k: content(k) for k in keys[:20] + keys[25:30]}
    node.settle_verification()
    stats = node.pool.stats()
    assert (stats["cpu_adopted_blocks"], stats["cpu_adoption_dropped_blocks"], stats["cpu_adoption_pending_blocks"]) \
        == (25, 0, 0)
    node.store(keys[30:])  # the adopted tier takes new blocks too
    node.close()  # a clean stop keeps the files
    node = Node(tmp_path, 64)
    assert node.served(keys) == {k: content(k) for k in keys[:20] + keys[25:]}
    node.close()


def test_a_corrupt_block_is_dropped_never_served_and_the_rest_is(tmp_path: Path) -> None:
    node = Node(tmp_path, 16)
    keys = [key(i) for i in range(10)]
    node.store(keys)
    slot_of = {k: node.pool.cpu.get(k).slot for k in keys}  # type: ignore[union-attr]
    node.kill()
    data = node.arena.index.path.with_suffix(".data")
    with open(data, "r+b") as f:  # a byte of block 3 and one of block 7's record go bad
        f.seek(slot_of[keys[3]] * BB + 17)
        b = f.read(1)
        f.seek(slot_of[keys[3]] * BB + 17)
        f.write(bytes([b[0] ^ 0x40]))
    with open(node.arena.index.path, "r+b") as f:
        f.seek(HEADER_BYTES + slot_of[keys[7]] * RECORD_BYTES + 30)
        f.write(b"\x99")
    node = Node(tmp_path, 16)
    assert node.arena.opened.torn == 1
    assert node.served(keys) == {k: content(k) for k in keys if k not in (keys[3], keys[7])}
    node.settle_verification()
    assert node.pool.cpu.adopted_blocks == 8 and node.pool.cpu.adoption_dropped_blocks == 2
    node.close()


def test_another_layout_or_format_starts_empty_and_says_why(tmp_path: Path) -> None:
    node = Node(tmp_path, 16)
    node.store([key(i) for i in range(5)])
    node.close()
    node = Node(tmp_path, 16, layout={**LAYOUT, "dtype": "float16"})
    assert node.arena.opened.state == "reset" and "dtype: 'bfloat16' -> 'float16'" in node.arena.opened.reason
    assert len(node.pool.cpu) == 0 and "starts empty" in node.arena.describe()
    node.store([key(1)])
    node.close()
    index = next(tmp_path.glob("*.index"))
    raw = bytearray(index.read_bytes())
    raw[8:12] = struct.pack("<I", 2)
    index.write_bytes(bytes(raw))
    node = Node(tmp_path, 16, layout={**LAYOUT, "dtype": "float16"})
    assert node.arena.opened.state == "reset" and "format 2" in node.arena.opened.reason
    assert node.served([key(1)]) == {}
    node.close()


def test_a_smaller_tier_keeps_the_newest_blocks_that_fit_and_a_larger_one_all(tmp_path: Path) -> None:
    node = Node(tmp_path, 32)
    keys = [key(i) for i in range(30)]
    for i in range(0, 30, 5):
        node.store(keys[i:i + 5])  # oldest first
    node.pool.cpu.discard(keys[:3])  # holes in the low slots: the moved blocks fill them
    node.kill()
    node = Node(tmp_path, 12)
    assert node.arena.opened.unfit == 27 - 12 and node.arena.slots == 12
    assert node.arena.layout.num_blocks == 12
    assert os.path.getsize(node.arena.index.path.with_suffix(".data")) < 32 * BB
    assert node.served(keys) == {k: content(k) for k in keys[-12:]}
    node.kill()
    node = Node(tmp_path, 40)
    assert node.arena.opened.state == "adopted" and node.arena.slots == 40
    assert node.served(keys) == {k: content(k) for k in keys[-12:]}
    node.store([key(i, 1) for i in range(28)])  # the new slots hold blocks
    assert len(node.pool.cpu) == 40
    node.close()


def test_the_key_journal_numbers_past_the_previous_process(tmp_path: Path) -> None:
    node = Node(tmp_path, 16)
    node.store([key(i) for i in range(3)])
    journal = node.pool.journal
    assert journal is not None and journal.cursor == 3
    node.kill()
    node = Node(tmp_path, 16)
    journal = node.pool.journal
    assert journal is not None and journal.held == 3
    events, _next, lost = journal.since(3, 100)
    assert lost  # an old cursor: its reader must resynchronise
    events, _next, lost = journal.since(journal.cursor - 3, 100)
    assert not lost and sorted(k for _, k in events) == [key(i) for i in range(3)]
    node.close()


def test_list_and_remove_arenas(tmp_path: Path) -> None:
    node = Node(tmp_path, 8)
    node.store([key(1)])
    [info] = list_arenas(tmp_path)
    assert info.held and info.identity is not None and info.identity["pool"] == "p"
    assert info.memory_bytes >= 8 * BB and info.uid == os.getuid()
    with pytest.raises(RuntimeError, match="running kvtierd"):
        remove_arena(info)
    node.close()
    [info] = list_arenas(tmp_path)
    assert not info.held
    remove_arena(info)
    assert list_arenas(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_a_full_arena_dir_is_a_host_memory_error_that_says_what_to_do(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, off: int, n: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(HostMemoryError, match="remount,size="):
        ArenaDirectory(tmp_path, ENDPOINT).open("p", LAYOUT, 8, BB, pin=False)


# ---- kills at any instant --------------------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(1, 6)),
        st.tuples(st.just("run"), st.integers(0, 3)),  # run this many queued copies, then poll
        st.tuples(st.just("discard"), st.integers(0, 40)),
    ),
    min_size=1, max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, tear_record=st.booleans(), tear_data=st.booleans(), pick=st.integers(0, 10**6))
def test_a_kill_at_any_step_leaves_what_was_acknowledged_served_or_counted_dropped(
        tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]], tear_record: bool, tear_data: bool,
        pick: int) -> None:
    """Stores with copies left in flight, evictions (a 12-slot tier), discards; a kill after any step,
    with a record or a block torn as a kill (or a bad page) can leave them. After adoption: every byte
    served is the block's own, every block acknowledged and held at the kill is served or counted dropped,
    and nothing that was not held comes back."""
    where = tmp_path_factory.mktemp("arena")
    engine = SteppedEngine()
    node = Node(where, 12, engine=engine)
    stored = 0
    for op, n in ops:
        if op == "store":
            keys = [key(stored + i) for i in range(n)]
            stored += n
            try:
                node.pool.store(keys, source(keys), list(range(n)))
            except Exception:  # NoSpace: every slot busy with a write in flight
                pass
        elif op == "run":
            engine.run(False, n)
            node.pool.poll()
        else:
            node.pool.cpu.discard([key(n)])
    cpu = node.pool.cpu
    held = {k: e.slot for k, e in cpu._entries.items() if e.ready}  # acknowledged and still held
    torn: set[bytes] = set()
    if held and tear_record:
        k = sorted(held)[pick % len(held)]
        node.arena.index._view[HEADER_BYTES + held[k] * RECORD_BYTES + 8 + pick % 48] ^= 0x5A
        torn.add(k)
    if held and tear_data:
        k = sorted(held)[(pick // 7) % len(held)]
        node.arena.layout.slab()[held[k], pick % BB] ^= 0x3C
        torn.add(k)
    node.kill()
    copy = tmp_path_factory.mktemp("adopt")
    for f in where.iterdir():
        shutil.copy(f, copy / f.name)
    after = Node(copy, 12)
    served = after.served([key(i) for i in range(stored)])
    after.settle_verification()
    assert all(data == content(k) for k, data in served.items()), "a served block is not its own bytes"
    assert set(served) == set(held) - torn
    assert after.pool.cpu.adoption_dropped_blocks == len(torn) and after.pool.cpu.adoption_pending_blocks == 0
    after.close()


class FakeRegistry:
    """cudaHostRegister / Unregister stand-ins: what was page-locked, and what still is."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.live: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int, *_flags: object) -> None:
        self.calls.append((ptr, nbytes))
        self.live[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]


def test_an_adopted_tier_is_pinned_again_in_its_new_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Page-locking belongs to a process: a CUDA daemon that adopts a tier registers it again, chunk by chunk."""
    import gc
    import mmap

    from kvtier.tiers import cuda_copy
    from kvtier.tiers.host_memory import map_shared_slab

    reg = FakeRegistry()
    monkeypatch.setattr(cuda_copy, "host_register", reg.register)
    monkeypatch.setattr(cuda_copy, "host_unregister", reg.unregister)
    first = ArenaDirectory(tmp_path, ENDPOINT).open("p", LAYOUT, 64, BB, pin=True)
    assert first.layout.host_info["pinned"] == "chunked" and len(reg.live) == 1
    first.index.close()  # killed
    del first
    gc.collect()
    assert reg.live == {}
    again = ArenaDirectory(tmp_path, ENDPOINT).open("p", LAYOUT, 64, BB, pin=True)
    assert again.opened.state == "adopted" and again.layout.host_info["pinned"] == "chunked"
    (ptr, nbytes), = reg.live.items()
    assert ptr == again.layout.slab().data_ptr() and nbytes >= 64 * BB
    again.close()
    del again
    gc.collect()
    assert reg.live == {}
    # In chunks that start on page and block boundaries, as the private tier's.
    fd = os.open(tmp_path / "slab", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 37 * 3 * mmap.PAGESIZE)
    reg.calls.clear()
    layout = map_shared_slab(fd, 37, 3 * mmap.PAGESIZE, pin=True, chunk_bytes=1 << 16, register=reg.register,
                             unregister=reg.unregister)
    os.close(fd)
    base = layout.slab().data_ptr()
    assert [p - base for p, _ in reg.calls] == list(itertools.accumulate([0] + [n for _, n in reg.calls[:-1]]))
    assert all(n % (3 * mmap.PAGESIZE) == 0 for _, n in reg.calls[:-1]) and sum(n for _, n in reg.calls) >= 37 * 3 * mmap.PAGESIZE
    del layout
    gc.collect()
    assert reg.live == {}


def test_a_large_copys_checksums_split_over_threads_equal_one_threads(tmp_path: Path) -> None:
    from kvtier.tiers import persistent_arena
    from kvtier.tiers.slot_index import block_checksum

    bb = 1 << 20
    arena = ArenaDirectory(tmp_path, ENDPOINT).open("p", {**LAYOUT, "block_bytes": bb}, 12, bb, pin=False)
    arena.layout.slab().random_(0, 256)
    slots = [11, 3, 0, 7, 5, 9, 1]  # 7 MiB: past PARALLEL_CHECKSUM_BYTES, in a copy's slot order
    assert len(slots) * bb >= persistent_arena.PARALLEL_CHECKSUM_BYTES
    want = [block_checksum(arena.layout.slab()[s].numpy()) for s in slots]
    assert arena.checksums(slots) == want and arena.checksums(slots[:1]) == want[:1]
    arena.close()
