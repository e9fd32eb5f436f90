"""The built wheel is usable on its own: presets and the py.typed marker are package data.

Guards against a wheel that works only from a checkout (presets found through the repo's
`configs/` folder, never through the installed package). Builds a wheel offline from a copy of
the sources, installs it into a temporary folder outside the checkout, and runs the CLI and
`load_config` on every shipped preset from there, with nothing of the checkout on sys.path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import REPO

# the package folder holding the presets (configs/ at the root links to it)
PRESET_DIR = (REPO / "configs").resolve()

CHECK_INSTALLED = """
import sys
from importlib import resources
from pathlib import Path

import vltrain
from vltrain.config import load_config

target, rel = Path(sys.argv[1]).resolve(), sys.argv[2]
where = Path(vltrain.__file__).resolve()
assert where.is_relative_to(target), f"vltrain imported from {where}, not from {target}"
presets = sorted(p for p in resources.files("vltrain").joinpath(rel).iterdir()
                 if p.name.endswith(".yaml"))
for p in presets:
    with resources.as_file(p) as path:
        if p.name.endswith("pipeline.yaml"):  # a list of stage configs, not a config
            from vltrain.runs.pipeline import load_pipeline

            assert load_pipeline(path), p.name
        elif p.name.startswith("pipeline_"):  # its stages need model parts (pipeline_llava)
            from vltrain.config.core import ConfigError
            from vltrain.runs.pipeline import load_pipeline

            try:
                load_pipeline(path)
                raise AssertionError(p.name + " loaded without its model parts")
            except ConfigError as e:
                assert "does not exist" in str(e) or "not a local path" in str(e), (p.name, str(e))
        else:
            assert load_config(path).train.max_steps >= 1, p.name
assert resources.files("vltrain").joinpath("py.typed").is_file(), "py.typed not shipped"
print("presets:", len(presets))
"""


def _copy_sources(dst: Path) -> None:
    """What the wheel is built from, copied so the build leaves nothing in the checkout."""
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")
    shutil.copy(REPO / "README.md", dst / "README.md")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "vltrain", dst / "vltrain", ignore=ignore)


def test_wheel_ships_presets_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    shipped = sorted(p.name for p in PRESET_DIR.iterdir() if p.suffix in (".yaml", ".yml"))
    assert shipped, f"no presets in {PRESET_DIR}"
    rel = PRESET_DIR.relative_to((REPO / "vltrain").resolve()).as_posix()

    src, dist, target, cwd = (tmp_path / d for d in ("src", "dist", "site", "elsewhere"))
    for d in (src, dist, cwd):
        d.mkdir()
    _copy_sources(src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # offline: the build backend (setuptools) comes from this environment (the test extra)
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(dist)],
        check=True,
        cwd=cwd,
        env=env,
    )
    (wheel,) = dist.glob("vltrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.rsplit("/", 1)[1] for n in names if n.startswith(f"vltrain/{rel}/")) == shipped
    assert "vltrain/py.typed" in names
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
        cwd=cwd,
        env=env,
    )

    env = {**env, "PYTHONPATH": str(target), "TOKENIZERS_PARALLELISM": "false"}
    cli = subprocess.run(
        [sys.executable, "-m", "vltrain", "quickstart", "--help"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "--steps" in cli.stdout
    check = subprocess.run(
        [sys.executable, "-c", CHECK_INSTALLED, str(target), rel],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    assert f"presets: {len(shipped)}\n" in check.stdout, check.stdout
