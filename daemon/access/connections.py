"""One client connection of the ROUTER socket, named by its descriptor, and how to end it.

Contract:

- ``Connection(fd, cookie)``: the descriptor libzmq holds and the socket's
  ``SO_COOKIE`` (``daemon.access.gil_held``): the cookie tells this socket apart
  from a later one that reuses the number.
- ``connection_of(frame) -> Connection | None``: the connection a received
  frame came on: libzmq says which descriptor it was read from
  (ZMQ_SRCFD). None for a plain bytes frame or a socket without
  descriptors (inproc).
- ``peer_of_frame(frame) -> Peer``: who sent it: the uid of the process on
  ``ipc://`` (``SO_PEERCRED``), the IP address on ``tcp://``, None when the
  kernel would not say (``daemon.access.gil_held.peer_of``).
- ``shut_down(conn) -> bool``: ``shutdown(SHUT_RDWR)`` of that connection's
  socket, if the descriptor still is that socket; True if it was shut down.
  libzmq gives no per-peer disconnect on a ROUTER, but it sees the
  connection fail, closes it, terminates its pipe (the socket's
  ``LINGER`` 0: at once) and frees the messages still queued for that peer:
  their trackers complete on the loop's next poll of the socket (the pipe's
  termination needs the socket's thread). The peer's DEALER reconnects on
  its own. Only the loop thread calls this; the descriptor itself stays
  libzmq's (a duplicate is checked, shut down and closed: shutdown acts on
  the socket, not on the descriptor).
- ``shut_down_now(conn) -> bool``: the same without the duplicate, for a
  thread that must shed connections when no descriptor is left to dup
  (the connection guard at the fd limit): the cookie is checked and the
  socket shut down through libzmq's descriptor itself. If libzmq closed the
  connection and reused the number for a new one in the microseconds
  between the two system calls, that new connection is shut down instead;
  its client reconnects.

Every system call here keeps the GIL (``daemon.access.gil_held``): the connection
guard's thread must not queue behind a busy event loop for each one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from kvtier.daemon.access import gil_held

Peer = int | str | None  # uid on ipc, IP address on tcp, None when the kernel would not say


@dataclass(frozen=True, slots=True)
class Connection:
    fd: int
    cookie: int


def connection_of(frame: Any) -> Connection | None:
    """See the module docstring."""
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, ValueError, TypeError):
        return None
    cookie = gil_held.socket_cookie(fd)
    return Connection(fd, cookie) if cookie is not None else None


def peer_of_frame(frame: Any) -> Peer:
    """See the module docstring."""
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, ValueError, TypeError):
        return None
    return gil_held.peer_of(fd)


def shut_down(conn: Connection) -> bool:
    """See the module docstring."""
    # The duplicate holds the socket open: the check and the shutdown act on
    # the same socket even if libzmq closes its descriptor in between.
    dup = gil_held.dup(conn.fd)
    if dup is None:
        return False  # closed already: libzmq dropped the connection itself
    try:
        if gil_held.socket_cookie(dup) != conn.cookie:
            return False  # the number now names another socket: that connection is gone
        return gil_held.shutdown(dup)
    finally:
        gil_held.close(dup)


def shut_down_now(conn: Connection) -> bool:
    """See the module docstring."""
    if gil_held.socket_cookie(conn.fd) != conn.cookie:
        return False
    return gil_held.shutdown(conn.fd)
