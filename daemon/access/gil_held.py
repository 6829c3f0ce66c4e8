"""Socket and libzmq calls that keep the GIL, for the threads that must not queue behind the event loop.

Every system call CPython wraps (``os.fstat``, ``socket.shutdown``, a pyzmq
``recv``) lets go of the GIL and must take it back afterwards. While another
thread runs Python (the event loop on a busy daemon) taking it back waits for
that thread's switch interval, 5 ms: the convoy effect. Measured on the 2-core
VM: ``os.fstat`` from one thread, 989,000 calls/s alone and 2,820/s beside a
thread spinning in Python; the same kind of call through ``ctypes.PyDLL``
(which keeps the GIL), 1,128,000/s beside it. The connection guard makes a few
such calls per accepted connection, so beside a busy loop it shed a few hundred
connections a second while libzmq accepted thousands, and libzmq aborted the
daemon when its ``accept`` ran out of descriptors. These calls are each a
microsecond or less and never block, so holding the GIL through them costs the
loop nothing.

Contract (Linux; each returns its failure value, never raises, on a closed or
foreign descriptor):

- ``socket_cookie(fd) -> int | None``: the socket's ``SO_COOKIE``, a number
  the kernel gives no other socket while the host is up: with the descriptor
  it names one connection even after libzmq closes it and reuses the number.
  None when ``fd`` is not an open socket.
- ``peer_of(fd) -> int | str | None``: who is at the other end: the uid of the
  process on a unix socket (``SO_PEERCRED``: the kernel vouches for it), the
  IP address on TCP; None when the kernel would not say.
- ``peer_uid(fd) -> int | None``: the uid of the process at the other end of
  a unix socket (``SO_DOMAIN`` then ``SO_PEERCRED``); None for any other
  descriptor. Two system calls and no Python socket object: the server asks
  per request.
- ``unix_peer_uid(fd) -> int | None``: the same for a descriptor known to be
  a unix socket (one accepted by a unix listener): ``SO_PEERCRED`` alone, one
  system call; None if the kernel would not say.
- ``shutdown(fd) -> bool``: ``shutdown(SHUT_RDWR)``; True if it was shut down.
- ``dup(fd) -> int | None`` and ``close(fd)``.
- ``MonitorEvents(sock)``: reads a ZMQ socket monitor's events (``sock`` is the
  PAIR socket connected to the monitor) without blocking: ``next() ->
  (event, value) | None`` (None: none queued now). It calls libzmq's
  ``zmq_recv`` on ``sock``'s own handle, through the libzmq pyzmq loaded; where
  that library cannot be found it falls back to pyzmq's ``recv`` (which lets go
  of the GIL) and ``gil_held`` is False. Only the thread that owns ``sock``
  calls it; ``zmq.ContextTerminated``/``zmq.ZMQError`` once the socket is closed.
"""

from __future__ import annotations

import ctypes
import errno
import socket
import struct
import threading
from typing import Any

import zmq

_SOL_SOCKET = 1
_SO_PEERCRED = 17
_SO_DOMAIN = 39
_SO_COOKIE = 57  # asm-generic, x86 and arm64 alike
_SHUT_RDWR = 2
_ZMQ_DONTWAIT = 1
_ZMQ_RCVMORE = 13
_EVENT = struct.Struct("=HI")  # ZMTP socket monitor event v1: uint16 event, uint32 value

# PyDLL: the calls keep the GIL (CDLL would let go of it around each one).
_libc = ctypes.PyDLL(None, use_errno=True)
_getsockopt = _libc.getsockopt
_getsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
_getsockopt.restype = ctypes.c_int
_getpeername = _libc.getpeername
_getpeername.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
_getpeername.restype = ctypes.c_int
_shutdown = _libc.shutdown
_shutdown.argtypes = [ctypes.c_int, ctypes.c_int]
_shutdown.restype = ctypes.c_int
_dup = _libc.dup
_dup.argtypes = [ctypes.c_int]
_dup.restype = ctypes.c_int
_close = _libc.close
_close.argtypes = [ctypes.c_int]
_close.restype = ctypes.c_int


def socket_cookie(fd: int) -> int | None:
    """See the module docstring."""
    value = ctypes.c_uint64(0)
    size = ctypes.c_uint32(8)
    if _getsockopt(fd, _SOL_SOCKET, _SO_COOKIE, ctypes.byref(value), ctypes.byref(size)) != 0:
        return None
    return int(value.value)


def peer_of(fd: int) -> int | str | None:
    """See the module docstring."""
    addr = ctypes.create_string_buffer(128)
    size = ctypes.c_uint32(128)
    if _getpeername(fd, addr, ctypes.byref(size)) != 0:
        return None
    family = struct.unpack_from("=H", addr.raw, 0)[0]
    if family == socket.AF_UNIX:
        return _cred_reader().unix_uid(fd)
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, addr.raw[4:8])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, addr.raw[8:24])
    return None


