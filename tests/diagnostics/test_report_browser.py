"""The HTML report in headless Chromium: no console errors, plots not blank in a screenshot,
the page fits a 1,280-px window however wide its tables are.

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
    "--enable-logging=stderr", "--v=0", "--window-size=1280,1400",
]  # fmt: skip
WINDOW = 1280  # px: a laptop browser window


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


def scroll_width(page: Path, tmp: Path) -> int:
    """The page's scrollWidth in a 1,280-px window (a copy that writes it into its title)."""
    probe = tmp / f"probe-{page.name}"
    script = "<script>document.title = 'W' + document.documentElement.scrollWidth</script>"
    probe.write_text(page.read_text().replace("</body>", script + "</body>"))
    dom = _chromium(probe, tmp, "--dump-dom").stdout
    return int(dom.split("<title>W", 1)[1].split("<", 1)[0])


def _wide_run(path: Path, seed: int) -> Path:
    """A run whose tables are wide: 24 eval metrics, 14 tuned parameters, long paths, and the
    same minor doctor finding at 30 steps."""
    _run_dir(path, 60)
    cfg = load_config(None, [f"run.seed={seed}", f"data.train={path}/{'long_folder_' * 8}.jsonl"])
    dump_config(cfg, path / "config.yaml")
    names = [f"eval_{split}_{m}@{k}" for split in ("i2t", "t2i") for m in ("R", "MRR", "nDCG")
             for k in (1, 5, 10, 50)]  # fmt: skip
    evals = [{"step": s, **{n: 1 / (s + i + 3) for i, n in enumerate(names)}} for s in (20, 40, 60)]
    with (path / "metrics.jsonl").open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in evals))
    (path / "summary.json").write_text(json.dumps({"best_metric": names[0], "best_step": 60}))
    blips = [
        {"severity": "info", "check": "grad_spike", "step": s, "fix": "check the batch",
         "message": f"grad norm {1 + s / 7:.4g} is {s % 9 + 6} MADs above the recent median"}
        for s in range(10, 40)
    ]  # fmt: skip
    (path / "doctor.jsonl").write_text("".join(json.dumps(r) + "\n" for r in blips))
    return path


def _wide_study(path: Path) -> Path:
    """A tune study folder: two wide runs as its trials, and a trials table of 14 tuned
    parameters."""
    for seed in (0, 1):
        _wide_run(path / f"trial_{seed:04d}", seed)
    params = [f"params.optim.option_{i}" for i in range(14)]
    trials = [",".join(["number", "value", *params])]
    trials += [",".join([str(t), str(1 / (t + 7)), *[str(t / (i + 3)) for i in range(14)]])
               for t in range(5)]  # fmt: skip
    (path / "trials.csv").write_text("\n".join(trials) + "\n")
    return path


def test_report_fits_a_1280_px_window(tmp_path):
    page = write_report([str(_wide_study(tmp_path / "study"))], tmp_path / "report.html")
    html = page.read_text()
    assert scroll_width(page, tmp_path) <= WINDOW
    assert html.count("<td>info</td><td>30</td>") == 2  # the 30 blips: one row per run, counted
    assert "0.3333333" not in html and "<td>0.04348</td>" in html  # rounded to 4 digits
    assert "params.optim.option_13" in html  # the study's trials table is on the page
    # negative control: without the tables' scrolling boxes the same page is far too wide
    unboxed = tmp_path / "unboxed.html"
    unboxed.write_text(html.replace('<div class="scroll">', "<div>"))
    assert scroll_width(unboxed, tmp_path) > 1.5 * WINDOW


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
