"""The drafter stage with an HF image-text-to-text target (model.kind=hf_vlm): a tiny random
Qwen2-VL directory, shapes captions; the drafter trains on the target's features of prompt +
caption (images in), evaluates by real speculative decoding, and `vltrain generate --model DIR
--draft RUN` gives the plain greedy captions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, hardlink_tree
from vltrain.cli import main

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    from tests.inference.vlm_helpers import make_tiny_qwen2vl

    return make_tiny_qwen2vl(tmp_path_factory.mktemp("qwen2vl"))


def _data(shapes_dir: Path, tmp_path: Path, n: int = 16) -> tuple[Path, list[str]]:
    data = tmp_path / "data"
    data.mkdir()
    hardlink_tree(shapes_dir / "images", data / "images")
    lines = (shapes_dir / "train.jsonl").read_text().splitlines()[:n]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    return data, [str(data / json.loads(x)["image"]) for x in lines[:4]]


def _overrides(
    vlm_dir: str | Path, data: Path, run: Path, eval_file: str = "train.jsonl"
) -> list[str]:
    """A 3-step drafter run against an hf_vlm target (a directory or a caption run)."""
    return [
        f"run.out_dir={run}",
        "model.kind=hf_vlm",
        f"model.target={vlm_dir}",
        f"data.train={data}/train.jsonl",
        f"data.eval={data}/{eval_file}",
        "data.batch_size=4",
        "train.max_steps=3",
        "train.eval_every=0",
        "train.save_every=0",
        "optim.warmup_steps=1",
        "log.progress=false",
        "log.tensorboard=false",
        "drafter.block_size=4",
        "drafter.eval_prompts=3",
        "drafter.eval_max_new_tokens=8",
        "drafter.eval_tree_budget=6",
    ]


def test_hf_vlm_drafter_end_to_end(vlm_dir, shapes_dir, tmp_path, capsys) -> None:
    data, images = _data(shapes_dir, tmp_path)
    run = tmp_path / "drafter"
    assert (
        main(["train", str(REPO / "configs" / "drafter.yaml"), *_overrides(vlm_dir, data, run)])
        == 0
    )
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in reversed(rows) if "eval_tau" in r)
    assert m["eval_tau_decode"] >= 1.0 and "eval_tau_decode_tree" in m
    assert torch.isfinite(torch.tensor(m["eval_loss"]))
    meta = json.loads((run / "checkpoints" / "best" / "drafter.json").read_text())
    assert meta["target"]["kind"] == "hf_vlm"
    capsys.readouterr()
    base = ["generate", "--model", vlm_dir, "--images", *images, "--max-new-tokens", "10"]
    assert main([*base, "--prompt", "describe the image."]) == 0
    plain = capsys.readouterr().out
    for budget in ("0", "6"):
        assert main([*base, "--draft", str(run), "--tree-budget", budget]) == 0
        got = capsys.readouterr()
        assert got.out == plain  # lossless (--prompt's default: the stage's instruction)
        assert json.loads(got.err.strip().splitlines()[-1])["rounds"] > 0
    export = tmp_path / "export"  # vltrain's own format: drafter.json names the VLM
    assert main(["export", str(run), "--out", str(export)]) == 0
    assert json.loads((export / "drafter.json").read_text())["target"]["kind"] == "hf_vlm"
    capsys.readouterr()
    assert main([*base, "--draft", str(export), "--tree-budget", "6"]) == 0
    assert capsys.readouterr().out == plain


def test_hf_vlm_drafter_batches_hold_the_image_inputs(vlm_dir, shapes_dir, tmp_path) -> None:
    """The stage's batch: prompt (image tokens) + caption + EOS, loss on the caption only,
    pixel inputs of every row; the target's features then predict the caption's tokens."""
    from transformers import AutoTokenizer

    from vltrain.data.caption_data import read_caption_source
    from vltrain.data.chat import IGNORE_INDEX
    from vltrain.data.draft_data import DraftCollate, DraftDataset, VLMCaptionRecords
    from vltrain.data.hf_collate import HFCollate

    data, _ = _data(shapes_dir, tmp_path, n=3)
    tok = AutoTokenizer.from_pretrained(vlm_dir)
    source = read_caption_source(data / "train.jsonl")
    base = VLMCaptionRecords(source, HFCollate(vlm_dir, "vlm"), tok, "describe.", 40)
    batch = DraftCollate(0)([DraftDataset(base, 4, 0)[(0, 0, i)] for i in range(3)])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    for i, rec in enumerate(source.records):
        labels = batch["labels"][i]
        got = labels[labels != IGNORE_INDEX].tolist()
        caption = tok(rec["text"][0], add_special_tokens=False)["input_ids"]
        assert got == [*caption[:39], tok.eos_token_id]  # cut to max_len 40, then EOS
        prompt = batch["input_ids"][i][labels == IGNORE_INDEX]
        assert int((prompt == image_id).sum()) > 0  # the image tokens are in the prompt
    v = batch["vision"]
    assert v["mm_token_type_ids"].shape == batch["input_ids"].shape
    assert torch.equal(v["mm_token_type_ids"].bool(), batch["input_ids"] == image_id)
    patches = int(v["image_grid_thw"].prod(-1).sum())
    assert v["pixel_values"].shape[0] == patches and v["image_grid_thw"].shape == (3, 3)


def test_hf_vlm_target_refusals(vlm_dir, shapes_dir, tmp_path, capsys) -> None:
    """One-line errors at load, before the run folder is made."""
    data, _ = _data(shapes_dir, tmp_path)
    over = [*_overrides(vlm_dir, data, tmp_path / "r"), "model.kind=hf_vlm"]
    cases = [
        ([f"model.target={tmp_path}"], "image-text-to-text"),
        ([f"model.target={vlm_dir}", "drafter.cache_target=true"], "drafter.cache_target"),
    ]
    for extra, words in cases:
        assert main(["train", str(REPO / "configs" / "drafter.yaml"), *over, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vltrain: error:") and words in err, err
        assert not (tmp_path / "r").exists()
