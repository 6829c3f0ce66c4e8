"""The import contracts, as code: pyproject's ``[tool.importlinter]`` checked by ``lint-imports``.

What the contracts say (docs/architecture.md, "Who imports whom"):

- ``kvtier.blocks`` (block bytes in memory: layouts, copy plans) imports
  nothing else of kvtier, and neither ``zmq`` nor ``msgpack``.
- ``kvtier.tiers`` imports no ``daemon``, ``client``, ``tools`` or
  ``integrations``, and neither ``zmq`` nor ``msgpack``: it is a library
  that knows nothing of the wire or of processes.
- ``kvtier.client`` imports no ``daemon``, ``tiers``, ``blocks``, ``tools`` or
  ``integrations``, and no torch at module level (checked here at run time
  too: ``kv_share`` imports torch inside the functions that need it).
- ``kvtier.tools`` imports no ``daemon``; ``kvtier.integrations`` imports no
  ``daemon`` and no ``tiers`` (the copies an adapter makes go through
  ``kvtier.blocks``); its engine-free half, ``kvtier.integrations.adapter``,
  imports no engine (checked here at run time).
- Bookkeeping (``kvtier.tiers.pool`` without bytes, ``kvtier replay``) loads no
  torch: the copy interface is ``kvtier.tiers.copy_types``, layouts are
  imported where bytes move (checked here at run time).
- No import cycles between the modules and subpackages of any package
  (``if TYPE_CHECKING:`` imports, which never run, are not counted).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.fail(f"{lint} not found: import-linter is in the test extra (pip install -e '.[test]')")
    out = subprocess.run([str(lint), "--no-cache", str(REPO / "pyproject.toml")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout, out.stdout[-6000:]


def test_client_modules_load_no_torch() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import kvtier.client as c\n"
        "for m in pkgutil.iter_modules(c.__path__):\n"
        "    importlib.import_module('kvtier.client.' + m.name)\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_adapter_half_loads_no_engine() -> None:
    """The engine-free half of an adapter (``kvtier.integrations.adapter``) must import, every module of it, where no
    engine is installed: an SGLang adapter built on it must not pull in vLLM, nor vLLM's SGLang."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import kvtier.integrations.adapter as a\n"
        "names = [m.name for m in pkgutil.iter_modules(a.__path__)]\n"
        "for n in names:\n"
        "    importlib.import_module('kvtier.integrations.adapter.' + n)\n"
        "print(len(names), sorted(n for n in sys.modules if n.split('.')[0] in ('vllm', 'sglang')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    count, engines = out.stdout.strip().split(" ", 1)
    assert int(count) >= 9, out.stdout  # every module was imported, not an empty package
    assert engines == "[]", out.stdout


