"""CURVE keys for kvtier clients (and ``kvtier keygen``): authenticated, encrypted tcp:// to kvtierd.

Contract
========

- ``CurveKeys.load(server_key, secret_key_file)``: ``server_key`` is the
  daemon's public key, either its 40 Z85 characters or the path of its
  public key file (``NAME.key``); ``secret_key_file`` is this client's
  ``NAME.key_secret`` (both halves of its key pair are in it). Paths may
  start with ``~``. Raises
  ``ValueError`` naming the file when a key is missing or malformed.
- ``CurveKeys.apply(sock)`` makes a socket a CURVE client of that daemon;
  call it before ``connect``. A daemon that does not know the client's
  public key never answers (the handshake fails silently): the client sees
  its own timeout, nothing else.
- ``create_key_pair(directory, name)`` writes ``NAME.key`` (public, mode
  0644) and ``NAME.key_secret`` (mode 0600, created that way, never wider)
  with ``zmq.auth.create_certificates``; refuses to overwrite either file.
  Returns both paths. The daemon's keys and every client's are made the
  same way; the operator copies client ``NAME.key`` files into the
  daemon's ``curve_public_keys_dir`` (or names them in ``[tenants.X]``).

Imports zmq only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

__all__ = ["CurveKeys", "create_key_pair", "read_public_key"]

Z85_KEY_CHARS = 40


def read_public_key(key: str | bytes | os.PathLike[str]) -> bytes:
    """A public key from its 40 Z85 characters or from a ``zmq.auth`` key file."""
    if isinstance(key, (str, bytes)) and len(key) == Z85_KEY_CHARS and not os.path.exists(key):
        raw = key.encode() if isinstance(key, str) else key
        try:
            z85.decode(raw)
        except ValueError as exc:
            raise ValueError(f"not a Z85 CURVE key: {exc}") from None
        return raw
    path = Path(os.fsdecode(key)).expanduser()
    try:
        public, _secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a CURVE key file: {exc}") from None
    return public


@dataclass(frozen=True)
class CurveKeys:
    """A client's key pair and the daemon's public key; see the module docstring."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def load(cls, server_key: str | bytes | os.PathLike[str], secret_key_file: str | os.PathLike[str]) -> CurveKeys:
        server_public = read_public_key(server_key)
        path = Path(secret_key_file).expanduser()
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a CURVE key file: {exc}") from None
        if not secret:
            raise ValueError(f"{path} holds no secret key; give this client's NAME.key_secret file")
        return cls(server_public, public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


def create_key_pair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """See the module docstring."""
    directory = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad key name {name!r}: a plain file name, e.g. 'server' or 'engine-0'")
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public_file, secret_file):
        if path.exists():
            raise FileExistsError(f"{path} exists; remove it first or choose another --name")
    directory.mkdir(parents=True, exist_ok=True)
    # zmq.auth writes files with the process umask (0644 by default): make
    # the secret unreadable to others from its first byte, not after a chmod.
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(secret_file, 0o600)
    os.chmod(public_file, 0o644)
    return public_file, secret_file