class _Ucred(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_int), ("uid", ctypes.c_int), ("gid", ctypes.c_int)]


# The same getsockopt without argtypes: converting declared argtypes costs
# more than the system call (peer_uid, per request: 3.4 -> 1.3 us a call);
# every argument below is a Python int (a C int) or a byref pointer.
_getsockopt_raw = ctypes.PyDLL(None).getsockopt
_getsockopt_raw.restype = ctypes.c_int


class _CredReader:
    """One thread's getsockopt buffers for ``SO_DOMAIN`` and ``SO_PEERCRED``, made once: building the ctypes
    objects per call cost more than the two system calls (``peer_uid``, per request: 3.6 -> 1.4 us a call)."""

    __slots__ = ("_domain", "_cred", "_size", "_domain_p", "_cred_p", "_size_p")

    def __init__(self) -> None:
        self._domain = ctypes.c_int(0)
        self._cred = _Ucred()
        self._size = ctypes.c_uint32(0)
        self._domain_p = ctypes.byref(self._domain)
        self._cred_p = ctypes.byref(self._cred)
        self._size_p = ctypes.byref(self._size)

    def uid(self, fd: int) -> int | None:
        """The peer's uid if ``fd`` is a unix socket, else None."""
        self._size.value = 4
        if _getsockopt_raw(fd, _SOL_SOCKET, _SO_DOMAIN, self._domain_p, self._size_p) != 0:
            return None
        if self._domain.value != socket.AF_UNIX:
            return None
        return self.unix_uid(fd)

    def unix_uid(self, fd: int) -> int | None:
        """The peer's uid of ``fd``, known to be a unix socket."""
        self._size.value = 12
        if _getsockopt_raw(fd, _SOL_SOCKET, _SO_PEERCRED, self._cred_p, self._size_p) != 0:
            return None
        return int(self._cred.uid)


# Per thread: the loop asks per request, the connection guard's thread per connection (peer_of), and a
# thread switch between a call and the read of its buffer must not hand one thread the other's answer.
_readers = threading.local()


def _cred_reader() -> _CredReader:
    reader = getattr(_readers, "reader", None)
    if reader is None:
        reader = _readers.reader = _CredReader()
    return reader


def peer_uid(fd: int) -> int | None:
    """See the module docstring."""
    return _cred_reader().uid(fd)


def unix_peer_uid(fd: int) -> int | None:
    """See the module docstring."""
    return _cred_reader().unix_uid(fd)


def shutdown(fd: int) -> bool:
    """See the module docstring."""
    return _shutdown(fd, _SHUT_RDWR) == 0


def dup(fd: int) -> int | None:
    """See the module docstring."""
    new = _dup(fd)
    return new if new >= 0 else None


def close(fd: int) -> None:
    """See the module docstring."""
    _close(fd)


def _loaded_libzmq() -> ctypes.PyDLL | None:
    # The very library pyzmq's sockets belong to: a socket handle means nothing to another copy.
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libzmq" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if p.startswith("/") and "/libzmq" in p):
        try:
            lib = ctypes.PyDLL(path)
            lib.zmq_recv  # noqa: B018 - present, or not this library
            return lib
        except (OSError, AttributeError):
            continue
    return None


class MonitorEvents:
    """See the module docstring."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._lib = _loaded_libzmq()
        self.gil_held = self._lib is not None
        if self._lib is not None:
            self._recv = self._lib.zmq_recv
            self._recv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._recv.restype = ctypes.c_int
            self._errno = self._lib.zmq_errno
            self._errno.argtypes = []
            self._errno.restype = ctypes.c_int
            self._getsockopt = self._lib.zmq_getsockopt
            self._getsockopt.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_size_t)]
            self._getsockopt.restype = ctypes.c_int
            self._buf = ctypes.create_string_buffer(64)
            self._more = ctypes.c_int(0)
            self._more_size = ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))

    def next(self) -> tuple[int, int] | None:
        """See the module docstring."""
        if self._lib is None:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            event, value = _EVENT.unpack_from(frames[0])
            return int(event), int(value)
        handle: Any = self._sock.underlying
        n = self._recv(handle, self._buf, 64, _ZMQ_DONTWAIT)
        if n < 0:
            code = self._errno()
            if code == errno.EAGAIN:
                return None
            raise zmq.ZMQError(code)
        event, value = _EVENT.unpack_from(self._buf.raw)
        # The rest of the event (the endpoint): read and dropped, whatever its parts.
        while True:
            self._more_size.value = ctypes.sizeof(ctypes.c_int)
            if self._getsockopt(handle, _ZMQ_RCVMORE, ctypes.byref(self._more), ctypes.byref(self._more_size)) != 0:
                break
            if not self._more.value:
                break
            if self._recv(handle, self._buf, 64, _ZMQ_DONTWAIT) < 0:
                break
        return int(event), int(value)
