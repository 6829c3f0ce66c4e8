"""One client connection of the ROUTER socket, named by its descriptor, and how to end it.

Contract:

- ``connection_of(frame) -> Connection | None``: the connection a received
  frame came on: libzmq says which descriptor it was read from
  (ZMQ_SRCFD), and ``(st_dev, st_ino)`` of that descriptor tells this
  socket apart from a later one that reuses the number (a socket's inode is
  unique while it lives). None for a plain bytes frame or a socket without
  descriptors (inproc).
- ``shut_down(conn) -> bool``: ``shutdown(SHUT_RDWR)`` of that connection's
  socket, if the descriptor still is that socket; True if it was shut down.
  libzmq gives no per-peer disconnect on a ROUTER, but it sees the
  connection fail, closes it, terminates its pipe (the socket's
  ``LINGER`` 0: at once) and frees the messages still queued for that peer:
  their trackers complete on the loop's next poll of the socket (the pipe's
  termination needs the socket's thread). The peer's DEALER reconnects on
  its own. Only the loop thread calls this; the descriptor itself stays
  libzmq's (a duplicate is shut down and closed: shutdown acts on the
  socket, not on the descriptor).
- ``shut_down_now(conn) -> bool``: the same without the duplicate, for a
  thread that must shed connections when no descriptor is left to dup
  (the connection guard at the fd limit): the inode is checked and the
  socket shut down through libzmq's descriptor itself. If libzmq closed the
  connection and reused the number for a new one in the microseconds
  between the two system calls, that new connection is shut down instead;
  its client reconnects.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import zmq


@dataclass(frozen=True, slots=True)
class Connection:
    fd: int
    dev: int
    ino: int


def connection_of(frame: Any) -> Connection | None:
    """See the module docstring."""
    try:
        fd = frame.get(zmq.SRCFD)
        st = os.fstat(fd)
    except (zmq.ZMQError, AttributeError, OSError, ValueError, TypeError):
        return None
    return Connection(fd, st.st_dev, st.st_ino)


def shut_down(conn: Connection) -> bool:
    """See the module docstring."""
    try:
        # The duplicate holds the socket open: the check and the shutdown act on
        # the same socket even if libzmq closes its descriptor in between.
        dup = os.dup(conn.fd)
    except OSError:
        return False  # closed already: libzmq dropped the connection itself
    try:
        st = os.fstat(dup)
        if (st.st_dev, st.st_ino) != (conn.dev, conn.ino):
            return False  # the number now names another file: that connection is gone
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False  # not connected any more
    finally:
        sock.close()


def shut_down_now(conn: Connection) -> bool:
    """See the module docstring."""
    try:
        st = os.fstat(conn.fd)
    except OSError:
        return False
    if (st.st_dev, st.st_ino) != (conn.dev, conn.ino):
        return False
    try:
        sock = socket.socket(fileno=conn.fd)
    except OSError:
        return False  # libzmq closed it since the fstat
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()  # the descriptor stays libzmq's
