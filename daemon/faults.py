"""TEST-ONLY fault injection for kvtierd's copies. Never set in production.

The stress suite (``tests/stress``) needs copies that fail or run slowly on
demand, against a real daemon process: a failed copy must fail only its own
request, and a daemon killed mid-restore must leave its client a timeout,
not a hang. The composition root (``kvtier.daemon.__main__``) reads the
environment variable ``KVTIER_TEST_FAULTS`` (and removes it from what the
configuration loader sees); nothing else in the project reads it.

Contract
========

``parse_faults(spec) -> FaultPlan | None``: ``spec`` is a comma-separated
list of ``<kind>.<action>=<value>`` items, ``kind`` one of ``demote``,
``restore``, ``store``, ``load`` (``kvtier.tiers.transfer.CopyKind``) or
``any``:

- ``<kind>.fail_every=N``: every N-th copy of that kind (1st counted) fails
  with ``RuntimeError("injected fault ...")``: N=1 fails every copy;
- ``<kind>.delay_s=S``: each copy of that kind first sleeps S seconds on
  its copy worker thread (the daemon's loop keeps serving).

An empty spec is no plan (None); a malformed one raises ``ValueError``
naming the item.

``FaultPlan.serve_options(options) -> ServeOptions``: the daemon's options
with the plan applied through the loop's one test seam, and nothing else:

- ``transfer_factory``: each pool's copy engine is a
  ``FaultInjectingEngine``, a ``ThreadTransferEngine`` whose copies (on
  their worker threads) first call the plan with their ``Transfer``, which
  may sleep and may raise. A pool on CUDA keeps its CUDA engine, unfaulted
  (logged): the plan acts on thread-engine copies only;
- ``lend_restore_max_bytes`` 0: no restore is lent in place from a tier to
  the client's memory (``daemon.planes.lent``). Such a restore runs no copy
  engine, so a fault planned for restores would never reach it.

Production code carries no fault hook: the handlers and planes know
nothing of this module.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.tiers.copy_types import TransferEngine, CopyJob
from kvtier.tiers.transfer import ThreadTransferEngine, make_transfer_engine

if TYPE_CHECKING:
    from kvtier.daemon.server import ServeOptions

log = logging.getLogger(__name__)

FAULTS_ENV = "KVTIER_TEST_FAULTS"
KINDS = ("demote", "restore", "store", "load", "any")
ACTIONS = ("fail_every", "delay_s")


@dataclass
class FaultPlan:
    """Per copy kind: fail every N-th copy, delay each copy (see the module docstring)."""

    fail_every: dict[str, int] = field(default_factory=dict)
    delay_s: dict[str, float] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    injected_failures: int = 0

    def __call__(self, transfer: Any) -> None:
        kind = getattr(transfer.kind, "value", str(transfer.kind))
        delay_s = self.delay_s.get(kind, self.delay_s.get("any", 0.0))
        if delay_s > 0:
            time.sleep(delay_s)
        every = self.fail_every.get(kind, self.fail_every.get("any"))
        if every is None:
            return
        # Two copy workers (one per priority class) call this concurrently.
        with self._lock:
            n = self._counts[kind] = self._counts.get(kind, 0) + 1
            fail = n % every == 0
            if fail:
                self.injected_failures += 1
        if fail:
            raise RuntimeError(f"injected fault ({FAULTS_ENV}): {kind} copy #{n} fails")

    def transfer_engine(self, device: str) -> TransferEngine:
        """A pool's copy engine with this plan's faults (see the module docstring)."""
        if str(device).startswith("cuda"):
            log.warning("test fault injection needs the thread copy engine; a pool on %s runs without it", device)
            return make_transfer_engine(device)
        return FaultInjectingEngine(self)

    def serve_options(self, options: ServeOptions) -> ServeOptions:
        """``options`` with this plan applied through the test seam (see the module docstring)."""
        return dataclasses.replace(options, transfer_factory=self.transfer_engine, lend_restore_max_bytes=0)

    def describe(self) -> str:
        items = [f"{k}.fail_every={v}" for k, v in sorted(self.fail_every.items())]
        items += [f"{k}.delay_s={v}" for k, v in sorted(self.delay_s.items())]
        return ",".join(items)


class FaultInjectingEngine(ThreadTransferEngine):
    """A thread copy engine whose copies first run a ``FaultPlan`` (see the module docstring)."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan  # before the workers start: they read it
        super().__init__()

    def _copy(self, job: CopyJob) -> None:
        self.plan(job.transfer)
        super()._copy(job)


def parse_faults(spec: str) -> FaultPlan | None:
    """See the module docstring."""
    spec = spec.strip()
    if not spec:
        return None
    plan = FaultPlan()
    for item in spec.split(","):
        item = item.strip()
        key, sep, value = item.partition("=")
        kind, dot, action = key.partition(".")
        if not sep or not dot or kind not in KINDS or action not in ACTIONS:
            raise ValueError(f"bad item {item!r}: expected <kind>.<action>=<value>, kind one of {KINDS}, "
                             f"action one of {ACTIONS}")
        try:
            if action == "fail_every":
                n = int(value)
                if n < 1:
                    raise ValueError
                plan.fail_every[kind] = n
            else:
                seconds = float(value)
                if not 0 <= seconds <= 3600:
                    raise ValueError
                plan.delay_s[kind] = seconds
        except ValueError:
            raise ValueError(f"bad value in {item!r}: fail_every takes an integer >= 1, delay_s seconds 0..3600") from None
    return plan
