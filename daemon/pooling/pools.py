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
  (the validated hello layout) with the settings the daemon was configured
  with for the *bare* name (``sizing_for(bare name)``: a ``PoolSettings``,
  sized; every tenant's "llama" is built like the configured "llama"; its
  remote tier, if any, gets the daemon's ``remote_secret``); a later call whose
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
- A pool configured with ``disk_dir`` gets a disk tier below its CPU tier
  (``kvtier.tiers.disk_tier``): ``disk_bytes`` of slots in its own
  directory, named after the pool's key and layout identity, adopted by the
  next pool of that key and layout (another daemon start, or after an idle
  pool was closed). It opens in the background; a directory it cannot use
  leaves the pool without one (logged), never refuses the hello.
- Every pool keeps a key journal of its last ``JOURNAL_EVENTS`` events (the
  keys it started and stopped holding: ``tiers.pool.journal``), which the
  ``events`` verb reads.
- Persistence (``arenas``, a ``tiers.persistent_arena.ArenaDirectory``; None:
  CPU tiers in private memory, gone with the process): every CPU tier lives
  in arena files a later daemon on the same socket adopts. ``adopt_arenas``
  (at start-up, before the first request is read) re-creates each pool an arena of
  this instance names, with the layout recorded there and today's sizing,
  and adopts its blocks (``TieredPool.attach_arena``); an arena that cannot
  be adopted (another format, a tenant or hash algorithm no longer
  configured, no room) is removed with one log line saying why, and its pool
  starts empty at its next hello. An adopted pool no hello has joined yet is
  idle (``pool_idle_ttl_s`` and reclaim apply); a hello with another layout
  replaces it (one log line: the layout changed, the pool starts empty)
  instead of getting LAYOUT_MISMATCH. A pool closed for good (reclaimed,
  idle) removes its arena: its memory is freed. ``close_all`` (the drain)
  first demotes the GPU tier's cached blocks into the CPU tier, then keeps
  the arenas for the next daemon.
- Single-threaded: only the event loop calls this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.client.protocol import ErrorCode, ProtocolError
from kvtier.tiers.host_memory import HostMemoryError, allocate_host_slab
from kvtier.blocks.layout import BlockLayout
from kvtier.tiers.persistent_arena import ArenaDirectory, PersistentArena
from kvtier.tiers.slot_index import SlotIndexBusy
from kvtier.tiers.pool import PoolSpec, TieredPool, WrapPolicy
from kvtier.tiers.transfer import TransferEngine, make_transfer_engine

if TYPE_CHECKING:
    from kvtier.daemon.config import PoolSettings
    from kvtier.tiers.disk_tier import DiskTier

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

ANONYMOUS = ""  # the tenant of every session on a daemon without tenants (daemon.tenancy.tenants.ANONYMOUS)


def pool_key(tenant: str, name: str) -> str:
    """A pool's key in the registry and its name in the operator's views (stats, metrics, logs).

    The anonymous tenant's pools keep their bare names: a daemon without
    tenants names everything as it always did. A tenant's pool is
    ``"<tenant>/<name>"``; tenant names have no ``/``, so the first one
    splits it back.
    """
    return name if tenant == ANONYMOUS else f"{tenant}/{name}"


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
    arena: PersistentArena | None = None  # its CPU tier's files (persistence on), or None
    unclaimed: bool = False  # adopted at start-up, no hello has joined it yet

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
        sizing_for: Callable[..., PoolSettings],
        hash_algo: str | None = None,
        wakeup: Callable[[], None] | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        policy_wrapper: Callable[[int], WrapPolicy | None] | None = None,
        arenas: ArenaDirectory | None = None,
        close_timeout_s: float = 10.0,
        remote_secret: bytes | None = None,
        transfer_factory: Callable[[str], TransferEngine] = make_transfer_engine,
    ) -> None:
        self.device = device
        self._sizing_for = sizing_for
        # The remote tier's secret (kvtier.tiers.remote.secret): required by a pool with a remote_url; never printed.
        self._remote_secret = remote_secret
        # device -> a new pool's copy engine; only the test seam (kvtier.daemon.faults) passes another
        self._transfer_factory = transfer_factory
        self._hash_algo = hash_algo
        self._wakeup = wakeup
        # (pool key, bytes done, bytes total) after each pinned chunk of a new
        # CPU tier: the daemon reports it (STATUS=) and feeds the watchdog.
        self._progress = progress
        # block_bytes -> what wraps a new pool's CPU-tier policy (tenant quotas), or None
        self._policy_wrapper = policy_wrapper
        self._arenas = arenas
        self._close_timeout_s = close_timeout_s  # for a pool replaced at a hello (an adopted one, unclaimed)
        self._pools: dict[str, PoolEntry] = {}  # pool_key(tenant, name) -> its pool

    def __iter__(self) -> Iterator[PoolEntry]:
        return iter(list(self._pools.values()))

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

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
        if entry is not None and entry.unclaimed and not entry.sessions and entry.layout != dict(layout):
            diffs = sorted(k for k in set(entry.layout) | set(layout) if entry.layout.get(k) != layout.get(k))
            log.warning("pool %r: the first hello since the restart has another layout (%s); the %d adopted "
                        "blocks are dropped and the pool starts empty", key,
                        ", ".join(f"{k}: {entry.layout.get(k)!r} -> {layout.get(k)!r}" for k in diffs),
                        len(entry.pool.cpu))
            self.close(key, self._close_timeout_s)
            entry = None  # the last reference: its tier's memory is back before the new one is sized
        if entry is not None:
            entry.unclaimed = False
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
        """A new pool (see the module docstring); with persistence its CPU tier is its arena, adopted if there."""
        # Errors name the bare name (the caller's); logs and progress the key (the operator's).
        key = pool_key(tenant, name)
        # Memory its arena's files hold already (after a restart) is reused, not taken anew.
        reusable = self._arenas.memory_bytes(key) if self._arenas is not None else 0
        # Configured per bare name: every tenant's "llama" is sized alike.
        sizing = self._sizing_for(name, reusable_bytes=reusable)
        if sizing.remote_url and self._remote_secret is None:
            raise ValueError("a pool with a remote tier needs its secret (remote_secret_key_file)")
        block_bytes = int(layout["block_bytes"])
        cpu_bytes, gpu_bytes = sizing.resolve_cpu_bytes(), sizing.resolve_gpu_bytes(on_cuda=self.on_cuda)
        cpu_blocks = cpu_bytes // block_bytes
        gpu_blocks = gpu_bytes // block_bytes
        for tier, blocks, nbytes in (("CPU", cpu_blocks, cpu_bytes),
                                     ("GPU", gpu_blocks if layout["mode"] == "store" else 0, gpu_bytes)):
            if blocks > MAX_BLOCKS_PER_TIER:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD,
                    f"pool {name!r}: layout.block_bytes {block_bytes} cuts this daemon's {nbytes}-byte {tier} tier "
                    f"into {blocks} blocks; at most {MAX_BLOCKS_PER_TIER} per tier (use larger blocks)",
                )
        store_gpu_blocks = gpu_blocks if layout["mode"] == "store" else 0
        if (cpu_bytes > 0 and cpu_blocks == 0) or (layout["mode"] == "store" and store_gpu_blocks + cpu_blocks == 0):
            # block_bytes larger than the tiers: a pool that can hold nothing
            # would take a name, threads and bookkeeping for no cache at all.
            tiers = f"CPU tier {cpu_bytes} bytes" + (
                f", GPU tier {gpu_bytes} bytes" if layout["mode"] == "store" else "")
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"pool {name!r}: layout.block_bytes {block_bytes} gives this pool no block ({tiers} on this "
                f"daemon); a block must fit in each tier",
            )
        on_chunk = None
        if self._progress is not None:
            report = self._progress
            on_chunk = lambda done, total: report(key, done, total)  # noqa: E731
        arena = self._open_arena(tenant, name, layout, cpu_blocks, block_bytes, on_chunk)
        try:
            return self._build(tenant, name, layout, sizing, arena, on_chunk)
        except BaseException:
            if arena is not None:
                arena.close(remove=arena.opened.state != "adopted")  # adopted blocks wait for another try
            raise

    def _open_arena(self, tenant: str, name: str, layout: dict[str, Any], cpu_blocks: int, block_bytes: int,
                    on_chunk: Callable[[int, int], None] | None) -> PersistentArena | None:
        """The pool's arena (persistence on), or None: private memory, with a warning when the files are busy."""
        if self._arenas is None:
            return None
        key = pool_key(tenant, name)
        if not cpu_blocks:
            if self._arenas.memory_bytes(key):
                log.warning("pool %r has no CPU tier now (cpu_bytes 0): the blocks its CPU tier held before the "
                            "restart are dropped", key)
                self._arenas.remove(key)
            return None
        try:
            arena = self._arenas.open(key, layout, cpu_blocks, block_bytes, progress=on_chunk,
                                      tenant=tenant, name=name)
        except HostMemoryError as exc:
            raise ProtocolError(ErrorCode.NO_SPACE, f"pool {name!r}: {exc}") from None
        except (SlotIndexBusy, OSError) as exc:  # held by another process, or arena_dir failing: still a cache
            log.warning("pool %r: its CPU tier stays private (not kept across restarts): %s", key, exc)
            return None
        (log.warning if arena.opened.state == "reset" else log.info)("pool %r: %s", key, arena.describe())
        return arena

    def _build(self, tenant: str, name: str, layout: dict[str, Any], sizing: PoolSettings,
               arena: PersistentArena | None, on_chunk: Callable[[int, int], None] | None) -> PoolEntry:
        key = pool_key(tenant, name)
        block_bytes = int(layout["block_bytes"])
        cpu_blocks = sizing.resolve_cpu_bytes() // block_bytes  # sized (sizing_for): no host memory read again
        gpu_blocks = sizing.resolve_gpu_bytes(on_cuda=self.on_cuda) // block_bytes
        if arena is not None:
            cpu_storage: BlockLayout | None = arena.layout
        else:
            try:
                cpu_storage = allocate_host_slab(cpu_blocks, block_bytes, progress=on_chunk) if cpu_blocks else None
            except HostMemoryError as exc:
                raise ProtocolError(ErrorCode.NO_SPACE, f"pool {name!r}: {exc}") from None
        gpu_layout = None
        if layout["mode"] == "store" and gpu_blocks:
            try:
                gpu_layout = BlockLayout.contiguous(gpu_blocks, block_bytes, self.device, hugepages=True)
            except (RuntimeError, MemoryError) as exc:  # torch reports device OOM as RuntimeError
                raise ProtocolError(ErrorCode.NO_SPACE, f"pool {name!r}: cannot allocate the GPU tier: {exc}") from None
        transfer = self._transfer_factory(self.device)
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
        disk = _disk_tier(sizing, key, spec)
        remote = None
        if sizing.remote_url:
            from kvtier.tiers.remote.tier import RemoteTier, make_pool_key

            # Keyed by the whole layout identity: daemons of one model share
            # blocks, other pools (and, through the hashes, tenants) never do.
            # Never raises for an unreachable server: it starts unavailable.
            remote = RemoteTier(sizing.remote_url, make_pool_key(spec.name, spec.block_size, spec.block_bytes,
                                                                 [list(kv) for kv in spec.extra]), block_bytes,
                                sizing.remote, secret=self._remote_secret)
        pool = TieredPool(
            spec,
            cpu_blocks=cpu_blocks,
            policy=sizing.policy,
            transfer=transfer,
            cpu_storage=cpu_storage,
            clean_ahead_blocks=sizing.clean_ahead_blocks,
            remote=remote,
            disk=disk,
            defer_learning=True,  # the loop calls learn() after sending its replies
            journal_events=JOURNAL_EVENTS,
            policy_wrapper=self._policy_wrapper(block_bytes) if self._policy_wrapper is not None else None,
        )
        if arena is not None:
            pool.attach_arena(arena, self._wakeup)
        if gpu_layout is not None:
            pool.attach_gpu(gpu_layout)
        log.info(
            "pool %r created: mode=%s block_bytes=%d gpu_blocks=%d cpu_blocks=%d disk_blocks=%d device=%s%s",
            key, layout["mode"], block_bytes, gpu_blocks if gpu_layout is not None else 0, cpu_blocks,
            disk.capacity_blocks if disk is not None else 0, self.device,
            " (persistent CPU tier)" if arena is not None else "",
        )
        return PoolEntry(key, layout, pool, transfer, tenant=tenant, bare_name=name, arena=arena)

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
        """Drop the pool with this key (``PoolEntry.name``) with its blocks (an idle one: the caller checks it
        has no session), and its arena: this is the pool's end, its memory is freed."""
        entry = self._pools.pop(key)
        _close_entry(entry, timeout_s, keep_arena=False)

    def idle(self) -> list[PoolEntry]:
        """Pools without sessions, longest idle first: what may be reclaimed, in that order."""
        return sorted((e for e in self._pools.values() if not e.sessions and e.idle_since_s is not None),
                      key=lambda e: e.idle_since_s or 0.0)

    def close_all(self, timeout_s: float) -> bool:
        """The daemon stops: persistent pools first demote what only their GPU tier holds, then every pool
        closes; arenas are kept for the next daemon (see the module docstring). Returns False when a pool's
        copies, or its disk tier's writer, were still running at its close (abandoned: they may still write
        its CPU tier or disk directory; a hand-over's successor then adopts only after this process exits)."""
        deadline_s = time.monotonic() + timeout_s
        persistent = [e for e in self._pools.values() if e.arena is not None and e.pool.gpu_blocks]
        for i, entry in enumerate(persistent):
            share_s = max(0.0, deadline_s - time.monotonic()) / (2 * (len(persistent) - i))  # half for the closes
            try:
                n = entry.pool.demote_cached(share_s)
            except Exception:  # a failed demotion loses those blocks, not the stop
                log.exception("pool %r: demoting the GPU tier before the stop", entry.name)
                continue
            if n:
                log.info("pool %r: %d blocks only the GPU tier held demoted into the persistent CPU tier", entry.name, n)
        finished = True
        for entry in self._pools.values():
            finished &= _close_entry(entry, max(0.5, deadline_s - time.monotonic()), keep_arena=True)
        self._pools.clear()
        return finished

    # ---- adoption at start-up ------------------------------------------------------------

    def adopt_arenas(self, tenant_known: Callable[[str], bool]) -> int:
        """Re-create the pools this instance's arenas name, adopting their blocks (see the module docstring);
        returns how many pools were adopted. ``tenant_known(tenant)``: whether the configuration still has it."""
        if self._arenas is None:
            return 0
        adopted = 0
        for info in self._arenas.instance_arenas():
            ident = info.identity or {}
            key = ident.get("pool", info.stem)
            why = info.problem
            if why and ident.get("kvtier"):
                why += f" (written by kvtier {ident['kvtier']})"
            if info.held:
                log.warning("arena %s of pool %r is held by another live process; not adopted", info.stem, key)
                continue
            if not why and not all(isinstance(ident.get(k), t) for k, t in
                                   (("pool", str), ("tenant", str), ("name", str), ("layout", dict))):
                why = "its identity is incomplete"
            if not why and not tenant_known(ident["tenant"]):
                why = f"tenant {ident['tenant']!r} is no longer configured"
            if not why:
                try:
                    entry = self.get_or_create(ident["name"], ident["layout"], tenant=ident["tenant"])
                except ProtocolError as exc:
                    why = exc.message
                else:
                    entry.unclaimed = True
                    entry.idle_since_s = time.monotonic()  # idle until a hello joins it: TTL and reclaim apply
                    adopted += entry.arena is not None and entry.arena.opened.state == "adopted"
                    continue
            log.warning("pool %r starts empty: its CPU tier from before the restart (%s) is not adopted because %s; "
                        "removed", key, info.stem, why)
            self._arenas.remove_stem(info.stem)
        return adopted


