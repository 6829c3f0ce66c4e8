"""The disk tier on its own: its index against a model, restarts, torn records, kills, full disks."""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tiers.disk_settings import DiskTierError, DiskTierSettings
from kvtier.tiers.disk_tier import DATA_NAME, INDEX_NAME, DiskTier
from kvtier.tiers.slot_index import HEADER_BYTES, RECORD_BYTES

BLOCK = 4096 + 512  # not a multiple of 4 KiB: reads go through the bounce buffer
FAST = DiskTierSettings(index_sync_interval_s=0.05, error_backoff_s=0.2, reader_threads=2)


def block_of(key: bytes) -> bytes:
    """A key's bytes, derived from the key (content-addressed, as the pool's keys are)."""
    seed = hashlib.sha256(key).digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def key(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8


def open_tier(root: Path, capacity: int = 6, **kw: object) -> DiskTier:
    tier = DiskTier(root, "pool", {"layout": "test"}, block_bytes=BLOCK, capacity_blocks=capacity,
                    settings=kw.pop("settings", FAST), **kw)  # type: ignore[arg-type]
    assert tier.wait_ready(10.0), tier.last_error
    return tier


def read(tier: DiskTier, keys: list[bytes]) -> list[bytes]:
    """What the tier serves of ``keys``' prefix, each checked against its key's bytes."""
    bufs = [bytearray(BLOCK) for _ in keys]
    n = tier.read_into(keys, bufs)
    for k, b in zip(keys[:n], bufs[:n]):
        assert bytes(b) == block_of(k), "the disk tier served wrong bytes"
    return keys[:n]


_RUNS = itertools.count()


class DiskTierModel(RuleBasedStateMachine):
    """The tier's contents and LRU order against an ordered dict, across reopens and corrupted blocks.

    Every write is flushed before the next step, so the tier's state is
    deterministic: its keys are the model's, in the same recency order
    (write order after a reopen, as records keep no hits).
    """

    CAPACITY = 5

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(os.environ["KVTIER_TEST_TMP"]) / f"model-{next(_RUNS)}"
        self.tier = open_tier(self.root, self.CAPACITY)
        self.order: OrderedDict[bytes, None] = OrderedDict()  # least recent first
        self.seq: dict[bytes, int] = {}  # key -> when it was written (the records' order)
        self.counter = 0
        self.corrupt: set[bytes] = set()

    def teardown(self) -> None:
        self.tier.close(5.0)
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(i=st.integers(0, 11))
    def write(self, i: int) -> None:
        k = key(i)
        assert self.tier.write_back(k, block_of(k))
        assert self.tier.flush(5.0)
        if k in self.order:
            self.order.move_to_end(k)
            return
        if len(self.order) == self.CAPACITY:
            gone, _ = self.order.popitem(last=False)
            self.seq.pop(gone)
            self.corrupt.discard(gone)
        self.counter += 1
        self.order[k] = None
        self.seq[k] = self.counter

    @rule(ids=st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True))
    def read_prefix(self, ids: list[int]) -> None:
        keys = [key(i) for i in ids]
        run = 0
        while run < len(keys) and keys[run] in self.order:
            run += 1
        assert self.tier.exists_prefix(keys) == run
        good = 0
        while good < run and keys[good] not in self.corrupt:
            good += 1
        assert read(self.tier, keys) == keys[:good]
        for k in keys[:run]:  # every block of the run was read: the good ones are most recent, the bad gone
            if k in self.corrupt:
                self.order.pop(k)
                self.seq.pop(k)
                self.corrupt.discard(k)
            else:
                self.order.move_to_end(k)

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def corrupt_a_block(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.order)))
        entry = self.tier._catalog.begin_read([k])[0]
        self.tier._catalog.end_read([entry], [True])
        self.order.move_to_end(k)  # end_read(ok) made it most recent, as a hit would
        with open(self.tier.directory / DATA_NAME, "r+b") as f:
            f.seek(entry.slot * self.tier.slot_bytes + 7)
            f.write(bytes([block_of(k)[7] ^ 0x5A]))  # never the right byte, however often it is done
        self.corrupt.add(k)

    @rule()
    def reopen(self) -> None:
        assert self.tier.close(5.0)
        self.tier = open_tier(self.root, self.CAPACITY)
        self.order = OrderedDict((k, None) for k in sorted(self.order, key=self.seq.__getitem__))

    @invariant()
    def same_keys_same_order(self) -> None:
        assert self.tier.keys() == list(self.order)


