"""The remote tier's per-deployment secret: the key every value in Redis/Valkey is authenticated with.

Every daemon that shares one server must hold the same secret (a value one
daemon wrote is a miss for a daemon with another secret); anyone who can
write to the server but does not hold it cannot make a value any daemon
serves (``kvtier.tiers.remote.values``; threat model in docs/remote-tier.md).

Contract:

- A secret file holds ``SECRET_BYTES`` (32) random bytes as 64 hexadecimal
  digits, optionally followed by a newline, and nothing else.
- ``write_secret(path) -> Path``: a new secret from ``secrets.token_bytes``,
  written to a new file created with mode 0600 (never readable by others,
  not even for a moment). Refuses (``FileExistsError``) to overwrite: a
  replaced secret makes every value already stored a miss.
  ``kvtier keygen DIR --remote-secret`` calls it.
- ``load_secret(path) -> bytes``: the secret's 32 bytes. Raises
  ``OSError`` when the file cannot be read and ``ValueError`` (the message
  says what to do) when it is readable by others, or is not 64 hex digits.
  kvtierd calls it at start (``remote_secret_key_file``) and exits 2 on
  either.

Stdlib only: the daemon's start-up and ``kvtier keygen`` need no redis-py.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

__all__ = ["SECRET_BYTES", "load_secret", "write_secret"]

SECRET_BYTES = 32
_HEX_RE = re.compile(rb"[0-9a-fA-F]{%d}\n?" % (2 * SECRET_BYTES))
_MAX_FILE_BYTES = 4096  # a secret file is 65 bytes; never read a large file into memory


def write_secret(path: str | os.PathLike[str]) -> Path:
    """A new random secret in a new file of mode 0600 (see the module docstring)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask said
        os.write(fd, secrets.token_bytes(SECRET_BYTES).hex().encode() + b"\n")
    finally:
        os.close(fd)
    return path


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path`` (see the module docstring)."""
    path = Path(path)
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path} is not a regular file")
        if mode & stat.S_IROTH:
            raise ValueError(f"{path} is readable by others (mode {stat.S_IMODE(mode):04o}); chmod o-r it "
                             "(0600, or 0640 for the daemon's group)")
        text = f.read(_MAX_FILE_BYTES + 1)
    if not _HEX_RE.fullmatch(text):
        raise ValueError(f"{path} is not a remote tier secret ({2 * SECRET_BYTES} hex digits); "
                         "create one with `kvtier keygen DIR --remote-secret`")
    return bytes.fromhex(text.decode().strip())
