"""The event loop: one ROUTER socket, one thread, a dispatch table.

Contract:

- ``Server.run()`` binds, serves until the stop flag is set, drains, and
  returns the exit code (0 after a clean drain).
- One loop on one thread polls the ROUTER socket and a wakeup socket (the
  transfer engines poke it when a copy finishes) with a timeout, so it also
  sweeps expired leases and feeds the systemd watchdog when idle.
- Every request is decoded and validated (``client.protocol``) before it
  reaches a handler; a bad one gets an error reply and a counter and changes
  nothing. Handlers come from ``daemon.handlers``: ``SESSION_HANDLERS`` get
  the session the server looked up (its errors answered here), ``OPEN_HANDLERS``
  none.
- Copies never run on the loop. A handler whose copies are in flight returns
  ``Pending``; the request is parked (``daemon.handling.parking``) and its reply sent
  from the loop when the pool reports the op done.
- Exactly one reply per request, carrying its id: every path through
  ``_handle`` ends in exactly one reply (``_send_ok`` / ``_send_error``,
  through ``daemon.handling.replies.ReplyQueue``) or one parking, and every parked
  request leaves the parking lot through exactly one reply.
- Identity: with CURVE configured (``ServeOptions.curve``) the socket is a
  CURVE server and a ZAP handler (``daemon.access.security``) admits only known
  client keys. Each request's connection User-Id is ``ctx.peer`` while it is
  handled; a session may be used only by the identity that opened it (any
  other gets UNKNOWN_SESSION). On ipc the session is also bound to the uid
  of the process that opened it (SO_PEERCRED of the connection each
  request came on, ``security.peer_uid``): a sid sent by another user gets
  FOREIGN_SESSION. Tenants (``ServeOptions.tenants``) are
  resolved at hello and applied by the handlers; a peer's wrong tokens are
  limited to ``max_auth_failures_per_minute`` (``daemon.access.auth_limits``).
- Sessions: at most ``max_sessions`` live (TOO_MANY_SESSIONS).
- Unread replies: the unsent payload of one connection's replies, and the
  payload its parked replies will carry once their copies finish, is capped
  (``max_unread_reply_bytes``: then UNREAD_REPLIES); so is the payload of
  all connections' copied replies (staging buffers: memory the daemon
  allocated, not lent tier memory) together: past
  ``max_unread_reply_bytes_total`` a request from a connection that has
  replies unread gets UNREAD_REPLIES too (one that has read everything is
  served: the total passes the cap by at most one reply per such
  connection). Once a backlog of copied replies has drained, the heap is
  given back to the kernel (``daemon.pooling.heap_trim``). Restore replies that
  lend tier memory (zero-copy: the blocks stay held until libzmq lets go of
  the frames) remember their session and the connection their request came
  on; a session that ends with such replies unsent has those connections
  shut down (``daemon.handling.replies``). The client's socket reconnects by itself
  (requests it had in flight on that connection get no reply: its own
  timeouts apply).
- Connections: ``daemon.access.connection_limits`` sheds connections past
  ``max_connections`` / ``max_connections_per_peer`` as libzmq accepts them;
  a request on a refused connection gets TOO_MANY_CONNECTIONS.
- Pools: a pool that a hello would create is checked first, idle pools
  reclaimed to make room, and idle ones closed after ``pool_idle_ttl_s``
  (``daemon.pooling.pool_admission``: NO_SPACE with the numbers when the host or the
  CPU budget cannot take its CPU tier, TOO_MANY_POOLS past ``max_pools``).
  With persistent CPU tiers (``ServeOptions.arenas``), ``run()`` re-creates
  the pools the previous daemon left, adopting their blocks, before it reads
  the first request (``daemon.pooling.pools``).
- The listening socket (``daemon.process.listener``): bound here, or inherited
  (``ServeOptions.listener``: systemd socket activation, or a
  predecessor's hand-over); libzmq gets a duplicate (``ZMQ_USE_FD``), so
  the daemon keeps a descriptor it can hand to a successor, and an
  inherited socket file is never removed.
- Hand-over (``daemon.process.upgrade``, ``daemon.process.handover``): SIGUSR2 starts a
  successor; once it is ready, new requests are held unanswered (health
  and stats still answer) while copies finish, the pools close (arenas
  kept), the sessions end; the successor adopts and serves; the held
  requests get SHUTTING_DOWN (they did not run: the client resends them,
  and the successor accepts the new connection) and ``run()`` returns 0
  without removing the socket file. With ``ServeOptions.successor`` this
  daemon is the successor: ``run()`` first waits for the predecessor to
  release (``Successor.take_over``), then adopts and binds the inherited
  socket.
- systemd: READY=1 once the socket is bound, WATCHDOG=1 from the loop at
  half of WatchdogSec (and between pinned chunks of a CPU tier being
  allocated), STATUS= lines (allocation progress; a summary at most once a
  second when it changed), STOPPING=1 when the drain starts.
- Drain (stop flag set): new requests get SHUTTING_DOWN (``health`` and
  ``stats`` still answer), parked requests get their replies as their copies
  finish, and whatever is still parked at ``drain_timeout_s`` gets a
  SHUTTING_DOWN error. Then sessions are released, pools closed, the socket
  closed with a bounded linger, and the ipc socket file removed (one this
  daemon, or a kvtierd before it, made: not systemd's).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvtier.client.endpoint import parse_ipc
from kvtier.client.protocol import (
    MAX_HEADER_BYTES,
    OPS,
    RESERVED_ID,
    ErrorCode,
    ProtocolError,
    ReplyMessage,
    Request,
    decode_request,
    error_reply,
    ok_reply,
    recoverable_id,
)
from kvtier.daemon.config import PoolSettings
from kvtier.daemon.access.connection_limits import ConnectionGuard, ConnectionLimits
from kvtier.daemon.access.auth_limits import AuthFailureLimiter
from kvtier.daemon.access.connections import Connection, connection_of, peer_of_frame
from kvtier.daemon.handling.replies import ReplyQueue
from kvtier.daemon.access.descriptors import FLOOD_ROOM_GUARANTEED_FDS, FdBudget, auto_per_peer
from kvtier.daemon.pooling.heap_trim import HeapTrimmer
from kvtier.daemon.handling.handler_context import LOOP_COPY_MAX_BYTES, HandlerContext, KvImporter, Reply
from kvtier.daemon.handlers import OPEN_HANDLERS, SESSION_HANDLERS
from kvtier.daemon.handling.stats_verbs import stats_fields
from kvtier.daemon.clients.lends import DEFAULT_LEASE_S as DEFAULT_LEND_LEASE_S
from kvtier.daemon.clients.lends import LendTable
from kvtier.daemon.process.handover import Successor
from kvtier.daemon.process.lifecycle import StopFlag
from kvtier.daemon.process.listener import Listener, bind_listener
from kvtier.daemon.access.log_limit import RateLimitedLog
from kvtier.daemon.pooling.memory import gib
from kvtier.daemon.telemetry.metrics import Counters
from kvtier.daemon.handling.parking import Parked, ParkingLot
from kvtier.daemon.pooling.pool_admission import PoolAdmission
from kvtier.daemon.pooling.pools import PoolRegistry
from kvtier.daemon.telemetry.prometheus import StatsSnapshot
from kvtier.daemon.handling.release import release_session
from kvtier.daemon.process.sd_notify import Notifier
from kvtier.daemon.access.security import CurveGuard, CurveOptions, peer_uid, peer_user_id
from kvtier.daemon.clients.sessions import Closeable, Session, SessionTable
from kvtier.daemon.process.standby import StandbyKeeper, StandbyWait
from kvtier.daemon.tenancy.tenants import TenantRegistry
from kvtier.daemon.process.upgrade import Upgrade
from kvtier.tiers.persistent_arena import ArenaDirectory
from kvtier.tiers.pool import NoSpace, NotFound, Op, PoolError
from kvtier.tiers.copy_types import DeadlinePassed
from kvtier.tiers.transfer import TransferEngine, TransferError, make_transfer_engine

log = logging.getLogger(__name__)

# Requests handled per loop turn before the loop looks at completions and
# leases again: keeps one flooding client from starving everything else.
MAX_MESSAGES_PER_TURN = 64
# With copies in flight the transfer engine's wakeup ends a poll early; the
# short timeout only bounds the cost of a lost wakeup.
BUSY_POLL_MS = 10
# At most this often a STATUS= line for systemd (only when it changed).
STATUS_EVERY_S = 1.0
# Policy bookkeeping runs between requests and gives way to any client that
# is waiting; past this many keys behind it stops giving way, so a loop that
# is never idle still learns (and the backlog's memory stays bounded).
MAX_LEARN_BACKLOG_KEYS = 1 << 16
# Before refusing a request for unread replies the loop waits for that connection's replies to be
# reported sent (ReplyQueue.settle: a reply its client has read can look unsent for milliseconds), at
# most this long per turn: clients that really do not read cost the loop no more than that.
UNREAD_SETTLE_S_PER_TURN = 0.01
# ZMQ_EVENTS is a plain int: masked with an int, not the IntFlag member (whose __and__ is ~1 us of Python).
_POLLIN = int(zmq.POLLIN)


@dataclass
class ServeOptions:
    """What the loop needs from the daemon's configuration."""

    endpoint: str
    device: str = "cpu"
    # (pool name, memory its persistent CPU tier's files already hold) -> its settings, sized (daemon.pooling.pool_admission)
    sizing_for: Callable[[str, int], PoolSettings] = field(
        default=lambda name, _reusable=0: PoolSettings(name, gpu_bytes=256 << 20, cpu_bytes=1 << 30))
    remote_secret: bytes | None = field(default=None, repr=False)  # pools' remote tiers' (remote_secret_key_file)
    # The loop's one test seam (kvtier.daemon.faults applies it; production leaves both as they are):
    # device -> each pool's copy engine, and the largest restore lent in place to a client's memory (0: none).
    transfer_factory: Callable[[str], TransferEngine] = make_transfer_engine
    lend_restore_max_bytes: int = LOOP_COPY_MAX_BYTES
    lease_s: float = 10.0  # also the longest lease a client may ask for
    heartbeat_s: float | None = None  # recommended to clients; None: lease_s / 3
    poll_interval_s: float = 0.1  # loop wakes at least this often when idle
    drain_timeout_s: float = 10.0
    max_payload_bytes: int = 256 << 20
    hash_algo: str | None = None  # None: pools may use any algorithm
    socket_mode: int = 0o600  # of the ipc socket file; 0o660 lets a group of engine users in
    curve: CurveOptions | None = None  # CURVE server keys and authorised clients; None: no CURVE
    tenants: TenantRegistry = field(default_factory=TenantRegistry)  # none configured: one anonymous tenant
    max_shm_files_per_session: int = 1024
    max_registrations_per_session: int = 64
    lend_lease_s: float = DEFAULT_LEND_LEASE_S
    max_pools: int = 128  # pools held at once; a hello that would create one more gets TOO_MANY_POOLS
    max_sessions: int = 4096  # live sessions at once; a hello past it gets TOO_MANY_SESSIONS
    max_auth_failures_per_minute: int = 10  # wrong tenant tokens one peer may send (daemon.access.auth_limits)
    max_pinned_share: float = 0.5  # pins a session (and a tenant) may hold, as a share of the pool's blocks
    cpu_budget_bytes: int | None = None  # all pools' CPU tiers together; None: no budget but host memory
    pool_idle_ttl_s: float = 3600.0  # a pool without sessions keeps its blocks this long
    max_unread_reply_bytes: int = 512 << 20  # payload bytes of replies one connection has not read
    max_unread_reply_bytes_total: int = 1 << 30  # copied payload of all connections' unread and parked replies
    max_connections: int | None = None  # client connections at once; None: a quarter of the descriptors (FdBudget)
    max_connections_per_peer: int | None = None  # of one uid (ipc) or IP address (tcp); None: auto_per_peer
    arenas: ArenaDirectory | None = None  # persistent CPU tiers (daemon.pooling.pools); None: private memory
    listener: Listener | None = None  # the listening socket, inherited (systemd, a predecessor); None: bind one
    successor: Successor | None = None  # this daemon takes over from the predecessor that started it
    standby_of: StandbyWait | None = None  # this daemon is a standby: it serves once that primary has exited
    standby: bool = False  # keep a standby kvtierd (upgrade_argv) that serves if this one dies (daemon.process.standby)
    upgrade_argv: Sequence[str] = ()  # what SIGUSR2 starts to take over (sys.orig_argv); empty: no upgrades
    upgrade_timeout_s: float = 300.0  # for a successor to get ready, and to serve after the release
    # The Prometheus endpoint (daemon.telemetry.metrics_endpoint), started once the daemon serves, closed when it stops
    # serving (a successor opens the port again).
    start_metrics: Callable[[StatsSnapshot], Closeable] | None = None


