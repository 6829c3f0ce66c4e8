"""The daemon's file descriptors, shared out between spares, client connections and mapped files.

Contract:

- ``FdBudget.at_start() -> FdBudget``: raises the soft ``RLIMIT_NOFILE`` to
  the hard one (a daemon that serves many engines wants every descriptor it
  may have; only the hard limit is the operator's choice, ``LimitNOFILE=``
  in the unit) and shares out what it got. Called once, at start.
- ``FdBudget.of(limit_fds)``: the same share-out for a given limit:
  ``spare_fds`` for the daemon itself (pool threads' pipes, log and
  metrics sockets, ZMQ internals), then of the rest half for the
  shared-memory files sessions map (``shm_files``), a quarter for client
  connections (``connections``: the ``max_connections`` default, at most
  ``MAX_AUTO_CONNECTIONS``), and the last quarter is never handed out: it
  is the room a connection flood gets between libzmq accepting connections
  and the connection guard shutting the ones past the caps
  (``daemon.connection_limits``). libzmq aborts the whole process when an
  ipc accept fails with EMFILE (ipc_listener.cpp), so this room is what
  keeps a flood from killing the daemon.
- ``auto_per_peer(max_connections)``: the ``max_connections_per_peer``
  default, a quarter of the total (at most ``MAX_AUTO_CONNECTIONS_PER_PEER``),
  so that one peer's flood leaves room for the others.
- ``small`` is True when ``connections`` is under ``MIN_COMFORTABLE_CONNECTIONS``:
  the daemon logs a warning naming ``LimitNOFILE`` at start.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

# Descriptors the daemon keeps for itself, whatever clients do.
SPARE_FDS = 512
# Each libzmq connection holds buffers and objects (tens of KiB): past this,
# an automatic cap would let clients spend memory rather than descriptors.
MAX_AUTO_CONNECTIONS = 16384
MIN_COMFORTABLE_CONNECTIONS = 256
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
        return self.connections < MIN_COMFORTABLE_CONNECTIONS

    @classmethod
    def of(cls, limit_fds: int) -> FdBudget:
        """See the module docstring."""
        spare_fds = min(SPARE_FDS, limit_fds // 4)
        rest = max(0, limit_fds - spare_fds)
        return cls(limit_fds, spare_fds, shm_files=max(16, rest // 2),
                   connections=max(8, min(MAX_AUTO_CONNECTIONS, rest // 4)))

    @classmethod
    def at_start(cls) -> FdBudget:
        """See the module docstring."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
        return cls.of(soft)
