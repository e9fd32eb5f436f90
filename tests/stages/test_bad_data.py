"""A bad sample never crashes a run and never trains silently: skipped, counted, thresholded."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides, torchrun_vltrain
from tests.fixtures import write_bad_corpus
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.runs import train


@pytest.fixture()
def mixed(shapes_dir: Path, tmp_path: Path) -> tuple[Path, Counter]:
    """The synthetic train split plus one record per failure kind (and tricky good images)."""
    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data)
    bad_lines = write_bad_corpus(data).read_bytes().splitlines()
    expected = Counter()
    for line in bad_lines:
        rec = json.loads(line.decode("utf-8", errors="replace"))
        if rec["expect"] != "ok":
            expected[rec["expect"]] += 1
    mixed = data / "mixed.jsonl"
    mixed.write_bytes((data / "train.jsonl").read_bytes() + b"\n".join(bad_lines) + b"\n")
    return mixed, expected


def test_every_failure_kind_is_skipped_and_counted_by_reason(mixed, tmp_path: Path) -> None:
    path, expected = mixed
    n = sum(1 for line in path.read_bytes().splitlines() if line.strip())
    assert len(expected) >= 7  # missing, empty, not an image, truncated, corrupt, bomb, ...
    # One global batch = the whole file, so every record is seen exactly once.
    cfg = load_config(
        None,
        tiny_overrides(
            path.parent,
            tmp_path / "run",
            **{
                "data.train": path,
                "data.batch_size": n,
                "train.max_steps": 1,
                "data.max_bad_fraction": 1.0,
                "optim.warmup_steps": 0,
            },
        ),
    )
    summary = train(cfg)
    assert summary["bad_samples"] == dict(expected)
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert last["bad_samples"] == sum(expected.values())
    assert all(last[f"bad_{reason}"] == k for reason, k in expected.items())


def test_too_many_bad_samples_abort_with_a_clear_error(mixed, tmp_path: Path, capsys) -> None:
    path, expected = mixed
    args = tiny_overrides(
        path.parent,
        tmp_path / "run",
        **{
            "data.train": path,
            "data.batch_size": 16,
            "train.max_steps": 30,
            "data.max_bad_fraction": 0.01,
        },
    )
    code = main(
        ["train", str(Path(__file__).resolve().parents[2] / "configs" / "clip.yaml"), *args]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "data.max_bad_fraction" in err and "Traceback" not in err
    assert any(reason in err for reason in expected)


@pytest.mark.slow
def test_a_small_bad_fraction_below_the_threshold_trains_on(mixed, tmp_path: Path) -> None:
    path, expected = mixed
    cfg = load_config(
        None,
        tiny_overrides(
            path.parent,
            tmp_path / "run",
            **{"data.train": path, "data.max_bad_fraction": 0.5, "train.max_steps": 4},
        ),
    )
    summary = train(cfg)
    assert summary["steps"] == 4


def _half_missing(shapes_dir: Path, tmp_path: Path, n_good: int) -> Path:
    """`n_good` synthetic records, each followed by one whose image does not exist."""
    lines = (shapes_dir / "train.jsonl").read_text().splitlines()[:n_good]
    out = []
    for i, line in enumerate(lines):
        rec = json.loads(line)
        out += [json.dumps(rec), json.dumps({**rec, "image": f"images/gone_{i}.png", "id": i})]
    shutil.copytree(shapes_dir / "images", tmp_path / "data" / "images")
    path = tmp_path / "data" / "half_missing.jsonl"
    path.write_text("\n".join(out) + "\n")
    return path


@pytest.mark.slow
def test_a_micro_batch_with_no_valid_sample_skips_the_step(shapes_dir: Path, tmp_path: Path):
    # batch 1: every bad record is a whole micro-batch with nothing to forward
    path = _half_missing(shapes_dir, tmp_path, 4)
    args = {"data.batch_size": 1, "train.max_steps": 8, "data.max_bad_fraction": 1.0}
    args["data.train"] = path
    cfg = load_config(None, tiny_overrides(shapes_dir, tmp_path / "run", **args))
    summary = train(cfg)
    assert summary["steps"] == 8
    assert summary["skipped_steps"] == 4  # one epoch of 8 records, 4 of them missing
    assert summary["bad_samples"] == {"missing": 4}
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 8 and losses.count("nan") == 4  # a skipped step logs no loss
    # the doctor judges the steps that trained: no 'nonfinite' error for an empty step (it
    # said "non-finite loss/gradient -> lower optim.lr" for each)
    found = (tmp_path / "run" / "doctor.jsonl").read_text()
    assert "nonfinite" not in found


@pytest.mark.slow
def test_two_ranks_skip_together_when_one_rank_has_only_bad_samples(
    shapes_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    path = _half_missing(shapes_dir, tmp_path, 6)
    over = tiny_overrides(
        shapes_dir,
        tmp_path / "run",
        **{
            "data.train": path,
            "data.batch_size": 1,
            "train.max_steps": 6,
            "train.save_every": 6,
            "data.max_bad_fraction": 1.0,
        },
    )
    cfg = Path(__file__).resolve().parents[2] / "configs" / "clip.yaml"
    res = torchrun_vltrain(["train", str(cfg), *over])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 6
    # 12 records, half missing, 2 per step: some step had a rank with nothing to forward
    assert 1 <= summary["skipped_steps"] < 6
    assert "held no valid sample" in res.stdout + res.stderr
    weights = load_file(tmp_path / "run" / "checkpoints" / "step_6" / "model.safetensors")
    assert all(bool(v.isfinite().all()) for v in weights.values())
