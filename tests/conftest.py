"""Suite-wide pytest configuration: tests marked ``cuda`` skip without a CUDA GPU;
helper modules in this folder (``redis_servers``) import by name from any test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/ is not a package (pytest runs with --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