DiskTierModel.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture
def _model_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # tmpfs where there is one: the model checks the index's logic, and fdatasync there costs nothing
    # (the other tests run on the test's own filesystem, with direct I/O where it has it).
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="kvtier-disk-model-", dir=shm if shm.is_dir() else tmp_path))
    monkeypatch.setenv("KVTIER_TEST_TMP", str(root))
    yield
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.usefixtures("_model_tmp")
class TestDiskTierModel(DiskTierModel.TestCase):  # type: ignore[name-defined]
    pass


def test_torn_records_and_stale_data_are_never_served(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "live", 8)
    keys = [key(i) for i in range(8)]
    for k in keys:
        assert tier.write_back(k, block_of(k))
    assert tier.flush(5.0)
    slots = {k: tier._catalog.begin_read([k])[0].slot for k in keys}
    tier.close(5.0)
    snap = tier.directory
    index = snap / INDEX_NAME
    with open(index, "r+b") as f:
        # Slot of key 1: its record torn (a kill in the middle of writing it).
        f.seek(HEADER_BYTES + slots[keys[1]] * RECORD_BYTES + 20)
        f.write(b"\xff\xfe")
    with open(snap / DATA_NAME, "r+b") as f:
        # Slot of key 2: the bytes changed under a complete record (a power loss between a
        # rewrite and its record's invalidation reaching the device).
        f.seek(slots[keys[2]] * tier.slot_bytes)
        f.write(block_of(key(77))[:BLOCK])
    again = open_tier(tmp_path / "live", 8)
    stats = again.stats()
    assert stats["torn_records"] == 1 and stats["adopted_blocks"] == 7
    assert again.exists_prefix(keys) == 1  # key 1's record is gone
    served = [k for k in keys if read(again, [k])]
    assert keys[1] not in served and keys[2] not in served
    assert sorted(served) == sorted(k for k in keys if k not in (keys[1], keys[2]))
    assert again.stats()["disk_corrupt"] == 1
    again.close(5.0)


def test_capacity_and_layout_changes(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, 8)
    keys = [key(i) for i in range(8)]
    for k in keys:
        tier.write_back(k, block_of(k))
    assert tier.flush(5.0)
    slots = {k: tier._catalog.begin_read([k])[0].slot for k in keys}
    tier.close(5.0)
    smaller = open_tier(tmp_path, 5)  # the records of slots 0..4 still fit
    assert sorted(smaller.keys()) == sorted(k for k in keys if slots[k] < 5)
    assert all(read(smaller, [k]) for k in smaller.keys())
    smaller.close(5.0)
    # Another layout: another directory, and the old one (not held) is removed.
    other = DiskTier(tmp_path, "pool", {"layout": "other"}, block_bytes=BLOCK, capacity_blocks=5, settings=FAST)
    assert other.wait_ready(10.0)
    assert other.keys() == [] and other.directory != smaller.directory
    assert not smaller.directory.exists()
    other.close(5.0)


def test_a_second_owner_of_a_directory_runs_without_it(tmp_path: Path) -> None:
    first = open_tier(tmp_path)
    second = DiskTier(tmp_path, "pool", {"layout": "test"}, block_bytes=BLOCK, capacity_blocks=6, settings=FAST)
    assert not second.wait_ready(10.0)
    assert "another live process" in second.last_error
    assert not second.available and second.exists_prefix([key(1)]) == 0
    assert not second.write_back(key(1), block_of(key(1)))
    second.close(1.0)
    first.close(5.0)


