"""Tests of kvtier.daemon (a package: see tests/__init__.py)."""
