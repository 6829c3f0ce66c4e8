"""The pool's parts are built from the collaborators they use, never from the facade (issue 36, item 1).

``TieredPool`` (``facade.py``) composes the parts of ``kvtier.tiers.pool``
and forwards to them; a part that held the facade reached into its private
fields, made an import circle through ``TYPE_CHECKING`` and a reference cycle
(``test_pool_refcount.py``). Checked on the source: no module of the package
but ``facade`` and ``__init__`` imports the facade (at run time or under
``TYPE_CHECKING``) or names ``TieredPool`` in code. Docstrings may name it:
it is what the parts' verbs are documented by.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier.tiers.pool as pool_package

PACKAGE = Path(pool_package.__file__).resolve().parent
FACADE_MODULES = {"facade.py", "__init__.py"}


def facade_references(source: str) -> list[str]:
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {alias.name for alias in node.names}
            if module.endswith("pool.facade") or (module.endswith("tiers.pool") and names & {"facade", "TieredPool"}):
                found.append(f"line {node.lineno}: from {module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.endswith("pool.facade")]
        elif isinstance(node, ast.Name) and node.id == "TieredPool":
            found.append(f"line {node.lineno}: TieredPool")
        elif isinstance(node, ast.Attribute) and node.attr == "TieredPool":
            found.append(f"line {node.lineno}: .TieredPool")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip() == "TieredPool":
            found.append(f"line {node.lineno}: 'TieredPool' (a string annotation)")
    return found


def test_no_part_of_the_pool_imports_or_names_the_facade() -> None:
    parts = sorted(p for p in PACKAGE.glob("*.py") if p.name not in FACADE_MODULES)
    assert {p.name for p in parts} >= {"copies.py", "demotion.py", "engine.py", "lending.py", "pins.py",
                                       "resolve.py", "store.py", "adoption.py"}
    offenders = {p.name: refs for p in parts if (refs := facade_references(p.read_text()))}
    assert offenders == {}


def test_the_check_sees_a_type_checking_import_and_an_annotation() -> None:
    """The check itself: the way every part used to hold the pool is caught."""
    refs = facade_references(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvtier.tiers.pool.facade import TieredPool\n"
        "class Part:\n    def __init__(self, pool: TieredPool) -> None:\n        self.pool = pool\n")
    assert refs == ["line 3: from kvtier.tiers.pool.facade import TieredPool", "line 5: TieredPool"]
