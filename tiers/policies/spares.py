"""Spare CPU copies: restored blocks the GPU tier still holds, for ``+session``.

The CPU tier is inclusive: a restore leaves the CPU copy in place. While the
GPU tier keeps the restored block, that copy is a *spare*: evicting it loses
no hit, because the GPU tier demotes the block again when it evicts it (the
price is that device-to-host copy, ``demotions``). So the session wrapper
offers spares as its first victims (after orphans) and the CPU tier's room
goes to blocks held nowhere else. Measured on the Claude Code trace
(``kvtier replay claude_code_even --gpu-tokens 500k --cpu-tokens 4M --hints
session``): block hit rate 0.6435 -> 0.6491, demotions 1.16M -> 2.89M.

``Spares`` keeps the books, per key:

- *spare*: resident here, restored into the GPU tier (``promote``) and not
  evicted there since (``gpu_dropped``);
- *above*: a spare evicted here (``evicted``) while the GPU tier still holds
  it. Its stream counts it in ``above_blocks``: the stream is still cached,
  and its return model must not count its life as ended;
- *coming*: above, and the demotion the GPU tier started when it evicted
  the block was admitted (``admitted``): ``landed`` (the tier's insert)
  settles it.

A key leaves *above* when it lands again, when the GPU tier lets it go
without a demotion that was admitted (``gpu_dropped`` returns its stream: if
nothing of that stream is cached any more, its life ended), or, past
``bound`` keys, oldest first (a demotion that never lands: no room, a failed
copy).

Order: ``victims()`` lists the spares, the latest promoted first: the GPU
tier evicts its oldest copies first, so the latest one's slot stays free
longest before its block comes back (the earliest first measured 0.6505
against 0.6491: no difference that holds, and more copies).

Cost: O(1) per call; ``victims()`` O(spares). Memory: at most the GPU tier's
blocks in spares and above.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["Spares"]


class _Owner(Protocol):
    above_blocks: int


O = TypeVar("O", bound=_Owner)


class Spares(Generic[O]):
    """The books of spare copies and of spares evicted while the GPU tier holds them. See the module."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._spares: OrderedDict[bytes, None] = OrderedDict()  # the latest promoted last
        self._above: OrderedDict[bytes, O] = OrderedDict()
        self._coming: set[bytes] = set()

    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` is a spare (resident here, and held by the GPU tier)."""
        return key in self._spares

    def __bool__(self) -> bool:
        return bool(self._spares)

    @property
    def tracked(self) -> bool:
        """Whether any key is a spare or above (else ``gpu_dropped`` has nothing to do)."""
        return bool(self._spares) or bool(self._above)

    def victims(self) -> Iterator[bytes]:
        return reversed(self._spares)

    def promote(self, key: bytes) -> None:
        """A resident key of a stream was restored into the GPU tier."""
        self._spares[key] = None
        self._spares.move_to_end(key)

    def evicted(self, key: bytes, owner: O) -> bool:
        """``key`` left this tier; True if it was a spare, which ``owner`` now counts above."""
        if key not in self._spares:
            return False
        del self._spares[key]
        self._above[key] = owner
        owner.above_blocks += 1
        while len(self._above) > self.bound:
            old, other = self._above.popitem(last=False)
            other.above_blocks -= 1
            self._coming.discard(old)
        return True

    def forget(self, key: bytes) -> None:
        """``key`` left this tier, no longer a spare of any stream."""
        self._spares.pop(key, None)

    def admitted(self, key: bytes) -> None:
        """The demotion of ``key`` was admitted."""
        if key in self._above:
            self._coming.add(key)

    def landed(self, key: bytes) -> None:
        """``key`` is resident here again."""
        owner = self._above.pop(key, None)
        if owner is not None:
            owner.above_blocks -= 1
            self._coming.discard(key)

    def gpu_dropped(self, key: bytes) -> O | None:
        """The GPU tier holds ``key`` no more: the stream whose above block it was, if it is gone for
        good (its demotion was not admitted); None otherwise."""
        self._spares.pop(key, None)
        if key in self._coming:
            return None  # its demotion is under way: ``landed`` settles it
        owner = self._above.pop(key, None)
        if owner is not None:
            owner.above_blocks -= 1
        return owner
