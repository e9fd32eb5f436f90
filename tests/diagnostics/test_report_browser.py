"""The HTML report in headless Chromium: no console errors, plots not blank in a screenshot.

Debian's `chromium` (installed by .ci/run when missing); skipped where it is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vltrain.config import load_config
from vltrain.config.schema import dump_config
from vltrain.diagnostics import svg
from vltrain.runs.run_report import write_report

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0", "--window-size=1300,1400",
]  # fmt: skip


def _chromium(page: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.iterdir()))}"
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def console_messages(page: Path, tmp: Path) -> list[str]:
    res = _chromium(page, tmp, "--dump-dom")
    return [line for line in res.stderr.splitlines() if ":CONSOLE" in line]


def plot_pixels(page: Path, tmp: Path) -> int:
    """Pixels of the plot palette's first two colours (line/point ink) in a screenshot."""
    shot = tmp / "shot.png"
    _chromium(page, tmp, f"--screenshot={shot}")
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    n = 0
    for hexcolor in svg.PALETTE[:2]:
        rgb = np.array([int(hexcolor[i : i + 2], 16) for i in (1, 3, 5)])
        n += int((np.abs(img - rgb).sum(-1) < 60).sum())
    return n


def _run_dir(path: Path, n: int) -> Path:
    path.mkdir(parents=True)
    dump_config(load_config(None, []), path / "config.yaml")
    rows = [
        {"step": i + 1, "loss": 3.0 / (1 + 0.1 * i) + 0.05 * (i % 3), "lr": 1e-3 * min(1, i / 5),
         "grad_norm": 1.0 + 0.1 * (i % 4), "samples_per_s": 100.0 + i}
        for i in range(n)
    ]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_renders_without_console_errors_and_plots_are_inked(tmp_path):
    page = write_report([str(_run_dir(tmp_path / "run", 60))], tmp_path / "report.html")
    assert console_messages(page, tmp_path) == []
    inked = plot_pixels(page, tmp_path)
    blank = write_report([str(_run_dir(tmp_path / "empty", 0))], tmp_path / "blank.html")
    assert plot_pixels(blank, tmp_path) < 50 < 500 < inked  # the negative control is blank


def test_console_error_is_caught(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<html><body><script>console.error("boom")</script></body></html>')
    assert any("boom" in m for m in console_messages(page, tmp_path))
