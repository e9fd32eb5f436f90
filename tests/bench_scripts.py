"""The bench/ scripts that tests exercise, loaded as modules from their files (bench/ is not a
package: its scripts run as ``python bench/NAME.py``)."""

from __future__ import annotations

from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/NAME.py`` as a fresh module."""
    spec = spec_from_file_location(name, BENCH / f"{name}.py")
    mod = module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
