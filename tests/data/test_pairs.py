"""Pair records: every side modality, doc ids, the image-caption special case, safety."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from vltrain.data.pairs import PairCollate, PairDataset, read_pair_records, role_modalities
from vltrain.data.readers import DataError


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name in ("a", "b", "c"):
        Image.new("RGB", (20, 20), (10, 200, 30)).save(tmp_path / f"{name}.png")
    _write(tmp_path / "corpus.jsonl", [{"_id": "d1", "image": "c.png"}])
    return tmp_path


def test_sides_of_every_kind_and_doc_ids(folder: Path) -> None:
    rows = [
        {
            "query": {"text": "q one"},
            "positive": {"image": "a.png"},
            "negatives": [{"image": "b.png"}, {"doc": "d1"}],
            "instruction": "Find it: ",
        },
        {"query": "q two", "positives": [{"image": "b.png"}, {"image": "a.png"}]},
    ]
    from vltrain.data.pairs import read_corpus

    recs = read_pair_records(_write(folder / "t.jsonl", rows), read_corpus(folder / "corpus.jsonl"))
    assert recs[0]["negatives"][1]["image"] == "c.png" and recs[0]["negatives"][1]["doc"] == "d1"
    assert recs[0]["instruction"] == "Find it: " and len(recs[1]["positives"]) == 2
    assert role_modalities(recs, "t") == {
        "query": "text",
        "positive": "image",
        "negatives": "image",
    }


def test_unknown_doc_id_and_mixed_modalities_are_errors(folder: Path) -> None:
    bad = _write(folder / "t.jsonl", [{"query": "q", "positive": {"doc": "nope"}}])
    with pytest.raises(DataError, match="nope"):
        read_pair_records(bad)
    mixed = [{"query": "q", "positive": {"image": "a.png"}}, {"query": "q", "positive": "txt"}]
    with pytest.raises(DataError, match="mix modalities"):
        PairDataset(_write(folder / "m.jsonl", mixed), 16, 0)


def test_image_caption_records_are_the_special_case(folder: Path) -> None:
    path = _write(
        folder / "old.jsonl", [{"image": "a.png", "text": ["x", "y"], "negatives": ["z"]}]
    )
    ds = PairDataset(path, 16, 0, hard_negatives=1, train=False)
    assert ds.modalities == {"query": "image", "positive": "text", "negatives": "text"}
    s = ds[0]
    assert s["query"]["image"].shape == (3, 16, 16)
    assert [p["text"] for p in s["positives"]] == ["x", "y"] and s["negatives"][0]["text"] == "z"


def test_bad_sides_are_markers_with_reasons(folder: Path) -> None:
    rows = [
        {"query": "q", "positive": {"image": "../a.png"}},
        {"query": "q", "positive": {"image": "missing.png"}},
        {"query": "", "positive": {"image": "a.png"}},
        {"query": "fine", "positive": {"image": "a.png"}},
    ]
    ds = PairDataset(_write(folder / "t.jsonl", rows), 16, 0)
    reasons = [ds[i].get("bad") for i in range(4)]
    assert reasons[0] == "path_escape" and reasons[1] is not None and reasons[2] == "bad_text"
    assert reasons[3] is None  # negative control: a good record is not marked


def test_training_draw_is_deterministic_and_collates_three_sides(folder: Path) -> None:
    rows = [
        {
            "query": f"q{i}",
            "positive": {"image": "a.png"},
            "negatives": [{"image": "b.png"}, {"image": "c.png"}],
        }
        for i in range(3)
    ]
    ds = PairDataset(_write(folder / "t.jsonl", rows), 16, 7, hard_negatives=1)
    assert ds[(0, 0, 1)]["negatives"][0]["image"].equal(ds[(0, 0, 1)]["negatives"][0]["image"])

    class Batcher:
        def text_batch(self, texts, instructions=None, role=""):
            return (texts, role)

        def image_batch(self, images, texts=None, instructions=None, role=""):
            import torch

            return torch.stack(images), torch.ones(len(images), dtype=torch.long)

    batch = PairCollate(Batcher(), ds.modalities)([ds[(0, 0, i)] for i in range(3)])
    assert batch["query"]["modality"] == "text" and batch["query"]["inputs"][1] == "query"
    assert batch["positive"]["inputs"].shape == (3, 3, 16, 16)
    assert batch["negatives"]["inputs"].shape == (3, 3, 16, 16)  # one negative each
    assert batch["visual_tokens"].shape == (6,)
