"""`vltrain data curate` end to end on planted shapes data: byte-for-byte output, reasons and
kept witnesses, every planted leak and exact/resized copy found, 1 and 2 workers identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import tiny_overrides
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.data.synth import write_shapes_dataset
from vltrain.runs import train


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("planted")
    write_shapes_dataset(d, n_train=160, n_val=10, n_test=40, seed=3, dup_rate=0.1, leak_rate=0.25)
    return d


def _curate(d: Path, out: Path, *extra: str) -> tuple[list[bytes], list[dict]]:
    code = main(["data", "curate", str(d / "train.jsonl"), "--out", str(out), *extra])
    assert code == 0
    removed = out.with_name(out.stem + ".removed.jsonl")
    return out.read_bytes().splitlines(keepends=True), [
        json.loads(x) for x in removed.read_text().splitlines()
    ]


def test_curate_finds_planted_copies_and_keeps_witnesses(planted: Path, tmp_path: Path) -> None:
    kept, removed = _curate(
        planted, planted / "cur.jsonl", "--against", str(planted / "test.jsonl"),
        "--report", str(tmp_path / "rep"),
    )  # fmt: skip
    src = (planted / "train.jsonl").read_bytes().splitlines(keepends=True)
    recs = [json.loads(x) for x in src]
    assert set(kept) <= set(src) and len(kept) + len(removed) == len(src)  # byte for byte
    kept_ids = {json.loads(x)["id"] for x in kept}
    by_id = {r["record"]["id"]: r for r in removed}
    for r in removed:
        if r["duplicate_source"] == "train":
            assert r["duplicate_of"] in kept_ids  # the witness is in the output
    leaks = [x["id"] for x in recs if x.get("planted", {}).get("kind") == "leak"]
    assert leaks and all(by_id[i]["reason"].startswith("leak_") for i in leaks)  # 0 FN
    # every leak names the eval record it leaked from, whose caption holds the n-gram
    evals = {
        json.loads(x)["id"]: json.loads(x)
        for x in (planted / "test.jsonl").read_text().splitlines()
    }
    ngram = [r for r in removed if r["reason"] == "leak_caption_ngram"]
    assert ngram  # the check below is not vacuous
    for r in ngram:
        source = evals[r["duplicate_of"].split(":", 1)[1]]
        assert r["duplicate_source"] == "eval"
        assert any(r["detail"] in " ".join(t.lower().split()) for t in source["text"])
    exact = [x["id"] for x in recs if x.get("planted", {}).get("kind") in ("exact", "resized")]
    assert exact and all(by_id[i]["reason"].startswith("dup_") for i in exact)
    image_dups = [r for r in removed if r["reason"] in ("dup_exact_image", "dup_near_image")]
    assert all("planted" in r["record"] for r in image_dups)  # no original removed as a dup
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["removed"] == len(removed) and summary["bloom"]["measured_fp_rate"] <= 1e-3
    assert "dup_near_image" in (tmp_path / "rep" / "report.html").read_text()


def test_without_eval_sets_nothing_is_a_leak_and_workers_do_not_change_output(
    planted: Path,
) -> None:
    one = _curate(planted, planted / "w1.jsonl", "--workers", "1")
    two = _curate(planted, planted / "w2.jsonl", "--workers", "2")
    assert one == two
    assert not any(r["reason"].startswith("leak_") for r in one[1])  # negative control


def test_out_in_another_folder_copies_kept_images(planted: Path, tmp_path: Path) -> None:
    kept, _ = _curate(planted, tmp_path / "o" / "dedup.jsonl")
    for line in kept:
        assert (tmp_path / "o" / json.loads(line)["image"]).is_file()


def test_caption_dups_drop_and_missing_input_is_a_clean_error(planted: Path, capsys) -> None:
    _, flagged = _curate(planted, planted / "f.jsonl")
    _, dropped = _curate(planted, planted / "d.jsonl", "--caption-dups", "drop")
    assert len(dropped) > len(flagged)
    assert any(r["reason"] in ("dup_exact_caption", "dup_near_caption") for r in dropped)
    assert main(["data", "dedup", str(planted / "nope.jsonl"), "--out", "x.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_path_mistakes_are_refused_before_anything_is_written(
    planted: Path, tmp_path: Path, capsys
) -> None:
    """A --report that cannot be a folder failed after the curated file was written; a folder,
    a CSV or a COCO file as input read as 'does not exist' or 'not valid JSON'; the input as
    --against removed every record."""
    src = planted / "train.jsonl"
    (tmp_path / "file").write_text("x")
    (tmp_path / "c.csv").write_text("image,caption\n")
    out = tmp_path / "o.jsonl"
    cases = [
        (["--report", str(src)], "is a file, not a folder"),
        (["--report", str(tmp_path / "file" / "sub")], "is a file, not a folder"),
        (["--against", str(src)], "is the input file: every record would leak"),
    ]
    for extra, words in cases:
        assert main(["data", "curate", str(src), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
        assert not out.exists() and not (tmp_path / "o.removed.jsonl").exists()
    for bad, words in ((planted, "is a folder"), (tmp_path / "c.csv", "curate reads JSONL")):
        assert main(["data", "curate", str(bad), "--out", str(out)]) == 2
        assert words in capsys.readouterr().err


def test_semantic_dedup_and_clip_filter_with_a_trained_checkpoint(
    shapes_dir: Path, tmp_path: Path
) -> None:
    from vltrain.curation.curate import curate
    from vltrain.curation.pipeline import CurateOptions
    from vltrain.tools.curation import CheckpointEmbedder

    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(shapes_dir, run, **{"train.max_steps": 2})))
    recs = [json.loads(x) for x in (shapes_dir / "val.jsonl").read_text().splitlines()]
    (tmp_path / "images").mkdir()
    for r in recs:
        Image.open(shapes_dir / r["image"]).save(tmp_path / r["image"])
    copies = []
    for r in recs[:3]:  # re-encoded copies: other pixels, same picture
        c = {**r, "id": r["id"] + "_jpg", "image": r["image"] + ".jpg"}
        Image.open(shapes_dir / r["image"]).save(tmp_path / c["image"], quality=95)
        copies.append(c)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs + copies))
    no_hash = dict(phash_radius=0, dhash_radius=0, thumb_min_corr=2.0, crop_radius=0)
    embedder = CheckpointEmbedder(run)
    eps = 1e-4
    opts = CurateOptions(semantic_eps=eps, **no_hash)
    curate(data, tmp_path / "o.jsonl", opts=opts, embedder=embedder)
    removed = [json.loads(x) for x in (tmp_path / "o.removed.jsonl").read_text().splitlines()]
    kept = {json.loads(x)["id"] for x in (tmp_path / "o.jsonl").read_text().splitlines()}
    sem = {r["record"]["id"]: r for r in removed if r["reason"] == "dup_semantic"}
    assert {c["id"] for c in copies} <= set(sem)  # every re-encoded copy found
    for r in sem.values():
        assert r["duplicate_of"] in kept and r["similarity"] > 1 - eps  # a kept witness
    curate(data, tmp_path / "c.jsonl", opts=CurateOptions(**no_hash))  # control: no embedder
    assert not (tmp_path / "c.removed.jsonl").read_text()
    n = len(recs) + 3
    s = curate(
        data, tmp_path / "f.jsonl", opts=CurateOptions(steps=("filter",), clip_top_fraction=0.5),
        embedder=embedder,
    )  # fmt: skip
    assert s["removed_by_reason"] == {"clip_score_low": n - -(-n // 2)}
