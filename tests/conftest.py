"""Suite-wide pytest configuration: the CUDA skip, and the fixtures of a real kvtierd process.

- Tests marked ``cuda`` skip without a CUDA GPU.
- Tests get the markers ``slow``, ``vllm``, ``stress`` and ``redis`` from
  where they live (``tests/markers.py``): ``pytest -m "not slow"`` is the
  fast inner loop.
- ``kvtierd_factory(**flags)`` starts a ``kvtier.testing.daemon.KvtierDaemon``
  under the test's ``tmp_path`` with ``DEFAULT_FLAGS`` (debug log, small
  tiers) overridden by ``flags`` (``gpu_bytes=4096`` becomes ``--gpu-bytes
  4096``), returns once it answers ``health``, and kills whatever is left at
  teardown. ``kvtierd_module_factory`` is the same with module scope;
  ``kvtierd`` is one daemon with the default flags. Used by tests/daemon,
  tests/client, tests/integrations and tests/tools; the stress suite has its
  own (tests/stress/conftest.py).

Helpers import as ``tests.<module>`` and ``kvtier.testing``: pyproject's
pytest ``pythonpath`` puts the repository root on the path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.testing.daemon import KvtierDaemon
from tests.markers import markers_for, never_selected

DEFAULT_FLAGS: dict[str, object] = {"log_level": "debug", "cpu_bytes": 64 * 1024, "gpu_bytes": 16 * 1024}
START_TIMEOUT_S = 30.0  # a test daemon has small tiers: longer than this to answer is a failure


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m``, skip importing a file whose every test the expression deselects (tests/markers.py)."""
    markexpr = config.option.markexpr
    if not markexpr or collection_path.suffix != ".py":
        return None
    try:
        rel_path = collection_path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return None
    return True if never_selected(rel_path, markexpr) else None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    root = config.rootpath
    by_file: dict[Path, set[str]] = {}
    for item in items:
        names = by_file.get(item.path)
        if names is None:
            module = getattr(item, "module", None)
            names = by_file[item.path] = markers_for(item.path.relative_to(root).as_posix(),
                                                    vars(module) if module is not None else {})
        for name in names:
            item.add_marker(name)
        if item.get_closest_marker("install") is not None:
            item.add_marker("slow")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


class _Starter:
    """Starts daemons under one folder and kills the ones still running at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[KvtierDaemon] = []

    def __call__(self, **flags: object) -> KvtierDaemon:
        daemon = KvtierDaemon.start(self.root / f"d{len(self.started)}", flags={**DEFAULT_FLAGS, **flags},
                                    start_timeout_s=START_TIMEOUT_S)
        self.started.append(daemon)
        return daemon

    def cleanup(self) -> None:
        for daemon in self.started:
            daemon.kill()


@pytest.fixture
def kvtierd_factory(tmp_path: Path) -> Iterator[Callable[..., KvtierDaemon]]:
    """A fresh daemon per call, for tests that stop, kill or restart it."""
    starter = _Starter(tmp_path)
    yield starter
    starter.cleanup()


@pytest.fixture(scope="module")
def kvtierd_module_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., KvtierDaemon]]:
    """Daemons shared by the tests of one module (torch makes each start cost seconds)."""
    starter = _Starter(tmp_path_factory.mktemp("kvtierd"))
    yield starter
    starter.cleanup()


@pytest.fixture
def kvtierd(kvtierd_factory: Callable[..., KvtierDaemon]) -> KvtierDaemon:
    return kvtierd_factory()
