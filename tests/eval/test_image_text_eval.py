"""Image-text evaluation: the eval loss does not move with the process count, and a file with
one line per caption evaluates as its images (the lines of one image merged)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from vltrain.data.readers import read_jsonl
from vltrain.data.records import ImageTextDataset
from vltrain.eval.image_text import ImageTextEvaluator
from vltrain.objectives.contrastive import Features, InfoNCELoss


def _loss(image: torch.Tensor, text: torch.Tensor):
    return InfoNCELoss(temperature=0.1, gather=False).loss_from_features(
        Features(image, text, None)
    )


def test_eval_loss_chunks_do_not_grow_with_the_world_size() -> None:
    """data.eval_batch_size is per process: chunked by it times the world size, a 2-process
    run scored its eval loss over twice the candidates (3.18 vs 3.87 in a reviewer's pair)."""
    g = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(24, 8, generator=g), dim=-1)
    txt = F.normalize(torch.randn(24, 8, generator=g), dim=-1)
    pos = torch.arange(24)

    def value(world: int, chunk: int) -> float:
        where = SimpleNamespace(world_size=world, device=torch.device("cpu"))
        ev = ImageTextEvaluator(None, where, 6, loss_chunk=chunk)  # type: ignore[arg-type]
        return ev._eval_loss(_loss, img, txt, pos)["loss"]

    assert value(1, 6) == value(2, 6) == value(4, 6)
    assert value(2, 0) != value(1, 0)  # negative control: the old chunk, 6 x world size


def test_lines_of_one_image_evaluate_as_one_image(shapes_dir: Path, tmp_path: Path) -> None:
    """One JSONL line per caption (COCO flattened): each line was its own image, copies tied in
    image retrieval and another line's caption of the same image counted as a miss."""
    recs = read_jsonl(shapes_dir / "val.jsonl")[:4]
    (tmp_path / "images").mkdir()
    lines = []
    for r in recs:
        shutil.copy(shapes_dir / r["image"], tmp_path / r["image"])
        negs = r.get("negatives", [])[:1]
        for t in r["text"]:
            lines.append(json.dumps({"image": r["image"], "text": t, "negatives": negs}))
    (tmp_path / "flat.jsonl").write_text("\n".join(lines) + "\n")
    flat = ImageTextDataset(tmp_path / "flat.jsonl", 32, 0, train=False, merge_images=True)
    assert len(flat) == 4
    for i, r in enumerate(recs):
        assert flat[i]["texts"] == r["text"]
        assert len(flat.records[i]["negatives"]) == len(r["text"]) * min(1, len(r["negatives"]))
    unmerged = ImageTextDataset(tmp_path / "flat.jsonl", 32, 0, train=False)
    assert len(unmerged) == sum(len(r["text"]) for r in recs) > 4  # the reader is unchanged
