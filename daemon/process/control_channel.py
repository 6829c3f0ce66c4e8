"""The control channel between a serving kvtierd and a kvtierd it starts beside itself.

Both a hand-over (``kvtier.daemon.process.handover``: the successor of an upgrade)
and a standby (``kvtier.daemon.process.standby``) are a second kvtierd, started
with the serving daemon's own command line, that inherits a duplicate of
the listening socket and talks to its starter over an ``AF_UNIX``
``SOCK_SEQPACKET`` pair, one JSON object per message (``{"msg": kind,
...}``, at most ``MAX_MESSAGE_BYTES``). This module is that channel; what
the messages mean is the two callers'.

Contract:

- ``start_peer(argv, environ, variable, listener, *extra)``: starts the
  process with ``environ`` plus ``variable=<control>,<listen>,<our pid>
  [,extra...]`` and those two descriptors (the channel's other end, a
  duplicate of the listening socket); stdin from /dev/null, stdout and
  stderr shared. Returns the process and our end of the channel; raises
  what ``subprocess.Popen`` raises, with nothing left open.
- ``inherit(environ, variable, fields, what)``: the started process's
  side. None unless ``variable`` is set (it is removed from ``environ``
  and ``os.environ``: it is not configuration, and our own peer gets its
  own); else our end of the channel and the other ``fields - 1`` numbers.
  Raises ``RuntimeError`` (naming ``what``) for a value that is not that.
- ``send(sock, kind, **fields)``: one message; False when the other end is gone.
- ``receive(sock, timeout_s)``: the next message, never blocking past
  ``timeout_s`` (None: not at all); ``{}`` when none came (or one not
  readable), None when the other end closed. ``kind_of(msg)`` is its
  ``"msg"`` (``""`` when it has none); ``receive_kind(sock)`` the next
  message's kind without waiting (``""`` when none, None when closed).
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Protocol

from kvtier.daemon.process.listener import Listener

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4096
POLL_SLICE_S = 0.1  # a waiting peer looks at its stop flag this often


class StopRequested(Protocol):
    @property
    def requested(self) -> bool: ...


def start_peer(argv: Sequence[str], environ: Mapping[str, str], variable: str, listener: Listener,
               *extra: int) -> tuple[subprocess.Popen[bytes], socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listen_fd = os.dup(listener.fd)
    try:
        env = dict(environ)
        env[variable] = ",".join(str(n) for n in (theirs.fileno(), listen_fd, os.getpid(), *extra))
        proc = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(), listen_fd))
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
        os.close(listen_fd)
    return proc, ours


def inherit(environ: MutableMapping[str, str], variable: str, fields: int,
            what: str) -> tuple[socket.socket, list[int]] | None:
    value = environ.pop(variable, None)
    os.environ.pop(variable, None)
    if not value:
        return None
    try:
        numbers = [int(x) for x in value.split(",")]
        if len(numbers) != fields:
            raise ValueError(f"{len(numbers)} numbers, not {fields}")
        ctl = socket.socket(fileno=numbers[0])
    except (ValueError, OSError) as exc:
        raise RuntimeError(f"{variable}={value!r}: not the descriptors of {what} ({exc})") from None
    os.set_inheritable(ctl.fileno(), False)
    return ctl, numbers[1:]


def send(sock: socket.socket, kind: str, **fields: Any) -> bool:
    try:
        sock.send(json.dumps({"msg": kind, **fields}).encode())
        return True
    except OSError:
        return False


def receive(sock: socket.socket, timeout_s: float | None) -> dict[str, Any] | None:
    if timeout_s is not None:
        ready, _, _ = select.select([sock], [], [], max(0.0, timeout_s))
        if not ready:
            return {}
    try:
        data = sock.recv(MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return {}
    except OSError:
        return None
    if not data:
        return None
    try:
        msg = json.loads(data)
    except ValueError:
        log.warning("control channel: an unreadable message (%d bytes) ignored", len(data))
        return {}
    return msg if isinstance(msg, dict) else {}


def kind_of(msg: Mapping[str, Any]) -> str:
    kind = msg.get("msg")
    return kind if isinstance(kind, str) else ""


def receive_kind(sock: socket.socket) -> str | None:
    msg = receive(sock, None)
    return None if msg is None else kind_of(msg)
