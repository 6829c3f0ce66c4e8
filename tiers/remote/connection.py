"""A remote tier's link to Redis / Valkey: the URL, one client, and whether it may be used now.

``RemoteTier`` (kvtier.tiers.remote.tier) moves blocks; this module decides
which client it moves them over and when not to try at all. It knows no
keys, values or counters of blocks.

Contract:

- ``parse_url(url) -> Endpoint``: ``kvtier.tiers.remote.url``'s (re-exported
  here): the mode (one server or a Cluster), nodes and credentials; a URL
  no client could use raises ``RemoteTierError``.
- ``RemoteConnection(endpoint, settings)`` makes one synchronous connect
  attempt (a healthy server is usable on return; a dead one costs at most
  ``settings.connect_timeout_s``) and never raises for an unreachable
  server: it starts unavailable. A health thread (``kvtier-remote-health``)
  reconnects with exponential backoff (``retry_initial_s`` doubling up to
  ``retry_max_s``, +-``retry_jitter_fraction``) and, while available, pings
  every ``health_interval_s`` unless traffic proved the server alive within
  that time. A connect counts only once the server (Cluster: every primary,
  and ``cluster_state:ok``) answers.
- ``current() -> (client, generation) | None``: the client to use now;
  None while unavailable (the caller answers "miss" or drops, without
  touching the network). Every (re)connect is a new generation.
- The caller reports each round trip: ``succeeded()``, or
  ``failed(exc, generation, what)``. A connection-level failure
  (``is_connection_failure``: refused, reset, timeout, CLUSTERDOWN,
  uncovered slot) of the current generation marks the connection
  unavailable (``unavailable_events``, one warning per outage) and wakes
  the health thread; a stale generation changes nothing (a newer client
  took over), and a per-command error (OOM refusal, WRONGTYPE) is only
  logged.
- ``pipeline(client)``: a plain (non-transactional) pipeline of that client.
- ``available``, ``last_error`` (the latest failure, for stats/health),
  ``wait_available(timeout_s)``, ``counters()``: ``unavailable_events``
  (available -> unavailable) and ``reconnects`` (unavailable -> available
  after a loss).
- ``stop_connecting()``: no new client from now on (the owner is closing:
  what it still sends goes over the current client or nowhere).
  ``close()``: that, then stop the health thread and close the client.
- Thread safety: every method may be called from any thread. redis-py
  retries nothing (standalone) or once (Cluster, to refresh the slot map):
  a failure reaches the caller at once instead of stalling it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from kvtier.tiers.remote.settings import RemoteTierError, RemoteTierSettings
from kvtier.tiers.remote.url import Endpoint, parse_url

try:
    import redis
    import redis.cluster
    import redis.exceptions
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only where redis-py is absent
    redis = None  # type: ignore[assignment]

__all__ = ["COUNTERS", "Endpoint", "RemoteConnection", "is_connection_failure", "parse_url"]

log = logging.getLogger(__name__)

COUNTERS = (
    "unavailable_events",  # transitions available -> unavailable
    "reconnects",  # transitions unavailable -> available after a loss
)


def is_connection_failure(exc: BaseException) -> bool:
    """Does this error say "the server (or part of the cluster) is not there"?

    Those make the connection unavailable until a probe succeeds. Other
    server errors (OOM refusal of a SET, WRONGTYPE on a foreign key) are
    per-command and only counted.
    """
    if redis is None:
        return True
    if isinstance(exc, redis.exceptions.ClusterDownError):
        return True
    if isinstance(exc, redis.exceptions.ResponseError):
        return False
    # ConnectionError, TimeoutError, ClusterError, RedisClusterException
    # (e.g. slot not covered), OSError and anything unexpected.
    return True


class RemoteConnection:
    """One Redis/Valkey client and its availability. See the module docstring."""

    def __init__(self, endpoint: Endpoint, settings: RemoteTierSettings) -> None:
        if redis is None:
            raise RemoteTierError("the remote tier needs redis-py: pip install 'redis>=5'")
        self._endpoint = endpoint
        self.url = endpoint.display
        self.cluster = endpoint.cluster
        self.settings = settings
        self._lock = threading.Lock()  # guards the client state and the counters below
        self._counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._client: Any = None
        self._generation = 0  # bumped on every (re)connect; stale failures don't mark a fresh client down
        self._available = False
        self._ever_available = False
        self._connect_failures = 0  # consecutive, in the current outage
        self._last_error = ""
        self._last_ok_s = 0.0
        self._closed = False  # no new client from now on
        self._wake_health = threading.Event()
        self._stop = threading.Event()
        self._try_connect()
        self._health = threading.Thread(target=self._health_loop, name="kvtier-remote-health", daemon=True)
        self._health.start()

    @property
    def available(self) -> bool:
        return self._available

    @property
    def last_error(self) -> str:
        return self._last_error

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def wait_available(self, timeout_s: float) -> bool:
        """Block until the connection is available (tests, start-up); False on timeout or once closing."""
        deadline = time.monotonic() + timeout_s
        while not self._available:
            if self._closed or time.monotonic() >= deadline:
                return False
            self._wake_health.set()
            time.sleep(0.01)
        return True

    def current(self) -> tuple[Any, int] | None:
        with self._lock:
            if not self._available or self._client is None:
                return None
            return self._client, self._generation

    def pipeline(self, client: Any) -> Any:
        # transaction=False: plain pipelining, no MULTI (Cluster pipelines never are).
        return client.pipeline() if self.cluster else client.pipeline(transaction=False)

    def succeeded(self) -> None:
        self._last_ok_s = time.monotonic()

    def failed(self, exc: BaseException, generation: int, what: str) -> None:
        """A round trip failed: mark the connection unavailable if it is a connection failure."""
        if not is_connection_failure(exc):
            log.warning("remote tier %s: %s failed: %s", self.url, what, exc)
            return
        with self._lock:
            if generation != self._generation or not self._available:
                return  # already down, or a newer client took over: stale news
            self._available = False
            self._connect_failures = 1  # the warning below covers this outage
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._counters["unavailable_events"] += 1
        log.warning("remote tier %s: unavailable after %s failed (%s: %s); reconnecting in the background",
                    self.url, what, type(exc).__name__, exc)
        self._wake_health.set()

    def stop_connecting(self) -> None:
        with self._lock:
            self._closed = True

    def close(self) -> None:
        """No new client, stop the health thread, close the client."""
        self.stop_connecting()
        self._stop.set()
        self._wake_health.set()
        self._health.join(1.0)
        with self._lock:
            client, self._client = self._client, None
            self._available = False
        if client is not None:
            self._close_client(client)

    # ---- connecting -------------------------------------------------------------------------

    def _new_client(self) -> Any:
        ep = self._endpoint
        common: dict[str, Any] = dict(
            socket_timeout=self.settings.timeout_s,
            socket_connect_timeout=self.settings.connect_timeout_s,
            socket_keepalive=True,
            health_check_interval=0,
        )
        if not ep.cluster:
            # No retries inside redis-py: a failure must reach us at once so
            # the tier goes unavailable instead of stalling the caller.
            return redis.Redis.from_url(ep.url, retry=Retry(NoBackoff(), 0),
                                        max_connections=self.settings.max_connections, **common)
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in ep.nodes]
        # One retry lets redis-py refresh the slot map after a failover or
        # MOVED storm; more would multiply the stall on a dead node.
        return redis.cluster.RedisCluster(
            startup_nodes=nodes, retry=Retry(NoBackoff(), 1), require_full_coverage=True,
            max_connections=self.settings.max_connections, **common, **dict(ep.options),
        )

    def _probe(self, client: Any) -> None:
        """Raise unless the server (every cluster primary, and the cluster state) answers."""
        if not self._endpoint.cluster:
            client.ping()
            return
        client.ping(target_nodes=redis.cluster.RedisCluster.PRIMARIES)
        info = client.cluster_info()
        state = info.get("cluster_state") if isinstance(info, dict) else None
        if state != "ok":
            raise redis.exceptions.ClusterDownError(f"cluster_state is {state!r}")

    def _try_connect(self) -> bool:
        client = None
        try:
            client = self._new_client()
            self._probe(client)
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            self._connect_failures += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            # The first failure of an outage says why; the retries stay quiet.
            log.log(logging.WARNING if self._connect_failures == 1 else logging.DEBUG,
                    "remote tier %s: cannot connect (%s); retrying with backoff up to %.1fs",
                    self.url, self._last_error, self.settings.retry_max_s)
            if client is not None:
                self._close_client(client)
            return False
        with self._lock:
            if self._closed:
                self._close_client(client)
                return False
            old, self._client = self._client, client
            self._generation += 1
            self._available = True
            self._connect_failures = 0
            self._last_ok_s = time.monotonic()
            if self._ever_available:
                self._counters["reconnects"] += 1
            self._ever_available = True
        if old is not None:
            self._close_client(old)
        log.info("remote tier %s: available (%s)", self.url, "cluster" if self.cluster else "standalone")
        return True

    @staticmethod
    def _close_client(client: Any) -> None:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing a broken client may fail; nothing to do
            pass

    def _health_loop(self) -> None:
        settings = self.settings
        delay_s = settings.retry_initial_s
        while not self._stop.is_set():
            if not self._available:
                if self._try_connect():
                    delay_s = settings.retry_initial_s
                    continue
                jitter = 1.0 + settings.retry_jitter_fraction * (2.0 * random.random() - 1.0)
                self._stop.wait(delay_s * jitter)
                delay_s = min(settings.retry_max_s, delay_s * 2.0)
                continue
            self._wake_health.wait(settings.health_interval_s)
            self._wake_health.clear()
            if self._stop.is_set() or not self._available:
                continue
            if time.monotonic() - self._last_ok_s < settings.health_interval_s:
                continue  # traffic proved it alive recently
            current = self.current()
            if current is None:
                continue
            client, gen = current
            try:
                self._probe(client)
                self.succeeded()
            except Exception as exc:  # noqa: BLE001
                self.failed(exc, gen, "health check")
