"""Process lifecycle: the stop flag that SIGTERM and SIGINT set.

Contract:

- ``StopFlag.install()`` makes SIGTERM and SIGINT set the flag and nothing
  else, except that the first signal also restores the default disposition of
  both signals: a second signal then ends the process at once, from the
  kernel, even while the main thread is stuck inside a long C call.
  ``kvtier.daemon.__main__`` installs it first thing, before any import that
  takes time (the configuration's, zmq's, torch's: seconds on a loaded
  host), so a SIGTERM at any point of the start-up is a clean stop (exit 0);
  this module imports only the standard library until ``refuse_if_served``
  runs.
- SIGUSR2 sets ``StopFlag.upgrade_requested`` and nothing else: the event
  loop then starts a successor and hands it the socket and the CPU tiers
  (``kvtier.daemon.process.upgrade``), and clears the flag. Installed with the
  others, so that a SIGUSR2 during the start-up (the default disposition
  would end the process) is only a flag, which the loop ignores once it
  serves (``Server.run``).
- ``StopFlag.requested`` is read by the event loop, which then drains
  (``kvtier.daemon.server``): stop taking requests, finish or fail in-flight
  copies, reply to everything pending, exit 0 within ``drain_timeout_s``.

- ``refuse_if_served(endpoint)`` runs before the daemon binds an ``ipc://``
  socket path: if a live daemon answers there it raises ``AlreadyServing``
  (libzmq would silently take the path over); a stale socket file left by a
  crashed daemon is removed.

systemd notifications live in ``kvtier.daemon.process.sd_notify``.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

from kvtier.client.endpoint import ipc_socket_file

log = logging.getLogger(__name__)
PROBE_TIMEOUT_MS = 300


class AlreadyServing(RuntimeError):
    """Another daemon answers on the configured socket."""


class StopFlag:
    """See the module docstring."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self.upgrade_requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGUSR2, self._on_upgrade)

    def _on_upgrade(self, _signum: int, _frame: FrameType | None) -> None:
        self.upgrade_requested = True

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        # Re-arming the defaults is what lets a second signal kill a daemon
        # whose main thread cannot get back to the loop.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def request(self, reason: str) -> None:
        """Stop without a signal (tests, fatal errors)."""
        self.requested = True
        self.signal_name = reason


def refuse_if_served(endpoint: str) -> None:
    """See the module docstring."""
    path = ipc_socket_file(endpoint)  # the configuration checked the endpoint
    if path is None or not os.path.exists(path):
        return
    import msgpack
    import zmq

    zctx = zmq.Context()
    probe = zctx.socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    try:
        probe.connect(endpoint)
        probe.send(msgpack.packb({"v": 1, "op": "health", "id": 1}))
        if probe.poll(PROBE_TIMEOUT_MS, zmq.POLLIN):
            raise AlreadyServing(f"another kvtierd is already serving {endpoint}")
    finally:
        probe.close()
        zctx.term()
    log.info("removing stale socket file %s", path)
    os.unlink(path)