def _disk_tier(sizing: PoolSettings, key: str, spec: PoolSpec) -> DiskTier | None:
    """The pool's disk tier under ``disk_dir`` (None without one, or with room for no block).

    Its directory is named after the pool's key (tenant and name: pools of two
    tenants never share one) and its layout identity; blocks of another layout
    are never read. It opens on its own thread: never an error for the hello.
    """
    if sizing.disk_dir is None or sizing.disk_bytes <= 0:
        return None
    from kvtier.tiers.disk_files import slot_bytes_for
    from kvtier.tiers.disk_tier import DiskTier

    slot_bytes = slot_bytes_for(spec.block_bytes)
    blocks = sizing.disk_bytes // slot_bytes
    if blocks == 0:
        log.warning("pool %r: disk_bytes %d holds no block of %d bytes; no disk tier", key, sizing.disk_bytes,
                    spec.block_bytes)
        return None
    if blocks > MAX_BLOCKS_PER_TIER:
        log.warning("pool %r: disk_bytes %d cuts into %d blocks of %d bytes; the disk tier keeps %d (use larger "
                    "blocks)", key, sizing.disk_bytes, blocks, slot_bytes, MAX_BLOCKS_PER_TIER)
        blocks = MAX_BLOCKS_PER_TIER
    identity = {"pool": key, "block_size": spec.block_size, "layout": [list(kv) for kv in spec.extra]}
    return DiskTier(sizing.disk_dir, key, identity, block_bytes=spec.block_bytes, capacity_blocks=blocks)


def _close_entry(entry: PoolEntry, timeout_s: float, *, keep_arena: bool = False) -> bool:
    """Close one pool; False if its copies (or its disk tier's writes) were still running when it gave up."""
    finished = False
    try:
        entry.pool.close(timeout_s)
        finished = not entry.pool.busy
        if entry.arena is not None:
            entry.arena.close(remove=not keep_arena)
    finally:
        entry.transfer.close(timeout_s)
        if entry.pool.remote is not None:
            entry.pool.remote.close(timeout_s)
        if entry.pool.disk is not None:
            # What is queued is written; the directory stays for the next start.
            finished = entry.pool.disk.close(timeout_s) and finished
    return finished
