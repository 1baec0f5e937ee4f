"""The import picture of the package: the two halves never import each other, runtime/
does not import d2d/, static/ uses only d2d's plan-time part, the shared contract imports
neither half, and no two packages import each other (read from the sources with `ast`)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mpress"

GROUPS = {
    "entry": "mpress.train",
    "static": "mpress.static",
    "runtime": "mpress.runtime",
    "d2d.static": "mpress.d2d.static",
    "d2d.runtime": "mpress.d2d.runtime",
    "launcher": "mpress.launcher",
    "commands": "mpress.commands",
    "tiling": "mpress.tiling",
    "models": "mpress.models",
    "cli": "mpress.cli",
    "main": "mpress.__main__",
}
"""Packages (and the entry modules `mpress.train`, `mpress.cli`), by the longest prefix of
a module's dotted name; anything else directly under mpress/ is the shared contract and
its leaves (plan, actions, identity, vocabulary, ...)."""

FORBIDDEN = {
    ("static", "runtime"), ("runtime", "static"),
    ("runtime", "d2d.static"), ("runtime", "d2d.runtime"),
    ("static", "d2d.runtime"), ("d2d.static", "runtime"), ("d2d.static", "d2d.runtime"),
    ("shared", "static"), ("shared", "runtime"), ("shared", "d2d.static"), ("shared", "d2d.runtime"),
    ("shared", "launcher"), ("shared", "commands"), ("shared", "tiling"), ("shared", "entry"), ("shared", "cli"),
}


def group_of(module: str) -> str:
    best = "shared"
    for name, prefix in GROUPS.items():
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(GROUPS.get(best, "")):
            best = name
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """mpress modules `path` imports, at any depth of the file (lazy imports too)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mpress"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpress") and node.level == 0:
            out.add(node.module)
    return out


@functools.cache
def arrows() -> dict[tuple[str, str], list[str]]:
    """(importing group, imported group) -> the imports that make the arrow."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src = module_name(path)
        for target in imports_of(path):
            a, b = group_of(src), group_of(target)
            if a != b:
                found.setdefault((a, b), []).append(f"{src} -> {target}")
    return found


def test_the_grouping_sees_every_package():
    packages = {module_name(p) for p in ROOT.rglob("__init__.py")} - {"mpress"}
    assert {group_of(p) for p in packages} - {"shared"} == set(GROUPS) - {"entry", "cli", "main"}
    assert group_of("mpress.d2d.static.mapper") == "d2d.static"
    assert group_of("mpress.runtime.swap.engine") == "runtime"
    assert group_of("mpress.plan") == "shared"


@pytest.mark.parametrize("arrow", sorted(FORBIDDEN))
def test_forbidden_arrow_is_absent(arrow):
    assert arrow not in arrows(), f"{arrow[0]} imports {arrow[1]}: {arrows()[arrow]}"


def test_no_two_packages_import_each_other():
    found = arrows()
    cycles = sorted((a, b) for (a, b) in found if (b, a) in found and a < b)
    assert not cycles, [(a, b, found[(a, b)][:2], found[(b, a)][:2]) for a, b in cycles]


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The check is not vacuous: an import of runtime/ from static/ is found."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from mpress.runtime.router import SavedTensorRouter\n")
    assert imports_of(path) == {"mpress.runtime.router"}
    assert group_of("mpress.static.probe") == "static"
