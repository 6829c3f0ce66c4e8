"""Where kvtierd listens, and session-less questions to it (for tools, probes and scripts).

Contract
========

- ``default_socket(environ, uid=None)`` is the endpoint kvtierd binds when
  nothing configures one, by the rule in ``kvtier.daemon.config`` (the
  daemon's copy; a test keeps the two equal): ``ipc://$XDG_RUNTIME_DIR/
  kvtier/kvtierd.sock`` when ``XDG_RUNTIME_DIR`` is an absolute path, else
  ``ipc:///run/user/<uid>/kvtier/kvtierd.sock`` when that directory exists,
  else ``ipc://${TMPDIR:-/tmp}/kvtier-<uid>/kvtierd.sock``.
- ``resolve_endpoint(explicit, environ)``: what a tool talks to: the
  explicit ``--socket`` value, else ``$KVTIER_SOCKET`` (the daemon reads the
  same variable), else ``default_socket``. A socket set only in a kvtierd
  config file must be passed with ``--socket``: tools read no daemon config.
- ``endpoint_problem(endpoint)``: why a client could never reach a
  kvtierd at ``endpoint`` (a string saying what is wrong and what is
  expected), or None when it is a well-formed ``ipc://`` (an absolute path
  of at most ``kvtier.client.endpoint.MAX_IPC_PATH_BYTES``, or an ``@name``) or ``tcp://HOST:PORT``
  endpoint: the forms kvtierd binds (``kvtier.daemon.config``'s rule, less
  what only the daemon decides: CURVE or ``insecure_tcp``).
- ``request(endpoint, op, timeout_s=...)`` sends one session-less request
  (``health`` or ``stats``: the verbs whose ``sid`` is optional) on a
  throwaway DEALER socket and returns the reply's fields. It opens no
  session and creates no pool. When nothing answers it raises
  ``DaemonUnavailable`` (a ``KvtierTimeout``) whose message says how to fix
  it; an ``ipc://`` socket file that does not exist fails at once, without
  waiting for the timeout. An error reply raises ``DaemonError``.

Importing this module imports no torch and nothing from ``kvtier.daemon``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import zmq

from kvtier.client.curve import CurveKeys
from kvtier.client.protocol import OPS, ErrorCode, ProtocolError, decode, encode, request_header
from kvtier.client.endpoint import EndpointError, check_endpoint, ipc_socket_file
from kvtier.client.transport import DaemonError, KvtierTimeout

__all__ = ["DaemonUnavailable", "default_socket", "endpoint_problem", "request", "resolve_endpoint"]

SOCKET_ENV = "KVTIER_SOCKET"
DEFAULT_ADMIN_TIMEOUT_S = 2.0


class DaemonUnavailable(KvtierTimeout):
    """No kvtierd answers at the endpoint (not running, or another socket)."""

    def __init__(self, endpoint: str, why: str = "") -> None:
        detail = f" ({why})" if why else ""
        super().__init__(f"no kvtierd at {endpoint}{detail}: start it with `kvtierd` or pass --socket")
        self.endpoint = endpoint


def default_socket(environ: Mapping[str, str] | None = None, *, uid: int | None = None) -> str:
    """The daemon's default ``ipc://`` endpoint; the order is in the module docstring."""
    environ = os.environ if environ is None else environ
    uid = os.getuid() if uid is None else uid
    runtime_dir = environ.get("XDG_RUNTIME_DIR", "")
    if runtime_dir and os.path.isabs(runtime_dir):
        return f"ipc://{Path(runtime_dir) / 'kvtier' / 'kvtierd.sock'}"
    user_run = Path(f"/run/user/{uid}")
    if user_run.is_dir():
        return f"ipc://{user_run / 'kvtier' / 'kvtierd.sock'}"
    tmp_dir = environ.get("TMPDIR", "")
    if not (tmp_dir and os.path.isabs(tmp_dir)):
        tmp_dir = "/tmp"
    return f"ipc://{Path(tmp_dir) / f'kvtier-{uid}' / 'kvtierd.sock'}"


def resolve_endpoint(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """``explicit``, else ``$KVTIER_SOCKET``, else ``default_socket()``."""
    environ = os.environ if environ is None else environ
    return explicit or environ.get(SOCKET_ENV) or default_socket(environ)


def endpoint_problem(endpoint: object) -> str | None:
    """What makes ``endpoint`` one no kvtierd can be at, or None; see the module docstring."""
    try:
        check_endpoint(endpoint)
    except EndpointError as exc:
        return str(exc)
    return None


def request(endpoint: str, op: str, *, timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S,
            curve: CurveKeys | None = None) -> dict[str, Any]:
    """One session-less request; see the module docstring. ``curve``: this client's keys for a
    ``tcp://`` daemon with CURVE (``CurveKeys.load(server public key, own secret key file)``)."""
    spec = OPS.get(op)
    if spec is None or spec.session != "optional":
        raise ValueError(f"{op!r} is not a session-less verb")
    try:
        path = ipc_socket_file(endpoint)  # None for tcp:// and ipc://@name (no file to look for)
    except EndpointError as exc:
        raise DaemonUnavailable(endpoint, str(exc)) from None
    if path is not None and not os.path.exists(path):
        raise DaemonUnavailable(endpoint, "no socket file")
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    try:
        sock.connect(endpoint)
        sock.send(encode(request_header(op, 1, None)))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise DaemonUnavailable(endpoint, f"no answer in {timeout_s:g} s")
        rh = decode(sock.recv_multipart()[0])
    finally:
        sock.close(linger=0)
        zctx.term()
    if not isinstance(rh, dict) or rh.get("id") != 1:
        raise ProtocolError(ErrorCode.MALFORMED, f"bad {op} reply: {rh!r:.200}")
    if rh.get("ok") is not True:
        err = rh.get("error") or {}
        raise DaemonError(int(err.get("code", ErrorCode.INTERNAL)), str(err.get("message", "")))
    return {k: v for k, v in rh.items() if k not in ("v", "id", "ok")}
