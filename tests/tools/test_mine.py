"""Hard-negative mining: rules on hand-made embeddings, and the CLI on a trained tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import tiny_overrides
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.runs import train
from vltrain.tools.mine import MineOptions, mine_negatives


def _unit(*rows: list[float]) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float32), dim=-1)


def test_rules_skip_positives_duplicates_and_false_negatives() -> None:
    img = _unit([1, 0, 0], [0, 1, 0])
    # caption 0-1 belong to image 0, caption 2 to image 1; 3-5 belong to record 2 (no image)
    txt = _unit(
        [1, 0.1, 0], [0.9, 0.2, 0], [0, 1, 0], [0.99, 0.05, 0], [0.7, 0.7, 0], [0.3, 0.9, 0]
    )
    texts = ["a", "b", "c", "near-duplicate", "mid", "a"]
    owner = torch.tensor([0, 0, 1, 2, 2, 2])
    mined = mine_negatives(img, [0, 1], txt, texts, owner, MineOptions(k=2, margin=0.95))
    # image 0: "near-duplicate" scores above 0.95 x positive -> skipped as a false negative;
    # "a" (same text as a positive) skipped; the next candidates are taken in rank order
    assert mined[0] == ["mid", "c"]
    loose = mine_negatives(img, [0, 1], txt, texts, owner, MineOptions(k=2, margin=10.0))
    assert loose[0][0] == "near-duplicate"  # control: without the margin rule it is taken
    window = mine_negatives(
        img, [0, 1], txt, texts, owner, MineOptions(k=5, range_min=3, range_max=5, margin=10.0)
    )
    assert len(window[0]) <= 2


def test_mine_cli_writes_negatives_for_every_record(shapes_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(shapes_dir, run, **{"train.max_steps": 4})))
    out = shapes_dir / "val_hn.jsonl"
    code = main(
        [
            "mine",
            "--checkpoint",
            str(run),
            "--data",
            str(shapes_dir / "val.jsonl"),
            "--out",
            str(out),
            "--k",
            "3",
        ]
    )
    assert code == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    src = [json.loads(x) for x in (shapes_dir / "val.jsonl").read_text().splitlines()]
    assert len(rows) == len(src)
    for row, rec in zip(rows, src, strict=True):
        assert row["image"] == rec["image"] and len(row["negatives"]) == 3
        assert not set(row["negatives"]) & set(rec["text"])
    out.unlink()
    # one line per caption: each line gets the image's negatives, never a caption of its own
    # image from another line (each line was its own image: its siblings were mined)
    flat = shapes_dir / "val_flat.jsonl"
    flat.write_text(
        "".join(json.dumps({"image": r["image"], "text": t}) + "\n" for r in src for t in r["text"])
    )
    argv = ["mine", "--checkpoint", str(run), "--data", str(flat), "--out", str(out), "--k", "3"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    texts = {r["image"]: set(r["text"]) for r in src}
    assert len(rows) == sum(len(r["text"]) for r in src)
    assert all(len(row["negatives"]) == 3 for row in rows)
    assert not any(set(row["negatives"]) & texts[row["image"]] for row in rows)
    flat.unlink()
    out.unlink()
    bad = main(
        [
            "mine",
            "--checkpoint",
            str(run),
            "--data",
            str(shapes_dir / "val.jsonl"),
            "--out",
            str(tmp_path / "elsewhere.jsonl"),
        ]
    )
    assert bad == 2
