"""The eviction-policy contract of the CPU tier: ``EvictionPolicy``, and ``PolicyWrapper``.

A policy orders the resident keys of one cache for eviction. It knows nothing
of bytes, slots, pins or copies in flight: the tier that owns it does.

The hooks (``HOOKS``), always called from the tier's single owner thread:

Residency (the CPU tier calls them):

- ``on_insert(key)``   a key became resident (its bytes are valid).
- ``on_remove(key)``   a resident key left (evicted, cleared or dropped).
- ``victims()``        resident keys, best victim first. The tier walks it and
                       takes the first keys it may evict (not pinned, no copy
                       in flight), then calls ``on_remove`` for them. The
                       iterator is consumed before the tier changes anything.
- ``admit(keys)``      one batch of demotions, asked before any of them is
                       reserved: one answer per key, in order; False means
                       "do not cache this key" (the tier counts it as not
                       admitted). No answer may change another of the same
                       batch's. Plain policies admit everything; admission
                       filters wrap a policy and decide (``+admit2``).

Use (the pool calls them, through the CPU tier):

- ``on_access(keys, promoted=False)``  resident keys were used (lookup hit,
                       restore, load), in the order used: a request's hits
                       tail first, so that the head ends up the most recent.
                       ``promoted``: they were restored into the GPU tier
                       above. While the GPU tier keeps such a copy, this one
                       is a *spare*: evicting it loses no hit, since the GPU
                       tier demotes the block again when it evicts it (the
                       price is that device-to-host copy).
- ``on_gpu_drop(keys)`` the GPU tier no longer holds these keys (evicted,
                       withdrawn or cleared), whether this tier holds them or
                       not. Keys this tier holds come before any victim is
                       chosen to make room for the demotions of the same
                       eviction; keys it does not hold, after their demotions
                       were planned, so their ``admit`` (and, once the copy
                       lands, ``on_insert``) may come first.

Learning (the pool's learning queue calls it):

- ``learn(request, chunk_keys=ALL_KEYS)``  one ``PolicyRequest``: the hashes
                       of a request, in order, as looked up (hit or miss),
                       with what the application said about it
                       (``request.hints``, ``kvtier.tiers.hints.RequestHints``;
                       None without hints). Lets frequency- and history-based
                       policies learn what is asked for, not only what is
                       resident. A request whose hints are marked
                       ``continues`` is a *follow-up* (``request.counted`` is
                       False): more about a request already learnt (a store of
                       its blocks, its allocation after its lookup), not a
                       new request: a policy learns nothing from it but its
                       hints. The hints are taken when ``learn`` is called
                       (they are few, and a retention must count before the
                       next eviction); the request itself is learnt by the
                       iterator it returns, in steps of about ``chunk_keys``
                       keys, so an owner with other work to do (an event loop)
                       can interleave it. Nothing of the keys is learnt before
                       the first step; drained with nothing in between, the
                       result is the same whatever ``chunk_keys``. Between
                       steps the owner may call every other hook (they see the
                       request half-learnt, which is safe and consistent), but
                       starts no other ``learn`` before this one is exhausted.
                       ``record(keys, hints)`` learns one request at once.

Stats:

- ``stats()``          ``PolicyStats``: the resident keys (``len(policy)``) and
                       the keys the policy holds state for, resident or not (a
                       learning policy's history, ghosts, streams' chains):
                       what its memory grows with. Every policy bounds the
                       latter by its capacity (each documents how), whatever
                       the traffic.

Defaults: ``on_access``, ``on_gpu_drop`` and ``learn`` do nothing, ``admit``
admits all, ``stats`` counts ``len`` for both; so a policy without hints
support behaves exactly as it would if hints did not exist.

Wrappers: extra behaviour wraps a policy (``"<policy>+<wrapper>"``); it does
not subclass one. A wrapper derives from ``PolicyWrapper``, which forwards
every hook to ``inner``; it overrides the hooks it adds to and forwards from
there. So a hook added here reaches every wrapped policy unless a wrapper
decides otherwise (tests/tiers/test_policy_wrappers.py checks each wrapper).

Policies are chosen by name through ``kvtier.tiers.policies.registry``.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

if TYPE_CHECKING:
    from kvtier.tiers.hints import RequestHints

__all__ = ["ALL_KEYS", "HOOKS", "EvictionPolicy", "PolicyRequest", "PolicyStats", "PolicyWrapper", "find_wrapped"]

# ``learn``'s chunk_keys for "in one step".
ALL_KEYS = sys.maxsize

# The hooks of the contract, in the module docstring's order: what a wrapper must forward.
HOOKS = ("on_insert", "on_remove", "victims", "admit", "on_access", "on_gpu_drop", "learn", "stats")


@dataclass(frozen=True, slots=True)
class PolicyRequest:
    """One request as a policy learns it: its hashes in order, and its hints (None: none)."""

    keys: Sequence[bytes]
    hints: RequestHints | None = None

    @property
    def counted(self) -> bool:
        """A new request (False: a follow-up of one already learnt, ``hints.continues``)."""
        return self.hints is None or not self.hints.continues


@dataclass(frozen=True, slots=True)
class PolicyStats:
    resident_keys: int
    remembered_keys: int


class EvictionPolicy(ABC):
    """Orders resident keys for eviction. See the module docstring."""

    name: ClassVar[str] = ""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks

    # ---- the hooks ----------------------------------------------------------------------

    @abstractmethod
    def on_insert(self, key: bytes) -> None: ...

    @abstractmethod
    def on_remove(self, key: bytes) -> None: ...

    @abstractmethod
    def victims(self) -> Iterator[bytes]: ...

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        return [True] * len(keys)

    def on_access(self, keys: Sequence[bytes], promoted: bool = False) -> None:
        return None

    def on_gpu_drop(self, keys: Sequence[bytes]) -> None:
        return None

    def learn(self, request: PolicyRequest, chunk_keys: int = ALL_KEYS) -> Iterator[None]:
        return iter(())

    @abstractmethod
    def stats(self) -> PolicyStats: ...

    # ---- built on the hooks (not hooks: nothing to override or forward) -----------------

    def record(self, keys: Sequence[bytes], hints: RequestHints | None = None) -> None:
        """``learn`` one request at once: ``keys`` as looked up, with ``hints`` if any."""
        for _ in self.learn(PolicyRequest(keys, hints)):
            pass

    def __len__(self) -> int:
        return self.stats().resident_keys


class PolicyWrapper(EvictionPolicy):
    """A policy around a policy (``inner``): every hook forwards to it unless overridden.

    An override adds to the hook and forwards from there (or, for ``admit``,
    may answer itself); ``stats`` adds the wrapper's remembered keys to the
    wrapped policy's.
    """

    def __init__(self, inner: EvictionPolicy) -> None:
        super().__init__(inner.capacity_blocks)
        self.inner = inner

    def on_insert(self, key: bytes) -> None:
        self.inner.on_insert(key)

    def on_remove(self, key: bytes) -> None:
        self.inner.on_remove(key)

    def victims(self) -> Iterator[bytes]:
        return self.inner.victims()

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.admit(keys)

    def on_access(self, keys: Sequence[bytes], promoted: bool = False) -> None:
        self.inner.on_access(keys, promoted)

    def on_gpu_drop(self, keys: Sequence[bytes]) -> None:
        self.inner.on_gpu_drop(keys)

    def learn(self, request: PolicyRequest, chunk_keys: int = ALL_KEYS) -> Iterator[None]:
        return self.inner.learn(request, chunk_keys)

    def stats(self) -> PolicyStats:
        return self.inner.stats()


W = TypeVar("W", bound=EvictionPolicy)


def find_wrapped(policy: EvictionPolicy, kind: type[W]) -> W | None:
    """The first policy of type ``kind`` in ``policy``'s chain of wrappers (``policy`` itself first)."""
    found: EvictionPolicy | None = policy
    while found is not None and not isinstance(found, kind):
        found = found.inner if isinstance(found, PolicyWrapper) else None
    return found
