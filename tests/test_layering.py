"""The import picture of the package (read from the sources with `ast`, lazy imports too),
as `mpress/README.md` states it:

- the two halves never import each other; runtime/ imports no part of d2d/; static/ uses
  only d2d's plan-time part;
- the kinds below both halves are leaves in order: config/ imports nothing of mpress but
  errors; hardware/ only config/; the contract only config/ and hardware/;
- static/ follows MPress's loop: profile -> memory -> emulate -> plan -> baselines ->
  studies, each room importing only rooms before it (and `static/schedules.py`);
- no two groups import each other, and no two modules do, through any chain;
- no folder holds more than 15 modules.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mpress"

GROUPS = {
    "entry": "mpress.train",
    "cli": "mpress.cli",
    "main": "mpress.__main__",
    "contract": "mpress.contract",
    "config": "mpress.config",
    "hardware": "mpress.hardware",
    "static": "mpress.static",
    "static.profile": "mpress.static.profile",
    "static.memory": "mpress.static.memory",
    "static.emulate": "mpress.static.emulate",
    "static.plan": "mpress.static.plan",
    "static.baselines": "mpress.static.baselines",
    "static.studies": "mpress.static.studies",
    "runtime": "mpress.runtime",
    "d2d.static": "mpress.d2d.static",
    "d2d.runtime": "mpress.d2d.runtime",
    "launcher": "mpress.launcher",
    "own_loop": "mpress.own_loop",
    "commands": "mpress.commands",
    "tiling": "mpress.tiling",
    "models": "mpress.models",
}
"""Groups by the longest prefix of a module's dotted name (the package `mpress.static`
itself, and `static/schedules.py`, are "static"); anything else directly under mpress/
(errors, ui, the package's version) is "shared": a leaf every group may use."""

STATIC_LOOP = ["static", "static.profile", "static.memory", "static.emulate", "static.plan",
               "static.baselines", "static.studies"]
"""static/'s rooms in the order of the loop: a room imports only rooms before it."""

HALVES = ("static", *STATIC_LOOP[1:])
FORBIDDEN = (
    {(s, r) for s in HALVES for r in ("runtime", "d2d.runtime")}
    | {(r, s) for s in HALVES for r in ("runtime",)}
    | {(r, "own_loop") for r in ("runtime", "d2d.runtime", "launcher", "commands")}
    | {("runtime", "d2d.static"), ("runtime", "d2d.runtime"), ("d2d.static", "runtime"),
       ("d2d.static", "d2d.runtime")}
    | {(leaf, other) for leaf in ("contract", "config", "hardware")
       for other in ("static", *STATIC_LOOP[1:], "runtime", "d2d.static", "d2d.runtime", "launcher",
                     "commands", "tiling", "models", "entry", "cli", "main", "own_loop")}
    | {("config", "hardware"), ("config", "contract"), ("hardware", "contract")}
)

MAX_MODULES_PER_FOLDER = 15


def group_of(module: str) -> str:
    best = "shared"
    for name, prefix in GROUPS.items():
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(GROUPS.get(best, "")):
            best = name
    return best


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: frozenset[str] = frozenset()) -> set[str]:
    """mpress modules `path` imports, at any depth of the file (lazy imports too).
    `from package import name` counts as an import of `package.name` where that is a
    module (in `modules`), else of the package."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mpress"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpress") and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the mpress modules it imports (itself and the top package left out)."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    names = frozenset(paths)
    return {m: imports_of(p, names) - {m, root.name} for m, p in paths.items()}


def arrows_of(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing group, imported group) -> the imports that make the arrow."""
    found: dict[tuple[str, str], list[str]] = {}
    for src, targets in graph.items():
        for target in sorted(targets):
            a, b = group_of(src), group_of(target)
            if a != b:
                found.setdefault((a, b), []).append(f"{src} -> {target}")
    return found


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def loop_violations(arrows: dict[tuple[str, str], list[str]]) -> list[str]:
    """Imports of a static/ room by a room before it in the loop."""
    rank = {g: i for i, g in enumerate(STATIC_LOOP)}
    return [imp for (a, b), imps in arrows.items() if a in rank and b in rank and rank[b] > rank[a] for imp in imps]


@functools.cache
def arrows() -> dict[tuple[str, str], list[str]]:
    return arrows_of(module_graph())


def test_the_grouping_sees_every_package():
    packages = {module_name(p) for p in ROOT.rglob("__init__.py")} - {"mpress"}
    assert {group_of(p) for p in packages} - {"shared"} == set(GROUPS) - {"entry", "cli", "main"}
    assert group_of("mpress.d2d.static.mapper") == "d2d.static"
    assert group_of("mpress.runtime.swap.engine") == "runtime"
    assert group_of("mpress.contract.plan") == "contract"
    assert group_of("mpress.static.plan.planner") == "static.plan"
    assert group_of("mpress.static.schedules") == "static"
    assert group_of("mpress.errors") == "shared"


@pytest.mark.parametrize("arrow", sorted(FORBIDDEN))
def test_forbidden_arrow_is_absent(arrow):
    assert arrow not in arrows(), f"{arrow[0]} imports {arrow[1]}: {arrows()[arrow]}"


def test_static_rooms_follow_the_loop():
    assert not loop_violations(arrows())


def test_no_two_groups_import_each_other():
    found = arrows()
    cycles = sorted((a, b) for (a, b) in found if (b, a) in found and a < b)
    assert not cycles, [(a, b, found[(a, b)][:2], found[(b, a)][:2]) for a, b in cycles]


def test_no_import_circle_between_modules():
    assert not module_cycles(module_graph())


def test_no_folder_holds_more_than_fifteen_modules():
    crowded = {}
    for folder in [ROOT, *[p for p in ROOT.rglob("*") if p.is_dir() and p.name != "__pycache__"]]:
        n = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
        if n > MAX_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(ROOT.parent))] = n
    assert not crowded


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The check is not vacuous: an import of runtime/ from static/ is found."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from mpress.runtime.router import SavedTensorRouter\n")
    assert imports_of(path) == {"mpress.runtime.router"}
    assert group_of("mpress.static.probe") == "static"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "mpress" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "mpress"


def test_the_checks_fail_on_deliberately_wrong_imports(tmp_path):
    """A package laid out like mpress with one wrong import of each kind: every check that
    guards the real package reports it."""
    root = _tree(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "config/__init__.py": "",
        "config/units.py": "from mpress.hardware import server\n",   # a leaf that is not one
        "hardware/__init__.py": "",
        "hardware/server.py": "from mpress.config.units import X\n",  # with the above: a circle
        "runtime/__init__.py": "",
        "runtime/router.py": "",
        "static/__init__.py": "",
        "static/profile/__init__.py": "",
        "static/profile/measured.py": "def f():\n    from mpress.static.plan.planner import plan\n",  # against the loop
        "static/plan/__init__.py": "",
        "static/plan/planner.py": "from mpress.runtime.router import SavedTensorRouter\n",  # static -> runtime
    })
    graph = module_graph(root)
    found = arrows_of(graph)
    assert ("static.plan", "runtime") in found and ("static.plan", "runtime") in FORBIDDEN
    assert ("config", "hardware") in found and ("config", "hardware") in FORBIDDEN
    assert loop_violations(found) == ["mpress.static.profile.measured -> mpress.static.plan.planner"]
    assert module_cycles(graph) == [["mpress.config.units", "mpress.hardware.server"]]
