"""Records, the image-text dataset (bad samples never raise), and bad-sample accounting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.fixtures import write_bad_corpus
from vltrain.data.images import REASONS, BadSample
from vltrain.data.readers import DataError, read_jsonl, resolve_image_path
from vltrain.data.records import (
    BadSampleTracker,
    DataQualityError,
    ImageTextDataset,
    pick_caption_pair,
    read_records,
    split_bad,
)


def _img(path: Path, value: int = 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def caps_file(tmp_path: Path) -> Path:
    """Two images, five captions each, eight negatives each."""
    recs = []
    for i in range(2):
        _img(tmp_path / "images" / f"{i}.png", 50 * i)
        recs.append(
            {
                "image": f"images/{i}.png",
                "text": [f"caption {i}.{j}" for j in range(5)],
                "negatives": [f"negative {i}.{j}" for j in range(8)],
            }
        )
    return _jsonl(tmp_path / "d.jsonl", recs)


def test_read_jsonl_normalises(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(
        '\ufeff{"image": "a.png", "text": "one", "extra": 5}\n\n   \n'
        '{"image": "b.png", "text": ["x", "y"], "negatives": ["n"], "id": 42}\n',
        encoding="utf-8",
    )
    a, b = read_jsonl(p)
    assert a == {"image": "a.png", "text": ["one"], "negatives": [], "id": "1", "extra": 5}
    assert b == {"image": "b.png", "text": ["x", "y"], "negatives": ["n"], "id": "42"}


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"image": "a.png", "text": "x"', "not valid JSON"),
        ('["a.png", "x"]', "expected a JSON object"),
        ('{"image": "a.png", "caption": "x"}', "no 'text' key"),
        ('{"image": 3, "text": "x"}', "'image' must be a path string"),
        ('{"image": "a.png", "text": "x", "negatives": "n"}', "'negatives' must be a list"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"image": "ok.png", "text": "fine"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=match) as info:
        read_jsonl(p)
    assert f"{p}:3" in str(info.value)


def test_read_records_dispatch_and_errors(tmp_path: Path, caps_file: Path) -> None:
    assert len(read_records(caps_file)) == 2
    (tmp_path / "d.txt").write_text("image,text\n")
    with pytest.raises(DataError, match="unsupported data file suffix"):
        read_records(tmp_path / "d.txt")
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")


def test_coco_captions(tmp_path: Path) -> None:
    _img(tmp_path / "next_to_json.jpg")
    _img(tmp_path / "images" / "in_images_dir.jpg")
    coco = {
        "images": [
            {"id": 1, "file_name": "next_to_json.jpg"},
            {"id": 2, "file_name": "in_images_dir.jpg"},
            {"id": 3, "file_name": "nowhere.jpg"},
            {"id": 4, "file_name": "next_to_json.jpg"},
        ],
        "annotations": [
            {"image_id": 2, "caption": "b1"},
            {"image_id": 1, "caption": "a1"},
            {"image_id": 2, "caption": "b2"},
            {"image_id": 3, "caption": "c1"},
        ],
    }
    p = tmp_path / "captions.json"
    p.write_text(json.dumps(coco))
    recs = read_records(p)
    assert [r["image"] for r in recs] == [
        "next_to_json.jpg",
        "images/in_images_dir.jpg",
        "nowhere.jpg",
        "next_to_json.jpg",
    ]
    assert [r["text"] for r in recs] == [["a1"], ["b1", "b2"], ["c1"], []]
    assert [r["id"] for r in recs] == ["1", "2", "3", "4"]
    ds = ImageTextDataset(p, 8, seed=0, train=False)
    assert ds[1]["texts"] == ["b1", "b2"]
    assert ds[2]["bad"] == "missing" and ds[3]["bad"] == "bad_text"

    coco["annotations"].append({"image_id": 99, "caption": "orphan"})
    p.write_text(json.dumps(coco))
    with pytest.raises(DataError, match="image_id 99"):
        read_records(p)


def test_resolve_image_path(tmp_path: Path) -> None:
    jl = tmp_path / "data" / "d.jsonl"
    root = (tmp_path / "data").resolve()
    assert resolve_image_path(jl, "images/a.png") == root / "images" / "a.png"
    assert resolve_image_path(jl, "images/../b.png") == root / "b.png"  # stays inside
    for rel in ("../a.png", "images/../../a.png", str(root / "a.png"), "/etc/passwd", ""):
        with pytest.raises(BadSample) as info:
            resolve_image_path(jl, rel)
        assert info.value.reason == "path_escape"


def test_bad_corpus_every_reason_and_good_modes(tmp_path: Path) -> None:
    path = write_bad_corpus(tmp_path)
    ds = ImageTextDataset(path, 16, seed=0)
    expects = [r["expect"] for r in ds.records]
    assert set(REASONS) <= set(expects)  # the corpus covers every reason
    assert expects.count("ok") >= 7
    for i, rec in enumerate(ds.records):
        s = ds[(0, 0, i)]  # never raises
        got = s.get("bad", "ok")
        assert got == rec["expect"], (rec["id"], s)
        if got == "ok":
            assert s["image"].shape == (3, 16, 16)
            assert 0.0 <= float(s["image"].min()) <= float(s["image"].max()) <= 1.0
        else:
            assert s["key"] == (0, 0, i) and s["index"] == i and s["path"]
    good, bad = split_bad([ds[i] for i in range(len(ds))])
    assert len(good) == expects.count("ok") and len(good) + len(bad) == len(ds)
    assert all(reason in REASONS and path for reason, path in bad)


def test_keys_and_index_errors(caps_file: Path) -> None:
    ds = ImageTextDataset(caps_file, 8, seed=0)
    assert len(ds) == 2 and len(ds.records) == 2
    assert ds[1]["key"] == 1 and ds[1]["index"] == 1
    assert ds[1]["text"] == ds[(0, 5, 1)]["text"]  # int index means epoch 0
    assert ds[(np.int64(0), 0, torch.tensor(1))]["index"] == 1  # sampler integer types
    with pytest.raises(IndexError):
        ds[(0, 0, 2)]
    with pytest.raises(TypeError, match="epoch, batch_in_epoch, index"):
        ds["0"]


def test_caption_and_negative_sampling_deterministic(caps_file: Path) -> None:
    a = ImageTextDataset(caps_file, 8, seed=3, hard_negatives=3)
    b = ImageTextDataset(caps_file, 8, seed=3, hard_negatives=3)
    negs_all = a.records[0]["negatives"]
    texts, neg_sets = set(), set()
    for epoch in range(12):
        sa, sb = a[(epoch, 0, 0)], b[(epoch, 7, 0)]  # batch_in_epoch does not matter
        assert (sa["text"], sa["negatives"]) == (sb["text"], sb["negatives"])
        assert torch.equal(sa["image"], sb["image"])
        assert len(sa["negatives"]) == 3 == len(set(sa["negatives"]))  # without replacement
        assert set(sa["negatives"]) <= set(negs_all)
        texts.add(sa["text"])
        neg_sets.add(tuple(sa["negatives"]))
    assert len(texts) >= 3 and len(neg_sets) >= 6  # varies with the epoch
    other = ImageTextDataset(caps_file, 8, seed=4, hard_negatives=3)
    picks = [(a[(e, 0, 0)]["text"], other[(e, 0, 0)]["text"]) for e in range(12)]
    assert any(x != y for x, y in picks)  # and with the seed


def test_second_caption_is_another_caption_of_the_same_image(caps_file: Path) -> None:
    """objective.caption_contrast's `text2`: another caption of the record, deterministic, and
    the first caption is the one a run without it draws (length buckets predict that one)."""
    plain = ImageTextDataset(caps_file, 8, seed=3, hard_negatives=2)
    paired = ImageTextDataset(caps_file, 8, seed=3, hard_negatives=2, second_caption=True)
    caps = plain.records[1]["text"]
    seconds = set()
    for epoch in range(20):
        a, b = plain[(epoch, 0, 1)], paired[(epoch, 0, 1)]
        assert "text2" not in a
        assert (b["text"], b["negatives"]) == (a["text"], a["negatives"])
        assert b["text2"] in caps and b["text2"] != b["text"]
        assert paired[(epoch, 3, 1)]["text2"] == b["text2"]  # same key, same pick
        seconds.add(b["text2"])
    assert len(seconds) >= 4  # uniform over the others, varies with the epoch
    assert pick_caption_pair(["only"], 0, 0, 0) == ("only", "only")
    # eval samples never carry one
    assert "text2" not in ImageTextDataset(caps_file, 8, 0, train=False, second_caption=True)[0]


def test_caption_negatives_are_drawn_first_for_the_drawn_caption(tmp_path: Path) -> None:
    """A record's caption_negatives[i] belong to caption i: training draws the drawn caption's
    own negatives first, then the shared ones; malformed lists are a DataError."""
    _img(tmp_path / "images" / "0.png")
    rec = {
        "image": "images/0.png",
        "text": [f"caption {j}" for j in range(4)],
        "caption_negatives": [[f"own {j}"] for j in range(4)],
        "negatives": [f"shared {j}" for j in range(5)],
    }
    path = _jsonl(tmp_path / "d.jsonl", [rec])
    one = ImageTextDataset(path, 8, seed=1, hard_negatives=1)
    three = ImageTextDataset(path, 8, seed=1, hard_negatives=3, second_caption=True)
    for epoch in range(12):
        s1, s3 = one[(epoch, 0, 0)], three[(epoch, 0, 0)]
        j = s1["text"].split()[-1]
        assert s1["negatives"] == [f"own {j}"]
        assert s3["text"] == s1["text"] and s3["negatives"][0] == f"own {j}"
        assert len(s3["negatives"]) == 3
        assert all(n.startswith("shared") for n in s3["negatives"][1:])
    assert ImageTextDataset(path, 8, seed=1)[0]["negatives"] == []  # hard_negatives=0
    evals = ImageTextDataset(path, 8, seed=1, hard_negatives=2, train=False)[0]
    assert evals["negatives"] == ["shared 0", "shared 1"]  # evaluation: the shared list only
    bad = _jsonl(tmp_path / "bad.jsonl", [{**rec, "caption_negatives": [["x"]]}])
    with pytest.raises(DataError, match="caption_negatives"):
        ImageTextDataset(bad, 8, seed=1)


def test_fewer_negatives_than_requested(caps_file: Path) -> None:
    ds = ImageTextDataset(caps_file, 8, seed=0, hard_negatives=20)
    assert sorted(ds[0]["negatives"]) == sorted(ds.records[0]["negatives"])
    assert ImageTextDataset(caps_file, 8, seed=0)[0]["negatives"] == []


def test_eval_mode(caps_file: Path) -> None:
    ds = ImageTextDataset(caps_file, 8, seed=0, hard_negatives=2, train=False)
    for epoch in range(3):
        s = ds[(epoch, 0, 1)]
        assert s["text"] == "caption 1.0"
        assert s["texts"] == [f"caption 1.{j}" for j in range(5)]
        assert s["negatives"] == ["negative 1.0", "negative 1.1"]


def test_bad_negative_text_only_checked_when_used(tmp_path: Path) -> None:
    _img(tmp_path / "a.png")
    p = _jsonl(tmp_path / "d.jsonl", [{"image": "a.png", "text": "ok", "negatives": ["", "n"]}])
    assert "bad" not in ImageTextDataset(p, 8, seed=0)[0]
    assert ImageTextDataset(p, 8, seed=0, hard_negatives=1)[0]["bad"] == "bad_text"


def _bad(n: int, reason: str) -> list[tuple[str, str]]:
    return [(reason, f"img/{reason}_{i}.png") for i in range(n)]


def test_tracker_threshold_and_message() -> None:
    t = BadSampleTracker(max_bad_fraction=0.1, min_seen=50)
    t.update(40, _bad(20, "missing"))
    t.check()  # 50% bad, but fewer than min_seen samples seen
    t.update(160, _bad(1, "truncated"))
    assert t.seen == 200 and t.total_bad == 21
    assert t.counts() == {"missing": 20, "truncated": 1}
    with pytest.raises(DataQualityError) as info:
        t.check()  # 10.5% > 10%
    msg = str(info.value)
    for part in ("21 of 200", "10.5%", "data.max_bad_fraction", "missing: 20", "truncated: 1"):
        assert part in msg, part
    assert "img/missing_0.png, img/missing_1.png, img/missing_2.png" in msg
    assert "img/missing_3.png" not in msg  # at most three examples per reason


def test_tracker_stops_a_run_whose_every_sample_is_bad_before_min_seen() -> None:
    """Fewer than min_seen samples is too few to judge a rate, but not when every one of at
    least 8 was bad (a 2-step run on data whose images are all missing finished with rc 0)."""
    t = BadSampleTracker(max_bad_fraction=0.01, min_seen=50)
    t.update(4, _bad(4, "missing"))
    t.check()  # 4 of 4: too few to say
    t.update(4, _bad(4, "missing"))
    with pytest.raises(DataQualityError, match="8 of 8 samples were bad"):
        t.check()
    mixed = BadSampleTracker(max_bad_fraction=0.01, min_seen=50)
    mixed.update(12, _bad(11, "missing"))
    mixed.check()  # one good sample: judged at min_seen, as before
    allowed = BadSampleTracker(max_bad_fraction=1.0, min_seen=50)
    allowed.update(60, _bad(60, "missing"))
    allowed.check()  # data.max_bad_fraction=1 allows everything


def test_tracker_at_threshold_passes() -> None:
    t = BadSampleTracker(max_bad_fraction=0.1, min_seen=0)
    t.update(100, _bad(10, "corrupt"))
    t.check()  # exactly 10% is allowed
    t.update(0, [])
    with pytest.raises(ValueError, match="smaller than"):
        t.update(1, _bad(2, "corrupt"))
    with pytest.raises(ValueError, match="max_bad_fraction"):
        BadSampleTracker(1.5)


def test_tracker_state_survives_resume(tmp_path: Path) -> None:
    t = BadSampleTracker(0.3, min_seen=10)
    t.update(30, _bad(4, "missing") + _bad(2, "bad_text"))
    torch.save(t.state_dict(), tmp_path / "s.pt")
    u = BadSampleTracker(0.3, min_seen=10)
    u.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    u.check()  # 6 of 30 = 20%: fine
    assert (u.seen, u.counts(), u.vector()) == (t.seen, t.counts(), t.vector())
    u.update(10, _bad(30, "corrupt")[:10])
    with pytest.raises(DataQualityError, match="img/missing_0.png"):
        u.check()
    with pytest.raises(ValueError, match="not a BadSampleTracker state"):
        u.load_state_dict({"counts": {}})


def test_tracker_cross_rank_merge_equals_single_process() -> None:
    rank0 = _bad(3, "missing") + _bad(1, "corrupt")
    rank1 = _bad(2, "missing") + _bad(4, "path_escape")
    single = BadSampleTracker(0.2)
    single.update(64, rank0 + rank1)
    v0 = BadSampleTracker.step_vector(32, rank0)
    v1 = BadSampleTracker.step_vector(32, rank1)
    summed = [x + y for x, y in zip(v0, v1, strict=True)]  # what all_reduce_sum returns
    assert len(summed) == 1 + len(REASONS)
    merged = BadSampleTracker(0.2)
    merged.merge_counts(summed, examples=rank0)
    assert merged.counts() == single.counts() and merged.seen == single.seen == 64
    assert merged.vector() == single.vector() == summed
    with pytest.raises(ValueError, match="not one of"):
        BadSampleTracker.step_vector(1, [("odd", "x.png")])
