"""The daemon's pools: name -> TieredPool with the layout that created it.

Contract:

- ``get_or_create(name, layout)`` returns the pool called ``name``. The first
  call creates it from ``layout`` (the validated hello layout) with the sizes
  and policy the daemon was configured with for that name (``sizing_for``);
  a later call whose layout differs in any field raises LAYOUT_MISMATCH, and
  the existing pool is untouched. When the daemon is configured with a hash
  algorithm, a layout naming another one is a LAYOUT_MISMATCH too (an
  operator who requires sha256 for tenants sharing a daemon gets it).
- Store-mode pools get a GPU tier the daemon allocates at creation (device
  memory on CUDA; host memory standing in for it without a GPU). Engine-mode
  pools start with a CPU tier only; the engine's registered KV tensors become
  their GPU tier (``attach_engine_gpu``) for as long as the registration
  lives (``detach_engine_gpu``).
- A layout whose ``block_bytes`` leaves a configured tier without a single
  block (the CPU tier; in store mode also a pool with no block in either
  tier) is refused with INVALID_FIELD before anything is allocated.
- CPU tiers are checked against available host memory before allocation
  (``tiers.host_memory``); a pool that does not fit is refused with NO_SPACE
  and nothing is created. ``progress(name, done_bytes, total_bytes)``, when
  given, is called after each pinned chunk of a new CPU tier.
- Pools outlive sessions: the cache is the point. An idle one (no session,
  ``idle()``, longest idle first) goes when a new pool needs its memory or
  its idle time passes ``pool_idle_ttl_s`` (the server decides, ``close``);
  all go at ``close_all``.
- Single-threaded: only the event loop calls this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.protocol import ErrorCode, ProtocolError
from kvtier.tiers.host_memory import HostMemoryError, allocate_host_slab
from kvtier.tiers.layout import BlockLayout
from kvtier.tiers.pool import PolicyWrapper, PoolSpec, TieredPool
from kvtier.tiers.transfer import ThreadTransferEngine, TransferEngine, make_transfer_engine

log = logging.getLogger(__name__)

# Every block of a tier has a bookkeeping record built when the tier is (the
# block manager's Block objects, the CPU tier's free-slot list): ~50-100 bytes
# and ~0.3 us each. A client picks block_bytes, so without a bound one hello
# with block_bytes=1 makes a daemon with a 16 GiB CPU tier build 16Gi records
# (its loop stalls, then it is OOM-killed). 2**23 blocks is a 1 TiB tier of
# 128 KiB blocks (Llama-3-8B, 16 tokens).
MAX_BLOCKS_PER_TIER = 1 << 23


@dataclass(frozen=True)
class PoolSizing:
    """How a new pool is built (from the daemon's configuration for its name)."""

    gpu_bytes: int  # store mode only; engine mode uses the engine's tensors
    cpu_bytes: int
    policy: str = "lru"
    clean_ahead_blocks: int = 64
    remote_url: str | None = None  # Redis/Valkey tier below the CPU tier
    # TEST-ONLY copy fault injection (kvtier.daemon.faults); None in production.
    fault_hook: Callable[[Any], None] | None = None


@dataclass(eq=False)
class PoolEntry:
    name: str
    layout: dict[str, Any]
    pool: TieredPool
    transfer: TransferEngine
    # Engine mode: (sid, registration name) whose tensors are the GPU tier.
    gpu_owner: tuple[str, str] | None = None
    sessions: set[str] = field(default_factory=set)
    tenants: set[str] = field(default_factory=set)  # whose sessions opened it: who may see it in stats
    idle_since_s: float | None = None  # monotonic time its last session ended; None while it has sessions

    @property
    def mode(self) -> str:
        return str(self.layout["mode"])

    @property
    def block_bytes(self) -> int:
        return int(self.layout["block_bytes"])

    @property
    def cpu_bytes(self) -> int:
        """Host memory its CPU tier holds (what the daemon's CPU budget counts)."""
        return self.pool.cpu_blocks * self.block_bytes

    @property
    def capacity_blocks(self) -> int:
        """Blocks the pool's tiers hold (GPU + CPU): what per-client shares are shares of."""
        return self.pool.gpu_blocks + self.pool.cpu_blocks


class PoolRegistry:
    """See the module docstring."""

    def __init__(
        self,
        *,
        device: str,
        sizing_for: Callable[[str], PoolSizing],
        hash_algo: str | None = None,
        wakeup: Callable[[], None] | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        policy_wrapper: Callable[[int], PolicyWrapper | None] | None = None,
    ) -> None:
        self.device = device
        self._sizing_for = sizing_for
        self._hash_algo = hash_algo
        self._wakeup = wakeup
        # (pool name, bytes done, bytes total) after each pinned chunk of a new
        # CPU tier: the daemon reports it (STATUS=) and feeds the watchdog.
        self._progress = progress
        # block_bytes -> what wraps a new pool's CPU-tier policy (tenant quotas), or None
        self._policy_wrapper = policy_wrapper
        self._pools: dict[str, PoolEntry] = {}

    def __iter__(self) -> Iterator[PoolEntry]:
        return iter(list(self._pools.values()))

    def __len__(self) -> int:
        return len(self._pools)

    def find(self, name: str) -> PoolEntry | None:
        return self._pools.get(name)

    def get(self, name: str) -> PoolEntry:
        entry = self._pools.get(name)
        if entry is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no pool {name!r}")
        return entry

    def get_or_create(self, name: str, layout: Mapping[str, Any], *, reveal: bool = True) -> PoolEntry:
        """The pool ``name``, created with ``layout`` if new. ``reveal=False`` (a tenant that never
        used the pool): a mismatch names the fields that differ, not the pool's values."""
        entry = self._pools.get(name)
        if entry is not None:
            if entry.layout != dict(layout):
                diffs = sorted(k for k in set(entry.layout) | set(layout) if entry.layout.get(k) != layout.get(k))
                detail = ", ".join(f"{k}: pool has {entry.layout.get(k)!r}, hello has {layout.get(k)!r}" if reveal
                                   else f"{k}: hello has {layout.get(k)!r}" for k in diffs)
                raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"pool {name!r} exists with another layout ({detail})")
            return entry
        if self._hash_algo is not None and layout["hash_algo"] != self._hash_algo:
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"this daemon is configured for hash_algo {self._hash_algo!r}, hello has {layout['hash_algo']!r}",
            )
        entry = self._create(name, dict(layout))
        self._pools[name] = entry
        return entry

    def _create(self, name: str, layout: dict[str, Any]) -> PoolEntry:
        sizing = self._sizing_for(name)
        block_bytes = int(layout["block_bytes"])
        cpu_blocks = sizing.cpu_bytes // block_bytes
        gpu_blocks = sizing.gpu_bytes // block_bytes
        for tier, blocks, nbytes in (("CPU", cpu_blocks, sizing.cpu_bytes),
                                     ("GPU", gpu_blocks if layout["mode"] == "store" else 0, sizing.gpu_bytes)):
            if blocks > MAX_BLOCKS_PER_TIER:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD,
                    f"pool {name!r}: layout.block_bytes {block_bytes} cuts this daemon's {nbytes}-byte {tier} tier "
                    f"into {blocks} blocks; at most {MAX_BLOCKS_PER_TIER} per tier (use larger blocks)",
                )
        store_gpu_blocks = gpu_blocks if layout["mode"] == "store" else 0
        if (sizing.cpu_bytes > 0 and cpu_blocks == 0) or (layout["mode"] == "store" and store_gpu_blocks + cpu_blocks == 0):
            # block_bytes larger than the tiers: a pool that can hold nothing
            # would take a name, threads and bookkeeping for no cache at all.
            tiers = f"CPU tier {sizing.cpu_bytes} bytes" + (
                f", GPU tier {sizing.gpu_bytes} bytes" if layout["mode"] == "store" else "")
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"pool {name!r}: layout.block_bytes {block_bytes} gives this pool no block ({tiers} on this "
                f"daemon); a block must fit in each tier",
            )
        try:
            on_chunk = None
            if self._progress is not None:
                report = self._progress
                on_chunk = lambda done, total: report(name, done, total)  # noqa: E731
            cpu_storage = allocate_host_slab(cpu_blocks, block_bytes, progress=on_chunk) if cpu_blocks else None
        except HostMemoryError as exc:
            raise ProtocolError(ErrorCode.NO_SPACE, f"pool {name!r}: {exc}") from None
        gpu_layout = None
        if layout["mode"] == "store" and gpu_blocks:
            try:
                gpu_layout = BlockLayout.contiguous(gpu_blocks, block_bytes, self.device)
            except (RuntimeError, MemoryError) as exc:  # torch reports device OOM as RuntimeError
                raise ProtocolError(ErrorCode.NO_SPACE, f"pool {name!r}: cannot allocate the GPU tier: {exc}") from None
        transfer = make_transfer_engine(self.device)
        if sizing.fault_hook is not None:
            if isinstance(transfer, ThreadTransferEngine):
                transfer.fault_hook = sizing.fault_hook
            else:
                log.warning("pool %r: test fault injection needs the thread copy engine; ignored", name)
        if self._wakeup is not None:
            transfer.set_wakeup(self._wakeup)
        spec = PoolSpec(
            name=name,
            block_size=int(layout["block_size"]),
            block_bytes=block_bytes,
            extra=tuple(sorted((k, v) for k, v in layout.items() if k not in ("block_size", "block_bytes"))),
        )
        remote = None
        if sizing.remote_url:
            from kvtier.tiers.remote_tier import RemoteTier, make_pool_key

            # Keyed by the whole layout identity: daemons of one model share
            # blocks, other pools (and, through the hashes, tenants) never do.
            # Never raises for an unreachable server: it starts unavailable.
            remote = RemoteTier(sizing.remote_url, make_pool_key(spec.name, spec.block_size, spec.block_bytes,
                                                                 [list(kv) for kv in spec.extra]), block_bytes)
        pool = TieredPool(
            spec,
            cpu_blocks=cpu_blocks,
            policy=sizing.policy,
            transfer=transfer,
            cpu_storage=cpu_storage,
            clean_ahead_blocks=sizing.clean_ahead_blocks,
            remote=remote,
            defer_learning=True,  # the loop calls learn() after sending its replies
            policy_wrapper=self._policy_wrapper(block_bytes) if self._policy_wrapper is not None else None,
        )
        if gpu_layout is not None:
            pool.attach_gpu(gpu_layout)
        log.info(
            "pool %r created: mode=%s block_bytes=%d gpu_blocks=%d cpu_blocks=%d device=%s",
            name, layout["mode"], block_bytes, gpu_blocks if gpu_layout is not None else 0, cpu_blocks, self.device,
        )
        return PoolEntry(name, layout, pool, transfer)

    def attach_engine_gpu(self, entry: PoolEntry, owner: tuple[str, str], layout: BlockLayout) -> None:
        if entry.mode != "engine":
            raise ProtocolError(ErrorCode.WRONG_MODE, "only engine-mode pools take registered tensors as their GPU tier")
        if entry.gpu_owner is not None:
            raise ProtocolError(
                ErrorCode.INVALID_STATE,
                f"pool {entry.name!r} already has a GPU tier registered (registration {entry.gpu_owner[1]!r})",
            )
        if layout.num_blocks > MAX_BLOCKS_PER_TIER:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"registered tensors have {layout.num_blocks} blocks; a GPU tier has at most {MAX_BLOCKS_PER_TIER}",
            )
        entry.pool.attach_gpu(layout)
        entry.gpu_owner = owner
        log.info("pool %r: engine KV tensors attached as GPU tier (%d blocks)", entry.name, layout.num_blocks)

    def detach_engine_gpu(self, entry: PoolEntry, owner: tuple[str, str], timeout_s: float) -> None:
        if entry.gpu_owner != owner:
            return
        entry.pool.detach_gpu(timeout_s)
        entry.gpu_owner = None
        log.info("pool %r: engine GPU tier detached", entry.name)

    def busy(self) -> bool:
        return any(e.pool.busy for e in self._pools.values())

    def poll(self) -> None:
        for entry in self._pools.values():
            entry.pool.poll()

    def learn(self, should_yield: Callable[[], bool] | None = None) -> bool:
        """Policy bookkeeping of every pool (see ``TieredPool.learn``); True when none is left."""
        for entry in self._pools.values():
            if not entry.pool.learn(should_yield):
                return False
        return True

    def learn_backlog_keys(self) -> int:
        return sum(e.pool.learn_backlog_keys for e in self._pools.values())

    def close(self, name: str, timeout_s: float) -> None:
        """Drop a pool with its blocks (an idle one: the caller checks it has no session)."""
        entry = self._pools.pop(name)
        _close_entry(entry, timeout_s)

    def idle(self) -> list[PoolEntry]:
        """Pools without sessions, longest idle first: what may be reclaimed, in that order."""
        return sorted((e for e in self._pools.values() if not e.sessions and e.idle_since_s is not None),
                      key=lambda e: e.idle_since_s or 0.0)

    def close_all(self, timeout_s: float) -> None:
        for entry in self._pools.values():
            _close_entry(entry, timeout_s)
        self._pools.clear()


def _close_entry(entry: PoolEntry, timeout_s: float) -> None:
    try:
        entry.pool.close(timeout_s)
    finally:
        entry.transfer.close(timeout_s)
        if entry.pool.remote is not None:
            entry.pool.remote.close(timeout_s)
