"""A standby kvtierd: a second, fully started process that serves the moment the daemon that serves dies.

A restart after a crash costs a whole start: importing torch alone takes
seconds on a small host, and the adoption of the CPU tier (0.01 s for 4 GiB)
waits behind it. With ``standby = true`` the serving daemon (the primary)
keeps a second kvtierd (the standby) started with its own command line: it
has imported everything, built its server and holds a duplicate of the
listening socket, and waits. When the primary dies (SIGKILL, the OOM
killer, a crash) the standby adopts the CPU tiers the primary left and
serves on the very socket (connections made meanwhile wait in its backlog),
then starts a standby of its own. This module is the conversation of both
ends over their control channel (``kvtier.daemon.process.control_channel``);
``kvtier.daemon.server`` drives them.

Contract:

- ``StandbyKeeper(argv, environ, listener)`` (the primary's side, its
  event loop calls ``turn(now_s, refused=)`` every iteration): starts a
  standby with ``argv`` and ``environ`` plus ``KVTIER_STANDBY_FDS=
  <control>,<listen>,<primary pid>,<owns file>`` and those two descriptors
  (the other end of a ``kvtier.daemon.process.control_channel``; a duplicate of
  the listening socket), stdin from /dev/null, stdout and stderr shared.
  ``refused``, a reason in words (an upgrade under way: its successor
  takes over the tiers, and a standby beside it would be a second
  claimant; a stop), stands the standby down; ``""`` starts one when there
  is none (again ``RETRY_S`` after one exited on its own). ``stand_down(why)``
  sends ``stand_down`` and closes the channel: the standby exits 0 (at
  once, or as soon as its start-up reaches the wait). ``pid`` is the
  standby's, ``ready`` whether it said it waits. Never raises: a standby
  that cannot start is a warning, the primary serves on.
- ``StandbyWait.from_environ(environ)`` (the standby's side): None unless
  this process was started as a standby (the variable is removed from
  ``environ``: it is not configuration); opens a pidfd of the primary at
  once. ``wait(stop)`` sends ``ready`` and blocks until one of: a
  ``stand_down`` message, or a stop flag (returns None: exit 0, nothing
  served); the primary has exited without a ``stand_down`` (returns a
  ``Takeover``). It never returns a ``Takeover`` while the primary process
  exists: a closed channel alone (a primary that closed it and lives on)
  does not count. Once the primary has exited its descriptors are closed,
  its arena locks (``flock``) released and no thread of it can write the
  CPU tiers: the standby adopts them as after any crash
  (``PoolRegistry.adopt_arenas``), and an arena still held by some other
  live process is left alone there.
- The standby's start-up touches nothing the primary owns: it lists no
  arena (listing tidies leftovers of interrupted creations, which could be
  the primary's creation in progress), binds nothing, talks to systemd not
  at all until it serves; then ``READY=1`` with ``MAINPID=`` its own pid.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from kvtier.daemon.process.control_channel import POLL_SLICE_S, StopRequested, inherit, receive_kind, send, start_peer
from kvtier.daemon.process.listener import Listener

log = logging.getLogger(__name__)

STANDBY_ENV = "KVTIER_STANDBY_FDS"
RETRY_S = 30.0  # after a standby exited on its own (a start-up error), before the next try


class StandbyKeeper:
    """The primary's side: keeps one standby process waiting (see the module docstring)."""

    def __init__(self, argv: Sequence[str], environ: Callable[[], Mapping[str, str]],
                 listener: Callable[[], Listener | None]) -> None:
        self.argv = list(argv)
        self._environ = environ
        self._listener = listener
        self.proc: subprocess.Popen[bytes] | None = None
        self.ctl: socket.socket | None = None
        self.ready = False
        self._retry_at_s = 0.0
        # Stood down, not reaped yet. Never signalled: one still starting reads stand_down when it gets to its
        # wait, and one that read it is exiting (tearing torch down takes seconds; a signal then would kill it).
        self._leaving: list[subprocess.Popen[bytes]] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def turn(self, now_s: float, *, refused: str = "") -> None:
        self._reap_leaving()
        if refused:
            if self.proc is not None:
                self.stand_down(refused)
            return
        if self.proc is None:
            if now_s >= self._retry_at_s:
                self._start(now_s)
            return
        assert self.ctl is not None
        while (kind := receive_kind(self.ctl)):
            if kind == "ready" and not self.ready:
                self.ready = True
                log.info("standby kvtierd pid %d is ready: it serves if this daemon dies", self.proc.pid)
        if kind is None or self.proc.poll() is not None:
            status = self._reap(self.proc, 1.0)
            log.warning("standby kvtierd pid %d exited (status %s) before it was needed; another in %.0f s",
                        self.proc.pid, status, RETRY_S)
            self._forget()
            self._retry_at_s = now_s + RETRY_S

    def _start(self, now_s: float) -> None:
        listener = self._listener()
        if listener is None:
            return
        try:
            self.proc, self.ctl = start_peer(self.argv, self._environ(), STANDBY_ENV, listener,
                                             int(listener.owns_file))
        except OSError as exc:
            log.warning("cannot start a standby kvtierd (%s): %s; next try in %.0f s", " ".join(self.argv), exc,
                        RETRY_S)
            self._retry_at_s = now_s + RETRY_S
            return
        self.ready = False
        log.info("started standby kvtierd pid %d (it imports, then waits to serve if this daemon dies)",
                 self.proc.pid)

    def stand_down(self, why: str) -> None:
        """Tell the standby to exit (it never serves); reaped later, or left to whoever reaps orphans."""
        if self.proc is None or self.ctl is None:
            return
        send(self.ctl, "stand_down", why=why)
        log.info("standby kvtierd pid %d stands down: %s", self.proc.pid, why)
        self._leaving.append(self.proc)
        self._forget()

    def close(self, why: str) -> None:
        """Stopping for good (drained, or handed over): the standby stands down."""
        self.stand_down(why)
        self._reap_leaving()

    def _forget(self) -> None:
        if self.ctl is not None:
            self.ctl.close()
        self.ctl = None
        self.proc = None
        self.ready = False

    def _reap_leaving(self) -> None:
        kept = []
        for proc in self._leaving:
            if (status := proc.poll()) is not None:
                log.info("standby kvtierd pid %d exited (status %s) after standing down", proc.pid, status)
            else:
                kept.append(proc)
        self._leaving = kept

    @staticmethod
    def _reap(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None


@dataclass(frozen=True)
class Takeover:
    primary_pid: int
    owns_file: bool  # the ipc socket file is kvtierd's to remove when the last daemon stops for good


class StandbyWait:
    """The standby's side: the control channel, the primary's pidfd, the socket it inherits."""

    def __init__(self, ctl: socket.socket, listen_fd: int, primary_pid: int, owns_file: bool) -> None:
        self.ctl = ctl
        self.listen_fd = listen_fd
        self.primary_pid = primary_pid
        self.owns_file = owns_file
        # Opened now, while the primary is our parent: the pidfd names that very process (no pid reuse).
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(primary_pid)
        except (ProcessLookupError, OSError, AttributeError):
            self._pidfd = None
        if os.getppid() != primary_pid and self._pidfd is not None:
            # It died before the pidfd opened: the pid may be another process's by now.
            os.close(self._pidfd)
            self._pidfd = None

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str]) -> StandbyWait | None:
        inherited = inherit(environ, STANDBY_ENV, 4, "a standby")
        if inherited is None:
            return None
        ctl, (listen_fd, pid, owns) = inherited
        return cls(ctl, listen_fd, pid, bool(owns))

    def primary_alive(self) -> bool:
        if self._pidfd is not None:
            ready, _, _ = select.select([self._pidfd], [], [], 0)
            return not ready
        return os.getppid() == self.primary_pid

    def wait(self, stop: StopRequested) -> Takeover | None:
        send(self.ctl, "ready", pid=os.getpid())
        log.info("standby: ready; serving %s as soon as kvtierd pid %d exits", "the socket", self.primary_pid)
        channel_open = True
        try:
            while not stop.requested:
                watched = [self.ctl] if channel_open else []
                if self._pidfd is not None:
                    watched.append(self._pidfd)
                select.select(watched, [], [], POLL_SLICE_S)
                # Messages first: a primary that stood us down and then exited was not a crash.
                while channel_open and (kind := receive_kind(self.ctl)) != "":
                    if kind is None:
                        channel_open = False
                    elif kind == "stand_down":
                        log.info("standby: kvtierd pid %d stood this standby down; exiting", self.primary_pid)
                        return None
                if not self.primary_alive():
                    log.warning("standby: kvtierd pid %d died; adopting what it left and serving", self.primary_pid)
                    return Takeover(self.primary_pid, self.owns_file)
            return None
        finally:
            self.close()

    def close(self) -> None:
        if self.ctl.fileno() >= 0:
            self.ctl.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
