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
naming the item. A ``FaultPlan`` is the ``fault_hook`` of
``kvtier.tiers.transfer.ThreadTransferEngine``: called on a worker thread
with the ``Transfer`` before its copy, it may sleep and may raise.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

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

    def describe(self) -> str:
        items = [f"{k}.fail_every={v}" for k, v in sorted(self.fail_every.items())]
        items += [f"{k}.delay_s={v}" for k, v in sorted(self.delay_s.items())]
        return ",".join(items)


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
