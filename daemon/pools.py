"""The daemon's pools: (tenant, name) -> TieredPool with the layout that created it.

Contract:

- Pool names are per tenant. ``get_or_create(name, layout, tenant=...)``
  returns tenant ``tenant``'s pool called ``name``: two tenants' pools of one
  name are two pools, so no tenant can create ("squat") a pool name before
  another, reach another's pool, or learn whether another's exists. Without
  tenants every session is the anonymous tenant ``""`` (clients are mutually
  trusted) and shares pools by name, as always.
- Names: ``PoolEntry.bare_name`` is the name the hello sent, the only name
  its tenant ever sees (hello reply, errors). ``PoolEntry.name`` is its key
  here and the operator's name for it (``pool_key``): the bare name for the
  anonymous tenant, ``"<tenant>/<bare name>"`` for a tenant's pool. Tenant
  names never contain ``/`` (configuration refuses them) and a daemon's
  sessions are either all anonymous (no tenants) or all tenants', so the
  key is unambiguous: split at the first ``/``. ``get`` / ``close`` /
  ``find`` take that key (``Session.pool_name`` holds it).
- The first ``get_or_create`` of a key creates the pool from ``layout``
  (the validated hello layout) with the sizes and policy the daemon was
  configured with for the *bare* name (``sizing_for(bare name)``: every
  tenant's "llama" is sized like the configured "llama"); a later call whose
  layout differs in any field raises LAYOUT_MISMATCH naming both values (the
  caller is the pool's own tenant), and the existing pool is untouched. When
  the daemon is configured with a hash algorithm, a layout naming another
  one is a LAYOUT_MISMATCH too (an operator who requires sha256 for tenants
  sharing a daemon gets it).
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
  and nothing is created. ``progress(key, done_bytes, total_bytes)``, when
  given, is called after each pinned chunk of a new CPU tier.
- Pools outlive sessions: the cache is the point. An idle one (no session,
  ``idle()``, longest idle first) goes when a new pool needs its memory or
  its idle time passes ``pool_idle_ttl_s`` (the server decides, ``close``);
  all go at ``close_all``.
- Every pool keeps a key journal of its last ``JOURNAL_EVENTS`` events (the
  keys it started and stopped holding: ``tiers.pool.journal``), which the
  ``events`` verb reads.
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

# Events a pool's key journal keeps for the "events" verb: ~150 bytes each, ~10 MB at most per
# pool. A reader polling every 0.1 s misses none below ~650k key changes a second.
JOURNAL_EVENTS = 1 << 16

ANONYMOUS = ""  # the tenant of every session on a daemon without tenants (daemon.tenants.ANONYMOUS)


def pool_key(tenant: str, name: str) -> str:
    """A pool's key in the registry and its name in the operator's views (stats, metrics, logs).

    The anonymous tenant's pools keep their bare names: a daemon without
    tenants names everything as it always did. A tenant's pool is
    ``"<tenant>/<name>"``; tenant names have no ``/``, so the first one
    splits it back.
    """
    return name if tenant == ANONYMOUS else f"{tenant}/{name}"


@dataclass(frozen=True)
class PoolSizing:
    """How a new pool is built (from the daemon's configuration for its name)."""

    gpu_bytes: int  # store mode only; engine mode uses the engine's tensors
    cpu_bytes: int
    policy: str = "lru"
    clean_ahead_blocks: int = 64
    remote_url: str | None = None  # Redis/Valkey tier below the CPU tier
    # The remote tier's secret (kvtier.tiers.remote_secret): required with remote_url; never printed.
    remote_secret: bytes | None = field(default=None, repr=False)
    # TEST-ONLY copy fault injection (kvtier.daemon.faults); None in production.
    fault_hook: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        if self.remote_url and self.remote_secret is None:
            raise ValueError("a pool with a remote tier needs its secret (remote_secret_key_file)")


@dataclass(eq=False)
class PoolEntry:
    name: str  # its key (pool_key): unique in the daemon, what the operator sees and the server uses
    layout: dict[str, Any]
    pool: TieredPool
    transfer: TransferEngine
    tenant: str = ANONYMOUS  # whose pool it is: only that tenant's sessions open, see or name it
    bare_name: str = ""  # the name its hellos send: the only one its tenant sees (== name without tenants)
    # Engine mode: (sid, registration name) whose tensors are the GPU tier.
    gpu_owner: tuple[str, str] | None = None
    sessions: set[str] = field(default_factory=set)
    idle_since_s: float | None = None  # monotonic time its last session ended; None while it has sessions

    def __post_init__(self) -> None:
        if not self.bare_name:
            self.bare_name = self.name

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
        # (pool key, bytes done, bytes total) after each pinned chunk of a new
        # CPU tier: the daemon reports it (STATUS=) and feeds the watchdog.
        self._progress = progress
        # block_bytes -> what wraps a new pool's CPU-tier policy (tenant quotas), or None
        self._policy_wrapper = policy_wrapper
        self._pools: dict[str, PoolEntry] = {}  # pool_key(tenant, name) -> its pool

    def __iter__(self) -> Iterator[PoolEntry]:
        return iter(list(self._pools.values()))

    def __len__(self) -> int:
        return len(self._pools)

    def find(self, key: str) -> PoolEntry | None:
        """The pool with this key (``pool_key``), if any."""
        return self._pools.get(key)

    def get(self, key: str) -> PoolEntry:
        """The pool with this key (``pool_key``; a session's ``pool_name``); NOT_FOUND if none."""
        entry = self._pools.get(key)
        if entry is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no pool {key!r}")
        return entry

    def get_or_create(self, name: str, layout: Mapping[str, Any], *, tenant: str = ANONYMOUS) -> PoolEntry:
        """Tenant ``tenant``'s pool ``name``, created with ``layout`` if new (see the module docstring)."""
        key = pool_key(tenant, name)
        entry = self._pools.get(key)
        if entry is not None:
            if entry.layout != dict(layout):
                # Only the pool's own tenant (or, without tenants, a trusted
                # client) can get here: it may be told the pool's values.
                diffs = sorted(k for k in set(entry.layout) | set(layout) if entry.layout.get(k) != layout.get(k))
                detail = ", ".join(f"{k}: pool has {entry.layout.get(k)!r}, hello has {layout.get(k)!r}" for k in diffs)
                raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"pool {name!r} exists with another layout ({detail})")
            return entry
        if self._hash_algo is not None and layout["hash_algo"] != self._hash_algo:
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"this daemon is configured for hash_algo {self._hash_algo!r}, hello has {layout['hash_algo']!r}",
            )
        entry = self._create(tenant, name, dict(layout))
        self._pools[key] = entry
        return entry

    def _create(self, tenant: str, name: str, layout: dict[str, Any]) -> PoolEntry:
        # Errors name the bare name (the caller's); logs and progress the key (the operator's).
        key = pool_key(tenant, name)
        sizing = self._sizing_for(name)  # configured per bare name: every tenant's "llama" is sized alike
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
                on_chunk = lambda done, total: report(key, done, total)  # noqa: E731
            cpu_storage = allocate_host_slab(cpu_blocks, block_bytes, progress=on_chunk) if cpu_blocks else None
        except HostMemoryError as exc:
            raise ProtocolError(ErrorCode.NO_SPACE, f"pool {name!r}: {exc}") from None
        gpu_layout = None
        if layout["mode"] == "store" and gpu_blocks:
            try:
                gpu_layout = BlockLayout.contiguous(gpu_blocks, block_bytes, self.device, hugepages=True)
            except (RuntimeError, MemoryError) as exc:  # torch reports device OOM as RuntimeError
                raise ProtocolError(ErrorCode.NO_SPACE, f"pool {name!r}: cannot allocate the GPU tier: {exc}") from None
        transfer = make_transfer_engine(self.device)
        if sizing.fault_hook is not None:
            if isinstance(transfer, ThreadTransferEngine):
                transfer.fault_hook = sizing.fault_hook
            else:
                log.warning("pool %r: test fault injection needs the thread copy engine; ignored", key)
        if self._wakeup is not None:
            transfer.set_wakeup(self._wakeup)
        spec = PoolSpec(
            # The bare name: the remote tier's key space is per layout (below),
            # and tenants' blocks there stay apart through their namespaced hashes.
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
                                                                 [list(kv) for kv in spec.extra]), block_bytes,
                                secret=sizing.remote_secret)
        pool = TieredPool(
            spec,
            cpu_blocks=cpu_blocks,
            policy=sizing.policy,
            transfer=transfer,
            cpu_storage=cpu_storage,
            clean_ahead_blocks=sizing.clean_ahead_blocks,
            remote=remote,
            defer_learning=True,  # the loop calls learn() after sending its replies
            journal_events=JOURNAL_EVENTS,
            policy_wrapper=self._policy_wrapper(block_bytes) if self._policy_wrapper is not None else None,
        )
        if gpu_layout is not None:
            pool.attach_gpu(gpu_layout)
        log.info(
            "pool %r created: mode=%s block_bytes=%d gpu_blocks=%d cpu_blocks=%d device=%s",
            key, layout["mode"], block_bytes, gpu_blocks if gpu_layout is not None else 0, cpu_blocks, self.device,
        )
        return PoolEntry(key, layout, pool, transfer, tenant=tenant, bare_name=name)

    def attach_engine_gpu(self, entry: PoolEntry, owner: tuple[str, str], layout: BlockLayout) -> None:
        if entry.mode != "engine":
            raise ProtocolError(ErrorCode.WRONG_MODE, "only engine-mode pools take registered tensors as their GPU tier")
        if entry.gpu_owner is not None:
            raise ProtocolError(
                ErrorCode.INVALID_STATE,
                f"pool {entry.bare_name!r} already has a GPU tier registered (registration {entry.gpu_owner[1]!r})",
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

    def clean_when_idle(self) -> None:
        """The loop has nothing else to do: each pool demotes ahead of its next allocations (``TieredPool.clean_when_idle``)."""
        for entry in self._pools.values():
            entry.pool.clean_when_idle()

    def learn(self, should_yield: Callable[[], bool] | None = None) -> bool:
        """Policy bookkeeping of every pool (see ``TieredPool.learn``); True when none is left."""
        for entry in self._pools.values():
            if not entry.pool.learn(should_yield):
                return False
        return True

    def learn_backlog_keys(self) -> int:
        return sum(e.pool.learn_backlog_keys for e in self._pools.values())

    def close(self, key: str, timeout_s: float) -> None:
        """Drop the pool with this key (``PoolEntry.name``) with its blocks (an idle one: the caller checks it has no session)."""
        entry = self._pools.pop(key)
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
