"""The CPU tier (tiers/cpu_tier.py): LRU over evictable entries, fail-fast reserve, commit/abort."""

from __future__ import annotations

import pytest

from kvtier.tiers.cpu_tier import CpuEntry, CpuTier, CpuTierFull
from kvtier.tiers.policies.lru import LRUPolicy
from kvtier.blocks.layout import BlockLayout


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make_tier(capacity: int, storage: bool = False) -> CpuTier:
    layout = BlockLayout.contiguous(capacity, 32) if storage else None
    return CpuTier(capacity, LRUPolicy(capacity), layout)


def put(tier: CpuTier, *keys: bytes) -> list[CpuEntry]:
    entries = tier.reserve(list(keys))
    for e in entries:
        tier.commit(e)
    return entries


def state(tier: CpuTier) -> tuple:
    return (
        {key: (e.slot, e.pins, e.readers, e.ready) for key, e in tier._entries.items()},
        list(tier._free_slots),
        list(tier.policy.victims()),
        tier.evictions,
    )


def check(tier: CpuTier) -> None:
    slots = [e.slot for e in tier._entries.values()] + tier._free_slots
    assert sorted(slots) == list(range(tier.capacity_blocks)), "slots leaked or shared"
    assert len(tier) <= tier.capacity_blocks
    assert set(tier.policy.victims()) == {key for key, e in tier._entries.items() if e.ready}


def test_lru_order_evicts_least_recently_used_first() -> None:
    tier = make_tier(3)
    put(tier, k(1), k(2), k(3))
    assert tier.num_free_slots == 0
    tier.accessed([k(1)])  # order now 2 3 1
    (e4,) = tier.reserve([k(4)])
    assert tier.get(k(2)) is None and tier.evictions == 1
    assert e4.ready is False and tier.get_ready(k(4)) is None  # invisible until committed
    tier.commit(e4)
    assert tier.get_ready(k(4)) is not None
    assert list(tier.policy.victims()) == [k(3), k(1), k(4)]
    # Two at once: the two least recent go, in order.
    tier.accessed([k(3)])  # order 1 4 3
    tier.reserve([k(5), k(6)])
    assert tier.get(k(1)) is None and tier.get(k(4)) is None and tier.get_ready(k(3)) is not None
    assert tier.evictions == 3
    check(tier)


def test_free_slots_are_used_before_evicting() -> None:
    tier = make_tier(4)
    put(tier, k(1), k(2))
    tier.reserve([k(3), k(4)])
    assert tier.evictions == 0 and tier.num_free_slots == 0
    assert {tier.get(k(i)).slot for i in range(1, 5)} == {0, 1, 2, 3}
    check(tier)


@pytest.mark.parametrize("hold", ["pin", "read", "not_ready"])
def test_pinned_being_read_and_not_ready_entries_are_never_evicted(hold: str) -> None:
    tier = make_tier(3)
    if hold == "not_ready":
        (held,) = tier.reserve([k(1)])  # a write in flight
        put(tier, k(2), k(3))
    else:
        held, _, _ = put(tier, k(1), k(2), k(3))
        (tier.pin if hold == "pin" else tier.begin_read)(held)
    # k1 is the oldest (or not in the LRU at all); k2 and k3 go instead.
    tier.reserve([k(4), k(5)])
    assert tier.get(k(1)) is held
    assert tier.get(k(2)) is None and tier.get(k(3)) is None
    check(tier)
    # No more room: everything left is held or not ready.
    before = state(tier)
    failures = tier.full_failures
    with pytest.raises(CpuTierFull):
        tier.reserve([k(6)])
    assert tier.full_failures == failures + 1
    assert state(tier) == before
    # Releasing the hold makes it evictable again.
    if hold == "pin":
        tier.unpin(held)
    elif hold == "read":
        tier.end_read(held)
    else:
        tier.commit(held)
    for e in (tier.get(k(4)), tier.get(k(5))):
        if not e.ready:
            tier.commit(e)
    victims = list(tier.policy.victims())
    tier.reserve([k(6)])
    assert tier.get(victims[0]) is None and tier.get(k(6)) is not None
    check(tier)


