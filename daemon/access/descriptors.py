"""The daemon's file descriptors, shared out between spares, client connections and mapped files.

Contract:

- ``FdBudget.at_start(max_connections=None) -> FdBudget``: raises the soft
  ``RLIMIT_NOFILE`` to the hard one (a daemon that serves many engines wants
  every descriptor it may have; only the hard limit is the operator's
  choice, ``LimitNOFILE=`` in the unit) and shares out what it got. Called
  once, at start. ``descriptor_limit()`` is what it will get, for the
  configuration's checks before then.
- ``FdBudget.of(limit_fds, max_connections=None)``: the same share-out for a
  given limit: ``spare_fds`` for the daemon itself (pool threads' pipes, log
  and metrics sockets, ZMQ internals), then of the rest a quarter for client
  connections (``connections``: ``max_connections``, or by default a
  quarter, at most ``MAX_AUTO_CONNECTIONS``), the shared-memory files
  sessions map (``shm_files``: half, less what a configured
  ``max_connections`` takes past its quarter), and the rest never handed
  out: the room a connection flood gets between libzmq accepting
  connections and the connection guard shutting the ones past the caps
  (``daemon.access.connection_limits``): a quarter, and at least
  ``FLOOD_ROOM_GUARANTEED_FDS`` where that fits beside the default
  connections and a quarter for files. libzmq aborts the whole process when
  an ipc accept fails with EMFILE (ipc_listener.cpp), so this room is what
  keeps a flood from killing the daemon. Raises ``ValueError`` (saying
  what the limit allows) for a ``max_connections`` over
  ``max_connections_for(limit_fds)``: what leaves that room and a quarter
  for files, and no more than the default where the room does not fit.
- ``auto_per_peer(max_connections)``: the ``max_connections_per_peer``
  default, a quarter of the total (at most ``MAX_AUTO_CONNECTIONS_PER_PEER``),
  so that one peer's flood leaves room for the others.
- ``small`` is True when the flood room is under ``FLOOD_ROOM_GUARANTEED_FDS``:
  the connection guard cannot fall further behind libzmq than that (its
  monitor pipe's bound, plus the refusals it holds), so from there up no
  flood can make accept fail, and below it a flood on a starved CPU might.
  The daemon logs a warning naming ``LimitNOFILE`` at start.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

# Descriptors the daemon keeps for itself, whatever clients do.
SPARE_FDS = 512
# Each libzmq connection holds buffers and objects (tens of KiB): past this,
# an automatic cap would let clients spend memory rather than descriptors.
MAX_AUTO_CONNECTIONS = 16384
# How far libzmq can get ahead of the connection guard: the events its monitor pipe holds
# (libzmq's monitor socket's SNDHWM, 1000, plus the guard's RCVHWM, 1), one per accepted
# connection, plus the refused connections the guard holds open (MAX_HELD_REFUSALS), plus
# some for the shed connections libzmq has not closed yet.
FLOOD_ROOM_GUARANTEED_FDS = 1001 + 64 + 64
# A host's engines (TP ranks, two sockets each, reconnects) stay far below this.
MAX_AUTO_CONNECTIONS_PER_PEER = 1024


def auto_per_peer(max_connections: int) -> int:
    """See the module docstring."""
    return max(1, min(MAX_AUTO_CONNECTIONS_PER_PEER, max_connections // 4))


@dataclass(frozen=True, slots=True)
class FdBudget:
    limit_fds: int
    spare_fds: int
    shm_files: int
    connections: int

    @property
    def flood_room_fds(self) -> int:
        """Descriptors neither files nor admitted connections may take."""
        return self.limit_fds - self.spare_fds - self.shm_files - self.connections

    @property
    def small(self) -> bool:
        return self.flood_room_fds < FLOOD_ROOM_GUARANTEED_FDS

    @staticmethod
    def max_connections_for(limit_fds: int) -> int:
        """The largest ``max_connections`` a limit of ``limit_fds`` descriptors allows."""
        spare_fds, rest, quarter, auto, flood_room = _shares(limit_fds)
        if flood_room < FLOOD_ROOM_GUARANTEED_FDS:
            return auto  # no room to guarantee anything: not a connection past the default either
        return max(auto, rest - quarter - flood_room)

    @classmethod
    def of(cls, limit_fds: int, max_connections: int | None = None) -> FdBudget:
        """See the module docstring."""
        spare_fds, rest, quarter, auto, flood_room = _shares(limit_fds)
        most = cls.max_connections_for(limit_fds)
        if max_connections is None:
            connections = auto
        elif max_connections > most:
            room = ("a quarter stays for shared-memory files and the rest for a connection flood"
                    if flood_room >= FLOOD_ROOM_GUARANTEED_FDS else
                    f"under {FLOOD_ROOM_GUARANTEED_FDS} descriptors left for a connection flood, libzmq may run "
                    "out of them before the connection guard sheds it")
            raise ValueError(
                f"{max_connections} connections do not fit {limit_fds} file descriptors (RLIMIT_NOFILE): at most "
                f"{most}, so that {room}; lower max_connections or raise LimitNOFILE= (systemd) / ulimit -n")
        else:
            connections = max_connections
        shm_files = max(min(16, quarter), min(rest // 2, rest - connections - flood_room))
        return cls(limit_fds, spare_fds, shm_files=shm_files, connections=connections)

    @classmethod
    def at_start(cls, max_connections: int | None = None) -> FdBudget:
        """See the module docstring."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = descriptor_limit()
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
        return cls.of(soft, max_connections)


def _shares(limit_fds: int) -> tuple[int, int, int, int, int]:
    """(spare_fds, rest, a quarter of the rest, the automatic max_connections, the flood room to keep)."""
    spare_fds = min(SPARE_FDS, limit_fds // 4)
    rest = max(0, limit_fds - spare_fds)
    quarter = rest // 4
    auto = max(8, min(MAX_AUTO_CONNECTIONS, quarter))
    guaranteed = max(quarter, FLOOD_ROOM_GUARANTEED_FDS)
    # The room that keeps any flood from outrunning the guard, where it fits beside the default
    # connections and a quarter for files; else a quarter, and the daemon warns at start.
    flood_room = guaranteed if rest - quarter - auto >= guaranteed else quarter
    return spare_fds, rest, quarter, auto, flood_room


def descriptor_limit() -> int:
    """The descriptors ``FdBudget.at_start`` raises the soft limit to: the hard limit (2**20 if unlimited)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if hard == resource.RLIM_INFINITY else int(hard)
