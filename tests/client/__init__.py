"""Tests of kvtier.client (a package: see tests/__init__.py)."""
