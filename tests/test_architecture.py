"""Import boundaries: the arrows of DESIGN.md point one way.

cli -> runs/tools -> stages -> engine/objectives/models/data/eval/inference/diagnostics ->
config. Every module under vltrain/ is parsed with `ast` (nothing is imported), and every
import counts: top-level, function-level (lazy), under TYPE_CHECKING, relative, and
`importlib.import_module("...")` with a literal name. A rule names a source package and the
packages it may not import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

# (source package, packages it must not import), all under vltrain
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("engine", ("stages", "runs", "tools", "cli")),
    ("config", ("models", "engine", "stages", "data", "objectives", "runs", "tools")),
    ("diagnostics", ("engine",)),
    ("models", ("stages", "runs", "tools", "cli")),
    ("data", ("stages", "runs", "tools", "cli")),
    ("objectives", ("stages", "runs", "tools", "cli")),
    ("eval", ("stages", "runs", "tools", "cli")),
    ("inference", ("stages", "runs", "tools", "cli")),
    ("stages", ("runs", "tools", "cli")),
    ("scaling", ("stages", "runs", "tools", "cli")),
]
# orchestration that sits at the top level today and moves under vltrain.runs (DESIGN.md)
RUNS_TODAY = ("pipeline", "quickstart", "tuning")
RULES = [(s, f + RUNS_TODAY if "runs" in f else f) for s, f in RULES]


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
