"""kvtier's test suite, a package so its helpers import as ``tests.<module>`` (pytest puts the repository root on the path)."""
