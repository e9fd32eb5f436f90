"""A bad sample never crashes a run and never trains silently: skipped, counted, thresholded."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.data.synth import write_bad_corpus
from vltrain.engine.loop import train


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
