"""A kvtierd endpoint's form: the one parser of ``ipc://`` endpoints and the one check of any endpoint.

Contract:

- ``parse_ipc(endpoint) -> IpcAddress | None``: None when ``endpoint`` is
  not an ``ipc://`` endpoint (``tcp://``, or anything else); otherwise its
  address: ``IpcAddress(path=..., name=None)`` for a socket file
  (``ipc:///abs/path.sock``), ``IpcAddress(path=None, name=...)`` for Linux's
  abstract namespace (``ipc://@name``: no file, no permissions). An
  ``ipc://`` endpoint no kvtierd binds raises ``EndpointError`` (a
  ``ValueError``) saying what is wrong and what is expected: no path, a
  relative path, a path ending in ``/``, a path of more than
  ``MAX_IPC_PATH_BYTES`` bytes, ``@`` without a name.
- ``ipc_socket_file(endpoint) -> str | None``: the socket file of an
  ``ipc://`` endpoint; None for ``tcp://`` and abstract sockets. Raises as
  ``parse_ipc`` does.
- ``check_endpoint(endpoint)``: returns None for the forms kvtierd binds
  (``ipc://`` as above, ``tcp://HOST:PORT`` with PORT in 1..65535), raises
  ``EndpointError`` for anything else. Whether a ``tcp://`` endpoint may be
  served (CURVE or ``insecure_tcp``) is the daemon's configuration's call,
  not this module's.

Callers: the daemon's configuration (``socket``), its listener and
lifecycle, and every client-side check of a socket file (``admin``,
``data_planes``, the engine adapters' link). Stdlib only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["MAX_IPC_PATH_BYTES", "EndpointError", "IpcAddress", "check_endpoint", "ipc_socket_file", "parse_ipc"]

IPC_PREFIX = "ipc://"
MAX_IPC_PATH_BYTES = 107  # sun_path, less its terminating NUL
EXPECTED = "ipc:///path/kvtierd.sock, ipc://@name or tcp://HOST:PORT"
_TCP_RE = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9*._-]+):([0-9]{1,5})")


class EndpointError(ValueError):
    """An endpoint no kvtierd binds; the message says what is wrong and what is expected."""


@dataclass(frozen=True, slots=True)
class IpcAddress:
    path: str | None  # the socket file (absolute); None for an abstract socket
    name: str | None  # the abstract socket's name (after '@'); None for a socket file

    @property
    def abstract(self) -> bool:
        return self.name is not None


def parse_ipc(endpoint: str) -> IpcAddress | None:
    """See the module docstring."""
    if not isinstance(endpoint, str) or not endpoint.startswith(IPC_PREFIX):
        return None
    rest = endpoint[len(IPC_PREFIX):]
    if rest.startswith("@"):
        if len(rest) < 2:
            raise EndpointError(f"an abstract ipc socket needs a name after '@' (ipc://@name), got {endpoint!r}")
        return IpcAddress(path=None, name=rest[1:])
    if not os.path.isabs(rest):
        raise EndpointError(f"an ipc:// endpoint needs an absolute path after ipc:// ({EXPECTED}), got {endpoint!r}")
    if rest.endswith("/"):
        raise EndpointError(f"the ipc:// path names a directory, not a socket: {endpoint!r}")
    size = len(os.fsencode(rest))
    if size > MAX_IPC_PATH_BYTES:
        raise EndpointError(f"the ipc:// path is {size} bytes, the limit is {MAX_IPC_PATH_BYTES} (a unix socket's "
                            f"sun_path); choose a shorter path: {endpoint!r}")
    return IpcAddress(path=rest, name=None)


def ipc_socket_file(endpoint: str) -> str | None:
    """See the module docstring."""
    address = parse_ipc(endpoint)
    return address.path if address is not None else None


def check_endpoint(endpoint: object) -> None:
    """See the module docstring."""
    if not isinstance(endpoint, str):
        raise EndpointError(f"expected an endpoint like {EXPECTED}, got {endpoint!r}")
    if parse_ipc(endpoint) is not None:
        return
    if endpoint.startswith("tcp://"):
        match = _TCP_RE.fullmatch(endpoint)
        if not match or not 1 <= int(match.group(2)) <= 65535:
            raise EndpointError(f"a tcp:// endpoint is tcp://HOST:PORT with PORT in 1..65535, got {endpoint!r}")
        return
    raise EndpointError(f"expected an ipc:// or tcp:// endpoint ({EXPECTED}), got {endpoint!r}")
