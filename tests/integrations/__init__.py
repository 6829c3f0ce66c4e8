"""Tests of kvtier.integrations against real engines (a package: see tests/__init__.py)."""
