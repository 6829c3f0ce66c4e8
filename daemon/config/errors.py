"""The one exception of ``kvtier.daemon.config``.

Contract: every configuration mistake is a ``ConfigError(key, message)``.
``key`` is the dotted config key (``lease_s``, ``default_pool.cpu_bytes``,
``pools."llama-8b/tp0".policy``) or, for a source as a whole, its name
(``config``, an environment variable). Checks in the dataclasses name the key
relative to their table; ``sources`` prefixes the table and appends the source
a value came from.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(Exception):
    """A configuration value that cannot be used. ``key`` is the dotted config key (or the source)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message
