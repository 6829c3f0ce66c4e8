"""The ``stats`` verb, and whose view of the daemon a request gets.

Contract (the event loop's thread only):

- ``stats_fields(ctx)``: the operator's view, what ``stats`` replies and the
  Prometheus endpoint serves. Pools are keyed by ``PoolEntry.name``: with
  tenants ``"<tenant>/<name>"``, each also saying its ``tenant`` and bare ``name``.
- ``stats``: a handler (see ``daemon.handlers``) that needs no session.
- ``viewer_of(ctx, req)`` / ``sees(viewer, tenant)``: with tenants, a tenant
  sees its own pools (by the bare names its hellos sent), counters and
  sessions; someone who is neither a tenant nor the operator sees no pool and
  no tenant. ``stats`` and ``health`` both answer in the asker's view.
"""

from __future__ import annotations

import os
from typing import Any

from kvtier.client.protocol import ProtocolError, Request
from kvtier.daemon.handling.handler_context import HandlerContext, Reply, Result

__all__ = ["sees", "stats", "stats_fields", "viewer_of"]


def stats_fields(ctx: HandlerContext) -> dict[str, Any]:
    """The ``stats`` reply's fields, the operator's view; also the snapshot the Prometheus endpoint serves
    (loop thread only). Pools are keyed by ``PoolEntry.name``: with tenants ``"<tenant>/<name>"``, and
    each says its ``tenant`` and bare ``name`` (what ``stats`` and Prometheus label them with)."""
    pools: dict[str, Any] = {}
    for entry in ctx.pools:
        s = entry.pool.stats()
        s["mode"] = entry.mode
        s["sessions"] = len(entry.sessions)
        s["gpu_registered"] = entry.gpu_owner is not None
        if ctx.tenants.enabled:  # without tenants the reply stays as it always was
            s["tenant"] = entry.tenant
            s["name"] = entry.bare_name
        pools[entry.name] = s
    # Lends keep their own counts (daemon.clients.lends); they read as daemon counters.
    out = {"pools": pools, "daemon": ctx.metrics.snapshot() | ctx.lends.stats(), "sessions": len(ctx.sessions)}
    if ctx.tenants.enabled:
        out["tenants"] = ctx.tenants.stats()
    return out


def stats(ctx: HandlerContext, req: Request) -> Result:
    fields = stats_fields(ctx)
    viewer = viewer_of(ctx, req)
    if viewer is not None:
        # A tenant sees its own pools, by the names its hellos sent, and its own
        # counters; someone who is neither a tenant nor the operator sees no pool or tenant.
        fields["pools"] = {s["name"]: s for s in fields["pools"].values() if sees(viewer, s["tenant"])}
        fields["tenants"] = ctx.tenants.stats(only=viewer) if viewer else {}
        fields["sessions"] = sum(1 for s in ctx.sessions if s.tenant == viewer) if viewer else 0
    return Reply(fields)


def viewer_of(ctx: HandlerContext, req: Request) -> str | None:
    """Whose view a session-optional request gets: None the operator's (everything), a tenant's name,
    or "" (nobody's: no pool, no tenant). Without tenants, everyone is the operator."""
    if not ctx.tenants.enabled:
        return None
    if req.sid is not None:
        # stats does not need a session, but one it names says whose it is.
        try:
            named = ctx.sessions.get(req.sid)
        except ProtocolError:
            named = None
        mine = named is not None and named.peer == ctx.peer and named.uid in (None, ctx.peer_uid)
        return named.tenant if mine and named is not None else ""
    tenant = ctx.tenants.tenant_of_peer(ctx.peer)
    if tenant is not None:
        return tenant
    if ctx.peer is not None:
        return None  # an authorised CURVE key that is no tenant's: the operator's
    # ipc: the daemon's own user (and root) is the operator; a token tenant names its session.
    return None if ctx.peer_uid in (os.getuid(), 0) else ""


def sees(viewer: str | None, tenant: str) -> bool:
    """Whether ``viewer`` (see ``viewer_of``) may see what belongs to ``tenant``: the operator all, a tenant its own."""
    return viewer is None or (viewer != "" and tenant == viewer)
