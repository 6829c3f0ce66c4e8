"""Tenant namespace tags: the 2 bytes every block key of a tenant starts with.

Contract: ``tenant_tag(name)`` is the BLAKE2b digest (``TAG_BYTES`` long,
personalised for kvtier) of the tenant's name. ``kvtier.daemon.config``
refuses two tenants whose tags are equal; ``kvtier.daemon.tenancy.tenants`` puts the
tag in front of every key of the tenant's namespace. A leaf (hashlib only),
so that both import it and neither imports the other.
"""

from __future__ import annotations

import hashlib

__all__ = ["TAG_BYTES", "tenant_tag"]

TAG_BYTES = 2
_TAG_PERSON = b"kvtier-tenant"


def tenant_tag(name: str) -> bytes:
    """The 2-byte prefix of every key in tenant ``name``'s namespace."""
    return hashlib.blake2b(name.encode(), digest_size=TAG_BYTES, person=_TAG_PERSON).digest()
