"""Golden loss traces: tiny CLIP, caption, RL and drafter runs reproduce stored per-step losses.

Guards the numerics of the whole training path (data, tokenizer, model init, loss, optimizer,
schedule) against silent drift: a refactor that changes any of them changes these numbers.
Every run goes through the CLI (`python -m vltrain train PRESET overrides...`) in a fresh
process, CPU fp32, one thread, fixed seed, and the losses are read from metrics.jsonl. The RL
run starts from the caption run's checkpoint; the drafter run drafts for the caption run's
captioner, trained on its greedy captions (`vltrain data regenerate`), as a user would chain them.

The stored values live in tests/golden/*.json and are only ever written on purpose:

    VLTRAIN_REFRESH_GOLDEN=1 python -m pytest tests/test_golden.py

rewrites them from the current code (review the diff before committing it); without the
variable the test never writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, hardlink_tree

GOLDEN = Path(__file__).resolve().parent / "golden"
ATOL = 1e-4
REFRESH = os.environ.get("VLTRAIN_REFRESH_GOLDEN") == "1"

COMMON = {
    "data.batch_size": 16,
    "data.num_workers": 0,
    "data.tokenizer_vocab": 400,
    "train.eval_every": 0,
    "train.save_every": 0,
    "train.log_every": 1,
    "run.seed": 0,
    "run.precision": "fp32",
    "run.device": "cpu",
    "run.threads": 1,
    "run.deterministic": True,
    "log.progress": False,
    "log.tensorboard": False,
}
RUNS = {
    "clip": (
        "clip.yaml",
        {"train.max_steps": 6, "optim.warmup_steps": 2},
    ),
    "caption": (
        "caption_finetune.yaml",
        {
            "train.max_steps": 4,
            "optim.warmup_steps": 1,
            "model.init_from": "",
            "data.length_buckets": 0,
            "caption.strategy": "greedy",
            "caption.max_new_tokens": 6,
        },
    ),
    # tests/stages/test_rl_stage.py's run: 4 images x 3 samples, 3 steps (model.init_from is
    # the caption run, set by golden_losses)
    "rl": (
        "rl.yaml",
        {
            "train.max_steps": 3,
            "optim.warmup_steps": 0,
            "optim.lr": 1e-3,
            "data.batch_size": 4,
            "model.freeze": "[]",
            "caption.max_new_tokens": 6,
            "caption.num_beams": 2,
            "rl.k": 3,
            "rl.max_new_tokens": 8,
        },
    ),
    # tests/stages/test_drafter_stage.py's captioner drafter, 3 steps (model.target and the
    # regenerated data are the caption run's, set by golden_losses)
    "drafter": (
        "drafter.yaml",
        {
            "train.max_steps": 3,
            "optim.warmup_steps": 1,
            "data.batch_size": 8,
            "data.length_buckets": 0,
            "drafter.block_size": 4,
            "drafter.eval_prompts": 4,
            "drafter.eval_max_new_tokens": 8,
        },
    ),
}
STARTS_FROM = {
    "rl": "from the caption run's checkpoint",
    "drafter": "for the caption run's captioner, on its regenerated captions",
}


def run_losses(name: str, data: Path, out: Path, **extra: object) -> dict[int, float]:
    """Train golden run `name` on `data` into `out` via the CLI; {step: training loss}."""
    preset, opts = RUNS[name]
    over = {
        **COMMON,
        "run.out_dir": out,
        "data.train": data / "train.jsonl",
        "data.eval": data / "val.jsonl",
        **opts,
        **extra,
    }
    args = ["train", str(REPO / "configs" / preset), *[f"{k}={v}" for k, v in over.items()]]
    vltrain_cli(args, out.parent)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def vltrain_cli(args: list[str], cwd: Path) -> None:
    """`python -m vltrain ARGS` in a fresh process on one thread; must exit 0."""
    cmd = [sys.executable, "-m", "vltrain", *args]
    # the checkout under test, whatever is installed; one thread so BLAS sums in a fixed order
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def regenerated_captions(caption_run: Path, data: Path, out: Path) -> Path:
    """The caption run's greedy captions of 24 training images (the drafter's training data)."""
    hardlink_tree(data / "images", out / "images")
    lines = (data / "train.jsonl").read_text().splitlines()[:24]
    (out / "train.jsonl").write_text("\n".join(lines) + "\n")
    regen = out / "regen.jsonl"
    args = ["data", "regenerate", "--checkpoint", str(caption_run), "--max-new-tokens", "12"]
    vltrain_cli([*args, "--data", str(out / "train.jsonl"), "--out", str(regen)], out)
    return regen


def mismatches(got: dict[int, float], want: dict[int, float], atol: float) -> list[str]:
    """Human-readable differences between two loss traces (empty when they agree)."""
    if sorted(got) != sorted(want):
        return [f"steps differ: got {sorted(got)}, golden {sorted(want)}"]
    return [
        f"step {s}: got {got[s]:.6f}, golden {want[s]:.6f} (|diff| {abs(got[s] - want[s]):.2e})"
        for s in sorted(want)
        if not abs(got[s] - want[s]) <= atol  # NaN counts as a mismatch
    ]


def golden_path(name: str) -> Path:
    return GOLDEN / f"{name}_losses.json"


def read_golden(name: str) -> dict[int, float]:
    path = golden_path(name)
    assert path.is_file(), f"{path} is missing: create it with VLTRAIN_REFRESH_GOLDEN=1"
    return {int(s): v for s, v in json.loads(path.read_text())["loss"].items()}


def write_golden(name: str, losses: dict[int, float]) -> None:
    preset, opts = RUNS[name]
    doc = {
        "about": f"per-step training loss of tests/test_golden.py::{name} "
        f"(configs/{preset}{' ' + STARTS_FROM[name] if name in STARTS_FROM else ''}, "
        f"{len(losses)} steps, CPU fp32, seed 0); "
        "refresh with VLTRAIN_REFRESH_GOLDEN=1 python -m pytest tests/test_golden.py",
        "atol": ATOL,
        "loss": {str(s): losses[s] for s in sorted(losses)},
    }
    GOLDEN.mkdir(exist_ok=True)
    golden_path(name).write_text(json.dumps(doc, indent=2) + "\n")


@pytest.fixture(scope="module")
def golden_losses(
    shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], dict[int, float]]:
    """Train a golden run by name, each at most once per module (rl and drafter start from the
    caption run, trained once for the three); returns its losses."""
    root = tmp_path_factory.mktemp("golden")
    done: dict[str, dict[int, float]] = {}

    def losses(name: str) -> dict[int, float]:
        if name not in done:
            extra: dict[str, object] = {}
            if name in STARTS_FROM:
                losses("caption")
            caption = root / "caption"
            if name == "rl":
                extra = {"model.init_from": caption}
            elif name == "drafter":
                regen = regenerated_captions(caption, shapes_dir, root / "regen")
                extra = {"model.target": caption, "data.train": regen, "data.eval": regen}
            done[name] = run_losses(name, shapes_dir, root / name, **extra)
        return done[name]

    return losses


@pytest.mark.parametrize("name, steps", [("clip", 6), ("caption", 4), ("rl", 3), ("drafter", 3)])
def test_loss_trace_matches_golden(
    name: str, steps: int, golden_losses: Callable[[str], dict[int, float]]
) -> None:
    got = golden_losses(name)
    assert sorted(got) == list(range(1, steps + 1)), "train.log_every=1 logs every step"
    if REFRESH:
        write_golden(name, got)
    bad = mismatches(got, read_golden(name), ATOL)
    assert not bad, (
        f"{name} losses moved from {golden_path(name)} (atol {ATOL}):\n"
        + "\n".join(bad)
        + "\nIf the change is intended, refresh with VLTRAIN_REFRESH_GOLDEN=1 and commit the diff."
    )


def test_golden_comparison_detects_another_seed(shapes_dir: Path, tmp_path: Path) -> None:
    """Negative control: the comparison above is not vacuous; a different init fails it."""
    golden = read_golden("clip")
    assert len(golden) == 6
    assert not mismatches(golden, golden, ATOL)
    other = run_losses("clip", shapes_dir, tmp_path / "seed1", **{"run.seed": 1})
    bad = mismatches(other, golden, ATOL)
    assert len(bad) >= 3, bad  # most steps differ, not just a rounding at one of them
    assert max(abs(other[s] - golden[s]) for s in golden) > 100 * ATOL
