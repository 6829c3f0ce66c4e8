"""Tests of kvtier.tiers (a package: see tests/__init__.py)."""