def test_bookkeeping_loads_no_torch() -> None:
    """The pool in bookkeeping mode and ``kvtier replay`` move no bytes, so they must not pay torch's import."""
    code = (
        "import sys\n"
        "from kvtier.tools.replay.core import ReplayConfig, replay\n"
        "from kvtier.tools.traces import load_trace\n"
        f"r = replay(load_trace({str(REPO / 'examples' / 'traces' / 'sample.jsonl')!r}), "
        "ReplayConfig(gpu_blocks=64, cpu_blocks=512, policy='chain'))\n"
        "assert r.looked_up_blocks > 0\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_both_remote_stores_implement_the_protocol_the_pool_uses() -> None:
    import inspect

    from kvtier.tiers.remote import RemoteStore
    from kvtier.tiers.remote.tier import RemoteTier
    from kvtier.tools.replay.nodes import SimulatedRemoteTier

    wanted = {name for name, _ in inspect.getmembers(RemoteStore) if not name.startswith("_")}
    assert wanted == {"available", "exists_prefix", "fetch", "write_back", "stats", "close"}
    for impl in (RemoteTier, SimulatedRemoteTier):
        missing = {name for name in wanted if not hasattr(impl, name)}
        assert not missing, f"{impl.__name__} lacks {missing}"
        for name in wanted - {"available"}:
            want = [p for p in inspect.signature(getattr(RemoteStore, name)).parameters if p != "self"]
            have = list(inspect.signature(getattr(impl, name)).parameters)
            assert all(p in have for p in want), (impl.__name__, name, want, have)


def _tiers_imports(folders: tuple[str, ...]) -> dict[tuple[str, str], list[str]]:
    """(module, name) -> the files under ``folders`` that import ``name`` from a ``kvtier.tiers`` module."""
    import ast

    found: dict[tuple[str, str], list[str]] = {}
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtier.tiers"):
                    pairs = [(node.module, a.name) for a in node.names]
                elif isinstance(node, ast.Import):
                    pairs = [(a.name, "") for a in node.names if a.name.startswith("kvtier.tiers")]
                else:
                    continue
                for pair in pairs:
                    found.setdefault(pair, []).append(str(path.relative_to(REPO)))
    return found


def test_daemon_integrations_and_tools_use_only_the_public_tiers_api() -> None:
    """What kvtier.tiers' docstring and ``__all__`` state is all that daemon/, integrations/ and tools/ import."""
    import importlib

    import kvtier.tiers as tiers

    public_modules = {f"kvtier.tiers.{m}" for m in tiers.PUBLIC_MODULES}
    wrong = []
    for (module, name), files in _tiers_imports(("daemon", "integrations", "tools")).items():
        if module in public_modules:
            ok = name in importlib.import_module(module).__all__
        elif module == "kvtier.tiers" and f"kvtier.tiers.{name}" in public_modules:
            ok = True
        else:
            # The same object whether imported from kvtier.tiers or from the module it came from.
            ok = name in tiers.__all__ and getattr(importlib.import_module(module), name) is getattr(tiers, name)
        if not ok:
            wrong.append(f"{module}.{name or '*'} in {files}")
    assert not wrong, ("imports of tiers internals; use a public name, or make it public in tiers/__init__.py "
                       f"(_PUBLIC and the docstring): {wrong}")


def test_tiers_public_api_resolves_and_imports_lazily() -> None:
    import importlib

    import kvtier.tiers as tiers

    for name in tiers.__all__:
        assert getattr(tiers, name) is getattr(importlib.import_module(tiers.public_module_of(name)), name), name
    with pytest.raises(AttributeError, match="public API"):
        tiers.no_such_name  # noqa: B018
    # Importing the package, or a stdlib-only module of it, loads no submodule it does not need.
    code = ("import sys\nimport kvtier.tiers, kvtier.tiers.units\n"
            "print(sorted(n for n in sys.modules if n.startswith(('torch', 'kvtier.tiers.pool'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_fault_injection_reaches_the_daemon_only_through_its_test_seam() -> None:
    """Issue 36 item 8: no shipped module carries a fault hook or branches on one. Test-only fault
    injection (``kvtier.daemon.faults``) is imported by the composition root alone, and reaches the loop
    through ``ServeOptions.transfer_factory`` / ``lend_restore_max_bytes``."""
    shipped = [p for sub in ("blocks", "tiers", "client", "daemon", "tools", "integrations") for p in (REPO / sub).rglob("*.py")]
    assert len(shipped) > 50
    hooked = [str(p.relative_to(REPO)) for p in shipped
              if p.name != "faults.py" and "fault_hook" in p.read_text()]
    assert hooked == []
    importing = re.compile(r"^\s*(from kvtier\.daemon\.faults import|import kvtier\.daemon\.faults)", re.M)
    importers = sorted(str(p.relative_to(REPO)) for p in shipped if importing.search(p.read_text()))
    assert importers == ["daemon/__main__.py"]


def test_every_wire_plane_has_one_daemon_plane() -> None:
    """The daemon's data planes are a table keyed by the wire plane names (``daemon.planes.PLANES``)."""
    from kvtier.client.protocol import PLANES as WIRE_PLANES
    from kvtier.daemon.planes import PLANES, Plane

    assert sorted(PLANES) == sorted(WIRE_PLANES)
    assert all(isinstance(plane, Plane) for plane in PLANES.values())
