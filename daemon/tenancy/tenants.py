"""Tenants: who a session belongs to, its private block namespace, and its CPU-tier quota.

Contract
========

- ``TenantRegistry(tenants)`` from the configuration's ``[tenants.<name>]``
  tables. With no tenants configured it is *disabled*: every session belongs
  to the anonymous tenant ``""``, hashes are used as the client sent them,
  and nothing below costs anything.
- ``resolve(user_id, token) -> tenant name`` at ``hello``. ``user_id`` is
  the ZMQ ``User-Id`` of the connection (set by the daemon's CURVE
  authenticator, ``user_id_for_key``: ``"tenant:<name>"`` for a key a tenant
  is configured with, ``"key:<z85>"`` for another authorised key, None
  without CURVE); ``token`` the optional ``token`` field of hello. With
  tenants configured, a session must name exactly one tenant: a token that
  matches no tenant, a token of another tenant than the CURVE key's, or no
  identity at all is refused with UNAUTHORIZED (the same message for every
  case, so the refusal says nothing about which tenants exist).
- ``namespace(tenant, hashes)``: the daemon maps every client block hash to
  ``tag(tenant) || BLAKE2b-112(hash; key = tenant name)`` (16 bytes) at the
  handler boundary, before any pool sees it. Pools share capacity, but two
  tenants' keys can never collide (their 2-byte tags differ: configuration
  refuses tenant names with equal tags), and no tenant can name another's
  block: lookups, pins, restores and allocation hits only ever see the
  caller's namespace. Replies carry tiers and block ids, never keys.
- Quotas (``cpu_quota_bytes`` per tenant, over all pools): ``policy_wrapper(
  block_bytes)``, given to a pool as it is built, wraps its CPU-tier eviction policy in
  ``TenantQuotaPolicy``, which counts each tenant's CPU-tier blocks (resident,
  plus admitted demotions whose copies are still in flight) and refuses to
  admit a *demotion* that would take a tenant over its quota (the block is
  dropped, as any not-admitted demotion: counted per tenant in
  ``dropped_demotions``). What it counts comes from the CPU tier's state,
  not from the order of the pool's calls (see the class). ``check_store`` refuses (NO_SPACE, counted in
  ``refused_stores``) a ``store`` whose blocks would overflow straight into
  the CPU tier past the quota; blocks a store puts in the GPU tier are
  checked when they are demoted. An admitted demotion that never lands
  (the CPU tier was full, the copy failed) stops counting at the next
  batch of admissions, so counting errs on the refusing side and never
  drifts. A quota never evicts anybody's blocks: over it, a tenant's
  demotions are dropped until its own blocks age out of the CPU tier.
- ``stats(tenant)``: per-tenant counters (resident CPU bytes and blocks,
  quota, refusals, sessions), never keys. Single-threaded (the event loop).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.client.protocol import ErrorCode, ProtocolError
from kvtier.daemon.tenancy.tenant_ids import TAG_BYTES, tenant_tag

from kvtier.tiers.policies.base import EvictionPolicy, PolicyWrapper  # stdlib only: no torch

if TYPE_CHECKING:
    from kvtier.daemon.config import TenantConfig
    from kvtier.tiers.cpu_tier import CpuTier
    from kvtier.tiers.pool import TieredPool, WrapPolicy

log = logging.getLogger(__name__)

ANONYMOUS = ""
TENANT_USER_PREFIX = "tenant:"
KEY_USER_PREFIX = "key:"
_NS_PERSON = b"kvtier-ns"
UNAUTHORIZED_MESSAGE = "this daemon serves tenants: authenticate with a tenant's CURVE key or token"


def user_id_for_key(z85_key: str, tenant_by_key: Mapping[str, str]) -> str:
    """The ZMQ User-Id the authenticator gives a connection with client key ``z85_key``."""
    tenant = tenant_by_key.get(z85_key)
    return f"{TENANT_USER_PREFIX}{tenant}" if tenant is not None else f"{KEY_USER_PREFIX}{z85_key}"


@dataclass
class _Tenant:
    name: str
    tag: bytes
    token_sha256: bytes | None
    quota_bytes: int | None
    template: Any  # a keyed blake2b to copy per hash (cheaper than keying each time)


class TenantRegistry:
    """See the module docstring."""

    def __init__(self, tenants: Mapping[str, TenantConfig] | None = None) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._by_tag: dict[bytes, str] = {}
        self.tenant_by_key: dict[str, str] = {}  # CURVE public key (z85) -> tenant name
        for name, cfg in (tenants or {}).items():
            key = name.encode()
            t = _Tenant(
                name=name,
                tag=tenant_tag(name),
                token_sha256=bytes.fromhex(cfg.token_sha256) if cfg.token_sha256 else None,
                quota_bytes=cfg.cpu_quota_bytes,
                template=hashlib.blake2b(digest_size=16 - TAG_BYTES, key=key, person=_NS_PERSON),
            )
            self._tenants[name] = t
            self._by_tag[t.tag] = name
            if cfg.public_key:
                self.tenant_by_key[cfg.public_key] = name
        self.resident_bytes: Counter[str] = Counter()
        self.pending_bytes: Counter[str] = Counter()  # admitted demotions not yet committed
        self.resident_blocks: Counter[str] = Counter()
        self.dropped_demotions: Counter[str] = Counter()
        self.refused_stores: Counter[str] = Counter()
        self.looked_up_blocks: Counter[str] = Counter()  # counted lookups and allocations, all pools
        self.hit_blocks: dict[str, Counter[str]] = {name: Counter() for name in self._tenants}  # tenant -> tier -> n
        self.has_quotas = any(t.quota_bytes is not None for t in self._tenants.values())

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tenants)

    # ---- who is it -----------------------------------------------------------------

    def resolve(self, user_id: str | None, token: str | None) -> str:
        """The tenant of a new session; see the module docstring."""
        if not self._tenants:
            if token is not None:
                raise ProtocolError(ErrorCode.INVALID_FIELD, "this daemon has no tenants configured; send no token")
            return ANONYMOUS
        by_key = None
        if user_id is not None and user_id.startswith(TENANT_USER_PREFIX):
            by_key = user_id[len(TENANT_USER_PREFIX):]
        by_token = self._match_token(token) if token is not None else None
        if token is not None and by_token is None:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
        if by_key is not None and by_token is not None and by_key != by_token:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
        tenant = by_key or by_token
        if tenant is None or tenant not in self._tenants:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, UNAUTHORIZED_MESSAGE)
        return tenant

    def _match_token(self, token: str) -> str | None:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        # Compare with every tenant, in constant time each: how long this
        # takes says nothing about which token came close.
        for t in self._tenants.values():
            if t.token_sha256 is not None and hmac.compare_digest(digest, t.token_sha256):
                found = t.name
        return found

    # ---- namespaces ------------------------------------------------------------------

    def namespace(self, tenant: str, hashes: Sequence[bytes]) -> list[bytes]:
        """Pool keys for a tenant's block hashes (the hashes themselves for the anonymous tenant)."""
        if tenant == ANONYMOUS:
            # A request's own decoded list is nobody else's: no copy of it per request.
            return hashes if type(hashes) is list else list(hashes)
        t = self._tenants[tenant]
        out = []
        for h in hashes:
            d = t.template.copy()
            d.update(h)
            out.append(t.tag + d.digest())
        return out

    def tenant_of_peer(self, user_id: str | None) -> str | None:
        """The tenant a CURVE User-Id belongs to, if any."""
        if user_id is not None and user_id.startswith(TENANT_USER_PREFIX):
            name = user_id[len(TENANT_USER_PREFIX):]
            return name if name in self._tenants else None
        return None

    def clear(self, pool: TieredPool, tenant: str) -> int:
        """``clear`` for one tenant: drop its cached blocks nobody uses or pins, in both tiers."""
        tag = self._tenants[tenant].tag
        policy = pool.policy
        cpu_keys = policy.keys_of(tenant) if isinstance(policy, TenantQuotaPolicy) else ()
        return pool.clear_matching(lambda key: key[:TAG_BYTES] == tag, cpu_keys)

    def tenant_of(self, key: bytes) -> str | None:
        """Whose namespace a pool key is in (None: the anonymous tenant or unknown)."""
        return self._by_tag.get(key[:TAG_BYTES])

    # ---- quotas ----------------------------------------------------------------------

    def policy_wrapper(self, block_bytes: int) -> WrapPolicy | None:
        """What counts (and caps) tenants' CPU-tier residency in a pool of ``block_bytes`` blocks:
        ``TieredPool(policy_wrapper=...)``. None without tenants."""
        if not self._tenants:
            return None
        return lambda policy, cpu: TenantQuotaPolicy(policy, self, block_bytes, cpu)

    def over_quota(self, tenant: str | None, extra_bytes: int) -> bool:
        if tenant is None or tenant == ANONYMOUS:
            return False
        quota = self._tenants[tenant].quota_bytes
        return quota is not None and self.resident_bytes[tenant] + self.pending_bytes[tenant] + extra_bytes > quota

    def check_store(self, tenant: str, pool: TieredPool, keys: Sequence[bytes], block_bytes: int) -> None:
        """Refuse a store whose blocks would spill into the CPU tier past the tenant's quota.

        Blocks the GPU tier takes do not count now: they are checked when
        they are demoted (``TenantQuotaPolicy.admit``).
        """
        if tenant == ANONYMOUS or self._tenants[tenant].quota_bytes is None:
            return
        # The pool's own split (TieredPool.store): the free blocks holding keys
        # of this store are protected, so they take none of its new blocks.
        spill = pool.cpu_spill(keys)
        if spill and self.over_quota(tenant, spill * block_bytes):
            self.refused_stores[tenant] += 1
            quota = self._tenants[tenant].quota_bytes
            raise ProtocolError(
                ErrorCode.NO_SPACE,
                f"tenant {tenant!r}: storing {spill} more blocks in the CPU tier would exceed its quota "
                f"({self.resident_bytes[tenant] + spill * block_bytes} > {quota} bytes); they spill there because "
                f"the GPU tier cannot take them ({pool.num_pinned()} blocks pinned by all sessions)",
            )

    def note_lookup(self, tenant: str, looked_up_blocks: int, tiers: Sequence[Any]) -> None:
        """A tenant's counted lookup or allocation: its blocks, and the tier of each hit (for per-tenant hit rates)."""
        hits = self.hit_blocks.get(tenant)
        if hits is None:
            return  # the anonymous tenant: the pools' own counters say it all
        self.looked_up_blocks[tenant] += looked_up_blocks
        for tier in tiers:
            hits[getattr(tier, "value", tier)] += 1

    def stats(self, only: str | None = None) -> dict[str, Any]:
        """Per-tenant counters (all tenants, or only ``only``); no keys, ever."""
        out: dict[str, Any] = {}
        for name, t in self._tenants.items():
            if only is not None and name != only:
                continue
            out[name] = {
                "cpu_resident_bytes": self.resident_bytes[name],
                "cpu_resident_blocks": self.resident_blocks[name],
                "cpu_quota_bytes": t.quota_bytes,
                "dropped_demotions": self.dropped_demotions[name],
                "refused_stores": self.refused_stores[name],
                "looked_up_blocks": self.looked_up_blocks[name],
                "hit_blocks": {tier: self.hit_blocks[name][tier] for tier in ("gpu", "cpu", "disk", "remote")},
            }
        return out


