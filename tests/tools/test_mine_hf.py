"""`vltrain mine` on Hugging Face backbones embeds exactly as the model is trained and evaluated.

The bug this guards: mining stacked raw 64x64 tensors and called `encode_image` directly, so
hf_clip / hf_siglip embeddings skipped the processor's normalisation (silently wrong) and the
vlm embedder crashed. Mining now goes through the stage's evaluation path; here its embeddings
are checked against the *training* collate path (`stage.batcher(samples)` -> `model.embed`),
an independent route through the backbone's processor, for each backbone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_overrides
from tests.models.test_hf_embedders import clip_dir, qwen2vl_dir, siglip_dir  # noqa: F401
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.data.records import ImageTextDataset, split_bad
from vltrain.runs import train
from vltrain.tools.loading import load_trained
from vltrain.tools.mine import _embed

KINDS = {
    "hf_clip": ("clip_dir", {}),
    "hf_siglip": ("siglip_dir", {"objective.loss": "siglip", "data.max_text_len": 16}),
    "vlm": ("qwen2vl_dir", {"data.max_visual_tokens": 4, "data.max_text_len": 24}),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_mined_embeddings_equal_training_path_embeddings(
    kind: str, shapes_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    fixture, extra = KINDS[kind]
    model_dir = request.getfixturevalue(fixture)
    run = tmp_path / "run"
    over = {"model.kind": kind, "model.path": model_dir, "train.max_steps": 1, **extra}
    over.update({"data.batch_size": 4, "optim.warmup_steps": 0, "data.eval": ""})
    train(load_config(None, tiny_overrides(shapes_dir, run, **over)))
    _, stage, model = load_trained(run)
    data = shapes_dir / "val.jsonl"
    records, img, owners, txt, texts, txt_owner = _embed(stage, model, data, batch_size=5)
    assert len(records) == len(owners) == img.shape[0] and txt.shape[0] == len(texts)

    ds = stage.data.eval_dataset(data, hard_negatives=0)
    good, _ = split_bad([ds[i] for i in range(8)])
    with torch.no_grad():  # the training collate: processor-normalised pixels, chat template
        ref_img, ref_txt, _ = model.embed(stage.batcher(good))
    first = [int((txt_owner == s["index"]).nonzero()[0]) for s in good]
    assert texts[first[0]] == good[0]["text"]
    torch.testing.assert_close(img[:8], ref_img.float(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(txt[first], ref_txt.float(), atol=2e-5, rtol=1e-4)
    if kind != "vlm":  # negative control: the old path (raw [0, 1] pixels, no processor)
        pixels, _ = stage.batcher.image_batch([s["image"] for s in good])
        side = pixels.shape[-1]
        raw = torch.stack(
            [ImageTextDataset(data, side, 0, train=False)[i]["image"] for i in range(8)]
        )
        with torch.no_grad():
            old = model.encoder.encode_image(raw)
        assert (old - ref_img).abs().max() > 1e-2

    out = shapes_dir / f"val_{kind}_hn.jsonl"  # and the CLI writes negatives for every record
    args = ["--data", str(data), "--out", str(out), "--margin", "100"]  # tiny model: no filter
    code = main(["mine", "--checkpoint", str(run), *args])
    assert code == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == len(records) and all(len(r["negatives"]) <= 5 for r in rows)
    assert sum(len(r["negatives"]) == 5 for r in rows) > len(rows) // 2
    assert all(
        not set(r["negatives"]) & set(rec["text"]) for r, rec in zip(rows, records, strict=True)
    )
    out.unlink()
