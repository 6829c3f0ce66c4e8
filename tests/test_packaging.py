"""pyproject's explicit package list names every package folder, and nothing else.

``[tool.setuptools] packages`` is a list, not a discovery: a package folder
missing from it is silently left out of a plain install (``pip install .``),
and kvtierd then fails to import it there (``kvtier.daemon.planes`` was, until
cc89d0a). ``tests/test_plain_install.py`` finds that by installing, in about
40 s and only outside the fast loop; this finds it from the tree in
milliseconds.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def package_folders(package_dirs: dict[str, str]) -> dict[str, Path]:
    """Dotted name -> folder of every folder holding an ``__init__.py`` under the mapped top-level folders."""
    found = {}
    for package, folder in package_dirs.items():
        root = REPO / folder
        for init in sorted(root.rglob("__init__.py")):
            rel = init.parent.relative_to(root)
            found[".".join((package, *rel.parts))] = init.parent
    return found


def test_every_package_folder_is_listed_and_every_listed_package_exists() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = package_folders(setuptools["package-dir"])
    assert sorted(set(found) - listed) == [], "package folders missing from pyproject's [tool.setuptools] packages"
    assert sorted(listed - set(found)) == [], "pyproject lists packages that have no folder with an __init__.py"


def test_no_module_folder_lacks_its_init() -> None:
    """A folder of modules without ``__init__.py`` under a package would be a namespace package: never installed."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    lacking = []
    for folder in {REPO / d for d in setuptools["package-dir"].values()}:
        for path in folder.rglob("*.py"):
            if "__pycache__" not in path.parts and not (path.parent / "__init__.py").exists():
                lacking.append(str(path.parent.relative_to(REPO)))
    assert sorted(set(lacking)) == []