class TenantQuotaPolicy(PolicyWrapper):
    """Wraps a pool's CPU-tier policy: per-tenant residency counts and quota admission.

    Eviction order is the wrapped policy's; only ``admit`` and the residency
    counters are added (every other hook is forwarded, ``PolicyWrapper``).
    Keys of the anonymous tenant are not counted.

    What counts against a quota is read from the CPU tier's own state, never
    inferred from the order of the calls: resident keys (``on_insert`` until
    ``on_remove``), plus keys admitted here that the tier holds but has not
    committed yet (their copies are in flight). At each ``admit`` batch, an
    earlier admitted key the tier does not hold (its reservation failed, its
    copy failed or was discarded) stops counting: the tier reserves a
    batch's admitted keys, or gives up on them, before it asks about the
    next batch (``CpuTier``). Which other hooks come in between, and in what
    order, changes nothing.
    """

    name = "tenant-quota"

    def __init__(self, inner: EvictionPolicy, registry: TenantRegistry, block_bytes: int, cpu: CpuTier) -> None:
        super().__init__(inner)
        self.registry = registry
        self.block_bytes = block_bytes
        # The CpuTier this policy orders: says which admitted keys it still holds. Weak: the tier holds
        # this policy, and a strong reference back would keep a dropped pool's tier in a cycle.
        self._cpu: Callable[[], CpuTier | None] = weakref.ref(cpu) if cpu is not None else lambda: None
        self.keys_by_tenant: dict[str, set[bytes]] = {}
        self._pending: dict[bytes, str] = {}  # admitted, not yet committed -> tenant

    def _settle_pending(self, key: bytes) -> None:
        tenant = self._pending.pop(key, None)
        if tenant is not None:
            self.registry.pending_bytes[tenant] -= self.block_bytes

    def on_insert(self, key: bytes) -> None:
        self._settle_pending(key)
        self.inner.on_insert(key)
        tenant = self.registry.tenant_of(key)
        if tenant is not None:
            keys = self.keys_by_tenant.setdefault(tenant, set())
            if key not in keys:
                keys.add(key)
                self.registry.resident_bytes[tenant] += self.block_bytes
                self.registry.resident_blocks[tenant] += 1

    def on_remove(self, key: bytes) -> None:
        self.inner.on_remove(key)
        tenant = self.registry.tenant_of(key)
        if tenant is not None:
            keys = self.keys_by_tenant.get(tenant)
            if keys is not None and key in keys:
                keys.discard(key)
                self.registry.resident_bytes[tenant] -= self.block_bytes
                self.registry.resident_blocks[tenant] -= 1

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        if self._pending:
            cpu = self._cpu()
            peek = cpu.peek if cpu is not None else lambda key: False  # without verifying an adopted entry
            for key in [k for k in self._pending if not peek(k)]:
                self._settle_pending(key)
        registry = self.registry
        if not registry.has_quotas:  # counting only: the wrapped policy's answers, in one batch
            answers = self.inner.admit(keys)
            for key, yes in zip(keys, answers):
                if yes:
                    self._admitted(key, registry.tenant_of(key))
            return answers
        # Key by key: a key's quota check sees the keys before it that the wrapped policy admitted, and
        # the wrapped policy is asked only about the keys within quota (as its side effects expect).
        answers = []
        for key in keys:
            tenant = registry.tenant_of(key)
            if registry.over_quota(tenant, self.block_bytes):
                assert tenant is not None
                registry.dropped_demotions[tenant] += 1
                answers.append(False)
            elif self.inner.admit((key,))[0]:
                self._admitted(key, tenant)
                answers.append(True)
            else:
                answers.append(False)
        return answers

    def _admitted(self, key: bytes, tenant: str | None) -> None:
        if tenant is not None and key not in self._pending:
            self._pending[key] = tenant
            self.registry.pending_bytes[tenant] += self.block_bytes

    def keys_of(self, tenant: str) -> list[bytes]:
        return list(self.keys_by_tenant.get(tenant, ()))
