"""Someone with write access to the daemons' Redis, as the tests model them (docs/remote-tier.md, "Threat model").

The attacker knows the value format (it is documented) and finds the block
keys with ``SCAN``; it does not know the deployment's secret. Each attack
writes one key; none of what it writes may ever be served as a block.
Used by ``tests/daemon/test_remote_tier_attacks.py`` (each attack once,
checked one by one) and by the hostile stress scenario
(``hostile_clients.py redis``: all of them, round after round, while an
engine restores its blocks through the same pool).

Contract
========

- ``block_keys(r, limit)``: up to ``limit`` block keys on the server
  (``kvtier:*``), as SCAN finds them.
- ``key_of(r, block_hash)``: the one key of a block, found by SCAN; an
  ``AssertionError`` unless exactly one.
- ``sibling_key(key, block_hash)``: the key ``block_hash`` has in the pool
  of ``key`` (the pool part of a key is public: anyone who can SCAN reads it).
- ``copy_value(r, src, dst)``: a valid value, byte for byte, under another
  key. Returns the bytes written (empty when ``src`` vanished).
- ``old_format_value(payload)``: a value in the unkeyed format 1 (magic,
  version 1, length, XXH3-64 of the payload): every checksum right.
- ``forged_payload(r, key, template)``: ``template``'s header (format 2,
  a real tag, another key's) over random bytes, under ``key``.
- ``unkeyed_tag(r, key, template)``: format 2, the tag an unkeyed hash of
  key and payload, random payload.
- ``oversized(r, key, nbytes)``: ``nbytes`` zero bytes under ``key``.
- ``Attacker(r, targets, block_bytes, seed)``: ``step()`` runs the next
  attack of ``ATTACKS`` and counts it in ``counts``; False when there was
  nothing to attack yet. ``targets`` are the hashes the attacker predicts an
  engine will ask for, the most popular first (a common system prompt): it
  overwrites their keys where SCAN finds them, and injects keys for those
  nobody stored yet, choosing popular ones more often; the valid values it
  copies come from any key.
"""

from __future__ import annotations

import os
import random
import struct
from collections import Counter
from collections.abc import Sequence
from typing import Any

import xxhash

HEADER_BYTES = 32  # kvtier.tiers.remote.values.HEADER_BYTES; the attacker reads the docs, not the code
TAG_BYTES = 16
HASH_HEX = 32  # a block hash is 16 bytes
ATTACKS = ("copy", "old_format", "forged_payload", "unkeyed_tag", "inject", "oversized")


def block_keys(r: Any, limit: int = 1000) -> list[bytes]:
    out: list[bytes] = []
    for k in r.scan_iter(match=b"kvtier:*", count=1000):
        out.append(k)
        if len(out) >= limit:
            break
    return out


def key_of(r: Any, block_hash: bytes) -> bytes:
    found = [k for k in r.scan_iter(match=b"kvtier:*", count=1000) if k.endswith(block_hash.hex().encode())]
    assert len(found) == 1, found
    return found[0]


def sibling_key(key: bytes, block_hash: bytes) -> bytes:
    return key[:-HASH_HEX] + block_hash.hex().encode()


def copy_value(r: Any, src: bytes, dst: bytes) -> bytes:
    value = r.get(src) or b""
    if value:
        r.set(dst, value)
    return value


def old_format_value(payload: bytes) -> bytes:
    return struct.pack("<4sBxxxQQ", b"KVT1", 1, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def forged_payload(r: Any, key: bytes, template: bytes) -> bytes:
    evil = template[:HEADER_BYTES] + os.urandom(len(template) - HEADER_BYTES)
    r.set(key, evil)
    return evil


def unkeyed_tag(r: Any, key: bytes, template: bytes) -> bytes:
    payload = os.urandom(len(template) - HEADER_BYTES)
    evil = template[: HEADER_BYTES - TAG_BYTES] + xxhash.xxh3_128_digest(key + payload) + payload
    r.set(key, evil)
    return evil


def oversized(r: Any, key: bytes, nbytes: int) -> None:
    r.set(key, bytes(nbytes))


class Attacker:
    """One attack per ``step()``, in turn (see the module docstring)."""

    def __init__(self, r: Any, targets: Sequence[bytes], block_bytes: int, *, seed: int = 0,
                 oversized_bytes: int = 8 << 20) -> None:
        self.r = r
        self.targets = list(targets)
        self.block_bytes = block_bytes
        self.oversized_bytes = oversized_bytes
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self._next = 0

    def step(self) -> bool:
        keys = block_keys(self.r)
        if len(keys) < 2:
            return False
        attack = ATTACKS[self._next % len(ATTACKS)]
        self._next += 1
        src = self.rng.choice(keys)
        template = self.r.get(src) or b""
        if len(template) != HEADER_BYTES + self.block_bytes:
            return False  # gone, or an earlier attack's value
        present = set(keys)
        wanted = [sibling_key(src, t) for t in self.targets]
        # Injected: a predicted block nobody stored; the others overwrite a predicted block's value.
        choices = [k for k in wanted if (k in present) != (attack == "inject")] or [k for k in keys if k != src]
        dst = choices[int(len(choices) * self.rng.random() ** 2)]  # the popular ones more often
        if dst == src:
            return False
        if attack == "copy":
            self.r.set(dst, template)
        elif attack == "old_format":
            self.r.set(dst, old_format_value(os.urandom(self.block_bytes)))
        elif attack == "forged_payload":
            forged_payload(self.r, dst, template)
        elif attack == "unkeyed_tag":
            unkeyed_tag(self.r, dst, template)
        elif attack == "inject":
            self.r.set(dst, template)
        else:
            oversized(self.r, dst, self.oversized_bytes)
        self.counts[attack] += 1
        return True
