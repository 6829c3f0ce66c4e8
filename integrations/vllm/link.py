"""The connector's line to kvtierd: a Client that may come and go.

Contract
========

``DaemonLink.call(fn)`` runs ``fn(client)`` and returns its result, or
``None`` when kvtierd cannot serve it now; it never raises a kvtier error
into vLLM. A cache that is down must cost the engine a recompute, not an
error, and not a stall on every step:

- The first call connects (``hello``; ``on_connect`` then registers KV
  tensors). A daemon that is not there at vLLM's start-up is tried again
  later, not fatal.
- A timeout or a broken session marks the daemon down: for ``retry_s``
  every call returns ``None`` at once, without touching the socket. The next
  call after that tries again; the Client reconnects by itself and opens a
  new session (re-registering the KV tensors) when the daemon restarted.
- An error reply (``DaemonError``: no space, a refused layout, ...) is that
  call's failure only: ``None``, logged, the link stays up.

One log line per outage and one per recovery, not one per call. Thread-safe:
the Client serialises its calls, the link guards its own state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.client.client import Client, DaemonError, KvtierError, PoolLayout, SessionLost

log = logging.getLogger("kvtier.integrations.vllm")

T = TypeVar("T")


class DaemonLink:
    def __init__(self, endpoint: str, pool: str, layout: PoolLayout, *, retry_s: float,
                 client_kwargs: dict[str, Any], on_connect: Callable[[Client], None] | None = None) -> None:
        self.endpoint = endpoint
        self.pool = pool
        self._layout = layout
        self._retry_s = retry_s
        self._client_kwargs = client_kwargs
        self._on_connect = on_connect
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._down_until_s = 0.0  # monotonic; calls before it return None at once
        self._down = False
        self.failures = 0  # calls that returned None because of the daemon

    @property
    def client(self) -> Client | None:
        return self._client

    def is_up(self) -> bool:
        return not self._down or time.monotonic() >= self._down_until_s

    def call(self, fn: Callable[[Client], T]) -> T | None:
        client = self._connected()
        if client is None:
            return None
        try:
            result = fn(client)
        except SessionLost as exc:
            # The daemon restarted: pins and in-flight work of the old session
            # are gone, the new session is ready. This call's answer is lost.
            log.warning("kvtier: kvtierd at %s restarted; %d pins of the old session are gone", self.endpoint, len(exc.lost_pins))
            self.failures += 1
            return None
        except DaemonError as exc:
            log.warning("kvtier: kvtierd refused a call: %s", exc)
            self.failures += 1
            return None
        except KvtierError as exc:
            self._mark_down(exc)
            return None
        self._mark_up()
        return result

    def _connected(self) -> Client | None:
        with self._lock:
            if self._down and time.monotonic() < self._down_until_s:
                return None
            if self._client is not None:
                return self._client
            try:
                client = Client(self.endpoint, self.pool, self._layout, client_name="vllm", **self._client_kwargs)
            except (KvtierError, OSError) as exc:
                self._mark_down_locked(exc)
                return None
            try:
                if self._on_connect is not None:
                    self._on_connect(client)
            except (KvtierError, OSError, ValueError) as exc:
                client.close()
                self._mark_down_locked(exc)
                return None
            self._client = client
            if self._down:
                log.info("kvtier: kvtierd at %s answers again; pool %s", self.endpoint, self.pool)
            else:
                log.info("kvtier: connected to kvtierd at %s, pool %s", self.endpoint, self.pool)
            self._down = False
            return client

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            self._mark_down_locked(exc)

    def _mark_down_locked(self, exc: BaseException) -> None:
        self.failures += 1
        if not self._down:
            log.warning("kvtier: kvtierd at %s unavailable (%s); serving without it (recompute), retrying every %.1f s",
                        self.endpoint, exc, self._retry_s)
        self._down = True
        self._down_until_s = time.monotonic() + self._retry_s

    def _mark_up(self) -> None:
        if self._down:
            with self._lock:
                if self._down:
                    log.info("kvtier: kvtierd at %s answers again", self.endpoint)
                    self._down = False

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