def test_a_directory_that_cannot_be_made_is_a_tier_of_misses(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    tier = DiskTier(tmp_path / "file", "pool", {}, block_bytes=BLOCK, capacity_blocks=4, settings=FAST)
    assert not tier.wait_ready(10.0) and tier.last_error
    assert not tier.write_back(key(1), block_of(key(1)))
    assert tier.stats()["writes_dropped_unavailable"] == 1
    tier.close(1.0)


def test_settings_are_checked() -> None:
    for bad in ({"reader_threads": 0}, {"write_queue_bytes": True}, {"error_backoff_s": float("nan")},
                {"index_sync_interval_s": 0}, {"direct_io": 1}):
        with pytest.raises(DiskTierError, match=next(iter(bad))):
            DiskTierSettings(**bad)  # type: ignore[arg-type]


def test_a_file_size_limit_fails_writes_quietly(tmp_path: Path) -> None:
    """Writes past RLIMIT_FSIZE fail (EFBIG): counted, dropped, no exception; what was written is served."""
    code = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal, as a daemon would have it
        sys.path[:0] = {sys.path!r}
        from tests.tiers.test_disk_tier import open_tier, key, block_of, read
        from kvtier.tiers.disk_settings import DiskTierSettings
        tier = open_tier(Path({str(tmp_path)!r}), 6,
                         settings=DiskTierSettings(error_backoff_s=0.01, index_sync_interval_s=0.05))
        limit = 3 * tier.slot_bytes  # slots 0..2 can be written, 3..5 not
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        for i in range(6):
            tier.write_back(key(i), block_of(key(i)))
            tier.flush(5.0)
            time.sleep(0.02)
        s = tier.stats()
        assert s["write_errors"] >= 1, s
        held = tier.keys()
        assert len(held) == 3 and all(read(tier, [k]) for k in held), held
        tier.close(5.0)
        print("ok", s["write_errors"])
    """).replace("import resource,", "import time, resource,")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout + out.stderr


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only): a disk that fills up."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_degrades_to_misses(tiny_fs: Path) -> None:
    # 16 slots of 8 KiB do not fit in 64 KiB (less the index): not preallocated, writes meet ENOSPC.
    tier = open_tier(tiny_fs, 16, settings=DiskTierSettings(error_backoff_s=0.01, index_sync_interval_s=0.05))
    assert not tier.stats()["preallocated"]
    keys = [key(i) for i in range(16)]
    for k in keys:
        tier.write_back(k, block_of(k))
        assert tier.flush(5.0)
        time.sleep(0.02)
    s = tier.stats()
    assert s["write_errors"] >= 1 and "No space" in s["last_error"]
    held = tier.keys()
    assert 0 < len(held) < 16
    assert all(read(tier, [k]) for k in held)
    tier.close(5.0)
    again = open_tier(tiny_fs, 16)  # and what was held survives a restart
    assert sorted(again.keys()) == sorted(held)
    again.close(5.0)


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path[:0] = {path!r}
    from tests.tiers.test_disk_tier import open_tier, key, block_of
    from kvtier.tiers.disk_settings import DiskTierSettings
    tier = open_tier(Path({root!r}), 16, settings=DiskTierSettings(write_batch_blocks=3, index_sync_interval_s=0.01))
    print("ready", flush=True)
    i = {start}
    while True:
        tier.write_back(key(i % 200), block_of(key(i % 200)))
        i += 1
        if i % 7 == 0:
            time.sleep(0.001)
""")


def test_kills_at_random_instants_never_leave_a_block_that_is_served_wrong(tmp_path: Path) -> None:
    rng = random.Random(34)
    root = tmp_path / "killed"
    served_total = 0
    for round_ in range(6):
        code = _KILLED_WRITER.format(path=sys.path, root=str(root), start=round_ * 37)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                 cwd=Path(__file__).resolve().parents[2])
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.02, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        tier = open_tier(root, 16)
        held = tier.keys()
        served = [k for k in held if read(tier, [k])]  # read() asserts every byte
        served_total += len(served)
        tier.close(5.0)
    assert served_total > 0


def test_errors_of_reads_rest_the_tier_then_it_recovers(tmp_path: Path) -> None:
    failing = [True]

    def faults(op: str, slot: int) -> None:
        if op == "read" and failing[0]:
            raise OSError(errno.EIO, "injected")

    tier = open_tier(tmp_path, faults=faults)
    keys = [key(i) for i in range(3)]
    for k in keys:
        tier.write_back(k, block_of(k))
    assert tier.flush(5.0)
    assert read(tier, keys) == []  # a miss, not an exception
    s = tier.stats()
    assert s["read_errors"] == 3 and not s["available"]
    assert tier.exists_prefix(keys) == 0  # reads rest: misses
    assert tier.keys() == []  # blocks whose read failed are dropped
    failing[0] = False
    time.sleep(0.25)
    assert tier.available
    for k in keys:
        assert tier.write_back(k, block_of(k))
    assert tier.flush(5.0)
    assert read(tier, keys) == keys
    tier.close(5.0)


def test_a_disk_full_before_the_tier_opens_leaves_it_unavailable_not_dead(tiny_fs: Path) -> None:
    # The index is written through a shared mapping: a page the filesystem cannot back would be a
    # SIGBUS. Its blocks are allocated when the tier opens, so a full disk refuses the tier instead.
    (tiny_fs / "filler").write_bytes(b"x" * (60 << 10))  # one page left: the index header fits, its records not
    tier = DiskTier(tiny_fs, "pool", {}, block_bytes=BLOCK, capacity_blocks=1024, settings=FAST)
    assert not tier.wait_ready(10.0)
    assert "No space" in tier.last_error
    assert not tier.write_back(key(1), block_of(key(1))) and tier.exists_prefix([key(1)]) == 0
    tier.close(1.0)
