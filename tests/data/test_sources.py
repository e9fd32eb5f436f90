"""Data sources beyond JSONL: captions CSV, an image folder with a captions file, parquet and
`datasets` folders, read by `read_source` and served by `ImageTextDataset` (contrastive)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vltrain.data.readers import DataError, read_jsonl
from vltrain.data.records import ImageTextDataset, read_records
from vltrain.data.sources import read_source


def _copy_split(shapes_dir: Path, dst: Path, split: str = "val", n: int = 6) -> list[dict]:
    """The first `n` records of a shapes split with their images copied under `dst`."""
    recs = read_jsonl(shapes_dir / f"{split}.jsonl")[:n]
    (dst / "images").mkdir(parents=True, exist_ok=True)
    for r in recs:
        shutil.copy(shapes_dir / r["image"], dst / r["image"])
    return recs


def _write_csv(path: Path, rows: list[tuple[str, str]], header=("image", "caption")) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def test_captions_csv_groups_rows_per_image_and_matches_the_jsonl(
    shapes_dir: Path, tmp_path: Path
) -> None:
    recs = _copy_split(shapes_dir, tmp_path)
    rows = [(r["image"], t) for r in recs for t in r["text"]]  # one row per caption, with commas
    _write_csv(tmp_path / "captions.csv", rows)
    got = read_records(tmp_path / "captions.csv")
    assert [g["image"] for g in got] == [r["image"] for r in recs]
    assert [g["text"] for g in got] == [r["text"] for r in recs]
    ref = ImageTextDataset(shapes_dir / "val.jsonl", 32, 0, train=False)
    ds = ImageTextDataset(tmp_path / "captions.csv", 32, 0, train=False)
    for i in range(len(recs)):
        assert torch.equal(ds[i]["image"], ref[i]["image"]) and ds[i]["texts"] == recs[i]["text"]
    # the column may also be called `text`
    _write_csv(tmp_path / "t.csv", rows[:3], header=("image", "text"))
    assert read_records(tmp_path / "t.csv")[0]["text"] == [t for _, t in rows[:3]]


def test_csv_structure_errors_name_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("picture,caption\nx.png,a cat\n")
    with pytest.raises(DataError, match=r"a\.csv:1: a captions CSV needs a header"):
        read_records(tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text("image,caption\nx.png,a cat\ny.png,a dog,extra\n")
    with pytest.raises(DataError, match=r"b\.csv:3: the row does not have the header's 2 fields"):
        read_records(tmp_path / "b.csv")
    (tmp_path / "c.csv").write_text("image,caption\nx.png\n")
    with pytest.raises(DataError, match=r"c\.csv:2:"):
        read_records(tmp_path / "c.csv")


def test_csv_bad_content_is_counted_by_reason_not_raised(shapes_dir: Path, tmp_path: Path) -> None:
    recs = _copy_split(shapes_dir, tmp_path, n=1)
    rows = [
        (recs[0]["image"], "a good row"),
        ("images/missing.png", "no such file"),
        ("../outside.png", "escapes the folder"),
        ("images/empty_caption.png", ""),
    ]
    shutil.copy(tmp_path / recs[0]["image"], tmp_path / "images" / "empty_caption.png")
    _write_csv(tmp_path / "captions.csv", rows)
    ds = ImageTextDataset(tmp_path / "captions.csv", 32, 0, train=True)
    got = [ds[i].get("bad", "ok") for i in range(4)]
    assert got == ["ok", "missing", "path_escape", "bad_text"]


def test_image_folder_with_a_captions_file(shapes_dir: Path, tmp_path: Path) -> None:
    recs = _copy_split(shapes_dir, tmp_path)
    with open(tmp_path / "captions.jsonl", "w") as f:
        f.writelines(json.dumps({"image": r["image"], "text": r["text"]}) + "\n" for r in recs)
    ds = ImageTextDataset(tmp_path, 32, 0, train=False)  # the folder itself is the source
    ref = ImageTextDataset(shapes_dir / "val.jsonl", 32, 0, train=False)
    assert len(ds) == len(recs) and ds.path == tmp_path / "captions.jsonl"
    assert torch.equal(ds[2]["image"], ref[2]["image"]) and ds[2]["texts"] == recs[2]["text"]
    _write_csv(tmp_path / "captions.csv", [(recs[0]["image"], "x")])
    with pytest.raises(DataError, match="holds 2 captions files"):
        read_source(tmp_path)
    empty = tmp_path / "no_captions"
    empty.mkdir()
    with pytest.raises(DataError, match="without a captions file"):
        read_source(empty)


def test_empty_and_missing_paths_are_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data path is empty"):
        read_records("")  # Path("") would be the current directory
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "nope.csv")


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_parquet_and_datasets_folders_for_the_contrastive_dataset(
    shapes_dir: Path, tmp_path: Path, kind: str
) -> None:
    datasets = pytest.importorskip("datasets")
    recs = read_jsonl(shapes_dir / "val.jsonl")[:4]
    table = datasets.Dataset.from_dict(
        {"image": [str(shapes_dir / r["image"]) for r in recs], "text": [r["text"] for r in recs]}
    ).cast_column("image", datasets.Image())
    path = tmp_path / ("d.parquet" if kind == "parquet" else "hf")
    table.to_parquet(str(path)) if kind == "parquet" else table.save_to_disk(str(path))
    ref = ImageTextDataset(shapes_dir / "val.jsonl", 32, 0, train=False)
    ds = ImageTextDataset(path, 32, 0, train=False)
    assert [r["text"] for r in read_records(path)] == [r["text"] for r in recs]
    for i in range(4):
        assert torch.equal(ds[i]["image"], ref[i]["image"])  # same pixels as the PNG file
        assert ds[i]["texts"] == recs[i]["text"]
    native = ImageTextDataset(path, 32, 0, train=False, native=True)[0]["image"]
    assert native.size == (64, 64) and native.mode == "RGB"  # HF backbones resize themselves
    train = ImageTextDataset(path, 32, 0, train=True)
    assert train[(0, 0, 1)]["text"] in recs[1]["text"]


def test_bad_bytes_in_a_table_are_bad_samples(shapes_dir: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    good = (shapes_dir / read_jsonl(shapes_dir / "val.jsonl")[0]["image"]).read_bytes()
    feats = datasets.Features({"image": datasets.Value("binary"), "text": datasets.Value("string")})
    data = {"image": [good, b"not an image", b""], "text": ["a", "b", "c"]}
    datasets.Dataset.from_dict(data, features=feats).to_parquet(str(tmp_path / "d.parquet"))
    ds = ImageTextDataset(tmp_path / "d.parquet", 32, 0, train=False)
    assert [ds[i].get("bad", "ok") for i in range(3)] == ["ok", "not_image", "empty_file"]


def test_decoded_images_are_the_decoded_pixels_and_respect_the_budget(
    shapes_dir: Path, tmp_path: Path
) -> None:
    """`data.image_cache_mb`: later epochs read kept pixels equal to a fresh decode; a full
    budget keeps nothing more; a file that fails is never kept, so it is counted every time."""
    from vltrain.data.images import DecodedImages

    recs = _copy_split(shapes_dir, tmp_path, n=6)
    (tmp_path / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    recs.append({**recs[0], "image": "images/broken.png", "id": "broken"})
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    plain = ImageTextDataset(tmp_path / "d.jsonl", 32, seed=0)
    cached = ImageTextDataset(tmp_path / "d.jsonl", 32, seed=0)
    one_image = 3 * 32 * 32  # uint8 bytes
    cached.source.decoded = DecodedImages(4.5 * one_image / 2**20)  # room for 4 images
    for epoch in range(2):
        for i in range(len(recs) - 1):
            a, b = plain[(epoch, 0, i)], cached[(epoch, 0, i)]
            assert torch.equal(a["image"], b["image"]) and a["text"] == b["text"]
        assert cached[(epoch, 0, len(recs) - 1)]["bad"] == "corrupt"
    assert len(cached.source.decoded.arrays) == 4
    assert cached.source.decoded.used == 4 * one_image
    # negative control: the kept pixels are what the dataset serves (a changed array shows)
    key = next(iter(cached.source.decoded.arrays))
    changed = cached.source.decoded.arrays[key].copy()
    changed[0, 0, 0] ^= 0xFF
    cached.source.decoded.arrays[key] = changed
    index = next(i for i, r in enumerate(recs) if r["image"] == key[0])
    assert not torch.equal(cached[(0, 0, index)]["image"], plain[(0, 0, index)]["image"])


def test_decoded_images_are_shared_per_record_file_version(shapes_dir: Path, tmp_path: Path):
    """Stages of one process (a pipeline) reuse one cache per record file; a rewritten record
    file gets a fresh one; the budget grows to the largest asked for."""
    from vltrain.data.images import DecodedImages

    recs = _copy_split(shapes_dir, tmp_path, n=3)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    first = DecodedImages.shared(path, 1)
    first.put(("x", 8), np.zeros((3, 8, 8), np.uint8))
    again = DecodedImages.shared(str(path), 2)
    assert again is first and again.budget == 2 * 2**20 and ("x", 8) in again.arrays
    ds = ImageTextDataset(path, 32, seed=0)
    ds.source.decoded = again
    ds[(0, 0, 0)]
    assert len(DecodedImages.shared(path, 1).arrays) == 2  # the dataset filled the shared one
    path.write_text("".join(json.dumps(r) + "\n" for r in recs[:2]))  # the file changes
    fresh = DecodedImages.shared(path, 1)
    assert fresh is not first and not fresh.arrays
    assert DecodedImages.shared(tmp_path / "missing.jsonl", 1) is not DecodedImages.shared(
        tmp_path / "missing.jsonl", 1
    )


def test_renamed_csv_columns_reach_every_reader_of_the_training_file(
    shapes_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """data.image_column / data.text_column were dropped by the built-in model's tokenizer
    texts, the scaling budget's and tune's record counts (a CSV with other column names was
    refused with advice to set the keys already set); `vltrain data shard` takes them as
    options."""
    from vltrain.cli import main
    from vltrain.config import load_config
    from vltrain.data.contrastive_data import ContrastiveData
    from vltrain.runs.tune.trial import TrialPlan
    from vltrain.scaling.budget import _texts

    recs = _copy_split(shapes_dir, tmp_path)
    rows = [(r["image"], t) for r in recs for t in r["text"]]
    _write_csv(tmp_path / "c.csv", rows, header=("img", "cap"))
    over = [f"data.train={tmp_path / 'c.csv'}", "data.image_column=img", "data.text_column=cap"]
    cfg = load_config("configs/clip.yaml", over)
    texts = [t for r in recs for t in r["text"]]
    assert ContrastiveData(cfg, native=False).training_texts() == texts
    assert _texts(cfg) == texts
    cfg.data.batch_size, cfg.optim.accum_steps = 2, 1
    plan = TrialPlan({}, cfg, 1, "", "eval_R@1_mean", "maximize")
    assert plan.steps_per_epoch(cfg) == len(recs) // 2  # records (images), not CSV rows
    with pytest.raises(DataError, match="data.image_column"):  # negative control: no columns
        read_records(tmp_path / "c.csv")
    argv = ["data", "shard", str(tmp_path / "c.csv"), "--out", str(tmp_path / "wds")]
    assert main([*argv, "--image-column", "img", "--text-column", "cap", "--shard-size", "4"]) == 0
    assert "wrote 6 samples" in capsys.readouterr().out
