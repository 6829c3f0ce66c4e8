"""The import contracts, as code: pyproject's ``[tool.importlinter]`` checked by ``lint-imports``.

What the contracts say (docs/architecture.md, "Who imports whom"):

- ``kvtier.tiers`` imports no ``daemon``, ``client``, ``tools`` or
  ``integrations``, and neither ``zmq`` nor ``msgpack``: it is a library
  that knows nothing of the wire or of processes.
- ``kvtier.client`` imports no ``daemon``, ``tiers``, ``tools`` or
  ``integrations``, and no torch at module level (checked here at run time
  too: ``kv_share`` imports torch inside the functions that need it).
- ``kvtier.tools`` imports no ``daemon``; ``kvtier.integrations`` imports no
  ``daemon``.
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

    from kvtier.tiers.remote_store import RemoteStore
    from kvtier.tiers.remote_tier import RemoteTier
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


def test_fault_injection_reaches_the_daemon_only_through_its_test_seam() -> None:
    """Issue 36 item 8: no shipped module carries a fault hook or branches on one. Test-only fault
    injection (``kvtier.daemon.faults``) is imported by the composition root alone, and reaches the loop
    through ``ServeOptions.transfer_factory`` / ``lend_restore_max_bytes``."""
    shipped = [p for sub in ("tiers", "client", "daemon", "tools", "integrations") for p in (REPO / sub).rglob("*.py")]
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
