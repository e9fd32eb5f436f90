"""The contrastive stage trains and evaluates on the sources beyond JSONL, through the CLI."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides
from vltrain.cli import main
from vltrain.data.readers import read_jsonl


def test_train_on_a_captions_csv_folder_and_evaluate_on_parquet(
    shapes_dir: Path, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    train = tmp_path / "train_images"  # a folder of images with its captions.csv
    (train / "images").mkdir(parents=True)
    recs = read_jsonl(shapes_dir / "train.jsonl")[:64]
    with open(train / "captions.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "caption"])
        for r in recs:
            shutil.copy(shapes_dir / r["image"], train / r["image"])
            w.writerows((r["image"], t) for t in r["text"])
    val = read_jsonl(shapes_dir / "val.jsonl")[:16]
    table = datasets.Dataset.from_dict(
        {"image": [str(shapes_dir / r["image"]) for r in val], "text": [r["text"] for r in val]}
    ).cast_column("image", datasets.Image())
    table.to_parquet(str(tmp_path / "val.parquet"))
    (tmp_path / "jsonl").mkdir()  # the same records as JSONL, the reference run
    for name, rows in (("train", recs), ("val", val)):
        with open(tmp_path / "jsonl" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"image": r["image"], "text": r["text"]}) + "\n" for r in rows)
    shutil.copytree(shapes_dir / "images", tmp_path / "jsonl" / "images")
    summaries = []
    for source in ("csv", "jsonl"):
        out = tmp_path / f"run_{source}"
        extra = {"train.max_steps": 2, "optim.warmup_steps": 0, "train.eval_every": 2}
        args = tiny_overrides(tmp_path / "jsonl", out, **extra)
        if source == "csv":
            args += [f"data.train={train}", f"data.eval={tmp_path / 'val.parquet'}"]
        assert main(["train", str(REPO / "configs" / "clip.yaml"), *args]) == 0
        summaries.append(json.loads((out / "summary.json").read_text()))
    csv_run, jsonl_run = summaries
    assert csv_run["val"]["eval_n_images"] == 16 and not csv_run["bad_samples"]
    # same records, same order, same pixels: the run is the JSONL run, metric for metric
    assert csv_run["val"] == jsonl_run["val"] and csv_run["best_value"] == jsonl_run["best_value"]
