"""Tests of kvtier.tools (a package: see tests/__init__.py)."""
