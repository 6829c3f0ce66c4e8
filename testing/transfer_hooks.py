"""``HookedTransferEngine``: the thread copy engine with a hook a test sets to delay or fail copies.

Contract: ``HookedTransferEngine(fault_hook=None)`` is a
``kvtier.tiers.transfer.ThreadTransferEngine``; ``fault_hook`` (settable
at any time) is called on the copy's worker thread with the ``Transfer``
before each copy. It may sleep (the copy waits, the caller does not) and it
may raise: the exception fails that transfer only, as a failed copy would.
It goes through the engine's one seam for tests (``_copy``), so production
engines carry no hook. A real kvtierd gets the same from
``kvtier.daemon.faults`` (``KVTIER_TEST_FAULTS``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.tiers.copy_types import Transfer, CopyJob
from kvtier.tiers.transfer import ThreadTransferEngine

__all__ = ["HookedTransferEngine"]


class HookedTransferEngine(ThreadTransferEngine):
    """See the module docstring."""

    def __init__(self, *, fault_hook: Callable[[Transfer], None] | None = None) -> None:
        self.fault_hook = fault_hook  # set before the workers start: they read it
        super().__init__()

    def _copy(self, job: CopyJob) -> None:
        hook = self.fault_hook
        if hook is not None:
            hook(job.transfer)
        super()._copy(job)