def _error_code_for(exc: BaseException) -> ErrorCode:
    if isinstance(exc, NoSpace):
        return ErrorCode.NO_SPACE
    if isinstance(exc, NotFound):
        return ErrorCode.NOT_FOUND
    if isinstance(exc, PoolError):
        return ErrorCode.INVALID_STATE
    if isinstance(exc, DeadlinePassed):
        return ErrorCode.DEADLINE_EXCEEDED
    if isinstance(exc, TransferError):
        return ErrorCode.TRANSFER_FAILED
    return ErrorCode.INTERNAL


def _message(exc: BaseException) -> str:
    # KeyError's str() adds quotes around its message.
    return exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)


class Server:
    """See the module docstring."""

    def __init__(self, options: ServeOptions, stop: StopFlag, *, kv_import: KvImporter,
                 notifier: Notifier | None = None) -> None:
        self.options = options
        self.stop = stop
        try:
            # The configuration checked max_connections against the same limit; this fails only
            # when raising the soft limit to the hard one did.
            self.fds = FdBudget.at_start(options.max_connections)
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
        max_connections = self.fds.connections
        self.connection_limits = ConnectionLimits(
            max_connections,
            options.max_connections_per_peer if options.max_connections_per_peer is not None
            else auto_per_peer(max_connections))
        self.notifier = notifier or Notifier(None)
        self.metrics = Counters()
        # Each op's two per-request series, named once (Counters.add): not a key built twice per request.
        self._op_series = {op: (Counters.series_key("requests_total", op=op),
                                Counters.series_key("request_seconds_total", op=op)) for op in OPS}
        # Refusals a client can cause at will: a line each up to a cap, then a count (daemon/access/log_limit.py).
        self._error_log = RateLimitedLog(log)
        # Other threads (the Prometheus endpoint) read stats only through this:
        # they ask, the loop builds a snapshot in _turn, they never touch pools.
        self.stats_snapshot = StatsSnapshot(self._wakeup)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.admission = PoolAdmission(
            configured_sizing=options.sizing_for,
            max_pools=options.max_pools,
            cpu_budget_bytes=options.cpu_budget_bytes,
            pool_idle_ttl_s=options.pool_idle_ttl_s,
            close_timeout_s=options.drain_timeout_s,
            metrics=self.metrics,
            notifier=self.notifier,
        )
        self.pools = PoolRegistry(
            device=options.device,
            sizing_for=self.admission.sizing_for,
            hash_algo=options.hash_algo,
            wakeup=self._wakeup,
            progress=self.admission.allocation_progress,
            policy_wrapper=options.tenants.policy_wrapper,
            arenas=options.arenas,
            close_timeout_s=options.drain_timeout_s,
            remote_secret=options.remote_secret,
            transfer_factory=options.transfer_factory,
        )
        self.admission.attach(self.pools)
        self.sessions = SessionTable(lambda session, reason: release_session(self.ctx, self.replies, session, reason),
                                     max_sessions=options.max_sessions)
        self.ctx = HandlerContext(
            pools=self.pools,
            sessions=self.sessions,
            metrics=self.metrics,
            kv_import=kv_import,
            default_lease_s=options.lease_s,
            max_lease_s=options.lease_s,
            heartbeat_s=options.heartbeat_s,
            max_payload_bytes=options.max_payload_bytes,
            detach_timeout_s=options.drain_timeout_s,
            tenants=options.tenants,
            max_shm_files_per_session=options.max_shm_files_per_session,
            max_registrations_per_session=options.max_registrations_per_session,
            max_pinned_share=options.max_pinned_share,
            max_shm_files_total=self.fds.shm_files,
            auth_failures=AuthFailureLimiter(options.max_auth_failures_per_minute),
            lend_restore_max_bytes=options.lend_restore_max_bytes,
            lends=LendTable(options.lend_lease_s),
        )
        self._parked = ParkingLot()  # requests whose copies are in flight
        # Replies libzmq has not sent yet: their buffers (lent tier memory, staging).
        self.replies = ReplyQueue(self.metrics, self._error_log)
        # Twice the largest reply (the buffers of clients that read stay mapped for the next request),
        # or half the daemon-wide cap (a backlog that reached it is worth giving back).
        self._heap = HeapTrimmer(min(2 * options.max_payload_bytes, options.max_unread_reply_bytes_total // 2),
                                 self.metrics)
        self._zctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None
        self.listener = options.listener
        self._metrics_endpoint: Closeable | None = None
        # A hand-over: requests held unanswered while it releases the tiers (identity, id, op, frames), then
        # every request redirected (SHUTTING_DOWN) until this daemon closes.
        self._holding = False
        self._redirecting = False
        self._held: list[tuple[bytes, int, str, list[Any]]] = []
        self.upgrade = Upgrade(self, argv=options.upgrade_argv, environ=lambda: os.environ,
                               listener=lambda: self.listener, notifier=self.notifier,
                               timeout_s=options.upgrade_timeout_s,
                               drain_timeout_s=options.drain_timeout_s) if options.upgrade_argv else None
        self._upgrade_fd: int | None = None  # the hand-over's control channel, while the poller watches it
        self.standby = StandbyKeeper(options.upgrade_argv, environ=lambda: os.environ,
                                     listener=lambda: self.listener) if options.standby and options.upgrade_argv else None
        self._curve_guard: CurveGuard | None = None
        self._connection_guard: ConnectionGuard | None = None
        ipc = parse_ipc(options.endpoint)
        self._ipc = ipc is not None  # peers have a uid (SO_PEERCRED)
        # An abstract socket has no file, hence no permissions: any local user
        # could connect. Without CURVE it serves the daemon's own user (and root).
        self._same_user_only = ipc is not None and ipc.abstract and options.curve is None
        self._next_status_s = 0.0
        self._sweep_every_s = min(0.1, options.lease_s / 10)
        self._next_sweep_s = 0.0
        self._settle_left_s = UNREAD_SETTLE_S_PER_TURN

    # ---- setup and teardown --------------------------------------------------

    def _wakeup(self) -> None:
        # Called from copy worker threads: a full socket buffer already means "wake up".
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def bind(self) -> None:
        self._zctx = zmq.Context()
        sock = self._zctx.socket(zmq.ROUTER)
        curve = self.options.curve
        if curve is not None:
            # The ZAP handler must run before the socket accepts a connection.
            self._curve_guard = CurveGuard.start(self._zctx, curve.keys)
            CurveGuard.apply(sock, curve.public, curve.secret)
        # A reply to a connection whose queue is full, or that is gone, fails instead of being
        # dropped without a word (daemon.handling.replies counts it); replies are sent NOBLOCK.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Above the soft limits, so that oversize requests get an error reply;
        # a frame above this makes libzmq drop the sender's connection.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * max(MAX_HEADER_BYTES, self.options.max_payload_bytes))
        sock.setsockopt(zmq.LINGER, 0)
        # Watching connections must start before the first one is accepted.
        self._connection_guard = ConnectionGuard.start(self._zctx, sock, self.connection_limits)
        if self.fds.small:
            log.warning("only %d file descriptors (RLIMIT_NOFILE): room for %d client connections, %d "
                        "shared-memory files and %d for a connection flood (under %d, a flood on a starved CPU "
                        "may outrun the connection guard); raise LimitNOFILE= (systemd) or ulimit -n",
                        self.fds.limit_fds, self.fds.connections, self.fds.shm_files, self.fds.flood_room_fds,
                        FLOOD_ROOM_GUARANTEED_FDS)
        endpoint = self.options.endpoint
        if self.listener is None:
            self.listener = bind_listener(endpoint, self.options.socket_mode)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        # libzmq takes a duplicate: it neither binds nor unlinks the endpoint, and closes only its own copy.
        zmq_fd = self.listener.for_zmq()
        try:
            sock.setsockopt(zmq.USE_FD, zmq_fd)
            sock.bind(endpoint)
        except BaseException:
            os.close(zmq_fd)
            raise
        self._sock = sock
        self.replies.attach(sock)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)

    def close(self, linger_s: float, *, remove_file: bool = True) -> None:
        """Close the socket (replies flush for ``linger_s``); ``remove_file``: the ipc socket file too, when a
        kvtierd made it (not after a hand-over, never systemd's)."""
        self._stop_metrics()
        if self._connection_guard is not None:
            self._connection_guard.stop()
            self._connection_guard = None
        if self._sock is not None:
            self._sock.close(linger=int(max(0.0, linger_s) * 1000))
            self._sock = None
        if self._curve_guard is not None:
            self._curve_guard.stop()
            self._curve_guard = None
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None
        if self.listener is not None:
            self.listener.close(remove_file=remove_file)
        self._wake_r.close()
        self._wake_w.close()

    # ---- the loop ------------------------------------------------------------

    def run(self) -> int:
        standby_of = self.options.standby_of
        if standby_of is not None:
            # Everything is ready but the socket and the CPU tiers: the primary serves them while it lives.
            takeover = standby_of.wait(self.stop)
            if takeover is None:
                return 0
            if self.listener is not None and takeover.owns_file:
                self.listener.own_file()
        successor = self.options.successor
        if successor is not None:
            # Everything is ready but the socket and the CPU tiers, which the predecessor still serves.
            released = successor.take_over(self.stop, self.options.upgrade_timeout_s)
            if released is None:
                successor.close()
                return 0 if self.stop.requested else 1
            if self.listener is not None and released.owns_file:
                self.listener.own_file()
        self.bind()
        # Everything built so far (torch and the other modules: ~170k objects)
        # lives as long as the process. Left to the cyclic GC, each full
        # collection walks all of it on the loop thread: a 0.2-0.3 s stall of
        # every client's requests. Frozen, full collections see only what the
        # loop made since.
        gc.freeze()
        # After the freeze (a pool adopted here is collected, its memory unmapped, when it closes) and before
        # the first request is read: no hello may create a pool whose arena is still to be adopted.
        self._adopt_arenas()
        self._start_metrics()
        log.info("kvtierd serving on %s (device %s, protocol v1)%s", self.options.endpoint, self.options.device,
                 f": took over from kvtierd pid {standby_of.primary_pid}, which died" if standby_of else "")
        if successor is not None:
            # The predecessor makes us systemd's main process (MAINPID=, READY=1) and exits.
            successor.serving()
        else:
            self.notifier.ready(f"serving on {self.options.endpoint}")
        if self.stop.upgrade_requested:
            log.warning("SIGUSR2 came during the start-up; ignored (send it again to upgrade)")
            self.stop.upgrade_requested = False
        while not self.stop.requested or (self.upgrade is not None and self.upgrade.releasing):
            self._turn()
            if self.upgrade is not None and self.upgrade.done:
                return self._handed_over()
        return self._drain()

    def _adopt_arenas(self) -> None:
        tenants = self.options.tenants
        self.pools.adopt_arenas(lambda t: t in set(tenants) if tenants.enabled else t == "")

    def _start_metrics(self) -> None:
        if self.options.start_metrics is not None and self._metrics_endpoint is None:
            self._metrics_endpoint = self.options.start_metrics(self.stats_snapshot)

    def _stop_metrics(self) -> None:
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
            self._metrics_endpoint = None

    def _upgrade_turn(self, now_s: float) -> None:
        """SIGUSR2 and the hand-over's next step (daemon.process.upgrade); the poller watches its control channel."""
        upgrade = self.upgrade
        if self.stop.upgrade_requested:
            self.stop.upgrade_requested = False
            if upgrade is None:
                log.warning("SIGUSR2: this daemon was started without a command to start a successor with; ignored")
            elif self.stop.requested or self.ctx.draining:
                log.warning("SIGUSR2 while stopping; ignored")
            else:
                upgrade.begin()
        if upgrade is None:
            return
        if self.stop.requested and not upgrade.releasing:
            upgrade.stop()
        upgrade.turn(now_s)
        self.ctx.lends.paused = upgrade.state != "idle"  # no new lend while a successor starts (daemon.clients.lends)
        fd = upgrade.fileno
        if fd != self._upgrade_fd:
            assert self._poller is not None
            if self._upgrade_fd is not None:
                self._poller.unregister(self._upgrade_fd)
            if fd is not None:
                self._poller.register(fd, zmq.POLLIN)
            self._upgrade_fd = fd

    # ---- the hand-over's hooks (daemon.process.upgrade.UpgradeHost) ------------------------

    def quiet(self) -> bool:
        # A lend still held is read by its client from tier memory the successor would write into.
        return not self._parked and not self.replies.lending and not len(self.ctx.lends)

    def shut_lent(self) -> None:
        n = self.replies.shut_lent()
        log.info("hand-over: shut down %d connections whose replies lent tier memory", n)

    def hold(self, on: bool) -> None:
        self._holding = on

    def redirect(self) -> None:
        self._holding = False
        self._redirecting = True
        self.ctx.draining = True

    def connections(self) -> int:
        return self._connection_guard.open_connections if self._connection_guard is not None else 0

    def release(self, deadline_s: float) -> bool:
        self.replies.release_sent()
        finished = self.pools.close_all(max(0.5, deadline_s - time.monotonic()))
        self.sessions.end_all("handed over")
        self.replies.release_sent()
        self._stop_metrics()
        # A reply still lending tier memory could be read from it after the successor wrote there.
        return not finished or self.replies.lending

    def readopt(self) -> None:
        self._adopt_arenas()
        self._start_metrics()

    def answer_held(self, shutting_down: bool) -> int:
        held, self._held = self._held, []
        for identity, rid, op, frames in held:
            if shutting_down:
                self._send_error(identity, rid, ErrorCode.SHUTTING_DOWN,
                                 "kvtierd handed its socket to a successor before this ran: resend it on a new "
                                 "connection", op=op)
            else:
                self._handle(frames)
        return len(held)

    def _handed_over(self) -> int:
        """The successor serves: flush the held requests' replies, close without removing the socket file."""
        self.replies.abandon()
        if self.standby is not None:
            self.standby.close("this daemon handed over to a successor")
        self.close(linger_s=1.0, remove_file=False)
        self.notifier.close()
        log.info("stopped: handed over to kvtierd pid %s", self.upgrade.handed_over_to if self.upgrade else "?")
        return 0

    def _turn(self, timeout_ms: int | None = None) -> int:
        """One poll and what follows it; returns the number of messages handled."""
        assert self._sock is not None and self._poller is not None
        if timeout_ms is None:
            idle_ms = int(self.options.poll_interval_s * 1000)
            busy = self._parked or self.replies.busy or self.pools.busy()
            timeout_ms = min(BUSY_POLL_MS, idle_ms) if busy else idle_ms
        events = dict(self._poller.poll(timeout_ms))
        self.replies.release_sent()  # before the requests: they may want those blocks
        self._settle_left_s = UNREAD_SETTLE_S_PER_TURN
        handled = 0
        if self._wake_r.fileno() in events:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        if self._sock in events:
            for _ in range(MAX_MESSAGES_PER_TURN):
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
                handled += 1
                # Asking costs less than the zmq.Again a drained socket raises.
                if not self._sock.getsockopt(zmq.EVENTS) & _POLLIN:
                    break
        self.pools.poll()
        self._deliver_done()
        self.replies.release_sent()
        if self.upgrade is not None or self.stop.upgrade_requested:
            self._upgrade_turn(time.monotonic())
        if self.standby is not None:
            # Never beside an upgrade's successor (both would claim the tiers if this daemon died), nor while stopping.
            upgrading = self.upgrade is not None and self.upgrade.state != "idle"
            self.standby.turn(time.monotonic(), refused="an upgrade's successor takes over instead" if upgrading
                              else "this daemon is stopping" if self.stop.requested or self.ctx.draining else "")
        self._heap.note(self.replies.copied_bytes + self._parked.reply_bytes_total, time.monotonic())
        # Policy bookkeeping off the reply path: it stops for a waiting request
        # or a client waiting on copies (whose threads need the GIL to finish),
        # unless it has fallen too far behind.
        backlog = self.pools.learn_backlog_keys()
        if backlog:
            self.pools.learn(self._clients_waiting if backlog <= MAX_LEARN_BACKLOG_KEYS else None)
        if not handled and not self._parked and not self.stop.requested:
            # Nothing asked this turn: demote ahead of the next long allocation (low priority, batched).
            self.pools.clean_when_idle()
        now_s = time.monotonic()
        if now_s >= self._next_sweep_s:
            self._next_sweep_s = now_s + self._sweep_every_s
            self.ctx.lends.expire()
            expired = self.sessions.sweep()
            if expired:
                self.metrics.inc("lease_expiries_total", len(expired))
            if self.replies.sessions_to_shut:
                self.replies.shut_unread(now_s)
            self.admission.close_expired(now_s)
            self._publish_gauges()
        if self.stats_snapshot.wanted():
            self._publish_gauges()
            self.stats_snapshot.refresh(lambda: stats_fields(self.ctx))
        if self.notifier.watchdog_due(now_s):
            self.notifier.watchdog(now_s)
        if self.notifier.enabled and now_s >= self._next_status_s:
            self._next_status_s = now_s + STATUS_EVERY_S
            self._post_status()
        return handled

    def _publish_gauges(self) -> None:
        """The gauges that describe the loop's state (sessions, parked requests, learning backlog, connections,
        auth failures, the standby): set at each sweep and just before anything reads them (a ``stats`` request, the
        Prometheus snapshot), not on every turn: a turn that serves one lookup need not pay for them."""
        self.metrics.set("sessions", len(self.sessions))
        self.metrics.set("requests_in_flight", len(self._parked))
        self.metrics.set("learn_backlog_keys", self.pools.learn_backlog_keys())
        if self._connection_guard is not None:
            self._connection_guard.publish(self.metrics)
        if self.ctx.auth_failures is not None:
            self.ctx.auth_failures.publish(self.metrics)
        if self.standby is not None:
            # Whether a crash now would be served at once, and by which process (operating.md, "A standby").
            self.metrics.set("standby_ready", int(self.standby.ready))
            self.metrics.set("standby_pid", self.standby.pid or 0)

    def _clients_waiting(self) -> bool:
        assert self._sock is not None
        return bool(self._parked) or bool(self._sock.getsockopt(zmq.EVENTS) & _POLLIN)

    def _post_status(self) -> None:
        """systemctl status shows this line; sent only when it changed."""
        cpu_bytes = sum(e.cpu_bytes for e in self.pools)
        text = (f"serving on {self.options.endpoint}: {len(self.pools)} pools, {len(self.sessions)} sessions, "
                f"CPU tiers {gib(cpu_bytes)}")
        if text != self.notifier.last_status:
            self.notifier.status(text)

    # ---- one request ---------------------------------------------------------

    def _handle(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        started_s = time.monotonic()
        try:
            if len(frames) < 2:
                raise ProtocolError(ErrorCode.MALFORMED, "empty message: expected [header, *payload]")
            req = decode_request(frames[1].buffer, frames[2:], max_payload_bytes=self.options.max_payload_bytes)
        except ProtocolError as exc:
            self.metrics.inc("protocol_errors_total", code=exc.code.name)
            self._error_log.log(exc.code.name, "rejected a message: %s", exc)
            self._send_error(identity, recoverable_id(frames[1].buffer) if len(frames) > 1 else RESERVED_ID, exc.code,
                             exc.message)
            return
        self.metrics.add(self._op_series[req.op][0])
        refusal = self._connection_guard.refusal(frames[1]) if self._connection_guard is not None else None
        if refusal is not None:
            # Past a connection cap: this connection is closed in a moment; say why first.
            self._send_error(identity, req.id, ErrorCode.TOO_MANY_CONNECTIONS, refusal, op=req.op)
            return
        if (self._holding or self._redirecting) and req.op not in ("health", "stats"):
            if self._redirecting:
                self._send_error(identity, req.id, ErrorCode.SHUTTING_DOWN,
                                 "kvtierd handed its socket to a successor: resend this on a new connection", op=req.op)
            else:
                # A hand-over is releasing the tiers: this runs nowhere yet; answered when the successor serves.
                self._held.append((identity, req.id, req.op, frames))
            return
        unread_refusal = self._unread_refusal(identity, req.op)
        if unread_refusal is not None:
            self._send_error(identity, req.id, ErrorCode.UNREAD_REPLIES, unread_refusal, op=req.op)
            return
        # Who is asking (CURVE User-Id); handlers read it for this request only.
        self.ctx.peer = peer_user_id(frames[1]) if self._curve_guard is not None else None
        # ...and, on ipc, as which user (only where a session is opened or named).
        self.ctx.peer_uid = (peer_uid(frames[1], unix_listener=True)
                             if self._ipc and (req.sid is not None or req.op in ("hello", "stats", "health")) else None)
        self.ctx.auth_peer = peer_of_frame(frames[1]) if req.op == "hello" else None
        if self._same_user_only:
            uid = self.ctx.peer_uid if self.ctx.peer_uid is not None else peer_uid(frames[1], unix_listener=self._ipc)
            if uid not in (os.getuid(), 0):
                self._send_error(identity, req.id, ErrorCode.UNAUTHORIZED,
                                 "this daemon listens on an abstract socket without CURVE and serves only its own "
                                 "user; run as that user, or ask the operator for a socket path with group access",
                                 op=req.op)
                return
        session: Session | None = None
        try:
            if self.ctx.draining and req.op not in ("health", "stats"):
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "daemon is shutting down; no new requests")
            needs_session = SESSION_HANDLERS.get(req.op)
            if needs_session is not None:
                session = self._session_for(req)
                result = needs_session(self.ctx, req, session)
            else:
                if req.op == "stats":
                    self._publish_gauges()  # the gauges are set lazily: fresh for whoever reads them
                result = OPEN_HANDLERS[req.op](self.ctx, req)
        except ProtocolError as exc:
            self._send_error(identity, req.id, exc.code, exc.message, op=req.op)
            return
        except (NoSpace, NotFound, PoolError, TransferError) as exc:
            self._send_error(identity, req.id, _error_code_for(exc), _message(exc), op=req.op)
            return
        except Exception as exc:
            log.exception("%s (id %d) failed", req.op, req.id)
            self._send_error(identity, req.id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", op=req.op)
            return
        if isinstance(result, Reply):
            lender = None
            if result.on_sent is not None and session is not None:
                # Lent tier memory: if the session ends with this reply unread,
                # this connection is shut down to get the blocks back (ReplyQueue.shut_unread).
                lender = (session.sid, connection_of(frames[1]))
            self._send_ok(identity, req, result, started_s, lender)
            return
        self._parked.park(Parked(identity, req, result, session, started_s))

    def _unread_refusal(self, identity: bytes, op: str) -> str | None:
        """Why a request of this connection is refused for replies it has not read; None: it is served.

        A client that does not read its replies would make the daemon hold their buffers without
        bound; the error reply is small, and the verbs that free things still go through.
        """
        unread = self.replies.unsent_bytes(identity) + self._parked.reply_bytes(identity)
        if not unread or op in ("bye", "heartbeat", "health"):
            return None
        held = self.replies.copied_bytes + self._parked.reply_bytes_total
        opts = self.options
        if unread >= opts.max_unread_reply_bytes or held >= opts.max_unread_reply_bytes_total:
            # Unless it read them, and they are not counted as sent yet (ReplyQueue.settle).
            self._settle_left_s -= self.replies.settle(identity, max(0.0, self._settle_left_s))
            unread = self.replies.unsent_bytes(identity) + self._parked.reply_bytes(identity)
            held = self.replies.copied_bytes + self._parked.reply_bytes_total
        if not unread:
            return None
        if unread >= opts.max_unread_reply_bytes:
            return (f"this connection's unread replies hold {unread} bytes (max_unread_reply_bytes "
                    f"{opts.max_unread_reply_bytes}); read them, then ask again")
        if held >= opts.max_unread_reply_bytes_total:
            return (f"the daemon's unread replies hold {held} bytes of copies (max_unread_reply_bytes_total "
                    f"{opts.max_unread_reply_bytes_total}), {unread} of them this connection's; read them, then "
                    "ask again")
        return None

    def _session_for(self, req: Request) -> Session:
        """The session a verb that needs one names (its lease renewed if the verb renews it), or the error."""
        assert req.sid is not None  # the decoder refused a session verb without one
        session = self.sessions.get(req.sid)
        if session.peer != self.ctx.peer:
            # A session is usable only over connections of the identity that
            # opened it: a leaked sid is no key to another tenant's session.
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION,
                f"no session {req.sid[:64]!r} (expired, closed, or the daemon restarted): send hello again",
            )
        if session.uid is not None and session.uid != self.ctx.peer_uid:
            # On ipc the kernel says which user sent this: a sid another
            # user learned is no use to them (a client's own reconnects and
            # heartbeat sockets are the same user).
            raise ProtocolError(ErrorCode.FOREIGN_SESSION,
                                f"session {req.sid[:8]}... was opened by another user; send hello to open your own")
        if req.spec.renews_lease:
            self.sessions.touch(session)
        return session

    def _deliver_done(self) -> None:
        for parked in self._parked.finished():
            self._finish_parked(parked)
        if self.sessions.num_ending:
            self.sessions.sweep_ending()

    def _finish_parked(self, parked: Parked) -> None:
        op: Op = parked.pending.op
        req = parked.req
        if op.error is not None:
            if parked.pending.on_error is not None:
                try:
                    parked.pending.on_error(op)
                except Exception:
                    log.exception("cleanup after failed %s (id %d)", req.op, req.id)
            code = _error_code_for(op.error)
            if code is ErrorCode.INTERNAL:
                code = ErrorCode.TRANSFER_FAILED  # an op fails only through its copies
            self._send_error(parked.identity, req.id, code, f"{req.op} failed: {op.error}", op=req.op)
            return
        try:
            reply = parked.pending.finish(op)
        except ProtocolError as exc:  # e.g. the copy out to the client's memory failed
            self._send_error(parked.identity, req.id, exc.code, exc.message, op=req.op)
            return
        except Exception as exc:
            log.exception("finishing %s (id %d)", req.op, req.id)
            self._send_error(parked.identity, req.id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", op=req.op)
            return
        self._send_ok(parked.identity, req, reply, parked.started_s)

    # ---- replies -------------------------------------------------------------

    def _send_ok(self, identity: bytes, req: Request, reply: Reply, started_s: float,
                 lender: tuple[str, Connection | None] | None = None) -> None:
        elapsed_s = time.monotonic() - started_s
        self.metrics.add(self._op_series[req.op][1], elapsed_s)
        if log.isEnabledFor(logging.DEBUG):
            n = len(getattr(req.msg, "hashes", None) or ())
            log.debug("%s id=%d blocks=%d ok in %.3f ms", req.op, req.id, n, elapsed_s * 1e3)
        body = reply.fields
        # A typed reply (its op's ReplyMessage, envelope included) is encoded as it is; a map gets the envelope.
        header = body if isinstance(body, ReplyMessage) else ok_reply(req.id, **body)
        self.replies.send(identity, header, reply.frames, reply.on_sent, lender)

    def _send_error(self, identity: bytes, rid: int, code: ErrorCode, message: str, *, op: str = "") -> None:
        self.metrics.inc("errors_total", code=code.name)
        if op:
            self._error_log.log(code.name, "%s id=%d -> %s: %s", op, rid, code.name, message)
        self.replies.send(identity, error_reply(rid, code, message), [])

    # ---- shutdown ----------------------------------------------------------------

    def _drain(self) -> int:
        self.ctx.draining = True
        if self.standby is not None:
            # First: a standby must not read this daemon's exit as a crash.
            self.standby.close("this daemon is stopping")
        # Clients told SHUTTING_DOWN reconnect: to the next daemon's socket file, not to this one's (a socket
        # systemd holds stays: its next daemon serves that very socket).
        if self.listener is not None:
            self.listener.remove_file()
        self._holding = False
        self.answer_held(shutting_down=True)
        self.notifier.stopping(f"draining {len(self._parked)} requests")
        deadline_s = time.monotonic() + self.options.drain_timeout_s
        log.info("stopping (%s): %d requests in flight", self.stop.signal_name or "requested", len(self._parked))
        # Until the copies in flight are done and the socket has nothing queued:
        # requests that reached us before we stopped still get their one reply.
        while time.monotonic() < deadline_s:
            if not self._turn(BUSY_POLL_MS) and not self._parked and not self.replies.busy:
                break
        for parked in self._parked.take_all():
            self._send_error(parked.identity, parked.req.id, ErrorCode.SHUTTING_DOWN,
                             "daemon shut down before the copy finished", op=parked.req.op)
        # Replies libzmq still holds are dropped when the socket closes; their
        # lent memory stays alive (the frames reference it) until then.
        self.replies.abandon()
        # Pools first: closing waits for (or abandons) the copies still in
        # flight, which may read the sessions' arenas and registered tensors.
        remaining_s = max(0.5, deadline_s - time.monotonic())
        self.ctx.lends.close()
        self.pools.close_all(remaining_s)
        self.sessions.end_all("shutdown")
        self.close(linger_s=min(1.0, remaining_s), remove_file=True)
        self.notifier.close()
        log.info("stopped")
        return 0
