"""Stateful property test: a store's acknowledgement means the block is held.

A store answers a block some tier already holds as ``present``. When that
block's own store is still being copied in, the acknowledgement must wait
for that copy, and fail if it fails: otherwise a client is told "held" for a
block that a failed copy then removes (issue 15, item 10).

Hypothesis drives overlapping stores whose copies fail or not, on a stepped
transfer engine (copies complete only when a rule runs them, in any order
across priority classes). The pool is large enough that nothing is ever
evicted, so the property is exact: every key of a store that completed
without error is held from then on, with the bytes that were stored.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.pool import Op, PoolSpec, TieredPool
from kvtier.tiers.transfer import CopyKind
from tests.stepped_engine import SteppedEngine

BB = 32
KEYS = [bytes([i]) * 16 for i in range(8)]
GPU_BLOCKS = 3  # fewer than the keys: stores spill into the CPU tier too
CPU_BLOCKS = 16  # with the GPU tier, room for every key: nothing is ever evicted


def content(key: bytes) -> torch.Tensor:
    return torch.full((BB,), key[0] + 1, dtype=torch.uint8)


class StoreAck(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = SteppedEngine()
        self.pool = TieredPool(PoolSpec("ack", 4, BB), cpu_blocks=CPU_BLOCKS, policy="lru", transfer=self.engine,
                               cpu_storage=BlockLayout.contiguous(CPU_BLOCKS, BB), clean_ahead_blocks=0)
        self.pool.attach_gpu(BlockLayout.contiguous(GPU_BLOCKS, BB))
        self.ops: list[tuple[Op, list[bytes]]] = []
        self.acked: set[bytes] = set()

    def teardown(self) -> None:
        self.engine.close()

    @rule(picks=st.lists(st.sampled_from(range(len(KEYS))), min_size=1, max_size=4, unique=True), fail=st.booleans())
    def store(self, picks: list[int], fail: bool) -> None:
        keys = [KEYS[i] for i in picks]
        src = BlockLayout.contiguous(len(keys), BB)
        for i, k in enumerate(keys):
            src.slab()[i].copy_(content(k))
        self.engine.failing = {CopyKind.STORE} if fail else set()
        op = self.pool.store(keys, src, list(range(len(keys))))
        self.engine.failing = set()
        self.ops.append((op, keys))
        self._collect()

    @rule(high=st.booleans(), n=st.integers(1, 3))
    def run_copies(self, high: bool, n: int) -> None:
        self.engine.run(high, n)
        self.pool.poll()
        self._collect()

    def _collect(self) -> None:
        still = []
        for op, keys in self.ops:
            if not op.done:
                still.append((op, keys))
            elif op.error is None:
                self.acked.update(keys)
        self.ops = still

    @invariant()
    def acknowledged_blocks_are_held(self) -> None:
        holds = self.pool._resolve.holds
        missing = [k[0] for k in self.acked if not holds(k)]
        assert not missing, f"acknowledged blocks {missing} are held by no tier"

    @invariant()
    def acknowledged_blocks_hold_their_bytes_once_settled(self) -> None:
        if self.pool.busy or self.engine.queued or not self.acked:
            return
        keys = sorted(self.acked)
        for k in keys:  # one at a time: a restore takes a prefix
            dst = BlockLayout.contiguous(1, BB)
            op = self.pool.restore([k], dst, [0])
            for _ in range(20):
                if op.done:
                    break
                self.engine.run(True, 10)
                self.engine.run(False, 10)
                self.pool.poll()
            assert op.done and op.error is None and op.result["tiers"], k[0]
            assert torch.equal(dst.slab()[0], content(k)), k[0]


TestStoreAck = StoreAck.TestCase
TestStoreAck.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])
