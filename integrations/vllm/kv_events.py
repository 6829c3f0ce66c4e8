"""kvtierd's key journal as vLLM KV cache events, for KV-aware routers.

vLLM publishes what its GPU prefix cache holds (``--kv-events-config``); a
router (llm-d, Dynamo) sends a request where its prefix is. With kvtier a
node also holds prefixes in kvtierd's tiers, and a request routed there
loads them instead of computing. This module tells vLLM's publisher about
them, as vLLM's own ``OffloadingConnector`` does for its CPU tier.

Contract
========

The scheduler half owns one ``KvEvents`` when vLLM has KV cache events
enabled, and calls it on vLLM's scheduler thread:

- ``note(request, first_block, keys, held=...)``: blocks ``first_block ...``
  of ``request`` have these kvtier keys: their ``BlockStored`` payload
  (vLLM's block hash, the parent's, the tokens, LoRA, extra keys) is built
  now, while the request is alive. ``held=True`` (a load: kvtierd holds them
  now) announces them at once; otherwise (a store on its way) when kvtierd's
  journal says it holds them.
- ``poll()``, once a step: when ``interval_s`` has passed since the last read
  and none is in flight, the connector's background thread reads kvtierd's
  ``events`` since its cursor and turns each change of a noted key into a
  ``BlockStored`` / ``BlockRemoved`` with medium ``"CPU"``. Keys this engine
  never noted (another engine's) are skipped: their vLLM hashes are that
  engine's, seeded per process, unknown here.
- ``take()`` hands vLLM what came since the last call (the connector's
  ``take_events``).
- ``forget_all()`` (``reset_cache``): every block announced is removed (the
  engine will not ask for those keys again) and forgotten.
- What is remembered is bounded (``max_blocks``, oldest first); an announced
  block forgotten that way is removed too, so a router is never left
  believing in a block nobody will report gone.
- Within one read only each key's last change counts: the events are the
  difference between what kvtierd held at two consecutive reads. A block
  that left kvtierd and came back in between (an eviction from its GPU tier
  before the CPU copy existed, then the copy) makes no event; one stored and
  evicted in between is never announced, nor removed. Deliberately: a
  router told of a block already gone could only send a request there for
  nothing. So what a router sees is, per block, ``BlockStored`` and
  ``BlockRemoved`` alternating, ``BlockStored`` first, and its belief equals
  what kvtierd held at the last read; how many short-lived blocks it ever
  heard of depends on when the reads fell (``interval_s``), and is no truth
  to count on.
- kvtierd's journal says ``lost`` (this reader fell behind its ring, or a
  restarted daemon): every announced block is removed, and announced again
  when kvtierd holds it anew. Wrong in the safe direction: a router loses
  an affinity for a while, it never sends a request for a block that is gone.
- A kvtierd without the ``events`` feature: logged once, no events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.client.protocol import FEATURE_EVENTS, ErrorCode
from kvtier.client.transport import DaemonError
from kvtier.integrations.adapter.background import Background
from kvtier.integrations.adapter.link import DaemonLink

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

    from kvtier.client.client import Client, Events

log = logging.getLogger("kvtier.integrations.vllm")

_UNSUPPORTED = object()  # _fetch's "no events from this daemon", with the reason


@dataclass(slots=True)
class _Block:
    stored: Any  # vLLM's BlockStored for this block, built from its request
    announced: bool = False  # vLLM was told it is held (and not told since that it went)


def _last_change(changes: Sequence[tuple[bool, bytes]]) -> dict[bytes, bool]:
    """Each key's last change in one read, in the order of those last changes.

    A key that went and came back within one read (a GPU-tier eviction before
    clean-ahead had copied the block, then the copy) is held at the end of
    it, as it was before: a router needs neither event. One that came and
    went is not held, and was never announced: it makes none either.
    """
    last: dict[bytes, bool] = {}
    for stored, key in changes:
        last.pop(key, None)
        last[key] = stored
    return last


class KvEvents:
    def __init__(self, link: DaemonLink, jobs: Background, block_size: int, *, interval_s: float,
                 max_blocks: int) -> None:
        self._link = link
        self._jobs = jobs
        self._bs = block_size
        self._interval_s = interval_s
        self._max_blocks = max_blocks
        self._lock = threading.Lock()  # the scheduler thread notes, the background thread applies
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._out: list[KVCacheEvent] = []
        self._cursor = 0
        self._next_read_s = 0.0
        self._reading = False
        self._enabled = True
        self._warned_granularity = False

    # ---- the scheduler thread ---------------------------------------------------------

    def note(self, request: Request, first_block: int, keys: Sequence[bytes], *, held: bool) -> None:
        if not self._enabled or not keys:
            return
        hashes = request.block_hashes
        if len(hashes) > request.num_tokens // self._bs:
            # vLLM hashes finer blocks than it allocates (hash_block_size): no one hash per block.
            if not self._warned_granularity:
                self._warned_granularity = True
                log.warning("kvtier: vLLM hashes blocks finer than its KV blocks; no KV events for kvtier's tier")
            return
        stored = [self._stored_event(request, first_block + i) for i in range(len(keys))
                  if first_block + i < len(hashes)]
        with self._lock:
            for key, event in zip(keys, stored):
                block = self._blocks.get(key)
                if block is None:
                    block = self._blocks[key] = _Block(event)
                    self._bound()
                else:
                    self._blocks.move_to_end(key)
                if held and not block.announced:
                    block.announced = True
                    self._out.append(block.stored)

    def poll(self) -> None:
        if not self._enabled or self._reading or time.monotonic() < self._next_read_s:
            return
        self._reading = True
        self._jobs.submit(self._read)

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            out, self._out = self._out, []
        return out

    def forget_all(self) -> None:
        with self._lock:
            self._out += [self._removed(b) for b in self._blocks.values() if b.announced]
            self._blocks.clear()

    # ---- the background thread --------------------------------------------------------

    def _read(self) -> None:
        try:
            got = self._link.call(self._fetch)
            if isinstance(got, tuple):
                self._enabled = False
                log.warning("kvtier: no KV cache events for kvtier's tier: %s", got[1])
            elif got is not None:
                self._apply(got)
        finally:
            self._next_read_s = time.monotonic() + self._interval_s
            self._reading = False

    def _fetch(self, client: Client) -> Events | tuple[object, str]:
        if FEATURE_EVENTS not in client.features:
            return _UNSUPPORTED, "this kvtierd does not serve events (feature 'events'): upgrade it"
        try:
            return client.events(self._cursor)
        except DaemonError as exc:
            if exc.code != ErrorCode.INVALID_STATE:
                raise
            return _UNSUPPORTED, str(exc)  # a tenant's session: kvtierd serves it no events

    def _apply(self, got: Events) -> None:
        with self._lock:
            if got.lost:
                for block in self._blocks.values():
                    if block.announced:
                        block.announced = False
                        self._out.append(self._removed(block))
            for key, stored in _last_change(got.changes).items():
                block = self._blocks.get(key)
                if block is None or block.announced == stored:
                    continue
                block.announced = stored
                self._out.append(block.stored if stored else self._removed(block))
            self._cursor = got.next

    # ---- helpers (under the lock, or free of state) -------------------------------------

    def _bound(self) -> None:
        while len(self._blocks) > self._max_blocks:
            _, old = self._blocks.popitem(last=False)
            if old.announced:
                self._out.append(self._removed(old))

    def _stored_event(self, request: Request, i: int) -> Any:
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
        from vllm.v1.core.kv_cache_utils import (generate_block_hash_extra_keys, maybe_convert_block_hash,
                                                 to_event_extra_keys)

        start, end = i * self._bs, (i + 1) * self._bs
        extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
        lora = request.lora_request
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(request.block_hashes[i])],
            parent_block_hash=maybe_convert_block_hash(request.block_hashes[i - 1]) if i > 0 else None,
            token_ids=list(request.all_token_ids[start:end]),
            block_size=self._bs,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_CPU,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys([extra]),
            group_idx=0,
            session_id=getattr(request, "session_id", None),
        )

    @staticmethod
    def _removed(block: _Block) -> Any:
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved

        return BlockRemoved(block_hashes=list(block.stored.block_hashes), medium=MEDIUM_CPU, group_idx=0)
