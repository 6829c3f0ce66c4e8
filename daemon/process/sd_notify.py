"""systemd's notify protocol, without a dependency: READY, STATUS, WATCHDOG, STOPPING.

Contract:

- ``Notifier.from_environ(environ, predecessor_pid=None)`` reads
  ``$NOTIFY_SOCKET`` (a filesystem path, or an abstract socket written with
  a leading ``@``) and ``$WATCHDOG_USEC`` / ``$WATCHDOG_PID``. Without
  ``$NOTIFY_SOCKET`` every call is a no-op, so the daemon runs the same
  outside systemd. A successor started by a hand-over inherits its
  predecessor's environment, whose ``WATCHDOG_PID`` names the predecessor
  (``predecessor_pid``): the watchdog is then this process's to feed, once
  the predecessor made it the main process (``MAINPID=``).
- ``notify(**fields)`` sends one datagram ``KEY=value\\n...``; failures are
  logged once and never raised (a lost status line must not stop a daemon).
- ``ready(status)``, ``status(text)``, ``stopping(status)``,
  ``watchdog_due(now_s)`` + ``watchdog()``: the daemon's loop pings at half
  of ``WatchdogSec`` so one slow iteration does not get it killed.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None, watchdog_interval_s: float | None = None) -> None:
        self.address = address
        self.watchdog_interval_s = watchdog_interval_s
        self._next_watchdog_s = 0.0
        self._warned = False
        self._sock: socket.socket | None = None
        # The STATUS= text sent last, by whoever sent it: the loop's summary goes
        # out only when it differs (an allocation's progress line in between counts).
        self.last_status = ""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, *, predecessor_pid: int | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        interval_s = None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        ours = {str(os.getpid())} | ({str(predecessor_pid)} if predecessor_pid is not None else set())
        if usec and (pid is None or pid in ours):
            try:
                interval_s = int(usec) / 1e6 / 2
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return cls(address, interval_s)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: str) -> bool:
        if self.address is None:
            return False
        if "status" in fields:
            self.last_status = fields["status"]
        payload = "".join(f"{k.upper()}={v}\n" for k, v in fields.items()).encode()
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, target)
            return True
        except OSError as exc:
            if not self._warned:
                log.warning("sd_notify to %s failed: %s", self.address, exc)
                self._warned = True
            return False

    def ready(self, status: str) -> bool:
        return self.notify(ready="1", status=status, mainpid=str(os.getpid()))

    def status(self, text: str) -> bool:
        return self.notify(status=text)

    def stopping(self, status: str = "draining") -> bool:
        return self.notify(stopping="1", status=status)

    def watchdog_due(self, now_s: float | None = None) -> bool:
        if self.watchdog_interval_s is None or self.address is None:
            return False
        return (time.monotonic() if now_s is None else now_s) >= self._next_watchdog_s

    def watchdog(self, now_s: float | None = None) -> bool:
        now = time.monotonic() if now_s is None else now_s
        self._next_watchdog_s = now + (self.watchdog_interval_s or 0.0)
        return self.notify(watchdog="1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