def test_reserve_fails_fast_counted_and_changes_nothing() -> None:
    tier = make_tier(4)
    e1, e2, e3, e4 = put(tier, k(1), k(2), k(3), k(4))
    tier.pin(e1)
    tier.begin_read(e2)
    # Two evictable entries; three are asked for.
    before = state(tier)
    with pytest.raises(CpuTierFull) as info:
        tier.reserve([k(10), k(11), k(12)])
    assert "3" in str(info.value)
    assert tier.full_failures == 1
    assert state(tier) == before
    # Exactly two fit, evicting exactly the two evictable ones.
    tier.reserve([k(10), k(11)])
    assert tier.get(k(3)) is None and tier.get(k(4)) is None
    assert tier.get(k(1)) is e1 and tier.get(k(2)) is e2
    assert tier.full_failures == 1 and tier.evictions == 2
    check(tier)


def test_zero_capacity_tier_refuses_everything() -> None:
    tier = make_tier(0)
    with pytest.raises(CpuTierFull):
        tier.reserve([k(1)])
    assert tier.full_failures == 1 and len(tier) == 0
    assert tier.reserve([]) == []


def test_reserve_rejects_duplicates_and_present_keys() -> None:
    tier = make_tier(4)
    put(tier, k(1))
    before = state(tier)
    with pytest.raises(ValueError):
        tier.reserve([k(2), k(2)])
    with pytest.raises(ValueError):
        tier.reserve([k(2), k(1)])
    assert state(tier) == before and tier.full_failures == 0


def test_commit_and_abort() -> None:
    tier = make_tier(2, storage=True)
    e1, e2 = tier.reserve([k(1), k(2)])
    assert tier.get(k(1)) is e1 and tier.get_ready(k(1)) is None
    assert len(tier.policy) == 0
    tier.commit(e1)
    assert tier.get_ready(k(1)) is e1 and list(tier.policy.victims()) == [k(1)]
    with pytest.raises(ValueError):
        tier.commit(e1)  # not pending any more
    with pytest.raises(ValueError):
        tier.abort(e1)
    tier.abort(e2)
    assert tier.get(k(2)) is None and tier.num_free_slots == 1
    assert k(2) not in list(tier.policy.victims())
    with pytest.raises(ValueError):
        tier.commit(e2)  # aborted: gone
    # The aborted slot is reusable.
    (e3,) = tier.reserve([k(3)])
    assert e3.slot == e2.slot and tier.evictions == 0
    check(tier)


def test_pins_and_reads_are_counted() -> None:
    tier = make_tier(2)
    (e,) = put(tier, k(1))
    tier.pin(e)
    tier.pin(e)
    tier.unpin(e)
    assert not e.evictable and tier.num_pinned == 1
    tier.unpin(e)
    assert e.evictable and tier.num_pinned == 0
    with pytest.raises(ValueError):
        tier.unpin(e)
    tier.begin_read(e)
    tier.end_read(e)
    with pytest.raises(ValueError):
        tier.end_read(e)


def test_discard_and_clear_drop_only_unheld_entries() -> None:
    tier = make_tier(4)
    e1, e2, e3 = put(tier, k(1), k(2), k(3))
    (pending,) = tier.reserve([k(4)])
    tier.pin(e1)
    tier.begin_read(e2)
    # k(3) goes now; k(4), being written, goes when its write lands.
    assert tier.discard([k(1), k(2), k(3), k(4), k(99)]) == 2
    assert tier.get(k(3)) is None and tier.get(k(4)) is pending
    assert tier.clear() == 1  # k(4) again: still only marked
    tier.commit(pending)
    assert tier.get(k(4)) is None and tier.num_free_slots == 2
    assert {key for key in tier._entries} == {k(1), k(2)}
    tier.unpin(e1)
    tier.end_read(e2)
    assert tier.clear() == 2 and len(tier) == 0 and tier.num_free_slots == 4
    check(tier)


