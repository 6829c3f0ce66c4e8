"""Tenants: who a session belongs to, its private block namespace and its CPU-tier quota.

- ``tenants``: the registry: tokens to tenants, namespaced keys, quotas;
- ``tenant_ids``: the 2-byte tag in front of every key of a tenant (a leaf, so that the
  configuration checks tags without the registry).
"""
