"""The daemon's listening socket: bound here, inherited from systemd, or handed over by a predecessor.

kvtierd makes (or inherits) the listening socket itself and gives libzmq a
duplicate with ``ZMQ_USE_FD``: libzmq then neither binds nor unlinks the
endpoint, and this process keeps a descriptor of the very socket its clients
connect to, one it can hand to a successor (``kvtier.daemon.process.handover``).
Connections that arrive while no daemon accepts (between two daemons) wait
in the kernel's backlog instead of being refused.

Contract:

- ``Listener``: ``fd`` (this process's descriptor, close-on-exec),
  ``endpoint``, ``origin`` (``"bound"``: made by a kvtierd; ``"systemd"``:
  socket activation, systemd owns the socket file) and ``owns_file``
  (whether the daemon that stops for good removes the ipc socket file:
  never for systemd's). ``for_zmq()`` returns a new duplicate for libzmq,
  which closes it with the ROUTER socket, and makes the socket non-blocking
  (two daemons accept on it in a hand-over). ``remove_file()`` removes an
  owned ipc socket file, and only while the path still names the file this
  socket was bound to (a daemon started meanwhile may have bound a new
  one there): a draining daemon removes it first thing, so that clients
  reconnect to its successor rather than to it. ``close(remove_file=)``
  closes this process's descriptor (and removes the file as above);
  other processes' descriptors keep the socket listening.
- ``bind_listener(endpoint, socket_mode)``: a new listening socket.
  ``ipc:///path``: the directory is created (0700, or 0710 when the group
  may connect) and checked (``security.check_socket_dir``), the file is
  born 0600 and then given ``socket_mode``; the path must not exist (the
  caller removed a stale file: ``lifecycle.refuse_if_served``), else
  ``OSError``. ``ipc://@name``: an abstract socket. ``tcp://HOST:PORT``:
  ``*`` is every IPv4 address, ``[addr]`` an IPv6 one, else a host name, an
  address, or a network interface's name (its first IPv4 address), with
  ``SO_REUSEADDR`` as libzmq sets it. Backlog ``BACKLOG``.
- ``systemd_listener(endpoint, environ)``: socket activation
  (``sd_listen_fds``): ``None`` unless ``LISTEN_PID`` is this process and
  ``LISTEN_FDS`` >= 1; then the descriptor named ``kvtierd``
  (``FileDescriptorName=``), or the only one, checked against
  ``endpoint``. The ``LISTEN_*`` variables are removed from ``environ``
  (a successor must not read them as its own).
- ``inherited_listener(fd, endpoint, origin, owns_file)``: a descriptor
  handed over, checked against ``endpoint``.
- A descriptor that is not a listening stream socket of the endpoint's kind
  and address raises ``ListenerMismatch`` saying what it is: the daemon
  exits 1 rather than serve a socket its clients do not use.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass

from kvtier.client.endpoint import ipc_socket_file, parse_ipc
from kvtier.daemon.access.security import check_socket_dir

log = logging.getLogger(__name__)

# Connections that may wait for a daemon to accept them (between two daemons, all of every engine's sockets
# reconnect at once); the kernel caps it at net.core.somaxconn.
BACKLOG = 4096
SD_LISTEN_FDS_START = 3
FD_NAME = "kvtierd"


class ListenerMismatch(RuntimeError):
    """An inherited descriptor is not the listening socket of the configured endpoint."""


@dataclass
class Listener:
    """See the module docstring."""

    fd: int
    endpoint: str
    origin: str  # "bound" | "systemd" | "predecessor"
    owns_file: bool
    file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file this socket was bound to

    def own_file(self) -> None:
        """The ipc socket file is kvtierd's to remove (a predecessor made it): the one at the path now."""
        self.owns_file = True
        self.file_id = _file_id(self.ipc_path)

    def for_zmq(self) -> int:
        """A duplicate of the socket for ``ZMQ_USE_FD``: libzmq owns (and closes) it."""
        fd = os.dup(self.fd)
        # libzmq makes its own listeners non-blocking but takes a given one as it is. In a hand-over two
        # daemons accept on this socket: woken for a connection the other took, a blocking accept() stalls
        # libzmq's I/O thread (every connection of this daemon, and zmq_ctx_term) until the next one comes.
        # The flag belongs to the socket, so this holds for every descriptor of it, systemd's included.
        os.set_blocking(fd, False)
        return fd

    @property
    def ipc_path(self) -> str | None:
        return _ipc_path(self.endpoint)

    def remove_file(self) -> None:
        path = self.ipc_path
        if not self.owns_file or path is None or self.file_id is None or _file_id(path) != self.file_id:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.file_id = None

    def close(self, *, remove_file: bool) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if remove_file:
            self.remove_file()


