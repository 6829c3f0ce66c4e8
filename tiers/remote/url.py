"""A remote tier's URL: which server (or cluster), checked before anything connects.

Contract:

- ``parse_url(url) -> Endpoint``: ``redis://[user:pass@]host[:port][/db]``
  (also ``rediss://``, ``valkey://``, ``valkeys://``) or
  ``unix:///absolute/path.sock[?db=N]`` is one server;
  ``redis+cluster://[user:pass@]host:port[,host:port...]`` (also
  ``rediss+cluster://``, ``valkey+cluster://``, ``valkeys+cluster://``) a
  Redis Cluster, the nodes being startup nodes. ``Endpoint.display`` is the
  URL without credentials (logs, stats).
- A URL that no client could use raises ``RemoteTierError`` saying what is
  wrong: another scheme, an unclosed ``[`` of an IPv6 address, a port that
  is not a number in 1..65535, a database that is not a number, a unix
  socket path that is not absolute, a cluster node without its port. The
  daemon's configuration calls this at load time (``remote_url``), so a
  typo exits 2 instead of reconnecting forever.

Stdlib only: the configuration checks URLs without importing redis-py.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.remote.settings import RemoteTierError

__all__ = ["SCHEMES", "Endpoint", "parse_url"]

# The one table of schemes: each one-server scheme and the redis-py scheme it stands for. Every
# TCP scheme has a "+cluster" form (a unix socket reaches one server only).
_ALIASES = {"redis": "redis", "rediss": "rediss", "unix": "unix", "valkey": "redis", "valkeys": "rediss"}
SCHEMES = (*_ALIASES, *(f"{s}+cluster" for s in _ALIASES if s != "unix"))
_DB_PATH_RE = re.compile(r"/?[0-9]*")


@dataclass(frozen=True, slots=True)
class Endpoint:
    cluster: bool
    url: str  # standalone: a URL redis-py understands; cluster: unused
    nodes: tuple[tuple[str, int], ...]  # cluster startup nodes
    options: tuple[tuple[str, Any], ...]  # username, password, ssl (cluster)
    display: str  # the URL without credentials, for logs and stats


def _bad(url: str, what: str) -> RemoteTierError:
    # The URL may carry a password: name the problem with the credentials cut out.
    shown = url.split("://", 1)
    if len(shown) == 2:
        shown[1] = shown[1].rpartition("@")[2]
    return RemoteTierError(f"remote tier URL {'://'.join(shown)!r}: {what}")


def _port(url: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise _bad(url, f"port {text!r} is not a number in 1..65535")
    return int(text)


def parse_url(url: str) -> Endpoint:
    """The mode, nodes and credentials of a remote tier URL (see the module docstring)."""
    if not isinstance(url, str):
        raise RemoteTierError(f"remote tier URL must be a string, got {type(url).__name__}")
    try:
        parsed = urllib.parse.urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL": an unclosed [
        raise _bad(url, f"{exc} (an IPv6 address is written [addr]:port)") from None
    scheme = parsed.scheme.lower()
    base, _, variant = scheme.partition("+")
    if scheme not in SCHEMES or "://" not in url:
        raise _bad(url, f"scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    hostpart = parsed.netloc.rpartition("@")[2]
    display = urllib.parse.urlunsplit((scheme, hostpart, parsed.path, parsed.query, ""))
    if not variant:
        if base == "unix":
            if not parsed.path.startswith("/"):
                raise _bad(url, "a unix socket URL is unix:///absolute/path.sock")
        else:
            try:
                port = parsed.port
            except ValueError as exc:  # out of 0..65535, or not a number
                raise _bad(url, f"{exc}; a port is a number in 1..65535") from None
            if port == 0:
                raise _bad(url, "port 0 is not a port a server listens on; a port is a number in 1..65535")
            if not _DB_PATH_RE.fullmatch(parsed.path):
                raise _bad(url, f"the database {parsed.path.lstrip('/')!r} after the host is not a number")
        db = urllib.parse.parse_qs(parsed.query).get("db")
        if db is not None and not all(d.isdigit() for d in db):
            raise _bad(url, f"db={db[0]!r} is not a number")
        rest = url[len(parsed.scheme):]
        return Endpoint(False, _ALIASES[base] + rest, (), (), display)
    nodes = []
    for item in hostpart.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port:
            raise _bad(url, "cluster nodes must be host:port[,host:port...]")
        if host.startswith("[") != host.endswith("]"):
            raise _bad(url, f"unclosed IPv6 address in node {item.strip()!r}")
        nodes.append((host.strip("[]"), _port(url, port)))
    options: list[tuple[str, Any]] = []
    userinfo = parsed.netloc.rpartition("@")[0]
    if userinfo:
        user, sep, password = userinfo.partition(":")
        if sep:
            options += [("username", urllib.parse.unquote(user) or None), ("password", urllib.parse.unquote(password))]
        else:
            options.append(("password", urllib.parse.unquote(user)))
    if _ALIASES[base] == "rediss":
        options.append(("ssl", True))
    return Endpoint(True, "", tuple(nodes), tuple(options), display)
