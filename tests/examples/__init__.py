"""Tests of the example engine, examples/engine (a package: see tests/__init__.py)."""
