"""Hard-negative accuracy in eval: overall and per `negative_kinds` label, vs brute force."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from tests.conftest import tiny_overrides
from vltrain.config import load_config
from vltrain.data.images import load_image
from vltrain.runs import train
from vltrain.tools.loading import load_trained


def test_hard_negative_accuracy_per_kind_equals_brute_force(shapes_dir: Path, tmp_path: Path):
    run = tmp_path / "run"
    opts = {"train.max_steps": 3, "train.save_every": 3, "objective.hard_negatives": 2}
    summary = train(load_config(None, tiny_overrides(shapes_dir, run, **opts)))
    val = summary["val"]
    kinds = ("color", "shape", "size", "relation")
    assert all(f"eval_hardneg_acc_{k}" in val for k in kinds)

    # brute force: one image at a time, its first caption against each of its negatives
    cfg, stage, model = load_trained(run)
    hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    recs = [json.loads(x) for x in (shapes_dir / "val.jsonl").read_text().splitlines()]
    with torch.no_grad():
        for r in recs:
            img = load_image(shapes_dir / r["image"], cfg.data.image_size)[None]
            im = model.encoder.encode_image(img)[0]
            sc = stage.retrieval.encode_texts(model.encoder, [r["text"][0], *r["negatives"]]) @ im
            for kind, s in zip(r["negative_kinds"], sc[1:].tolist(), strict=True):
                hits[kind][0] += int(float(sc[0]) > s)
                hits[kind][1] += 1
    assert set(hits) == set(kinds)
    for k in kinds:
        assert abs(val[f"eval_hardneg_acc_{k}"] - hits[k][0] / hits[k][1]) < 1e-9, k
    total = sum(h[1] for h in hits.values())
    overall = sum(h[0] for h in hits.values()) / total
    assert abs(val["eval_hardneg_acc"] - overall) < 1e-9
