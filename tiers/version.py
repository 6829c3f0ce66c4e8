"""kvtier's version: one answer for ``kvtierd --version``, ``kvtier --version`` and the daemon's replies.

Contract:

- ``kvtier_version() -> str``: the installed distribution's version
  (``importlib.metadata.version("kvtier")``: a wheel, or ``pip install -e``
  of a checkout); when no ``kvtier`` distribution is installed, the
  ``[project] version`` of the ``pyproject.toml`` of the source tree this
  module was loaded from (a checkout on ``PYTHONPATH``); ``"unknown"`` when
  there is neither. Never raises. Cached: the answer of the first call.

Callers: the daemon (``daemon_version`` in the ``hello`` and ``health``
replies, which is how an upgrade's successor is told apart, and
``kvtierd --version``), the persistent arena's identity (which kvtier wrote
the files a restarted or upgraded daemon adopts) and ``kvtier --version``.
In tiers because tiers, the daemon and tools all need it, and tiers is the
one package the other two may import. Stdlib only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

__all__ = ["DIST_NAME", "kvtier_version"]

DIST_NAME = "kvtier"
# tiers/version.py -> the checkout's root, where pyproject.toml names the distribution.
_SOURCE_ROOT = Path(__file__).resolve().parents[1]


def _source_tree_version(root: Path) -> str | None:
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    except (OSError, ValueError, KeyError):
        return None
    if project.get("name") != DIST_NAME or not isinstance(project.get("version"), str):
        return None
    return project["version"]


@functools.cache
def kvtier_version() -> str:
    """See the module docstring."""
    try:
        return importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return _source_tree_version(_SOURCE_ROOT) or "unknown"
