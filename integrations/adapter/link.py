"""An engine adapter's line to kvtierd: a Client that may come and go, connected off the request path.

Contract
========

``DaemonLink.call(fn)`` runs ``fn(client)`` and returns its result, or
``None`` when kvtierd cannot serve it now; it never raises a kvtier error
into the engine, and it never connects, reconnects or waits for a daemon that is
not up. A cache that is down must cost the engine a recompute, not an
error, and not a wait on any request's path:

- One background thread (``kvtier-link``) owns connecting: it sends
  ``hello`` (``on_connect`` then registers KV tensors) and, while the daemon
  is down, tries again every ``retry_s``. ``call`` only uses a link that is
  up; while it is not (never connected, or marked down) every call returns
  ``None`` at once, without touching a socket.
- The first attempt starts with the link; ``wait_first_attempt(timeout_s)``
  lets start-up code wait for it (a daemon that answers takes milliseconds;
  an ``ipc://`` socket file that does not exist fails at once, without a
  ``hello``). A daemon that is not there at the engine's start-up is not fatal.
- A call that times out or finds the transport broken marks the daemon
  down; the background thread takes over from there. That one call waited
  for its own deadline (a daemon may still act on a store or restore in
  flight until then: see docs/vllm.md, "A call given up is not run late");
  the calls after it do not.
- A daemon that restarted is found by the client itself (it opens a new
  session and re-registers the KV tensors): the call that finds out gets
  ``SessionLost``, counted as that call's miss; the link stays up.
- An error reply (``DaemonError``: no space, a refused layout, ...) is that
  call's failure only: ``None``, logged, the link stays up.

One log line per outage and one per recovery, not one per call. The first
line of an outage that starts before the daemon was ever reached names the
endpoint tried and how to find the daemon's own (``socket_setting``: the
engine's setting that names the socket). ``client_name`` is what the link's
``hello`` calls the engine. Thread-safe: the Client serialises its calls,
the link guards its own state.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.client.client import Client, DaemonError, KvtierError, PoolLayout, SessionLost
from kvtier.client.endpoint import ipc_socket_file

log = logging.getLogger("kvtier.integrations")

T = TypeVar("T")

HOW_TO_FIND = ("kvtierd logs the socket it serves at start-up ('kvtierd serving on ...'; for the unit: "
               "journalctl -u kvtierd@N), and `kvtierd --print-config`, run with the daemon's settings, prints it; "
               "set {socket_setting} (or $KVTIER_SOCKET) to it")


def missing_socket_file(endpoint: str) -> bool:
    """An ``ipc://`` endpoint whose socket file does not exist: no daemon can be listening there."""
    path = ipc_socket_file(endpoint)  # None for tcp:// and Linux's abstract namespace: nothing to look at
    return path is not None and not os.path.exists(path)


class DaemonLink:
    """See the module docstring."""

    def __init__(self, endpoint: str, pool: str, layout: PoolLayout, *, retry_s: float,
                 client_kwargs: dict[str, Any], on_connect: Callable[[Client], None] | None = None,
                 client_name: str = "engine", socket_setting: str = "the engine's kvtier socket setting") -> None:
        self.endpoint = endpoint
        self.pool = pool
        self._layout = layout
        self._retry_s = retry_s
        self._timeout_s = float(client_kwargs.get("timeout_s", 1.0))
        self._client_kwargs = client_kwargs
        self._on_connect = on_connect
        self._client_name = client_name
        self._socket_setting = socket_setting
        self._lock = threading.Lock()
        self._client: Client | None = None  # replaced only by the background thread
        self._up = False  # calls use the client only while this holds
        self._ever_up = False
        self._outage_logged = False
        self._wake = threading.Event()  # a call marked the daemon down, or close()
        self._first_attempt = threading.Event()
        self._closed = False
        self.failures = 0  # calls that returned None because of the daemon (skipped calls not counted)
        self.attempts = 0  # connection attempts by the background thread
        self._thread = threading.Thread(target=self._run, name="kvtier-link", daemon=True)
        self._thread.start()

    @property
    def client(self) -> Client | None:
        return self._client

    def is_up(self) -> bool:
        return self._up

    def wait_first_attempt(self, timeout_s: float) -> bool:
        """Wait (start-up only) until the first connection attempt ended; True if the link is up."""
        self._first_attempt.wait(timeout_s)
        return self._up

    def call(self, fn: Callable[[Client], T]) -> T | None:
        client = self._client if self._up else None
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
            self._mark_down(client, exc)
            return None
        return result

    def _mark_down(self, client: Client, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            if self._client is not client or not self._up:
                return  # another call marked it down already
            self._up = False
            self._log_outage(str(exc))
        self._wake.set()

    def _log_outage(self, why: str) -> None:
        if self._outage_logged:
            return
        self._outage_logged = True
        if self._ever_up:
            log.warning("kvtier: kvtierd at %s unavailable (%s); serving without it (the engine computes what it would "
                        "have loaded), reconnecting in the background every %.1f s", self.endpoint, why, self._retry_s)
        else:
            log.warning("kvtier: no kvtierd answering at %s (%s); serving without it (the engine computes every "
                        "block), connecting in the background every %.1f s. Is kvtierd on another socket? %s",
                        self.endpoint, why, self._retry_s, HOW_TO_FIND.format(socket_setting=self._socket_setting))

    # ---- the background thread -------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            if not self._up:
                self._attempt()
                self._first_attempt.set()
                if self._up or self._closed:
                    continue
                self._wake.wait(self._retry_s)
                self._wake.clear()
            else:
                self._wake.wait()
                self._wake.clear()

    def _attempt(self) -> None:
        """One try at an up link: a new client, or the old one asked whether its daemon answers again."""
        self.attempts += 1
        if missing_socket_file(self.endpoint):
            with self._lock:
                self._log_outage("no socket file there")
            return
        client = self._client
        try:
            if client is None:
                client = Client(self.endpoint, self.pool, self._layout, client_name=self._client_name,
                                **self._client_kwargs)
                try:
                    if self._on_connect is not None:
                        self._on_connect(client)
                except BaseException:
                    client.close(timeout_s=0.1)
                    raise
            else:
                # The client reopens its session (and re-registers) by itself if the daemon restarted.
                client.heartbeat(timeout_s=self._timeout_s)
        except SessionLost as exc:
            log.warning("kvtier: kvtierd at %s restarted; %d pins of the old session are gone", self.endpoint, len(exc.lost_pins))
        except Exception as exc:  # a refusal, a timeout, a registration that failed: this thread must go on
            with self._lock:
                self._log_outage(str(exc) if isinstance(exc, (KvtierError, OSError)) else f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            if self._closed:
                client.close(timeout_s=0.1)
                return
            self._client = client
            if self._ever_up:
                log.info("kvtier: kvtierd at %s answers again; pool %s", self.endpoint, self.pool)
            else:
                log.info("kvtier: connected to kvtierd at %s, pool %s", self.endpoint, self.pool)
            self._ever_up = True
            self._outage_logged = False
            self._up = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._up = False
            client, self._client = self._client, None
        self._wake.set()
        self._thread.join(self._timeout_s + 1.0)
        self._first_attempt.set()
        if client is not None:
            client.close()