def test_a_pin_or_read_before_the_write_lands_keeps_a_discarded_entry() -> None:
    tier = make_tier(4)
    pinned, read, failed = tier.reserve([k(1), k(2), k(3)])
    assert tier.clear() == 3
    tier.pin(pinned)
    tier.begin_read(read)
    tier.commit(pinned)
    tier.commit(read)
    tier.abort(failed)  # a discarded write that fails goes as any failed write
    assert None not in (tier.get_ready(k(1)), tier.get_ready(k(2))) and tier.get(k(3)) is None
    tier.unpin(pinned)
    tier.end_read(read)
    assert list(tier.policy.victims()) == [k(1), k(2)]
    (kept,) = tier.reserve([k(4)])
    assert tier.clear() == 3  # two ready, one being written
    tier.keep(k(4))  # a store counted it present
    tier.commit(kept)
    assert tier.get_ready(k(4)) is not None and len(tier) == 1
    check(tier)


def test_storage_must_match_capacity() -> None:
    with pytest.raises(ValueError):
        CpuTier(4, LRUPolicy(4), BlockLayout.contiguous(3, 32))
    with pytest.raises(ValueError):
        CpuTier(-1, LRUPolicy(0))


# ---- host memory for the CPU tier ----------------------------------------------------------


class _VM:
    def __init__(self, available: int) -> None:
        self.available = available


def test_check_host_capacity_refuses_absurd_size_with_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.tiers import host_memory

    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: _VM(8 * 1024**3))
    absurd = 1 << 50  # 1 PiB
    with pytest.raises(host_memory.HostMemoryError) as info:
        host_memory.check_host_capacity(absurd)
    msg = str(info.value)
    assert "1048576.00 GiB" in msg  # what was asked
    assert "8.00 GiB" in msg  # what is available
    assert "7.50 GiB" in msg  # what is usable after the reserve
    assert isinstance(info.value, MemoryError)
    # A size that fits passes.
    host_memory.check_host_capacity(1024**3)


def test_check_host_capacity_with_the_real_machine() -> None:
    import psutil

    from kvtier.tiers import host_memory

    absurd = 1 << 60
    with pytest.raises(host_memory.HostMemoryError, match=r"\d+\.\d\d GiB") as info:
        host_memory.check_host_capacity(absurd, what="test tier")
    assert f"{absurd / 1024**3:.2f} GiB" in str(info.value) and "test tier" in str(info.value)
    assert psutil.virtual_memory().available > 0
    host_memory.check_host_capacity(4096)


def test_check_host_capacity_pinned_respects_memlock(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.tiers import host_memory

    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: _VM(64 * 1024**3))
    monkeypatch.setattr(host_memory.resource, "getrlimit", lambda _which: (64 * 1024**2, 64 * 1024**2))
    with pytest.raises(host_memory.HostMemoryError) as info:
        host_memory.check_host_capacity(1024**3, pin=True)
    assert "1.00 GiB" in str(info.value) and "0.06 GiB" in str(info.value) and "MEMLOCK" in str(info.value)
    host_memory.check_host_capacity(1024**3, pin=False)  # unpinned: the limit does not apply


def test_allocate_host_slab_refuses_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.tiers import host_memory

    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: _VM(1024**3))
    with pytest.raises(host_memory.HostMemoryError):
        host_memory.allocate_host_slab(1 << 20, 1 << 20, pin=False)  # 1 TiB
    slab = host_memory.allocate_host_slab(4, 64, pin=False)
    assert slab.is_slab and slab.num_blocks == 4 and slab.block_bytes == 64
