"""The two ends of a hand-over: a running kvtierd (the predecessor) and the successor it starts.

A zero-downtime upgrade (SIGUSR2; ``systemctl reload kvtierd@N``) is a
conversation over a control channel (``kvtier.daemon.process.control_channel``)
between the daemon that serves and the one that is to serve.
``kvtier.daemon.process.upgrade`` drives the predecessor's side from its event
loop; ``kvtier.daemon.server`` runs the successor's before it binds. This
module is the conversation: its messages and what each end does on them.

Contract:

- ``Predecessor.start(argv, environ, listener)``: starts the successor
  with ``argv`` (``sys.orig_argv``: the same command, so after ``pip
  install -U``, the new code), ``environ`` plus ``KVTIER_HANDOVER_FDS=
  <control>,<listen>,<predecessor pid>``, and those two descriptors (the control channel's
  other end, a duplicate of the listening socket); stdin from /dev/null,
  stdout and stderr shared (its log lines follow ours in the journal).
  ``read()`` returns the successor's next message kind without blocking
  (``"ready"``, ``"serving"``), ``None`` when there is none yet, or
  ``"gone"`` once the channel is closed (the successor exited, or gave
  up). ``release(stuck=, owns_file=)`` sends ``released``; ``abort(why)``
  sends ``abort`` and stops the successor (SIGTERM, then SIGKILL after
  ``STOP_TIMEOUT_S``); ``reap()`` returns its exit status once it exited
  (None while it runs).
- ``Successor.from_environ(environ)``: None unless this process was started
  by a predecessor (the variable is removed from ``environ``: it is not
  configuration). ``take_over(stop, timeout_s)`` sends ``ready`` and waits
  for ``released``; returns a ``Released`` (``stuck``: the predecessor
  could not finish a copy into its CPU tiers; then this waits until the
  predecessor has exited, so no thread of it can write there again;
  ``owns_file``: whether the ipc socket file is kvtierd's to remove), or
  None when the predecessor sent ``abort``, the stop flag was set, or
  nothing came within ``timeout_s``. A predecessor that died without a
  word (SIGKILL) released everything with its death: that returns a
  ``Released`` too (``orphaned``), and the successor adopts as after a
  crash. ``serving()`` tells the predecessor it may go, and closes the
  channel.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from kvtier.daemon.process.control_channel import (POLL_SLICE_S, StopRequested, inherit, kind_of, receive, receive_kind, send,
                                            start_peer)
from kvtier.daemon.process.listener import Listener

log = logging.getLogger(__name__)

HANDOVER_ENV = "KVTIER_HANDOVER_FDS"
STOP_TIMEOUT_S = 10.0  # a successor told to stop gets this long before SIGKILL


class Predecessor:
    """The running daemon's side: the successor process and its control channel."""

    def __init__(self, proc: subprocess.Popen[bytes], ctl: socket.socket) -> None:
        self.proc = proc
        self.ctl = ctl
        self.pid = proc.pid
        self._closed = False

    @classmethod
    def start(cls, argv: Sequence[str], environ: Mapping[str, str], listener: Listener) -> Predecessor:
        proc, ours = start_peer(argv, environ, HANDOVER_ENV, listener)
        ours.setblocking(False)
        return cls(proc, ours)

    def fileno(self) -> int:
        return self.ctl.fileno()

    def read(self) -> str | None:
        if self._closed:
            return "gone"
        kind = receive_kind(self.ctl)
        if kind is None:
            self.close()
            return "gone"
        return kind or None

    def release(self, *, stuck: bool, owns_file: bool) -> bool:
        return send(self.ctl, "released", stuck=stuck, owns_file=owns_file, pid=os.getpid())

    def abort(self, why: str) -> None:
        """Tell the successor to give up, and make sure it does."""
        send(self.ctl, "abort", why=why)
        self.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)

    def reap(self, timeout_s: float = 0.0) -> int | None:
        try:
            return self.proc.wait(timeout_s) if timeout_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.ctl.close()


@dataclass(frozen=True)
class Released:
    stuck: bool  # the predecessor left copies into its CPU tiers unfinished (it has exited since)
    owns_file: bool  # the ipc socket file is kvtierd's to remove when the last daemon stops for good
    orphaned: bool = False  # the predecessor died without a word: what it held, the kernel released


class Successor:
    """The starting daemon's side: the control channel and the socket it inherits."""

    def __init__(self, ctl: socket.socket, listen_fd: int, predecessor_pid: int) -> None:
        self.ctl = ctl
        self.listen_fd = listen_fd
        # Named by the predecessor: if it died already, our parent is whoever reaps orphans.
        self.predecessor_pid = predecessor_pid

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str]) -> Successor | None:
        inherited = inherit(environ, HANDOVER_ENV, 3, "a hand-over")
        if inherited is None:
            return None
        ctl, (listen_fd, pid) = inherited
        return cls(ctl, listen_fd, pid)

    def take_over(self, stop: StopRequested, timeout_s: float) -> Released | None:
        if not send(self.ctl, "ready", pid=os.getpid()):
            return self._orphaned(stop, timeout_s)
        log.info("hand-over: ready; waiting for kvtierd pid %d to release the socket and the CPU tiers",
                 self.predecessor_pid)
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if stop.requested:
                return None
            msg = receive(self.ctl, min(POLL_SLICE_S, deadline_s - time.monotonic()))
            if msg is None:
                return self._orphaned(stop, deadline_s - time.monotonic())
            kind = kind_of(msg)
            if kind == "abort":
                log.warning("hand-over: kvtierd pid %d gave up the hand-over (%s); exiting", self.predecessor_pid,
                            msg.get("why", "no reason given"))
                return None
            if kind == "released":
                released = Released(stuck=bool(msg.get("stuck")), owns_file=bool(msg.get("owns_file")))
                if released.stuck and not self._wait_gone(stop, deadline_s - time.monotonic()):
                    return None
                return released
        log.error("hand-over: kvtierd pid %d did not release within %.0f s; exiting", self.predecessor_pid, timeout_s)
        return None

    def _orphaned(self, stop: StopRequested, timeout_s: float) -> Released | None:
        """The channel closed without a word: the predecessor died (its flocks went with it) or is dying."""
        if not self._wait_gone(stop, timeout_s):
            return None
        log.warning("hand-over: kvtierd pid %d died before it released; adopting what it left, as after a crash",
                    self.predecessor_pid)
        # Whose socket file it is went with it: left in place (a later start removes a stale one).
        return Released(stuck=False, owns_file=False, orphaned=True)

    def _wait_gone(self, stop: StopRequested, timeout_s: float) -> bool:
        """Wait until the predecessor has exited (it was our parent: we are re-parented then)."""
        deadline_s = time.monotonic() + max(0.0, timeout_s)
        while os.getppid() == self.predecessor_pid and _alive(self.predecessor_pid):
            if stop.requested or time.monotonic() >= deadline_s:
                return False
            time.sleep(0.01)
        return True

    def serving(self) -> None:
        send(self.ctl, "serving", pid=os.getpid())
        self.close()

    def close(self) -> None:
        if self.ctl.fileno() >= 0:
            self.ctl.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not reaped yet) still answers kill(0): it no longer runs.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False
