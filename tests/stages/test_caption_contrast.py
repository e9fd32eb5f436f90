"""objective.caption_contrast end to end: second captions reach the loss, the logged chance
counts the caption-caption term, and the option is refused where it cannot apply."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides
from tests.data.stream_fixtures import png_bytes
from vltrain.cli import main
from vltrain.config.core import ConfigError
from vltrain.data.records import pick_caption_pair
from vltrain.data.shard_decode import SampleDecoder
from vltrain.data.shards import RawSample
from vltrain.data.streaming import Entry
from vltrain.stages import load_run_config


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_caption_contrast_trains_and_logs_its_term(shapes_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    extra = {
        "objective.caption_contrast": 1.0,
        "objective.hard_negatives": 2,
        "model.text_options": "{causal: true, pool: mean}",
    }
    assert (
        main(
            [
                "train",
                str(REPO / "configs" / "clip.yaml"),
                *tiny_overrides(shapes_dir, out, **extra),
            ]
        )
        == 0
    )
    rows = [r for r in _rows(out) if "train_caption_loss" in r]
    assert len(rows) == 6  # every logged step
    for r in rows:
        assert math.isfinite(r["train_caption_loss"]) and r["train_caption_loss"] > 0
        # chance = image-text InfoNCE's + 1.0 * ln(batch + hard negatives)
        n, m = 16, 2 * 16
        want = 0.5 * (math.log(n + m) + math.log(n)) + math.log(n + m)
        assert r["train_chance_loss"] == pytest.approx(want, rel=1e-6)
    # the text tower pools the mean of its tokens, as configured
    cfg = (out / "config.yaml").read_text()
    assert "pool: mean" in cfg and "caption_contrast: 1.0" in cfg


def test_caption_contrast_is_refused_where_it_cannot_apply(
    shapes_dir: Path, tmp_path: Path
) -> None:
    cfg = REPO / "configs" / "clip.yaml"
    siglip = tiny_overrides(
        shapes_dir,
        tmp_path / "a",
        **{"objective.loss": "siglip", "objective.caption_contrast": 1.0},
    )
    with pytest.raises(ConfigError, match="caption_contrast"):
        load_run_config(cfg, siglip)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"query": "a red circle", "positive": "a red circle"}) + "\n")
    with pytest.raises(ConfigError, match="caption_contrast"):
        load_run_config(
            cfg,
            tiny_overrides(
                shapes_dir,
                tmp_path / "b",
                **{"data.train": pairs, "objective.caption_contrast": 1.0},
            ),
        )


def test_streamed_samples_draw_the_same_second_caption() -> None:
    """Tar shards: the decoder picks (text, text2) and the drawn caption's own negative as the
    map-style dataset does."""
    texts = ["one", "two", "three"]
    own = [["not one"], ["not two"], ["not three"]]
    meta = {"text": texts, "caption_negatives": own, "negatives": ["shared"]}
    raw = RawSample("17", 0, 0, {"json": json.dumps(meta).encode(), "png": png_bytes(3)})
    dec = SampleDecoder(8, seed=5, hard_negatives=2, second_caption=True)
    for epoch in range(4):
        sample = dec(Entry(epoch, 0, 0, "17", raw), "shard-0.tar")
        assert (sample["text"], sample["text2"]) == pick_caption_pair(texts, 5, epoch, 17)
        assert sample["text2"] != sample["text"]
        assert sample["negatives"] == [f"not {sample['text']}", "shared"]
    bad = RawSample(
        "18",
        0,
        0,
        {"json": json.dumps({**meta, "caption_negatives": [[]]}).encode(), "png": png_bytes(3)},
    )
    assert dec(Entry(0, 0, 0, "18", bad), "shard-0.tar")["bad"] == "bad_text"
