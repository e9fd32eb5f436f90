"""The public surface: `from vltrain import ...` works for every documented name, `import vltrain`
imports none of them (PEP 562), docs/api.md lists each one, and the API reference builds."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vltrain
from tests.conftest import REPO

PUBLIC = [n for n in vltrain.__all__ if n != "__version__"]


def test_documented_names_import_from_the_package() -> None:
    from vltrain import InfoNCELoss, Trainer, load_config, load_run, train  # noqa: F401
    from vltrain.engine.loop import Trainer as EngineTrainer
    from vltrain.objectives.contrastive import InfoNCELoss as Loss

    assert Trainer is EngineTrainer and InfoNCELoss is Loss
    for name in PUBLIC:
        obj = getattr(vltrain, name)
        assert obj is getattr(importlib.import_module(obj.__module__), name), name
        assert (obj.__doc__ or "").strip(), f"vltrain.{name} has no docstring"
    assert set(PUBLIC) == set(vltrain._EXPORTS) and set(PUBLIC) <= set(dir(vltrain))
    with pytest.raises(AttributeError, match="has no attribute 'Traner'"):
        vltrain.Traner  # noqa: B018


def test_import_vltrain_imports_nothing_heavy() -> None:
    """A fresh interpreter: `import vltrain` loads no torch and no submodule; the first
    access to a name imports its module (negative control: the same check sees it)."""
    code = (
        "import sys, vltrain\n"
        "print(sorted(m for m in sys.modules if m.startswith(('vltrain.', 'torch'))))\n"
        "vltrain.evaluate_retrieval\n"
        "print('torch' in sys.modules, 'vltrain.eval.retrieval' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == ["[]", "True True"]


def test_api_page_lists_the_public_surface() -> None:
    """docs/api.md's table names every public name, and nothing else."""
    text = (REPO / "docs" / "api.md").read_text()
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    listed = {n for cell in rows for n in re.findall(r"`([A-Za-z_]+)", cell)}
    assert listed == set(PUBLIC)


# ---- the API reference: docs/build_api.py fails on pdoc's warnings ---------------------------


def _builder():
    spec = importlib.util.spec_from_file_location("build_api", REPO / "docs" / "build_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_builder_fails_on_a_broken_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean package builds without warnings; one whose __all__ names something that does
    not resolve is reported (the negative control of the CI step)."""
    build = _builder().build
    for name, exported in (("api_ok", '["f"]'), ("api_broken", '["f", "gone"]')):
        pkg = tmp_path / "src" / name
        pkg.mkdir(parents=True)
        body = f'"""A package."""\n__all__ = {exported}\n\ndef f() -> int:\n    """One."""\n'
        (pkg / "__init__.py").write_text(body + "    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    assert build(tmp_path / "ok", ("api_ok",)) == []
    assert (tmp_path / "ok" / "api_ok.html").is_file()
    problems = build(tmp_path / "broken", ("api_broken",))
    assert any("'gone'" in p for p in problems), problems
