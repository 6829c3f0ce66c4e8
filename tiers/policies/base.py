"""The eviction-policy contract of the CPU tier: ``EvictionPolicy``.

A policy orders the resident keys of one cache for eviction. It knows nothing
of bytes, slots, pins or copies in flight: the tier that owns it does.

Who calls what (always from the tier's single owner thread):

- ``on_insert(key)``   a key became resident (its bytes are valid).
- ``on_hit(key)``      a resident key was used (lookup hit, restore).
- ``on_remove(key)``   a resident key left (evicted, cleared or dropped).
- ``victims()``        resident keys, best victim first. The tier walks it and
                       takes the first key it may evict (not pinned, no copy in
                       flight), then calls ``on_remove`` for it. The iterator is
                       consumed before the tier changes anything.
- ``admit(key)``       asked before a key is inserted; False means "do not
                       cache this key" (the tier counts it as not admitted).
                       Plain policies admit everything; admission filters wrap
                       a policy and decide (see ``AdmissionWrapper``).
- ``admit_many(keys)`` ``admit`` for each key of one batch of demotions, as a
                       list of answers in order, all asked before any of them
                       is inserted. Default: ``admit`` per key. A policy whose
                       answer costs a ranking may answer the batch at once;
                       its answers must be those ``admit`` would give.
- ``record_request(keys)``  the hashes of one request, in order, as looked up
                       (hit or miss). Lets frequency- and history-based
                       policies learn what is asked for, not only what is
                       resident. Default: nothing.
- ``record_request_steps(keys, chunk_keys=64)``  the same, resumable: a
                       generator that records the request in steps, each
                       doing the work of about ``chunk_keys`` keys, so an
                       owner with other work to do (an event loop) can
                       interleave it. Nothing is recorded before the first
                       step; drained with nothing in between, it leaves the
                       policy exactly as ``record_request(keys)`` would.
                       Between steps the owner may call ``on_insert``,
                       ``on_hit``, ``on_remove``, ``admit`` and ``victims``
                       (they see the request half-recorded, which is safe
                       and consistent), but starts no other
                       ``record_request`` or ``record_request_steps`` before
                       this one is exhausted. Default: ``record_request(keys)``
                       in a single step. Wrappers forward it to the wrapped
                       policy's, doing their own bookkeeping once.

- ``record_hints(keys, hints)``  what the application said about the request
                       whose keys these are (``kvtier.tiers.hints.RequestHints``:
                       session, retain_s, priority, at_s, output_tokens).
                       Called only for requests that carry hints, just
                       before their ``record_request``; or alone, with
                       ``hints.continues`` set, for more about a request
                       already recorded (a store of its blocks, its
                       allocation after its lookup). Default: nothing, so a
                       policy without hints support behaves exactly as
                       before. Wrappers forward it.

- ``remembered_keys()``  how many keys the policy holds state for, resident or
                       not (a learning policy's history, ghosts, streams' chains):
                       what its memory grows with. Every policy bounds it by
                       its capacity (each documents how), whatever the traffic.
                       Default: ``len(self)``. Wrappers add theirs to the
                       wrapped policy's.

The GPU tier above (the pool calls these; a policy may ignore both, and
wrappers forward them):

- ``on_promote(keys)`` resident keys were just restored into the GPU tier
                       for a request (in the order of the hits: tail first).
                       While the GPU tier keeps such a copy, this one is a
                       *spare*: evicting it loses no hit, since the GPU tier
                       demotes the block again when it evicts it (the price
                       is that device-to-host copy). Default: nothing.
- ``on_gpu_drop(keys)`` the GPU tier no longer holds these keys (evicted,
                       withdrawn or cleared), whether this tier holds them or
                       not. Keys this tier holds come before any victim is
                       chosen to make room for the demotions of the same
                       eviction; keys it does not hold, after their demotions
                       were planned, so their ``admit`` (and, once the copy
                       lands, ``on_insert``) may come first. Default: nothing.

Policies are chosen by name through ``kvtier.tiers.policies.registry``.
Extra behaviour wraps a policy; it does not subclass one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvtier.tiers.hints import RequestHints

__all__ = ["EvictionPolicy"]


class EvictionPolicy(ABC):
    """Orders resident keys for eviction. See the module docstring."""

    name: ClassVar[str] = ""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks

    @abstractmethod
    def on_insert(self, key: bytes) -> None: ...

    @abstractmethod
    def on_hit(self, key: bytes) -> None: ...

    @abstractmethod
    def on_remove(self, key: bytes) -> None: ...

    @abstractmethod
    def victims(self) -> Iterator[bytes]: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def admit(self, key: bytes) -> bool:
        return True

    def admit_many(self, keys: Sequence[bytes]) -> list[bool]:
        admit = self.admit
        return [admit(key) for key in keys]

    def record_request(self, keys: Sequence[bytes]) -> None:
        return None

    def record_hints(self, keys: Sequence[bytes], hints: RequestHints) -> None:
        return None

    def remembered_keys(self) -> int:
        return len(self)

    def on_promote(self, keys: Sequence[bytes]) -> None:
        return None

    def on_gpu_drop(self, keys: Sequence[bytes]) -> None:
        return None

    def record_request_steps(self, keys: Sequence[bytes], chunk_keys: int = 64) -> Iterator[None]:
        """``record_request(keys)``, resumable (see the module docstring). Here: one step."""
        self.record_request(keys)
        yield from ()
