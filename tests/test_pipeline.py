"""`vltrain pipeline`: stages chained by best checkpoint; restart skips; interrupted resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from vltrain.cli import main
from vltrain.config.core import ConfigError
from vltrain.pipeline import load_pipeline, run_pipeline


def _pipeline(tmp: Path, data: Path) -> Path:
    """pretrain (3 steps) -> finetune (4 steps, checkpoint every 2) on a 32-image subset."""
    for split, n in (("train", 32), ("val", 4)):
        lines = (data / f"{split}.jsonl").read_text().splitlines()[:n]
        (tmp / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp / "images").symlink_to(data / "images")
    for name in ("caption_pretrain.yaml", "caption_finetune.yaml"):
        shutil.copy(REPO / "configs" / name, tmp / name)
    shared = {
        "data.train": tmp / "train.jsonl",
        "data.eval": tmp / "val.jsonl",
        "data.batch_size": 8,
        "data.num_workers": 0,
        "data.tokenizer_vocab": 400,
        "data.length_buckets": 0,
        "data.max_text_len": 24,
        "caption.max_new_tokens": 5,
        "caption.num_beams": 2,
        "train.eval_every": 0,
        "train.log_every": 1,
        "optim.warmup_steps": 1,
        "log.progress": False,
        "log.tensorboard": False,
    }
    spec = {
        "root": str(tmp / "root"),
        "overrides": [f"{k}={v}" for k, v in shared.items()],
        "stages": [
            {"name": "pre", "config": "caption_pretrain.yaml", "overrides": ["train.max_steps=3"]},
            {
                "name": "ft",
                "config": "caption_finetune.yaml",
                "overrides": {"train.max_steps": 4, "train.save_every": 2},
            },
        ],
    }
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_pipeline_chains_skips_and_resumes(shapes_dir: Path, tmp_path: Path, capsys) -> None:
    path = _pipeline(tmp_path, shapes_dir)
    root = tmp_path / "root"
    stages = load_pipeline(path)
    assert stages[1].cfg.model.init_from == str(root / "pre")  # chained to the previous stage
    rows = run_pipeline(path)
    assert [(r["name"], r["action"], r["summary"]["steps"]) for r in rows] == [
        ("pre", "train", 3),
        ("ft", "train", 4),
    ]
    first_ft = rows[1]["summary"]
    ft_cfg = yaml.safe_load((root / "ft" / "config.yaml").read_text())
    assert ft_cfg["model"]["init_from"] == str(root / "pre")
    report = (root / "report.md").read_text()
    assert "| pre | train | 3 |" in report and "| ft | train | 4 |" in report
    assert "eval_CIDEr-D" in report

    # restart: both finished -> nothing trains (metrics files untouched)
    before = {n: (root / n / "metrics.jsonl").read_text() for n in ("pre", "ft")}
    assert main(["pipeline", str(path)]) == 0
    assert "| pre | skip | 3 |" in (root / "report.md").read_text()
    assert "| ft | skip | 4 |" in capsys.readouterr().out
    assert before == {n: (root / n / "metrics.jsonl").read_text() for n in ("pre", "ft")}

    # interrupt the second stage after its step-2 checkpoint: it resumes, the first is skipped
    (root / "ft" / "summary.json").unlink()
    shutil.rmtree(root / "ft" / "checkpoints" / "step_4")
    rows = run_pipeline(path)
    assert [r["action"] for r in rows] == ["skip", "resume"]
    out = capsys.readouterr()
    assert "at step 2" in out.out + out.err  # continued from step_2, not retrained from 0
    assert rows[1]["summary"]["steps"] == 4
    log = (root / "ft" / "metrics.jsonl").read_text()
    # resume reproduces the uninterrupted stage (CPU fp32)
    assert rows[1]["summary"]["val"]["eval_loss"] == pytest.approx(
        first_ft["val"]["eval_loss"], abs=1e-6
    )
    steps = [json.loads(x)["step"] for x in log.splitlines() if "loss" in json.loads(x)]
    assert steps[-1] == 4


def test_pipeline_errors_name_the_stage(tmp_path: Path) -> None:
    shutil.copy(REPO / "configs" / "caption_pretrain.yaml", tmp_path / "p.yaml")
    bad = {"root": "r", "stages": [{"name": "a", "config": "p.yaml", "overrides": ["optim.lrr=1"]}]}
    (tmp_path / "pl.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="stage 'a'.*optim.lr"):
        load_pipeline(tmp_path / "pl.yaml")
    (tmp_path / "pl.yaml").write_text(yaml.safe_dump({"root": "r", "stagez": []}))
    with pytest.raises(ConfigError, match="stagez"):
        load_pipeline(tmp_path / "pl.yaml")
