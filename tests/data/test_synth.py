"""The shapes data set: determinism, compositional split, captions true, negatives false.

Captions and negatives are checked by parsing the text back and evaluating it against the
record's object metadata with a checker written here, independent of the generator's own.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from tests.fixtures import write_bad_corpus
from vltrain.data.images import load_image
from vltrain.data.readers import read_jsonl
from vltrain.data.synth import (
    COLORS,
    SHAPES,
    SPLITS,
    held_out_combos,
    synth_command,
    write_shapes_dataset,
)

N = {"n_train": 120, "n_val": 20, "n_test": 40}
SIZE_OF = {"small": "small", "little": "small", "large": "large", "big": "large"}
DESC_RE = re.compile(rf"\b(small|little|large|big) ({'|'.join(COLORS)}) ({'|'.join(SHAPES)})\b")
REL_RE = re.compile(
    r"\b(to the left of|on the left of|left of|to the right of|on the right of|right of"
    r"|above|over|below|under|beneath)\b"
)
REL_OF = {
    "left": "left of",
    "right": "right of",
    "above": "above",
    "over": "above",
    "below": "below",
    "under": "below",
    "beneath": "below",
}


def _parse(text: str) -> tuple[tuple, str | None, tuple | None]:
    """(subject, relation, object) with descs as (size, color, shape)."""
    descs = [(SIZE_OF[m[0]], m[1], m[2]) for m in DESC_RE.findall(text)]
    rels = REL_RE.findall(text)
    assert len(descs) in (1, 2) and len(rels) == len(descs) - 1, text
    if len(descs) == 1:
        return descs[0], None, None
    word = rels[0].split()[-2] if rels[0].endswith(" of") else rels[0]
    rel = REL_OF[word]
    # "a Y with a X <rel> it" and "a Y <inverse rel> a X" are both written about X <rel> Y;
    # the first is the only template where the subject comes second.
    if text.endswith(" it"):
        return descs[1], rel, descs[0]
    return descs[0], rel, descs[1]


def _holds(x: dict, y: dict, rel: str, strict: bool) -> bool:
    dx, dy = y["x"] - x["x"], y["y"] - x["y"]
    along, across = {
        "left of": (dx, dy),
        "right of": (-dx, dy),
        "above": (dy, dx),
        "below": (-dy, dx),
    }[rel]
    if strict:
        return along >= 6.4 and abs(across) <= along / 2
    return along > 0


def _true(rec: dict, text: str, strict: bool) -> bool:
    a, rel, b = _parse(text)
    objs = rec["objects"]

    def match(o: dict, d: tuple) -> bool:
        return (o["size"], o["color"], o["shape"]) == d

    if rel is None:
        return any(match(o, a) for o in objs)
    return any(
        match(x, a) and match(y, b) and _holds(x, y, rel, strict)
        for i, x in enumerate(objs)
        for j, y in enumerate(objs)
        if i != j
    )


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("shapes")
    return out, write_shapes_dataset(out, seed=5, **N)


def _records(out: Path, split: str) -> list[dict]:
    return read_jsonl(out / f"{split}.jsonl")


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_counts_files_and_loading(shapes: tuple[Path, dict]) -> None:
    out, result = shapes
    assert (result["train"], result["val"], result["test"], result["images"]) == (120, 20, 40, 180)
    assert len(list((out / "images").glob("*.png"))) == 180
    meta = json.loads((out / "meta.json").read_text())
    assert meta["held_out"] == [list(c) for c in held_out_combos(5)]
    rec = _records(out, "val")[0]
    assert 3 <= len(rec["text"]) <= 5 and rec["negatives"]
    img = load_image(out / rec["image"], 64)
    assert img.shape == (3, 64, 64) and float(img.std()) > 0.05


def test_deterministic_bytes(tmp_path: Path) -> None:
    small = {"n_train": 15, "n_val": 5, "n_test": 5}
    write_shapes_dataset(tmp_path / "a", seed=1, **small)
    write_shapes_dataset(tmp_path / "b", seed=1, **small)
    write_shapes_dataset(tmp_path / "c", seed=2, **small)
    write_shapes_dataset(tmp_path / "d", seed=1, workers=2, **small)  # two processes
    a, b, c, d = (_digest(tmp_path / x) for x in "abcd")
    assert a == b == d and len(a) == 25 + 4
    assert a["train.jsonl"] != c["train.jsonl"]  # control: the seed matters
    assert sum(a[k] != c[k] for k in a) >= 20


def test_held_out_combos_shape() -> None:
    held = held_out_combos(0)
    assert len(held) == len(COLORS)  # 6 of 30 = 20%
    assert {c for c, _ in held} == set(COLORS) and {s for _, s in held} == set(SHAPES)
    assert any(held_out_combos(s) != held for s in range(1, 5))


def test_compositional_split(shapes: tuple[Path, dict]) -> None:
    out, _ = shapes
    held = {tuple(c) for c in held_out_combos(5)}
    phrases = [f"{c} {s}" for c, s in held]
    for split in ("train", "val"):
        for rec in _records(out, split):
            assert all((o["color"], o["shape"]) not in held for o in rec["objects"]), rec["id"]
            texts = " | ".join(rec["text"] + rec["negatives"])
            assert not any(p in texts for p in phrases), rec["id"]
    test = _records(out, "test")
    for rec in test:
        described = rec["objects"][:2]
        assert any((o["color"], o["shape"]) in held for o in described), rec["id"]
        assert any(p in rec["text"][0] for p in phrases), rec["id"]
    assert len({(o["color"], o["shape"]) for r in test for o in r["objects"]} & held) >= 4


def test_captions_true_negatives_false(shapes: tuple[Path, dict]) -> None:
    out, _ = shapes
    n_pairs = n_with_rel_neg = 0
    for split in ("train", "val", "test"):
        for rec in _records(out, split):
            assert 3 <= len(rec["text"]) <= 5 and len(set(rec["text"])) == len(rec["text"])
            for cap in rec["text"]:
                assert _true(rec, cap, strict=True), (rec["id"], cap)
            assert len(rec["negatives"]) >= 4, rec["id"]
            assert len(rec["negatives"]) == len(rec["negative_kinds"])
            for neg in rec["negatives"]:
                assert not _true(rec, neg, strict=False), (rec["id"], neg)
            kinds = set(rec["negative_kinds"])
            assert {"color", "shape", "size"} <= kinds, rec["id"]
            if rec["relation"] is not None:
                n_pairs += 1
                n_with_rel_neg += "relation" in kinds
    assert n_pairs > 50 and n_with_rel_neg >= 0.9 * n_pairs


def test_caption_negatives_invert_each_captions_relation(shapes: tuple[Path, dict]) -> None:
    """caption_negatives: per caption its own wording with the relation inverted, false for the
    scene, the same objects in the same places of the sentence; none for one-shape scenes."""
    folder, _ = shapes
    inverse = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
    seen = 0
    for split in ("train", "val", "test"):
        for rec in read_jsonl(folder / f"{split}.jsonl"):
            if rec["relation"] is None:
                assert "caption_negatives" not in rec
                continue
            assert len(rec["caption_negatives"]) == len(rec["text"])
            for caption, own in zip(rec["text"], rec["caption_negatives"], strict=True):
                for neg in own:
                    a, rel, b = _parse(caption)
                    assert _parse(neg) == (a, inverse[rel], b), (caption, neg)
                    assert not _true(rec, neg, strict=False), (caption, neg)
                    assert len(neg.split()) >= len(caption.split()) - 1  # a minimal pair
                    seen += 1
    assert seen > 100


def test_negatives_swap_exactly_one_attribute(shapes: tuple[Path, dict]) -> None:
    out, _ = shapes
    for rec in _records(out, "train"):
        a, rel, b = _parse(rec["text"][0])
        ref = (*a, rel, *(b or (None,) * 3))
        for neg, kind in zip(rec["negatives"], rec["negative_kinds"], strict=True):
            na, nrel, nb = _parse(neg)
            cand = (*na, nrel, *(nb or (None,) * 3))
            diff = [i for i in range(7) if cand[i] != ref[i]]
            assert len(diff) == 1, (rec["text"][0], neg)
            want = {
                0: "size",
                1: "color",
                2: "shape",
                3: "relation",
                4: "size",
                5: "color",
                6: "shape",
            }[diff[0]]
            assert kind == want, (neg, kind)


def test_checker_is_not_vacuous(shapes: tuple[Path, dict]) -> None:
    rec = next(r for r in _records(shapes[0], "train") if r["relation"] == "left of")
    a, _, b = _parse(rec["text"][0])
    flip = f"a {a[0]} {a[1]} {a[2]} to the right of a {b[0]} {b[1]} {b[2]}"
    same = f"a {a[0]} {a[1]} {a[2]} to the left of a {b[0]} {b[1]} {b[2]}"
    assert _true(rec, same, strict=True) and not _true(rec, flip, strict=False)


def test_objects_drawn_where_metadata_says(shapes: tuple[Path, dict]) -> None:
    out, _ = shapes
    for rec in _records(out, "test")[:20]:
        img = load_image(out / rec["image"], 64)  # (3, 64, 64), no resize at 64
        for o in rec["objects"]:
            rgb = img[:, int(o["y"]), int(o["x"])] * 255
            assert rgb.round().tolist() == list(COLORS[o["color"]]), (rec["id"], o)
        objs = rec["objects"]
        for i, p in enumerate(objs):
            for q in objs[i + 1 :]:
                gap = p["r"] + q["r"]
                assert abs(p["x"] - q["x"]) >= gap or abs(p["y"] - q["y"]) >= gap


def test_command_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vltrain.cli import main

    r = synth_command(str(tmp_path / "x"), 3, 2, 1, seed=0)
    assert r["images"] == 6 and "wrote 6 images" in capsys.readouterr().out
    argv = ["--out", str(tmp_path / "y"), "--n-train", "2", "--n-val", "0", "--n-test", "1"]
    assert main(["data", "synth", *argv]) == 0
    lines = {s: (tmp_path / "y" / f"{s}.jsonl").read_text().splitlines() for s in SPLITS}
    assert [len(lines[s]) for s in SPLITS] == [2, 0, 1]
    with pytest.raises(ValueError, match="n_val must be >= 0"):
        write_shapes_dataset(tmp_path / "z", n_val=-1)
    with pytest.raises(ValueError, match="image_size"):
        write_shapes_dataset(tmp_path / "z", image_size=16)


def test_bad_corpus_written(tmp_path: Path) -> None:
    path = write_bad_corpus(tmp_path)
    recs = read_jsonl(path)
    assert path.name == "bad.jsonl" and len(recs) >= 20
    assert all("expect" in r for r in recs)


def test_an_unplaceable_draw_is_drawn_again_and_others_are_unchanged() -> None:
    """Random(15884)'s first draw at 64 px cannot place its two shapes in their relation (the
    generator used to raise there, ending e.g. `--n-train 40000 --seed 0`); it is now drawn
    again from the same stream, and a draw that places at once is exactly what it was."""
    import random

    from vltrain.data import synth

    combos = [(c, sh) for c in COLORS for sh in SHAPES]
    assert synth._try_scene(random.Random(15884), 64, combos, []) is None
    objs, rel = synth._make_scene(random.Random(15884), 64, combos, [])
    assert rel is not None and len(objs) >= 2
    assert not synth._overlaps(objs[1], objs[:1])
    assert synth._relation_holds(objs[0], objs[1], rel, False, 64)
    for seed in range(50):
        assert synth._make_scene(random.Random(seed), 64, combos, []) == synth._try_scene(
            random.Random(seed), 64, combos, []
        )
