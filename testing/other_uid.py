"""kvtierd as another user: start as root, import what the daemon needs, drop to UID:GID, serve.

Used by tests/daemon/test_other_uid.py (issue 15), through
``KvtierDaemon(command=other_uid_command(uid, gid))`` of
``kvtier.testing.daemon``; any test, benchmark or example that needs a
daemon whose process truly has another uid than its client may use it
the same way.

Contract
========

``python -m kvtier.testing.other_uid --uid U --gid G [--groups G1,G2]
[--umask 0007] -- KVTIERD_ARGS...`` runs kvtierd in this very process (the
pid ``health`` reports is the one ``KvtierDaemon`` started), as follows:

1. Must be started as root (exit 2 otherwise: nothing else may change uid).
2. While still root, imports ``kvtier.daemon.__main__``, every module of
   the packages kvtier.daemon, kvtier.tiers and kvtier.client, and the
   third-party and standard-library modules those import inside functions
   (``LATE_MODULES``; torch among them). Why: this venv's interpreter and
   standard library live under /root (mode 0700), which the dropped user
   cannot read, so a module first imported after the drop fails with
   ModuleNotFoundError. A module that does not import even as root (an
   optional dependency not installed, a half-written file of a colleague)
   is skipped: the daemon would meet the same error there.
3. ``os.setgroups(groups)`` (default: ``[G]``), ``os.setgid(G)``,
   ``os.setuid(U)`` (real, effective and saved ids: no way back to root),
   and ``os.umask`` (default 0007, the unit's ``UMask=``). The numbers need
   no /etc/passwd or /etc/group entries. Like systemd's ``User=kvtier
   Group=kvtier``, the daemon's primary group is G, so the ipc socket it
   binds is group G (unless its directory is setgid), which is the group
   the client library gives its shared-memory files.
4. Installs, last on ``sys.meta_path``, a finder that writes one line
   ``kvtier.testing.other_uid: import after the privilege drop found
   nothing: NAME`` to stderr (the daemon's log) for each import no other
   finder could satisfy; it satisfies nothing itself. A test compares those
   names with what root can import to find a lazy import the dropped
   process could not do (``late_import_failures(log)``).
5. Calls ``kvtier.daemon.__main__.main(KVTIERD_ARGS)`` and exits with its
   status.

The caller sets up what the documented multi-user set-up has
(docs/operating.md, "users and groups"): a socket directory owned by U
(the daemon refuses another owner, ``check_socket_dir``) that the client's
group may traverse, and ``--socket-mode 0660``.

``other_uid_command(uid, gid, groups=None)`` is the ``command`` tuple (this
interpreter, so the child sees our venv); ``late_import_failures(log)``
the names of step 4's lines.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import os
import pkgutil
import re
import sys
from collections.abc import Sequence
from types import ModuleType

# What the daemon imports inside functions (grep the daemon, tiers and
# client packages for indented imports): imported up front because the
# dropped user could not read them later. Optional ones (redis, cupy,
# prometheus_client) only when installed.
LATE_MODULES = (
    "torch",
    "numpy",
    "numpy.ma",  # numpy loads it lazily, on first use; the daemon's first store gets there
    "resource",  # daemon/server.py, the descriptor limit
    "socket",
    "socketserver",
    "wsgiref.simple_server",  # daemon/telemetry/prometheus.py
    "importlib.metadata",  # tiers/version.py (--version, daemon_version)
    "encodings.idna",  # the metrics exporter's bind: socket.getfqdn decodes the host name with it
    "prometheus_client",
    "prometheus_client.core",
    "redis",  # tiers/remote/connection.py, tiers/remote/tier.py
    "redis.cluster",
    "redis.exceptions",
    "redis.backoff",
    "redis.retry",
    "cupy",  # tiers/cuda_copy.py, CUDA only
)
PACKAGES = ("kvtier.daemon", "kvtier.tiers", "kvtier.client")
LATE_IMPORT_PREFIX = "kvtier.testing.other_uid: import after the privilege drop found nothing: "


def other_uid_command(uid: int, gid: int, groups: Sequence[int] | None = None) -> tuple[str, ...]:
    """The ``KvtierDaemon`` ``command`` that runs kvtierd as ``uid``:``gid`` (kvtierd's flags follow it)."""
    command = [sys.executable, "-m", "kvtier.testing.other_uid", "--uid", str(uid), "--gid", str(gid)]
    if groups is not None:
        command += ["--groups", ",".join(str(g) for g in groups)]
    return (*command, "--")


def late_import_failures(log: str) -> list[str]:
    """The module names the launcher's last finder logged (imports nothing found after the drop)."""
    return re.findall(rf"^{re.escape(LATE_IMPORT_PREFIX)}(\S+)$", log, flags=re.MULTILINE)


def _import_quietly(name: str) -> ModuleType | None:
    # Anything: a missing optional dependency or a broken module fails the
    # same way after the drop, where the daemon reports it itself.
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def preload() -> None:
    """Import, as root, everything the daemon may import later (see the module docstring, step 2)."""
    import kvtier.daemon.__main__  # noqa: F401  (the entry point: must import, errors are not hidden)

    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}.", onerror=lambda _name: None):
            _import_quietly(info.name)
    for name in LATE_MODULES:
        _import_quietly(name)


class _ReportMissing(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: reached only when no finder found a module; says so on stderr."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        print(f"{LATE_IMPORT_PREFIX}{fullname}", file=sys.stderr, flush=True)
        return None


def drop_privileges(uid: int, gid: int, groups: Sequence[int], umask: int) -> None:
    """Become ``uid``:``gid`` with ``groups`` for good (groups first: after setuid it is no longer allowed)."""
    os.setgroups(list(groups))
    os.setgid(gid)
    os.setuid(uid)  # as root this sets the real, effective and saved uid
    os.umask(umask)
    if os.getuid() != uid or os.geteuid() != uid or os.getegid() != gid:
        raise SystemExit(f"privilege drop did not take: uid {os.getuid()}/{os.geteuid()}, gid {os.getegid()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.testing.other_uid",
                                     description="kvtierd as another user (see the module docstring)")
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--gid", type=int, required=True)
    parser.add_argument("--groups", default=None, help="comma-separated gids (default: the --gid)")
    parser.add_argument("--umask", type=lambda s: int(s, 8), default=0o007)
    parser.add_argument("kvtierd_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    kvtierd_args = list(args.kvtierd_args)
    if kvtierd_args[:1] == ["--"]:
        kvtierd_args = kvtierd_args[1:]
    if os.geteuid() != 0:
        print("kvtier.testing.other_uid: must start as root to change uid", file=sys.stderr)
        return 2
    groups = [args.gid] if args.groups is None else [int(g) for g in args.groups.split(",") if g]
    preload()
    drop_privileges(args.uid, args.gid, groups, args.umask)
    sys.meta_path.append(_ReportMissing())
    from kvtier.daemon.__main__ import main as kvtierd_main  # imported by preload(): no file is read here

    return kvtierd_main(kvtierd_args)


if __name__ == "__main__":
    sys.exit(main())