def _file_id(path: str | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint; None for tcp and abstract sockets."""
    return ipc_socket_file(endpoint)


def _split_tcp(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host, int(port)


def _tcp_address(host: str, port: int) -> tuple[int, tuple[str, int]]:
    """(family, sockaddr) to bind ``tcp://host:port`` as libzmq would."""
    if host == "*":
        return socket.AF_INET, ("0.0.0.0", port)
    if host.startswith("[") and host.endswith("]"):
        return socket.AF_INET6, (host[1:-1], port)
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror:
        infos = []
    if infos:
        family, _type, _proto, _canon, sockaddr = infos[0]
        return family, (str(sockaddr[0]), port)
    import psutil  # a network interface's name, as libzmq accepts ("tcp://eth0:5555")

    for addr in psutil.net_if_addrs().get(host, ()):
        if addr.family == socket.AF_INET:
            return socket.AF_INET, (addr.address, port)
    raise OSError(errno.EADDRNOTAVAIL, f"{host!r} is neither an address, a host name nor a network interface here")


def bind_listener(endpoint: str, socket_mode: int) -> Listener:
    """See the module docstring."""
    path = _ipc_path(endpoint)
    if path is not None:
        socket_dir = os.path.dirname(os.path.abspath(path))
        # A group that may use the socket must be able to reach it (x only).
        os.makedirs(socket_dir, mode=0o710 if socket_mode & 0o060 else 0o700, exist_ok=True)
        check_socket_dir(socket_dir)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # The socket file is born 0600: no window where others can connect.
            old_umask = os.umask(0o177)
            try:
                sock.bind(path)
            finally:
                os.umask(old_umask)
            os.chmod(path, socket_mode)
            sock.listen(BACKLOG)
        except BaseException:
            sock.close()
            raise
        return Listener(sock.detach(), endpoint, "bound", owns_file=True, file_id=_file_id(path))
    ipc = parse_ipc(endpoint)
    if ipc is not None and ipc.name is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        address: object = "\0" + ipc.name
    else:
        host, port = _split_tcp(endpoint)
        family, address = _tcp_address(host, port)
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return Listener(sock.detach(), endpoint, "bound", owns_file=False)


def _describe(sock: socket.socket) -> str:
    try:
        name = sock.getsockname()
    except OSError:
        name = "?"
    return f"a {sock.family.name} {sock.type.name} socket bound to {name!r}"


def check_listener(fd: int, endpoint: str) -> None:
    """Raise ``ListenerMismatch`` unless ``fd`` is a listening stream socket of ``endpoint`` (module docstring)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError as exc:
        raise ListenerMismatch(f"descriptor {fd} is not a socket ({exc})") from None
    try:
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ListenerMismatch(f"descriptor {fd} is {_describe(sock)}, not a listening stream socket")
        name = sock.getsockname()
        ipc = parse_ipc(endpoint)
        path = ipc.path if ipc is not None else None
        if ipc is not None:
            want = path if path is not None else f"\0{ipc.name}"
            got = name.decode(errors="replace") if isinstance(name, bytes) else name
            same = got == want or (path is not None and os.path.normpath(got) == os.path.normpath(want))
            if sock.family != socket.AF_UNIX or not same:
                raise ListenerMismatch(f"descriptor {fd} is {_describe(sock)}, not the configured socket {endpoint}")
            return
        host, port = _split_tcp(endpoint)
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or name[1] != port:
            raise ListenerMismatch(f"descriptor {fd} is {_describe(sock)}, not the configured socket {endpoint}")
        bound = ipaddress.ip_address(name[0].split("%")[0])
        if host != "*" and not bound.is_unspecified:
            _family, (want_host, _port) = _tcp_address(host, port)
            if ipaddress.ip_address(want_host.split("%")[0]) != bound:
                raise ListenerMismatch(f"descriptor {fd} is {_describe(sock)}, not the configured socket {endpoint}")
    finally:
        sock.close()


def inherited_listener(fd: int, endpoint: str, *, origin: str, owns_file: bool) -> Listener:
    """See the module docstring."""
    check_listener(fd, endpoint)
    os.set_inheritable(fd, False)
    return Listener(fd, endpoint, origin, owns_file=owns_file)


def systemd_listener(endpoint: str, environ: MutableMapping[str, str]) -> Listener | None:
    """See the module docstring."""
    pid, count, names = environ.get("LISTEN_PID"), environ.get("LISTEN_FDS"), environ.get("LISTEN_FDNAMES")
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        environ.pop(var, None)
    if pid is None or count is None:
        return None
    try:
        if int(pid) != os.getpid():
            return None  # meant for another process (our parent's, say)
        n = int(count)
    except ValueError:
        log.warning("ignoring LISTEN_PID=%r LISTEN_FDS=%r: not numbers", pid, count)
        return None
    if n < 1:
        return None
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n))
    labels = names.split(":") if names else []
    if FD_NAME in labels and len(labels) == n:
        fd = fds[labels.index(FD_NAME)]
    elif n == 1:
        fd = fds[0]
    else:
        raise ListenerMismatch(f"systemd passed {n} sockets ({names or 'unnamed'}); name kvtierd's "
                               f"FileDescriptorName={FD_NAME} or pass one")
    for other in fds:
        if other != fd:
            os.close(other)
    listener = inherited_listener(fd, endpoint, origin="systemd", owns_file=False)
    log.info("listening on %s: socket activation (descriptor %d from systemd)", endpoint, fd)
    return listener
