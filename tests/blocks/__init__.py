"""Tests of kvtier.blocks (a package: see tests/__init__.py)."""
