"""One decode-target protocol: the three targets implement every member of `DecodeTarget`, and
the modules of vltrain/inference import each other without a circle."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_architecture import cycles, imported_names
from vltrain.inference.captioner_target import CaptionerTarget
from vltrain.inference.hf_target import HFTarget
from vltrain.inference.native_llama import NativeTarget
from vltrain.inference.target import DecodeTarget

METHODS = [
    name
    for name, value in vars(DecodeTarget).items()
    if callable(value) and not name.startswith("_")
]


def test_the_protocol_is_the_one_the_docs_name() -> None:
    assert set(METHODS) == {
        "prefill",
        "step",
        "verify",
        "select",
        "crop",
        "reorder",
        "next_positions",
        "embed",
        "head",
        "head_params",
    }


@pytest.mark.parametrize("cls", [HFTarget, NativeTarget, CaptionerTarget])
def test_every_target_implements_every_method(cls: type) -> None:
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    assert not missing, f"{cls.__name__} lacks {missing}"


def module_graph(root: Path, package: str = "vltrain.inference") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (anywhere in the file)."""
    folder = root.joinpath(*package.split("."))
    names = {f"{package}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in sorted(names):
        path = folder / f"{name.rpartition('.')[2]}.py"
        found = {n for _, n in imported_names(path, root)}
        graph[name] = {m for m in names - {name} if m in found}
    return graph


def test_no_import_circle_between_inference_modules() -> None:
    assert cycles(module_graph(REPO)) == []


def test_the_circle_check_sees_a_two_file_circle(tmp_path: Path) -> None:
    """Negative control: a.py imports b lazily, b.py imports a at the top."""
    pkg = tmp_path / "vltrain" / "inference"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from vltrain.inference.b import g\n")
    (pkg / "b.py").write_text("from vltrain.inference import a\n")
    (pkg / "c.py").write_text("from vltrain.inference.a import f\n")
    assert cycles(module_graph(tmp_path)) == [["vltrain.inference.a", "vltrain.inference.b"]]
