"""The Prometheus endpoint: kvtierd's ``stats`` as metrics, served over HTTP (off by default).

Contract
========

- ``StatsSnapshot`` hands the ``stats`` verb's reply from the event loop to
  other threads. The loop owns the pools and is the only thread that ever
  reads them: a reader (an HTTP scrape) calls ``get()``, which asks the loop
  for a fresh snapshot (``wakeup()`` ends the loop's poll early) and waits up
  to ``wait_s`` for one built *after* it asked. The loop checks ``wanted()``
  once per turn and answers with ``refresh(build)``. A loop that does not
  answer in time (it is draining, or stuck in a slow remote round trip) gets
  the previous snapshot served, and its age says so. Publishing swaps one
  reference under a lock; no pool method runs off the loop thread.
- ``StatsCollector(snapshot)`` is a prometheus-client custom collector: every
  ``collect()`` turns one snapshot into metric families (names, types and
  labels in ``POOL_METRICS`` / ``DAEMON_METRICS`` and in docs/metrics.md).
  Pool counters carry a ``pool`` label; hits are split by ``tier`` so that
  ``sum by (pool)`` of ``kvtier_hit_blocks_total`` plus
  ``kvtier_miss_blocks_total`` equals ``kvtier_looked_up_blocks_total``.
  On a daemon with tenants pool names are per tenant, so pool series carry
  a ``tenant`` label too (``pool`` is then the bare name the tenant chose):
  two tenants' "llama" are two series. Without tenants there is no
  ``tenant`` label, as before.
  Daemon counters (``daemon.telemetry.metrics.Counters``) are exported by name:
  ``kvtier_<name>``, a counter when the name ends in ``_total``, else a
  gauge, with the labels they were counted with.
- The HTTP endpoint that serves these families is ``daemon.telemetry.metrics_endpoint``.

Importing this module imports neither torch nor prometheus-client; the
server imports ``StatsSnapshot`` whether or not the endpoint is on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# How long a scrape waits for the loop's fresh snapshot. The idle loop turns
# every poll_interval_s (50 ms by default); a second covers a busy loop too.
DEFAULT_WAIT_S = 1.0

Stats = Mapping[str, Any]  # the `stats` verb's reply: {"pools", "daemon", "sessions"}


class StatsSnapshot:
    """See the module docstring. ``wakeup`` must be safe to call from any thread."""

    def __init__(self, wakeup: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._wakeup = wakeup
        self._clock = clock
        self._cond = threading.Condition()
        self._requested = 0  # tickets handed to readers
        self._served = 0  # the highest ticket a published snapshot answers
        self._stats: Stats | None = None
        self._published_s = 0.0

    # ---- the loop's side ----------------------------------------------------------

    def wanted(self) -> bool:
        """True when a reader waits for a snapshot (a racy read: a miss is caught next turn)."""
        return self._requested > self._served

    def refresh(self, build: Callable[[], Stats]) -> None:
        """Build a snapshot now (loop thread) and hand it to every reader that asked before."""
        with self._cond:
            ticket = self._requested
        try:
            stats = build()  # outside the lock: readers may queue meanwhile
        except Exception:
            # A bug in a stats() must not take the loop down; the readers get
            # the previous snapshot (its age shows) instead of waiting.
            log.exception("building the stats snapshot")
            with self._cond:
                self._served = max(self._served, ticket)
                self._cond.notify_all()
            return
        self.publish(stats, ticket)

    def publish(self, stats: Stats, ticket: int | None = None) -> None:
        """Publish ``stats`` (loop thread). ``ticket``: the last request it answers (default: all so far)."""
        with self._cond:
            self._stats = stats
            self._published_s = self._clock()
            self._served = max(self._served, self._requested if ticket is None else ticket)
            self._cond.notify_all()

    # ---- readers ---------------------------------------------------------------------

    def latest(self) -> tuple[Stats | None, float]:
        """The last published snapshot and its age in seconds (``inf`` when there is none)."""
        with self._cond:
            if self._stats is None:
                return None, math.inf
            return self._stats, max(0.0, self._clock() - self._published_s)

    def get(self, wait_s: float = DEFAULT_WAIT_S) -> tuple[Stats | None, float]:
        """A snapshot built after this call began, or after ``wait_s`` the latest one; with its age."""
        with self._cond:
            self._requested += 1
            ticket = self._requested
        if self._wakeup is not None:
            self._wakeup()
        with self._cond:
            self._cond.wait_for(lambda: self._served >= ticket, timeout=wait_s)
        return self.latest()


# --------------------------------------------------------------------------------------------
# Metric catalog: one line per series, in the order of docs/metrics.md.


@dataclass(frozen=True)
class PoolMetric:
    """One pool series: ``stats["pools"][pool][key]`` exported as ``name{pool, **labels}``."""

    key: str
    name: str  # without the kvtier_ prefix; counters without _total (prometheus-client adds it)
    kind: str  # "counter" | "gauge"
    help: str
    labels: tuple[tuple[str, str], ...] = ()


_TIERS = ("gpu", "cpu", "remote", "disk")
# The remote tier's stats counters remote_<reason> (kvtier.tiers.remote.tier.COUNTERS).
_REMOTE_REJECTIONS = ("unauthentic", "oversized", "corrupt")
_DIRECTIONS = {
    "demote": "GPU tier to CPU tier (demotions, including clean-ahead)",
    "restore": "CPU tier to GPU tier (engine-mode allocations that hit the CPU tier)",
    "store": "client to a tier (store verb)",
    "load": "a tier to the client (restore verb)",
}

POOL_METRICS: tuple[PoolMetric, ...] = (
    PoolMetric("lookups", "lookups", "counter",
               "Lookups counted by lookup, restore and allocate (one per call)."),
    PoolMetric("looked_up_blocks", "looked_up_blocks", "counter",
               "Block hashes those lookups asked about (= hit blocks of all tiers + miss blocks)."),
    *(PoolMetric(f"hit_blocks_{t}", "hit_blocks", "counter",
                 "Looked-up blocks found, attributed to the first tier holding them (gpu, cpu, disk, remote).",
                 (("tier", t),)) for t in _TIERS),
    PoolMetric("miss_blocks", "miss_blocks", "counter",
               "Looked-up blocks past the longest held prefix (not found, or after the first gap)."),
    PoolMetric("demotions", "demotions", "counter", "Blocks copied from the GPU tier into the CPU tier."),
    PoolMetric("demotions_urgent", "demotions_urgent", "counter",
               "Blocks demoted on the spot because an eviction found them not yet in the CPU tier "
               "(the op waited for the copy); clean-ahead keeps this near zero in steady state."),
    PoolMetric("demotions_skipped_clean", "demotions_skipped", "counter",
               "Evicted GPU blocks not demoted: clean (already in the CPU tier), refused by the CPU "
               "admission policy, or dropped because the CPU tier was full of pinned/busy blocks.",
               (("reason", "clean"),)),
    PoolMetric("demotions_not_admitted", "demotions_skipped", "counter", "", (("reason", "not_admitted"),)),
    PoolMetric("demotions_dropped_full", "demotions_skipped", "counter", "", (("reason", "cpu_full"),)),
    PoolMetric("restores", "restores", "counter", "Blocks copied from the CPU tier into the GPU tier."),
    PoolMetric("cpu_evictions", "cpu_evictions", "counter",
               "CPU-tier blocks evicted to make room (dropped, or written back when a remote tier exists)."),
    PoolMetric("cpu_full_failures", "cpu_reserve_failures", "counter",
               "CPU-tier reservations refused because every slot was pinned, busy or being written."),
    PoolMetric("stores", "stored_blocks", "counter", "Blocks the store verb copied into a tier."),
    PoolMetric("stores_present", "store_present_blocks", "counter",
               "Blocks the store verb skipped because a tier already held them."),
    PoolMetric("stores_failed", "store_failures", "counter",
               "Store calls that failed fast with NO_SPACE (nothing changed, nothing waited for)."),
    PoolMetric("loads", "loaded_blocks", "counter", "Blocks the restore verb copied out to the client."),
    PoolMetric("lent_bytes", "lent_bytes", "counter",
               "Bytes inline restores sent straight from tier memory (no copy; not in copy_bytes)."),
    PoolMetric("copy_failures", "copy_failures", "counter",
               "Copies (any direction) that failed after they were started; their op failed."),
    PoolMetric("remote_fetch_short", "remote_fetch_short", "counter",
               "Remote fetches that returned fewer blocks than the probe had promised."),
    PoolMetric("remote_write_backs", "remote_write_backs", "counter",
               "CPU-tier evictions queued for write-back to the remote tier."),
    PoolMetric("cpu_adopted_blocks", "adopted_blocks", "counter",
               "Blocks this daemon adopted from the persistent CPU tier its predecessor left (a restart, "
               "crash or upgrade) and verified: served as if stored here."),
    PoolMetric("cpu_adoption_dropped_blocks", "adoption_dropped_blocks", "counter",
               "Blocks of that CPU tier dropped at adoption, never served: torn records, checksums that "
               "failed, blocks a smaller tier had no room for, blocks evicted before they were verified."),
    PoolMetric("cpu_adoption_pending_blocks", "adoption_pending_blocks", "gauge",
               "Adopted blocks not verified yet (each is verified before it is served)."),
    PoolMetric("disk_fetch_short", "disk_fetch_short", "counter",
               "Disk-tier reads that returned fewer blocks than asked (a block bad, unreadable, or no CPU room)."),
    PoolMetric("disk_write_backs", "disk_write_backs", "counter",
               "CPU-tier evictions the disk tier took (queued for writing, or already on disk)."),
    *(PoolMetric(f"bytes_{d}", "copy_bytes", "counter", "Bytes copied, by direction: " +
                 "; ".join(f"{k} = {v}" for k, v in _DIRECTIONS.items()) + ".", (("direction", d),))
      for d in _DIRECTIONS),
    *(PoolMetric(f"seconds_{d}", "copy_seconds", "counter",
                 "Seconds from submitting each copy to its completion (queueing included), summed over "
                 "copies, by direction.",
                 (("direction", d),)) for d in _DIRECTIONS),
    PoolMetric("gpu_blocks", "capacity_blocks", "gauge", "Block slots of each tier.", (("tier", "gpu"),)),
    PoolMetric("cpu_blocks", "capacity_blocks", "gauge", "", (("tier", "cpu"),)),
    PoolMetric("gpu_cached_blocks", "cached_blocks", "gauge",
               "Blocks a lookup can find by hash (GPU: referenced or evictable; CPU: every occupied slot).",
               (("tier", "gpu"),)),
    PoolMetric("cpu_used_blocks", "cached_blocks", "gauge", "", (("tier", "cpu"),)),
    PoolMetric("held_blocks", "held_blocks", "gauge",
               "Distinct blocks the pool holds, in any tier (a block in both tiers counts once)."),
    PoolMetric("policy_keys", "policy_keys", "gauge",
               "Block keys the CPU tier's eviction policy holds state for, resident or not (its history, "
               "ghosts, streams' chains): bounded by the pool's size, whatever the traffic."),
    PoolMetric("pinned_blocks", "pinned_blocks", "gauge",
               "Block pins held by sessions, both tiers (a block pinned by two sessions counts twice)."),
    PoolMetric("copies_in_flight", "copies_in_flight", "gauge", "Copies started and not yet finished."),
    PoolMetric("sessions", "pool_sessions", "gauge", "Live sessions using the pool."),
    PoolMetric("block_bytes", "block_bytes", "gauge", "Bytes of one block of the pool (all layers, K and V)."),
)

# Occupancy is derived (not a stats key): kvtier_blocks{pool, tier, state="used|free"}.
BLOCKS_HELP = ("Block slots by state; used + free = capacity. GPU: used = referenced by requests, pins or "
               "copies; free = on the free queue (empty, or cached and evictable). CPU: used = occupied "
               "slots; free = empty slots.")

# Daemon counters that must exist from the first scrape, before their first
# event (labelled ones as families without series until then).
DAEMON_DEFAULTS: dict[str, Any] = {
    "requests_total": {},
    "errors_total": {},
    "protocol_errors_total": {},
    "request_seconds_total": {},
    "lease_expiries_total": 0,
    "replies_dropped_total": {},
    "heap_trims_total": 0,
    "pools_reclaimed_total": {},
    "reply_bytes_unsent": 0,
    "reply_bytes_lent": 0,
    "unread_connections_shut_total": 0,
    "hints_retain_refused_total": 0,
    "pins_after_release_total": 0,
    "connections": 0,
    "connections_busiest_peer": 0,
    "connections_refused_total": {},
    "sessions": 0,
    "auth_failures_total": 0,
    "auth_refused_total": 0,
    "requests_in_flight": 0,
    "learn_backlog_keys": 0,
    "lends_granted_total": 0,
    "lends_released_total": 0,
    "lends_expired_total": 0,
    "lends_dropped_total": 0,
    "lends_held": 0,
    "lends_held_bytes": 0,
}
DAEMON_HELP: dict[str, str] = {
    "requests_total": "Requests that passed validation, by verb.",
    "errors_total": "Error replies sent, by error code name.",
    "protocol_errors_total": "Requests refused before any handler ran (malformed, bad field, ...), by error code name.",
    "request_seconds_total": "Seconds from receiving to answering successful requests, by verb.",
    "lease_expiries_total": "Sessions ended because their lease ran out (a crashed or stalled client).",
    "replies_dropped_total": "Replies that could not be sent: reason=full (the connection's queue held SNDHWM replies it had not read) or gone (the connection was gone).",
    "heap_trims_total": "Times the daemon gave freed heap back to the kernel after a backlog of copied replies drained.",
    "reply_bytes_unsent": "Payload bytes of replies handed to the socket and not yet sent (per connection at most max_unread_reply_bytes; copies, all connections together, max_unread_reply_bytes_total).",
    "reply_bytes_lent": "Bytes of tier memory lent to unsent zero-copy replies (those blocks can be neither evicted nor reused).",
    "unread_connections_shut_total": "Client connections shut down because a session ended with lent replies still unread on them.",
    "pools_reclaimed_total": "Pools without sessions closed with their blocks: reason=memory (a new pool needed the room) or idle (pool_idle_ttl_s).",
    "hints_retain_refused_total": "retain_s hints dropped because the session already retained its share of the pool.",
    "pins_after_release_total": "Pinning requests under a pin tag sent before the tag's release and read after it (a connection the client gave up): answered without pinning.",
    "connections": "Client connections admitted now (at most max_connections).",
    "connections_busiest_peer": "Connections of the peer (uid on ipc, IP address on tcp) that holds the most (at most max_connections_per_peer).",
    "connections_refused_total": "Connections closed as they were accepted: reason=total (max_connections) or peer (max_connections_per_peer).",
    "sessions": "Live sessions, all pools (at most max_sessions).",
    "auth_failures_total": "hellos whose tenant token was wrong.",
    "auth_refused_total": "hellos with a token refused untried: their peer used up max_auth_failures_per_minute.",
    "requests_in_flight": "Requests waiting for their copies to finish.",
    "learn_backlog_keys": "Block keys counted but not yet fed to the CPU-tier policy (its bookkeeping waits for idle moments).",
    "lends_granted_total": "Restores answered with a lend: CPU-tier blocks a same-user client copied itself from its mapping of the tier's file.",
    "lends_released_total": "Lends their client ended (release_lends, or along with its next restore).",
    "lends_expired_total": "Lends ended by their lease (lend_lease_s): a client that did not release them in time.",
    "lends_dropped_total": "Lends ended with their session (a bye, a dead client) or the daemon's stop.",
    "lends_held": "Lends held now: their blocks can be neither evicted nor overwritten.",
    "lends_held_bytes": "Bytes of CPU-tier blocks held by lends now.",
}


# The ``tenants`` map of ``stats`` (daemons with tenants): (key, kind, help), exported
# as kvtier_tenant_<key>{tenant}; hit_blocks as kvtier_tenant_hit_blocks_total{tenant, tier}.
TENANT_METRICS: tuple[tuple[str, str, str], ...] = (
    ("looked_up_blocks", "counter", "Blocks a tenant's counted lookups and allocations asked for, all pools."),
    ("cpu_resident_bytes", "gauge", "Bytes of a tenant's blocks in the CPU tiers."),
    ("cpu_resident_blocks", "gauge", "A tenant's blocks in the CPU tiers."),
    ("cpu_quota_bytes", "gauge", "A tenant's CPU-tier quota (absent: none)."),
    ("dropped_demotions", "counter", "A tenant's demotions dropped at its quota."),
    ("refused_stores", "counter", "A tenant's stores refused at its quota."),
)


# The disk tier (a pool's stats["disk"], kvtier.tiers.disk_tier.COUNTERS): family -> (kind, help, labels);
# each series is one stats key (_DISK_SERIES). Exported as kvtier_disk_<family>{pool, ...}.
_DISK_FAMILIES: dict[str, tuple[str, str, tuple[tuple[str, str], ...]]] = {
    "up": ("gauge", "1 when the pool's disk tier is open and no I/O error made it rest; 0 when not (absent: no "
                    "disk tier).", ()),
    "read_blocks": ("counter", "Blocks read from the disk tier and verified (checksum), into the CPU tier.", ()),
    "read_bytes": ("counter", "Bytes of those blocks.", ()),
    "written_blocks": ("counter", "Blocks written to the disk tier and made durable.", ()),
    "written_bytes": ("counter", "Bytes of those blocks.", ()),
    "dropped_write_backs": ("counter", "CPU-tier evictions the disk tier did not write: reason=full (its queue "
                                       "was full), unavailable (not open, or resting after an error), not_admitted "
                                       "(the policy's +admit2).", (("reason", ""),)),
    "errors": ("counter", "Disk-tier blocks lost to an error, by kind: read (EIO...), write (EIO, ENOSPC...), "
                          "checksum (read back wrong: never served).", (("kind", ""),)),
    "evicted_blocks": ("counter", "Disk-tier blocks evicted (LRU) to make room for newer ones.", ()),
    "adopted_blocks": ("gauge", "Blocks the disk tier found on disk, complete, when it opened (a restart or "
                                "reboot).", ()),
    "torn_records": ("gauge", "Records found torn when the disk tier opened (a kill while writing one): "
                              "their blocks are dropped, never served.", ()),
}
# (family, stats key, label value or "")
_DISK_SERIES: tuple[tuple[str, str, str], ...] = (
    ("read_blocks", "disk_hits", ""), ("read_bytes", "bytes_read", ""),
    ("written_blocks", "writes_done", ""), ("written_bytes", "bytes_written", ""),
    ("dropped_write_backs", "writes_dropped_full", "full"),
    ("dropped_write_backs", "writes_dropped_unavailable", "unavailable"),
    ("dropped_write_backs", "writes_not_admitted", "not_admitted"),
    ("errors", "read_errors", "read"), ("errors", "write_errors", "write"), ("errors", "disk_corrupt", "checksum"),
    ("evicted_blocks", "evictions", ""), ("adopted_blocks", "adopted_blocks", ""),
    ("torn_records", "torn_records", ""),
)


def _add_disk(families: Mapping[str, Any], blocks: Any, labels: list[str], disk: Mapping[str, Any]) -> None:
    families["up"].add_metric(labels, 1.0 if disk.get("available") else 0.0)
    for fam, key, label in _DISK_SERIES:
        value = disk.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            families[fam].add_metric([*labels, label] if label else labels, value)
    cap, used = int(disk.get("capacity_blocks", 0)), int(disk.get("used_blocks", 0))
    blocks.add_metric([*labels, "disk", "used"], used)
    blocks.add_metric([*labels, "disk", "free"], cap - used)


def _parse_label_key(label_key: str) -> dict[str, str]:
    # Counters.snapshot() spells labels "k=v,k2=v2"; our label values (verbs,
    # error code names) never contain "," or "=".
    out: dict[str, str] = {}
    for part in label_key.split(","):
        k, _, v = part.partition("=")
        out[k] = v
    return out


class StatsCollector:
    """A prometheus-client collector over one ``StatsSnapshot``: see the module docstring."""

    def __init__(self, snapshot: StatsSnapshot, *, wait_s: float = DEFAULT_WAIT_S) -> None:
        self.snapshot = snapshot
        self.wait_s = wait_s

    def describe(self) -> list[Any]:
        # Empty: registering must not call collect() (which would wait for the loop).
        return []

    def collect(self) -> Iterator[Any]:
        stats, age_s = self.snapshot.get(self.wait_s)
        yield from families_from_stats(stats, age_s)


def families_from_stats(stats: Stats | None, age_s: float = 0.0) -> list[Any]:
    """Metric families for one ``stats`` reply (``None``: only the age, which is then +Inf)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    families: dict[str, Any] = {}

    def family(name: str, kind: str, help_text: str, labels: list[str]) -> Any:
        fam = families.get(name)
        if fam is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = families[name] = cls(f"kvtier_{name}", help_text or name, labels=labels)
        return fam

    age = GaugeMetricFamily("kvtier_stats_age_seconds",
                            "Age of the daemon-loop snapshot behind this scrape (large: the loop did not answer).")
    age.add_metric([], age_s)
    out: list[Any] = [age]
    if stats is None:
        return out

    pools: Mapping[str, Mapping[str, Any]] = stats.get("pools") or {}
    # With tenants the stats keys are "<tenant>/<name>" and each pool says its
    # tenant and bare name: those become the labels, so dashboards group by
    # pool name and tenants' same-named pools are still separate series.
    per_tenant = any("tenant" in p for p in pools.values())
    pool_label_names = ["pool", "tenant"] if per_tenant else ["pool"]

    def pool_labels(key: str) -> list[str]:
        p = pools[key]
        return [str(p.get("name", key)), str(p.get("tenant", ""))] if per_tenant else [key]

    helps: dict[str, str] = {}
    for spec in POOL_METRICS:
        helps.setdefault(spec.name, spec.help)
    for spec in POOL_METRICS:
        label_names = [*pool_label_names, *(k for k, _ in spec.labels)]
        fam = family(spec.name, spec.kind, helps[spec.name], label_names)
        for pool_name in sorted(pools):
            value = pools[pool_name].get(spec.key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # a key this pool lacks (no transfer engine, older daemon)
            fam.add_metric([*pool_labels(pool_name), *(v for _, v in spec.labels)], value)

    blocks = family("blocks", "gauge", BLOCKS_HELP, [*pool_label_names, "tier", "state"])
    up = family("remote_up", "gauge",
                "1 when the pool's remote tier is reachable, 0 when not (absent: no remote tier).", pool_label_names)
    rejected = family("remote_rejected_blocks", "counter",
                      "Values the remote tier fetched and refused to serve (misses), by reason: unauthentic (a "
                      "wrong MAC: copied from another key, forged, or another secret's), oversized (longer than a "
                      "block: never read past one byte), corrupt (too short or malformed).",
                      [*pool_label_names, "reason"])
    attached = family("gpu_attached", "gauge",
                      "1 when the pool has a GPU tier (store mode: always; engine mode: while the engine's KV "
                      "tensors are registered).", pool_label_names)
    info = family("pool_info", "gauge", "Always 1; the labels say the pool's mode (store or engine).",
                  [*pool_label_names, "mode"])
    disk_families = {name: family(f"disk_{name}", kind, help_text, [*pool_label_names, *(k for k, _ in labels)])
                     for name, (kind, help_text, labels) in _DISK_FAMILIES.items()}
    for pool_name in sorted(pools):
        p = pools[pool_name]
        labels = pool_labels(pool_name)
        gpu_blocks, gpu_free = int(p.get("gpu_blocks", 0)), int(p.get("gpu_free_blocks", 0))
        cpu_blocks, cpu_used = int(p.get("cpu_blocks", 0)), int(p.get("cpu_used_blocks", 0))
        blocks.add_metric([*labels, "gpu", "used"], gpu_blocks - gpu_free)
        blocks.add_metric([*labels, "gpu", "free"], gpu_free)
        blocks.add_metric([*labels, "cpu", "used"], cpu_used)
        blocks.add_metric([*labels, "cpu", "free"], cpu_blocks - cpu_used)
        attached.add_metric(labels, 1.0 if p.get("mode") == "store" or p.get("gpu_registered") else 0.0)
        info.add_metric([*labels, str(p.get("mode", ""))], 1.0)
        disk = p.get("disk")
        if isinstance(disk, Mapping):
            _add_disk(disk_families, blocks, labels, disk)
        remote = p.get("remote")
        if isinstance(remote, Mapping):
            up.add_metric(labels, 1.0 if remote.get("available") else 0.0)
            for reason in _REMOTE_REJECTIONS:
                count = remote.get(f"remote_{reason}")
                if isinstance(count, int) and not isinstance(count, bool):
                    rejected.add_metric([*labels, reason], count)

    tenants: Mapping[str, Mapping[str, Any]] = stats.get("tenants") or {}
    if tenants:
        for key, kind, help_text in TENANT_METRICS:
            fam = family(f"tenant_{key}", kind, help_text, ["tenant"])
            for tenant in sorted(tenants):
                value = tenants[tenant].get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    fam.add_metric([tenant], value)
        hits = family("tenant_hit_blocks", "counter", "A tenant's looked-up blocks that hit, by the tier that held them.",
                      ["tenant", "tier"])
        for tenant in sorted(tenants):
            for tier, n in sorted((tenants[tenant].get("hit_blocks") or {}).items()):
                hits.add_metric([tenant, tier], n)

    daemon: dict[str, Any] = {**DAEMON_DEFAULTS, **(stats.get("daemon") or {})}
    if "sessions" not in (stats.get("daemon") or {}) and "sessions" in stats:
        daemon["sessions"] = stats["sessions"]
    for name in sorted(daemon):
        value = daemon[name]
        kind = "counter" if name.endswith("_total") else "gauge"
        if isinstance(value, Mapping):
            series = [(_parse_label_key(k), v) for k, v in sorted(value.items())]
            label_names = sorted({k for labels, _ in series for k in labels})
        else:
            series, label_names = [({}, value)], []
        base = name[: -len("_total")] if kind == "counter" else name
        fam = family(base, kind, DAEMON_HELP.get(name, f"daemon counter {name}"), label_names)
        for labels, v in series:
            fam.add_metric([labels.get(k, "") for k in label_names], v)
    return out + list(families.values())
