"""CURVE for kvtierd's socket: the daemon's key pair, the authorised client keys, the ZAP handler.

Contract
========

- ``load_server_key(path) -> (public, secret)`` (Z85 bytes) from a
  ``zmq.auth`` secret key file (``kvtier keygen`` writes them). Raises
  ``ValueError`` (with the path) if the file holds no secret key or others
  may read it (mode ``o+r``); the daemon turns that into exit status 2.
- ``ClientKeys(public_keys_dir, tenant_by_key)``: a client may connect iff
  its public key is in a ``*.key`` file of ``public_keys_dir`` or is a
  configured tenant's ``public_key``. A key not known yet makes the handler
  re-read the directory (at most once a second), so a key file added to the
  directory is accepted without a restart; removing one takes a restart.
- ``CurveGuard.start(zctx, keys)`` runs pyzmq's ZAP handler
  (``ThreadAuthenticator``, its own thread) on the daemon's ZMQ context with
  ``configure_curve_callback(domain='*')``. Every authenticated connection
  gets the ZMQ ``User-Id`` ``"tenant:<name>"`` for a tenant's key, else
  ``"key:<z85>"`` (``kvtier.daemon.tenancy.tenants.user_id_for_key``); the server
  reads it from each message's frames (``peer_user_id``). An unknown key or
  a client without CURVE never completes the handshake: it gets no reply at
  all, only its own timeout. ``apply(sock, public, secret)`` makes a socket
  a CURVE server; call it before ``bind``. ``stop()`` before ``zctx.term()``.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.auth.thread import ThreadAuthenticator

from kvtier.daemon.access import gil_held
from kvtier.daemon.tenancy.tenants import user_id_for_key

log = logging.getLogger(__name__)

RELOAD_EVERY_S = 1.0


def load_server_key(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """The daemon's CURVE key pair from its secret key file; see the module docstring."""
    path = Path(path)
    mode = path.stat().st_mode
    if mode & stat.S_IROTH:
        raise ValueError(f"{path} is readable by others (mode {stat.S_IMODE(mode):04o}); chmod o-r it "
                         "(0600, or 0640 for the daemon's group)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a CURVE key file: {exc}") from None
    if not secret:
        raise ValueError(f"{path} holds a public key only; give the *.key_secret file")
    return public, secret


def peer_uid(frame: Any, *, unix_listener: bool = False) -> int | None:
    """The uid of the process at the other end of a local (ipc) connection a frame came on; None otherwise.

    libzmq tells which descriptor a message was read from (ZMQ_SRCFD); for a
    unix socket the kernel vouches for its peer (SO_PEERCRED). Asked afresh
    per request through ``gil_held.peer_uid`` (two getsockopt calls, no socket
    object): nothing is cached, so a descriptor number libzmq reuses for a new
    connection is read anew. Not cached per routing identity either: a client
    may choose its own identity and reuse one. ``unix_listener``: the frame
    came through a unix listener (an ipc endpoint, checked when bound or
    inherited), so its connection is a unix socket: one getsockopt
    (``gil_held.unix_peer_uid``), the server's per-request case.
    """
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, ValueError, TypeError):
        return None
    if not isinstance(fd, int) or fd < 0:
        return None
    return gil_held.unix_peer_uid(fd) if unix_listener else gil_held.peer_uid(fd)


def peer_user_id(frame: Any) -> str | None:
    """The ZMQ User-Id of the connection a received frame came on (None without ZAP)."""
    try:
        return frame.get("User-Id") or None
    except (zmq.ZMQError, AttributeError):  # no ZAP on this socket, or a plain bytes frame
        return None


class ClientKeys:
    """The client public keys allowed to connect; see the module docstring."""

    def __init__(self, public_keys_dir: str | os.PathLike[str] | None, tenant_by_key: Mapping[str, str]) -> None:
        self.public_keys_dir = Path(public_keys_dir) if public_keys_dir is not None else None
        self.tenant_by_key = dict(tenant_by_key)
        self._lock = threading.Lock()
        self._dir_keys: set[str] = set()
        self._loaded_s = float("-inf")
        self.reload()

    def reload(self) -> None:
        keys: set[str] = set()
        if self.public_keys_dir is not None:
            try:
                keys = {k.decode() for k in zmq.auth.load_certificates(self.public_keys_dir)}
            except (OSError, ValueError) as exc:
                log.warning("cannot read client keys from %s: %s", self.public_keys_dir, exc)
                keys = self._dir_keys
        with self._lock:
            self._dir_keys = keys
            self._loaded_s = time.monotonic()

    def allowed(self, z85_key: str) -> bool:
        if z85_key in self.tenant_by_key or z85_key in self._dir_keys:
            return True
        if time.monotonic() - self._loaded_s >= RELOAD_EVERY_S:
            self.reload()
            return z85_key in self._dir_keys
        return False

    def __len__(self) -> int:
        return len(self._dir_keys | set(self.tenant_by_key))


class _Provider:
    def __init__(self, keys: ClientKeys) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        z85_key = key.decode("ascii", "replace")
        ok = self.keys.allowed(z85_key)
        if not ok:
            log.warning("CURVE: refused a client with unknown public key %s", z85_key)
        return ok


class _Authenticator(ThreadAuthenticator):
    def __init__(self, context: zmq.Context, keys: ClientKeys) -> None:
        super().__init__(context, log=logging.getLogger("kvtier.daemon.zap"))
        self.keys = keys

    def curve_user_id(self, client_public_key: bytes) -> str:
        return user_id_for_key(z85.encode(client_public_key).decode("ascii"), self.keys.tenant_by_key)


class CurveGuard:
    """The ZAP handler of one daemon; see the module docstring."""

    def __init__(self, auth: _Authenticator) -> None:
        self._auth = auth

    @classmethod
    def start(cls, zctx: zmq.Context, keys: ClientKeys) -> CurveGuard:
        auth = _Authenticator(zctx, keys)
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_Provider(keys))
        log.info("CURVE authentication on: %d authorised client keys", len(keys))
        return cls(auth)

    @staticmethod
    def apply(sock: zmq.Socket, public: bytes, secret: bytes) -> None:
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


class CurveOptions:
    """What the server needs to serve CURVE: its key pair and the client keys."""

    def __init__(self, public: bytes, secret: bytes, keys: ClientKeys) -> None:
        self.public = public
        self.secret = secret
        self.keys = keys

    def __repr__(self) -> str:  # never the secret key, not even in a traceback
        return f"CurveOptions(public={self.public.decode()!r}, clients={len(self.keys)})"


def check_socket_dir(path: str | os.PathLike[str]) -> None:
    """Refuse to put the ipc socket in a directory someone else controls.

    Whoever owns the directory (or may write to it without the sticky bit)
    can replace the socket file with their own and read every block. The
    daemon's own directories, root's (/run) and systemd's RuntimeDirectory
    (owned by the unit's user) pass.
    """
    st = os.stat(path)
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise RuntimeError(f"socket directory {path} belongs to uid {st.st_uid}, not to this daemon (uid {uid}); "
                           "another user could replace the socket")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise RuntimeError(f"socket directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                           "another user could replace the socket")
