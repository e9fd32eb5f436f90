"""Import boundaries: the arrows of DESIGN.md point one way, and packages form no cycle.

cli -> runs/tools -> stages -> scaling/curation -> engine -> inference -> diagnostics ->
objectives -> models -> eval -> data -> core -> config (FLOORS). Every module under vltrain/
is parsed with `ast` (nothing is imported), and every import counts: top-level, function-level
(lazy), under TYPE_CHECKING, relative, and `importlib.import_module("...")` with a literal
name. A rule names a source package and the packages it may not import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

# The floors of the house, bottom up (DESIGN.md). A package imports only packages on a lower
# floor: never one above it (an arrow that climbs) and never one beside it (two packages of a
# floor import neither each other). Every package under vltrain/ must be on a floor.
FLOORS: list[tuple[str, ...]] = [
    ("config",),
    ("core",),
    ("data",),
    ("eval",),
    ("models",),
    ("objectives",),
    ("diagnostics",),
    ("inference",),
    ("engine",),
    ("scaling", "curation"),
    ("stages",),
    ("runs", "tools"),
    ("cli",),
]
FLOOR = {pkg: level for level, names in enumerate(FLOORS) for pkg in names}
# (source package, packages it must not import): everything on its floor and above
RULES: list[tuple[str, tuple[str, ...]]] = [
    (pkg, tuple(p for p in FLOOR if p != pkg and FLOOR[p] >= FLOOR[pkg]))
    for pkg in FLOOR
    if pkg != "cli"
]


def module_name(path: Path, root: Path) -> str:
    """Dotted module name of `path` (a .py file under `root`, the folder above the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `path` imports, anywhere in the file."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from ..stages import base` inside vltrain.engine
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from vltrain import stages` imports vltrain.stages
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
            found.append((node.lineno, base))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(root: Path, source: str, forbidden: tuple[str, ...], top: str = "vltrain") -> list:
    """`file:line imports name` for each import from `top.source` into a forbidden package."""
    banned = [f"{top}.{f}" for f in forbidden]
    out = set()
    for path in sorted((root / top / source).rglob("*.py")):
        for line, name in imported_names(path, root):
            hit = next((b for b in banned if name == b or name.startswith(b + ".")), None)
            if hit:
                out.add(f"{path.relative_to(root).as_posix()}:{line} imports {hit}")
    return sorted(out)


@pytest.mark.parametrize("source, forbidden", RULES, ids=[r[0] for r in RULES])
def test_import_boundary(source: str, forbidden: tuple[str, ...]) -> None:
    files = list((REPO / "vltrain" / source).rglob("*.py"))
    assert files, f"vltrain/{source} holds no modules: update RULES"
    bad = violations(REPO, source, forbidden)
    assert not bad, f"vltrain.{source} must not import {', '.join(forbidden)}:\n" + "\n".join(bad)


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Negative control: a synthetic tree with forbidden imports of each kind is reported."""
    engine = tmp_path / "vltrain" / "engine"
    engine.mkdir(parents=True)
    for d in (tmp_path / "vltrain", engine):
        (d / "__init__.py").write_text("")
    (engine / "loop.py").write_text(
        "import importlib\n"
        "from vltrain.config import load_config\n"  # allowed
        "import vltrain.stages.base\n"  # line 3
        "def build():\n"
        "    from vltrain import cli\n"  # line 5: lazy, `from package import module`
        "    from ..stages import caption\n"  # line 6: relative
        "    return importlib.import_module('vltrain.tools.export')\n"  # line 7
    )
    (engine / "__init__.py").write_text("from . import loop\nfrom .. import runs\n")
    assert violations(tmp_path, "engine", ("stages", "runs", "tools", "cli")) == [
        "vltrain/engine/__init__.py:2 imports vltrain.runs",
        "vltrain/engine/loop.py:3 imports vltrain.stages",
        "vltrain/engine/loop.py:5 imports vltrain.cli",
        "vltrain/engine/loop.py:6 imports vltrain.stages",
        "vltrain/engine/loop.py:7 imports vltrain.tools",
    ]
    assert violations(tmp_path, "engine", ("models",)) == []


def test_every_package_is_on_a_floor() -> None:
    packages = {p.name for p in (REPO / "vltrain").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(FLOOR), (
        f"add to FLOORS: {packages - set(FLOOR)}; gone: {set(FLOOR) - packages}"
    )


def package_graph(root: Path, top: str = "vltrain") -> dict[str, set[str]]:
    """Package -> the packages it imports (first level under `top`), from every import."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = path.relative_to(root / top).parts
        if len(parts) < 2:
            continue  # top-level modules (__init__, __main__) are the face, not a room
        edges = graph.setdefault(parts[0], set())
        for _, name in imported_names(path, root):
            bits = name.split(".")
            if bits[0] == top and len(bits) > 1 and bits[1] != parts[0]:
                if (root / top / bits[1] / "__init__.py").is_file():
                    edges.add(bits[1])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one package (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_package_cycle() -> None:
    assert cycles(package_graph(REPO)) == []


def test_the_cycle_check_sees_a_cycle_through_a_lazy_import(tmp_path: Path) -> None:
    """Negative control: data -> eval (top level) and eval -> models -> data (lazy) is reported,
    and so is the floor rule that data may not import eval."""
    files = {
        "data/records.py": "from vltrain.eval import topk\n",
        "eval/topk.py": "def f():\n    from vltrain.models import towers\n",
        "models/towers.py": "import vltrain.data.records\n",
        "config/schema.py": "",
    }
    for rel, text in files.items():
        path = tmp_path / "vltrain" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").write_text("")
        path.write_text(text)
    (tmp_path / "vltrain" / "__init__.py").write_text("")
    assert cycles(package_graph(tmp_path)) == [["data", "eval", "models"]]
    banned = dict(RULES)["data"]
    assert violations(tmp_path, "data", banned) == [
        "vltrain/data/records.py:1 imports vltrain.eval"
    ]
    (tmp_path / "vltrain" / "models" / "towers.py").write_text("import vltrain.config.schema\n")
    assert cycles(package_graph(tmp_path)) == []


def test_stages_stay_thin() -> None:
    """A stage wires a model, an evaluator and a loss (DESIGN.md): a stage module past ~300
    lines holds code that belongs in models/, eval/, data/ or a helper object."""
    fat = {
        p.name: n
        for p in sorted((REPO / "vltrain" / "stages").glob("*.py"))
        if (n := len(p.read_text().splitlines())) > 320
    }
    assert not fat, f"stage modules over ~300 lines: {fat}"
