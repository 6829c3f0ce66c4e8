"""A zero-downtime upgrade, the serving daemon's side: start a successor, hand it the socket and the CPU tiers.

SIGUSR2 (``systemctl reload kvtierd@N``) sets ``StopFlag.upgrade_requested``;
the event loop calls ``Upgrade.turn`` every iteration, and this class walks
one hand-over through its steps (``kvtier.daemon.process.handover`` is the process
and channel mechanics and the successor's side):

- ``starting``: the successor (same command line and environment: after an
  upgrade, the new code and configuration) starts while this daemon serves
  as usual. It is stopped if not ``ready`` within ``upgrade_timeout_s``;
  one that exits first (a bad configuration, an import error) changes
  nothing here but a log line.
- ``quiescing`` (after ``ready``): new requests are held unanswered
  (``health`` and ``stats`` still answer); the copies in flight finish and
  the replies that lend tier memory go out (within ``drain_timeout_s``;
  then their connections are shut down, so that no frame of ours reads the
  CPU tier once the successor owns it). Then the host releases: its pools
  close (the GPU tier's blocks demoted first, as at SIGTERM; the arenas
  kept), its sessions end, the metrics endpoint closes: ``released``.
- ``released``: the successor adopts and starts accepting: ``serving``.
  Then systemd learns the new main process (``MAINPID=``, ``READY=1``) and
  every held request is answered ``SHUTTING_DOWN`` (it did not run; the
  client resends it on a new connection).
- ``redirecting``: both daemons accept on the socket now, and libzmq
  cannot stop accepting without dropping its connections, so for up to
  ``REDIRECT_MAX_S`` (less once it has no connection left) every request
  that still reaches this daemon is answered ``SHUTTING_DOWN`` at once (the
  client tries a new connection again, after a short pause), so that none
  is lost when it closes. Then the loop ends: the daemon exits 0, leaving
  the socket file in place. If the release left a copy unfinished
  (``stuck``) the successor adopts only after this process has exited,
  which it then does at once.
- A successor that dies between ``ready`` and ``serving``: the host adopts
  its arenas again and handles the held requests itself (its sessions are
  gone: clients open new ones). A stop (SIGTERM) before ``released``
  stops the successor and drains as usual; after it, the hand-over ends
  first.

``UpgradeHost`` is what the server provides: narrow hooks, all called on
the loop's thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvtier.daemon.process.handover import Predecessor
from kvtier.daemon.process.listener import Listener
from kvtier.daemon.process.sd_notify import Notifier

log = logging.getLogger(__name__)

SHUT_LENT_WAIT_S = 2.0  # after shutting down connections with lent replies, for libzmq to let go of the frames
GONE_REAP_WAIT_S = 1.0  # a successor whose channel closed: how long to wait for its exit status
REDIRECT_MAX_S = 1.0  # after the successor serves, the longest this daemon answers SHUTTING_DOWN before it closes


class UpgradeHost(Protocol):
    def quiet(self) -> bool:
        """No copy in flight and no reply libzmq still sends from tier memory."""

    def shut_lent(self) -> None:
        """Shut down the connections whose replies still lend tier memory."""

    def hold(self, on: bool) -> None:
        """Hold new requests unanswered (health and stats excepted), or stop holding."""

    def release(self, deadline_s: float) -> bool:
        """Close the pools (arenas kept), end the sessions, close the metrics endpoint; True if a copy was left
        unfinished."""

    def readopt(self) -> None:
        """Take the arenas back after a failed hand-over, and the metrics endpoint."""

    def answer_held(self, shutting_down: bool) -> int:
        """Answer the held requests SHUTTING_DOWN, or handle them now; returns how many."""

    def redirect(self) -> None:
        """From now on answer every request (health and stats excepted) SHUTTING_DOWN at once."""

    def connections(self) -> int:
        """Client connections this daemon still has."""


class Upgrade:
    """See the module docstring."""

    def __init__(self, host: UpgradeHost, *, argv: Sequence[str], environ: Callable[[], Mapping[str, str]],
                 listener: Callable[[], Listener | None], notifier: Notifier, timeout_s: float,
                 drain_timeout_s: float) -> None:
        self.host = host
        self.argv = list(argv)
        self._environ = environ
        self._listener = listener
        self.notifier = notifier
        self.timeout_s = timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.state = "idle"  # idle, starting, quiescing, released, redirecting, done
        self.successor: Predecessor | None = None
        self._deadline_s = 0.0
        self._quiesce_deadline_s = 0.0
        self._shut_at_s: float | None = None
        self.handed_over_to: int | None = None

    @property
    def fileno(self) -> int | None:
        """The control channel's descriptor while a hand-over runs (the loop polls it)."""
        return self.successor.fileno() if self.successor is not None and self.state != "done" else None

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def releasing(self) -> bool:
        """Past the point of no return for a stop: the CPU tiers are the successor's to adopt."""
        return self.state in ("released", "redirecting")

    def begin(self) -> None:
        """SIGUSR2: start a successor (once at a time)."""
        if self.state != "idle":
            log.warning("SIGUSR2: a hand-over to kvtierd pid %s is already under way; ignored",
                        self.successor.pid if self.successor else "?")
            return
        listener = self._listener()
        if listener is None:
            log.error("SIGUSR2: this daemon does not hold its listening socket; cannot hand it over")
            return
        try:
            self.successor = Predecessor.start(self.argv, self._environ(), listener)
        except OSError as exc:
            log.error("SIGUSR2: cannot start a successor (%s): %s; still serving", " ".join(self.argv), exc)
            return
        self.state = "starting"
        self._deadline_s = time.monotonic() + self.timeout_s
        log.info("SIGUSR2: upgrading; started kvtierd pid %d to take over (it has %.0f s to get ready); serving "
                 "meanwhile", self.successor.pid, self.timeout_s)
        self.notifier.notify(reloading="1", status=f"upgrading: successor kvtierd pid {self.successor.pid} starting")

    def stop(self) -> None:
        """SIGTERM/SIGINT before the release: the successor is stopped, the daemon drains as usual."""
        if self.state in ("starting", "quiescing") and self.successor is not None:
            log.info("stopping: the hand-over to kvtierd pid %d is abandoned", self.successor.pid)
            self._fail("this daemon is stopping", resume=False)

    def turn(self, now_s: float) -> None:
        """One step of the loop; reads the control channel when there is something to read."""
        if self.state == "redirecting":
            if now_s >= self._deadline_s or not self.host.connections():
                self.state = "done"
            return
        if self.successor is None or self.state in ("idle", "done"):
            return
        kind = self.successor.read()
        while kind not in (None, "gone"):
            self._on_message(kind, now_s)
            if self.successor is None or self.state in ("idle", "redirecting", "done"):
                return
            kind = self.successor.read()
        if kind == "gone":
            self._on_gone()
            return
        if self.state == "starting" and now_s >= self._deadline_s:
            self._fail(f"it was not ready within upgrade_timeout_s ({self.timeout_s:g} s)")
        elif self.state == "quiescing":
            self._quiesce(now_s)
        elif self.state == "released" and now_s >= self._deadline_s:
            self._fail(f"it did not serve within upgrade_timeout_s ({self.timeout_s:g} s) of the release")

    def _on_message(self, kind: str, now_s: float) -> None:
        assert self.successor is not None
        if kind == "ready" and self.state == "starting":
            log.info("hand-over: kvtierd pid %d is ready; holding new requests while copies finish and the CPU tiers "
                     "are released", self.successor.pid)
            self.state = "quiescing"
            self._quiesce_deadline_s = now_s + self.drain_timeout_s
            self.host.hold(True)
            self._quiesce(now_s)
        elif kind == "serving" and self.state == "released":
            self._finish()
        else:
            log.warning("hand-over: unexpected %r from kvtierd pid %d in state %s; ignored", kind, self.successor.pid,
                        self.state)

    def _quiesce(self, now_s: float) -> None:
        assert self.successor is not None
        if not self.host.quiet():
            if now_s < self._quiesce_deadline_s:
                return
            if self._shut_at_s is None:
                log.warning("hand-over: replies lending tier memory still unsent after drain_timeout_s (%g s): "
                            "shutting their connections down", self.drain_timeout_s)
                self.host.shut_lent()
                self._shut_at_s = now_s
                return
            if now_s < self._shut_at_s + SHUT_LENT_WAIT_S:
                return
        stuck = self.host.release(time.monotonic() + self.drain_timeout_s)
        listener = self._listener()
        if not self.successor.release(stuck=stuck, owns_file=bool(listener and listener.owns_file)):
            self._on_gone()
            return
        self.state = "released"
        self._deadline_s = time.monotonic() + self.timeout_s
        if stuck:
            # The successor adopts only once we are gone (no copy of ours may write its CPU tiers then).
            log.warning("hand-over: a copy into the CPU tiers did not finish within drain_timeout_s; exiting now so "
                        "that kvtierd pid %d can adopt them", self.successor.pid)
            self._finish(redirect=False)
        else:
            log.info("hand-over: released the CPU tiers and the socket to kvtierd pid %d", self.successor.pid)

    def _finish(self, *, redirect: bool = True) -> None:
        assert self.successor is not None
        pid = self.successor.pid
        # systemd: the successor is the service's main process from now on (it is in our cgroup).
        self.notifier.notify(mainpid=str(pid), ready="1", status=f"handed over to kvtierd pid {pid}")
        held = self.host.answer_held(shutting_down=True)
        self.successor.close()
        self.handed_over_to = pid
        if redirect:
            self.host.redirect()
            self.state = "redirecting"
            self._deadline_s = time.monotonic() + REDIRECT_MAX_S
        else:
            self.state = "done"
        log.info("hand-over: kvtierd pid %d serves; %d held requests told to resend there", pid, held)

    def _on_gone(self) -> None:
        """The control channel closed: the successor exited, or is exiting."""
        assert self.successor is not None
        if self.state == "released":
            self._fail("it went away after the release, before it served")
            return
        status = self.successor.reap(GONE_REAP_WAIT_S)
        self._fail(f"it exited with status {status}" if status is not None else "it closed the control channel")

    def _fail(self, why: str, *, resume: bool = True) -> None:
        assert self.successor is not None
        successor = self.successor
        was = self.state
        successor.abort(why)
        status = successor.reap()
        self.successor = None
        self.state = "idle"
        if was in ("quiescing", "released"):
            if was == "released":
                self.host.readopt()
            self.host.hold(False)
            # Held requests never ran: handled now, or (stopping) told to go elsewhere.
            self.host.answer_held(shutting_down=not resume)
        log.error("upgrade failed: successor kvtierd pid %d %s (exit status %s); %s", successor.pid, why, status,
                  "this daemon keeps serving" if resume else "draining")
        self.notifier.notify(ready="1", status=f"upgrade failed: successor {why}; serving (pid {os.getpid()})")

