"""Caps on client connections, per peer and in total, enforced as libzmq accepts them.

libzmq accepts every connection that reaches the ROUTER socket, on its own
I/O thread, and offers no per-peer refusal. Past the process's descriptor
limit an ipc accept fails with EMFILE and libzmq aborts the process. So the
daemon watches the socket's connection events and shuts down the
connections past its caps, fast enough that a flood stays inside the room
``daemon.access.descriptors`` leaves for it.

Contract:

- ``ConnectionGuard.start(zctx, sock, limits)``, before ``sock.bind``:
  monitors ``sock`` (``ZMQ_EVENT_ACCEPTED`` / ``ZMQ_EVENT_DISCONNECTED``,
  each carrying the connection's descriptor) on its own thread, so the
  shedding does not wait for the event loop to finish a request. Nor does
  it wait on the loop for the GIL between its steps: it reads the events and
  makes its system calls through ``daemon.access.gil_held``, which keeps the GIL, so
  a woken guard takes the GIL once (at most a switch interval, 5 ms, behind
  a busy loop) and sheds every connection queued by then in one go. Letting
  go of the GIL at each call, it shed a few hundred connections a second
  beside a busy loop, and a flood made libzmq abort the daemon.
- A connection's **peer** is the uid of the process at the other end on
  ``ipc://`` (``SO_PEERCRED``: the kernel vouches for it) and the remote IP
  address on ``tcp://`` (CURVE keys are only known after the handshake; a
  peer behind NAT shares its address). A connection is *admitted* while
  fewer than ``max_connections`` are admitted and its peer has fewer than
  ``max_connections_per_peer``; else it is *refused*, counted in
  ``refused_total[reason]`` (``"total"`` or ``"peer"``).
- A refused connection is held open for ``REFUSAL_GRACE_S``, so that the
  request it sends gets a ``TOO_MANY_CONNECTIONS`` reply naming the cap
  (the loop asks ``refusal(frame)`` for each request while any is held),
  then shut down (``daemon.access.connections.shut_down_now``: no spare descriptor
  needed, so shedding works at the limit). At most
  ``MAX_HELD_REFUSALS`` are held at once; the others are shut down at once,
  so their clients see only their own timeout. A client's DEALER
  reconnects by itself, and is admitted once the daemon is under its caps.
- ``open_connections``: the connections libzmq holds now (admitted and
  refused ones not shut yet).
- ``publish(metrics)`` (loop thread): the gauges ``connections`` (admitted),
  ``connections_busiest_peer`` (the most any one peer holds) and the
  counter ``connections_refused_total{reason}``.
- One warning per ``LOG_EVERY_S`` at most, with the counts: a flood does not
  flood the log.
- ``stop()``: ends the thread and closes the monitor socket; call it before
  the ROUTER socket is closed and the context terminated.

The two threads share only dicts and ints: the loop reads, the guard's
thread writes, each single operation atomic under the GIL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import zmq

from kvtier.daemon.access import gil_held
from kvtier.daemon.access.connections import Connection, Peer, connection_of, shut_down_now
from kvtier.daemon.telemetry.metrics import Counters

log = logging.getLogger(__name__)

REFUSAL_GRACE_S = 1.0
MAX_HELD_REFUSALS = 64
LOG_EVERY_S = 10.0
_IDLE_POLL_MS = 200
# The inproc pipe's bound is the sum of both ends' high-water marks: libzmq's own monitor
# socket's SNDHWM (the default 1000; libzmq offers no way to set it) and this.
_MONITOR_RCVHWM = 1
MONITOR_LAG_EVENTS = 1000 + _MONITOR_RCVHWM
# Then the guard looks at its held refusals before it reads on (a flood never starves them).
_EVENTS_PER_BATCH = 4096


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    max_connections_per_peer: int

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_connections_per_peer < 1:
            raise ValueError(f"connection limits must be at least 1, got {self}")


@dataclass(slots=True)
class _Live:
    conn: Connection
    peer: Peer
    refused_until_s: float | None = None  # a held refusal: shut down at this monotonic time
    refusal: str = ""


def _describe(peer: Peer) -> str:
    if isinstance(peer, int):
        return f"uid {peer}"
    return f"address {peer}" if peer is not None else "an unknown peer"


class ConnectionGuard:
    """See the module docstring."""

    def __init__(self, monitor: zmq.Socket, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._monitor = monitor
        self._events = gil_held.MonitorEvents(monitor)
        if not self._events.gil_held:
            log.warning("connection guard: libzmq not found among the loaded libraries; reading connection events "
                        "through pyzmq, which lets go of the GIL: a flood beside a busy loop may outrun the guard")
        self._live: dict[int, _Live] = {}  # by descriptor: libzmq reuses a number only after its DISCONNECTED
        self._per_peer: Counter[Peer] = Counter()
        self._admitted = 0
        self._held = 0
        self.refused_total: Counter[str] = Counter({"total": 0, "peer": 0})
        self._unlogged: Counter[str] = Counter()
        self._next_log_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtierd-connections", daemon=True)

    @classmethod
    def start(cls, zctx: zmq.Context, sock: zmq.Socket, limits: ConnectionLimits) -> ConnectionGuard:
        address = f"inproc://kvtierd-connections-{id(sock):x}"
        sock.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        monitor = zctx.socket(zmq.PAIR)
        # Backpressure: libzmq's I/O thread sends each event with a blocking send, so with a
        # bounded pipe it stops (accepting too) while MONITOR_LAG_EVENTS events wait for this
        # thread, whatever the scheduler does to it. No event is ever lost either: a lost
        # DISCONNECTED would count a connection forever.
        monitor.setsockopt(zmq.RCVHWM, _MONITOR_RCVHWM)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        guard = cls(monitor, limits)
        guard._thread.start()
        return guard

    # ---- the loop thread -----------------------------------------------------

    def refusal(self, frame: object) -> str | None:
        """The TOO_MANY_CONNECTIONS message for a request that came on a held refused connection, else None."""
        if not self._held:
            return None
        conn = connection_of(frame)
        live = self._live.get(conn.fd) if conn is not None else None
        if live is None or live.refused_until_s is None or live.conn != conn:
            return None
        return live.refusal

    @property
    def open_connections(self) -> int:
        return len(self._live)

    def publish(self, metrics: Counters) -> None:
        metrics.set("connections", self._admitted)
        per_peer = list(self._per_peer.values())
        metrics.set("connections_busiest_peer", max(per_peer, default=0))
        for reason, n in list(self.refused_total.items()):
            metrics.set("connections_refused_total", n, reason=reason)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._monitor.close()

    # ---- the guard's thread ------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            timeout_ms = _IDLE_POLL_MS
            if self._held:
                timeout_ms = 20  # refusals to shut down soon
            try:
                # The only wait that lets go of the GIL; the events then come in without.
                if self._monitor.poll(timeout_ms):
                    for _ in range(_EVENTS_PER_BATCH):
                        ev = self._events.next()
                        if ev is None:
                            break
                        event, fd = ev
                        try:
                            self._on_event(event, fd)
                        except Exception:  # one bad event must not end the guard: it would admit all
                            log.exception("connection guard: event %d on descriptor %d", event, fd)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            now_s = time.monotonic()
            if self._held:
                self._shut_expired_refusals(now_s)
            if self._unlogged and now_s >= self._next_log_s:
                self._log_refusals(now_s)

    def _on_event(self, event: int, fd: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            live = self._live.pop(fd, None)
            if live is None:
                return
            if live.refused_until_s is None:
                self._admitted -= 1
                self._per_peer[live.peer] -= 1
                if self._per_peer[live.peer] <= 0:
                    del self._per_peer[live.peer]
            else:
                self._held -= 1
            return
        if event != zmq.EVENT_ACCEPTED:
            return
        cookie = gil_held.socket_cookie(fd)
        if cookie is None:
            return  # closed already: its DISCONNECTED is queued behind this
        conn = Connection(fd, cookie)
        # libzmq's I/O thread may close the descriptor at any moment (a client that connects and
        # drops at once): then there is no peer to name, and its DISCONNECTED event follows.
        peer = gil_held.peer_of(fd)
        reason = ""
        if self._admitted >= self.limits.max_connections:
            reason = "total"
            message = (f"the daemon holds {self._admitted} client connections, its max_connections; "
                       "close idle clients or ask the operator to raise it")
        elif self._per_peer[peer] >= self.limits.max_connections_per_peer:
            reason = "peer"
            message = (f"{_describe(peer)} holds {self._per_peer[peer]} connections to this daemon, its "
                       f"max_connections_per_peer; close idle sockets or ask the operator to raise it")
        if not reason:
            self._live[fd] = _Live(conn, peer)
            self._admitted += 1
            self._per_peer[peer] += 1
            return
        self.refused_total[reason] += 1
        self._unlogged[reason] += 1
        if self._held < MAX_HELD_REFUSALS:
            self._live[fd] = _Live(conn, peer, time.monotonic() + REFUSAL_GRACE_S, message)
            self._held += 1
        else:
            # Not recorded: its DISCONNECTED finds nothing to undo.
            shut_down_now(conn)

    def _shut_expired_refusals(self, now_s: float) -> None:
        for live in list(self._live.values()):
            if live.refused_until_s is not None and live.refused_until_s <= now_s:
                live.refused_until_s = now_s + REFUSAL_GRACE_S  # once more later if it outlives this
                shut_down_now(live.conn)

    def _log_refusals(self, now_s: float) -> None:
        counts = ", ".join(f"{n} past {'max_connections' if r == 'total' else 'max_connections_per_peer'}"
                           for r, n in sorted(self._unlogged.items()))
        busiest = self._per_peer.most_common(1)
        log.warning("refused client connections (%s); %d admitted (max_connections %d), busiest peer %s",
                    counts, self._admitted, self.limits.max_connections,
                    f"{_describe(busiest[0][0])} with {busiest[0][1]}" if busiest else "none")
        self._unlogged.clear()
        self._next_log_s = now_s + LOG_EVERY_S
