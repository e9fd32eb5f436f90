"""The synthetic "shapes" data set: small, fast, exactly labelled, with a compositional split.

Layout written by `write_shapes_dataset(out_dir)`::

    out_dir/images/{split}_{i:05d}.png   64x64 RGB (image_size), dark flat background
    out_dir/{train,val,test}.jsonl       records: image, text (3-5 captions), negatives, id
    out_dir/meta.json                    colours, shapes, held-out combos, counts

Each image holds 1-3 non-overlapping shapes (circle, square, triangle, star, cross), each with a
colour (red, green, blue, yellow, purple, white) and a size (small/large). With two or more
shapes the first two stand in a clear spatial relation (left of, right of, above, below: the
offset along that axis is at least twice the offset across it). Captions are COCO-style
paraphrases of the first two shapes, e.g. "a large red circle to the left of a small blue
square" or "there is a little blue square to the right of a big red circle".

Hard negatives (``negatives``) re-render the first caption with exactly one attribute swapped
(colour, shape, size or relation): one of each kind first, then extras, and the kinds are in
``negative_kinds``. Every negative is checked to be false for the whole scene, under a lenient
reading of the relation (any offset in that direction counts), so a swap that happens to
describe another shape in the picture is dropped. Scenes with a relation also carry
``caption_negatives``: for each caption, the same wording with the relation inverted (its
minimal pair: the same words up to "left" / "right", NegCLIP's kind of negative), which training
draws before the shared ``negatives`` (`vltrain.data.records.training_texts`).

Compositional split: about 20% of the (colour, shape) combinations (one per colour, chosen
from the seed) never occur in train/val images, captions or negatives, and every test image
shows at least one of them among the two shapes its captions describe.

Generation is deterministic in `seed` (same PNG bytes and records on every run) and takes
about a second per thousand images.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from vltrain.core.files import OutputError
from vltrain.data import planted
from vltrain.data.rng import sample_seed

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 70),
    "blue": (60, 110, 245),
    "yellow": (240, 220, 50),
    "purple": (165, 70, 215),
    "white": (235, 235, 235),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
SIZES: tuple[str, ...] = ("small", "large")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
SPLITS: tuple[str, ...] = ("train", "val", "test")

_SIZE_WORDS = {"small": ("small", "little"), "large": ("large", "big")}
_REL_WORDS = {
    "left of": ("to the left of", "left of", "on the left of"),
    "right of": ("to the right of", "right of", "on the right of"),
    "above": ("above", "over"),
    "below": ("below", "under", "beneath"),
}
_INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
_AXIS = {"left of": (1, 0), "right of": (-1, 0), "above": (0, 1), "below": (0, -1)}
_PAIR_TEMPLATES = (
    "a {a} {rel} a {b}",
    "there is a {a} {rel} a {b}",
    "a {b} {irel} a {a}",
    "the {a} is {rel} the {b}",
    "a picture of a {a} {rel} a {b}",
    "a {b} with a {a} {rel} it",
    "an image showing a {a} {rel} a {b}",
    "on a dark background, a {a} sits {rel} a {b}",
)
_SINGLE_TEMPLATES = (
    "a {a}",
    "there is a {a}",
    "a single {a}",
    "a picture of a {a}",
    "a {a} on a dark background",
    "an image with one {a}",
    "just one {a} in the picture",
)
_N_NEGATIVES = 6
_GAP = 2.0  # pixels between shapes' bounding squares

Desc = tuple[str, str, str]  # (size, color, shape)


@dataclass(frozen=True)
class _Obj:
    shape: str
    color: str
    size: str
    cx: float
    cy: float
    r: float

    @property
    def desc(self) -> Desc:
        return (self.size, self.color, self.shape)

    def to_json(self) -> dict[str, Any]:
        d = {"shape": self.shape, "color": self.color, "size": self.size}
        return {**d, "x": round(self.cx, 2), "y": round(self.cy, 2), "r": round(self.r, 2)}


@dataclass(frozen=True)
class _Statement:
    """What a caption claims: `a` alone, or `a` in relation `rel` to `b`."""

    a: Desc
    rel: str | None = None
    b: Desc | None = None


@dataclass(frozen=True)
class _Style:
    """How a statement is worded: template and synonym choices (negatives reuse caption 0's)."""

    template: str
    size_word: tuple[int, int]
    rel_word: int


def scene_key(record: dict[str, Any]) -> tuple | None:
    """What a record's captions say, as a key: equal keys = captions with the same meaning.

    The captions describe the first two shapes (or the only one) and their relation; "A left of
    B" and "B right of A" are the same statement, so the key is the smaller of the two
    orderings. None for records without the synthetic data's ``objects`` / ``relation`` fields.
    Used for the retrieval ceiling (`vltrain.eval.ceiling`).
    """
    objs, rel = record.get("objects"), record.get("relation", "missing")
    if not isinstance(objs, list) or not objs or rel == "missing":
        return None
    try:
        descs = [(str(o["size"]), str(o["color"]), str(o["shape"])) for o in objs]
        if rel is None:
            return (descs[0],)
        a, b = descs[0], descs[1]
        return min((a, rel, b), (b, _INVERSE[rel], a))
    except (KeyError, IndexError, TypeError):
        return None


def held_out_combos(seed: int) -> list[tuple[str, str]]:
    """The (color, shape) pairs kept out of train/val: one per colour, every shape at least once."""
    rng = random.Random(sample_seed(seed, 0, 0, salt="synth-holdout"))
    colors = rng.sample(list(COLORS), len(COLORS))
    shapes = rng.sample(SHAPES, len(SHAPES))
    return sorted((c, shapes[i % len(shapes)]) for i, c in enumerate(colors))


def _relation_holds(a: _Obj, b: _Obj, rel: str, lenient: bool, image_size: int) -> bool:
    """Strict: clear offset along the axis, at least twice the offset across it.

    Lenient: any offset at all in that direction; used to prove negatives false.
    """
    ux, uy = _AXIS[rel]
    along = (b.cx - a.cx) * ux + (b.cy - a.cy) * uy
    if lenient:
        return along > 0.0
    across = abs((b.cx - a.cx) * uy + (b.cy - a.cy) * ux)
    return along >= 0.1 * image_size and across <= along / 2


def _is_true(objs: Sequence[_Obj], st: _Statement, lenient: bool, image_size: int) -> bool:
    """Whether any shape (or ordered pair of distinct shapes) in the scene fits the statement."""
    if st.rel is None:
        return any(o.desc == st.a for o in objs)
    return any(
        x.desc == st.a and y.desc == st.b and _relation_holds(x, y, st.rel, lenient, image_size)
        for i, x in enumerate(objs)
        for j, y in enumerate(objs)
        if i != j
    )


def _render(st: _Statement, style: _Style) -> str:
    def phrase(d: Desc, k: int) -> str:
        words = _SIZE_WORDS[d[0]]
        return f"{words[style.size_word[k] % len(words)]} {d[1]} {d[2]}"

    if st.rel is None:
        return style.template.format(a=phrase(st.a, 0))
    assert st.b is not None
    rel = _REL_WORDS[st.rel][style.rel_word % len(_REL_WORDS[st.rel])]
    irel_words = _REL_WORDS[_INVERSE[st.rel]]
    irel = irel_words[style.rel_word % len(irel_words)]
    return style.template.format(a=phrase(st.a, 0), b=phrase(st.b, 1), rel=rel, irel=irel)


def _pick_attrs(rng: random.Random, allowed: list[tuple[str, str]]) -> tuple[str, str, str]:
    color, shape = rng.choice(allowed)
    return color, shape, rng.choice(SIZES)


def _radius(rng: random.Random, size: str, s: int) -> float:
    lo, hi = (0.085, 0.10) if size == "small" else (0.16, 0.19)
    return rng.uniform(lo, hi) * s


def _overlaps(o: _Obj, others: Sequence[_Obj]) -> bool:
    return any(
        abs(o.cx - p.cx) < o.r + p.r + _GAP and abs(o.cy - p.cy) < o.r + p.r + _GAP for p in others
    )


def _place(rng: random.Random, attrs: tuple[str, str, str], s: int) -> _Obj:
    color, shape, size = attrs
    r = _radius(rng, size, s)
    cx, cy = rng.uniform(r + 1, s - r - 1), rng.uniform(r + 1, s - r - 1)
    return _Obj(shape, color, size, cx, cy, r)


def _make_scene(
    rng: random.Random, s: int, combos: list[tuple[str, str]], forced: list[tuple[str, str]]
) -> tuple[list[_Obj], str | None]:
    """Sample 1-3 shapes; `forced` non-empty puts one of those combos among the first two.

    A draw whose first two shapes cannot be placed in their relation (e.g. two large shapes one
    above the other; about one draw in 45,000 at 64 px) is drawn again from the same stream, so
    every scene that used to place at once comes out unchanged."""
    for _ in range(20):
        scene = _try_scene(rng, s, combos, forced)
        if scene is not None:
            return scene
    raise RuntimeError(f"could not place shapes on a {s}px canvas; use image_size >= 32")


def _try_scene(
    rng: random.Random, s: int, combos: list[tuple[str, str]], forced: list[tuple[str, str]]
) -> tuple[list[_Obj], str | None] | None:
    n = rng.choices([1, 2, 3], weights=[0.2, 0.45, 0.35])[0]
    attrs = [_pick_attrs(rng, combos) for _ in range(n)]
    if forced:
        f = rng.randrange(min(n, 2))
        attrs[f] = (*rng.choice(forced), attrs[f][2])
    rel = rng.choice(RELATIONS) if n >= 2 else None
    for _ in range(200):
        objs = [_place(rng, attrs[0], s)]
        if n >= 2:
            b = _place(rng, attrs[1], s)
            if _overlaps(b, objs) or not _relation_holds(objs[0], b, rel, False, s):
                continue
            objs.append(b)
        if n == 3:
            for _ in range(50):
                c = _place(rng, attrs[2], s)
                if not _overlaps(c, objs):
                    objs.append(c)
                    break
        return objs, rel
    return None


def _draw(objs: Sequence[_Obj], rng: random.Random, s: int) -> Image.Image:
    bg = (rng.randrange(60), rng.randrange(60), rng.randrange(60))
    img = Image.new("RGB", (s, s), bg)
    draw = ImageDraw.Draw(img)
    for o in objs:
        fill = COLORS[o.color]
        x, y, r = o.cx, o.cy, o.r
        if o.shape == "circle":
            draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)
        elif o.shape == "square":
            draw.rectangle([x - r, y - r, x + r, y + r], fill=fill)
        elif o.shape == "triangle":
            draw.polygon([(x, y - r), (x + r, y + r), (x - r, y + r)], fill=fill)
        elif o.shape == "star":
            pts = []
            for k in range(10):
                rad = r if k % 2 == 0 else 0.45 * r
                ang = -math.pi / 2 + k * math.pi / 5
                pts.append((x + rad * math.cos(ang), y + rad * math.sin(ang)))
            draw.polygon(pts, fill=fill)
        else:  # cross
            t = 0.35 * r
            draw.rectangle([x - r, y - t, x + r, y + t], fill=fill)
            draw.rectangle([x - t, y - r, x + t, y + r], fill=fill)
    return img


def _swaps(st: _Statement) -> list[tuple[str, _Statement]]:
    """Every statement that differs from `st` in exactly one attribute, with its kind."""
    out: list[tuple[str, _Statement]] = []
    targets = [("a", st.a)] + ([("b", st.b)] if st.b is not None else [])
    for name, (size, color, shape) in targets:

        def put(d: Desc, name: str = name) -> _Statement:
            return _Statement(d, st.rel, st.b) if name == "a" else _Statement(st.a, st.rel, d)

        out += [("color", put((size, c, shape))) for c in COLORS if c != color]
        out += [("shape", put((size, color, sh))) for sh in SHAPES if sh != shape]
        out += [("size", put((z, color, shape))) for z in SIZES if z != size]
    if st.rel is not None:
        out += [("relation", _Statement(st.a, r, st.b)) for r in RELATIONS if r != st.rel]
    return out


def _negatives(
    rng: random.Random,
    objs: Sequence[_Obj],
    st: _Statement,
    style: _Style,
    banned: set[tuple[str, str]],
    captions: Sequence[str],
    s: int,
) -> tuple[list[str], list[str]]:
    """One random false swap per kind (color, shape, size, relation), then random extras."""
    by_kind: dict[str, list[str]] = {}
    seen = set(captions)
    for kind, neg in _swaps(st):
        descs = [neg.a] + ([neg.b] if neg.b is not None else [])
        if any((d[1], d[2]) in banned for d in descs) or _is_true(objs, neg, True, s):
            continue
        text = _render(neg, style)
        if text not in seen:
            seen.add(text)
            by_kind.setdefault(kind, []).append(text)
    texts, kinds = [], []
    for kind in [k for k in ("color", "shape", "size", "relation") if k in by_kind]:
        pool = by_kind[kind]
        texts.append(pool.pop(rng.randrange(len(pool))))
        kinds.append(kind)
    rest = [(k, t) for k, pool in by_kind.items() for t in pool]
    for k, t in rng.sample(rest, min(len(rest), max(0, _N_NEGATIVES - len(texts)))):
        kinds.append(k)
        texts.append(t)
    return texts, kinds


def _captions(rng: random.Random, st: _Statement) -> tuple[list[str], list[_Style]]:
    templates = _PAIR_TEMPLATES if st.rel is not None else _SINGLE_TEMPLATES
    n = rng.randrange(3, 6)
    caps: list[str] = []
    styles: list[_Style] = []
    for template in rng.sample(templates, n):
        style = _Style(template, (rng.randrange(2), rng.randrange(2)), rng.randrange(3))
        text = _render(st, style)
        if text not in caps:
            caps.append(text)
            styles.append(style)
    return caps, styles


def _inverted(
    objs: Sequence[_Obj], st: _Statement, styles: Sequence[_Style], captions: Sequence[str], s: int
) -> list[list[str]] | None:
    """Per caption, the same wording with the relation inverted ("A left of B" -> "A right of
    B"; in "B right of A" wording "B left of A"): each caption's minimal pair, the same words up
    to the relation, NegCLIP's kind of negative. None for one-shape scenes; a caption whose
    inversion is true of the scene (another pair of shapes fits it) gets none."""
    if st.rel is None:
        return None
    inv = _Statement(st.a, _INVERSE[st.rel], st.b)
    if _is_true(objs, inv, True, s):
        return [[] for _ in captions]
    out = []
    for style in styles:
        text = _render(inv, style)
        out.append([text] if text not in captions else [])
    return out


def _make_record(
    split: str, i: int, seed: int, s: int, held: list[tuple[str, str]], out_dir: Path
) -> dict[str, Any]:
    # Python's Mersenne Twister: scalar draws are ~10x cheaper than numpy's. Output is fixed for
    # a given seed on one Python + zlib version (the determinism tests pin); across versions the
    # random module only guarantees random() itself.
    rng = random.Random(sample_seed(seed, SPLITS.index(split), i, salt="synth"))
    banned = set() if split == "test" else set(held)
    combos = [(c, sh) for c in COLORS for sh in SHAPES if (c, sh) not in banned]
    objs, rel = _make_scene(rng, s, combos, held if split == "test" else [])
    st = _Statement(objs[0].desc, rel, objs[1].desc if rel is not None else None)
    assert _is_true(objs, st, False, s), "caption must describe the scene"
    captions, styles = _captions(rng, st)
    negatives, kinds = _negatives(rng, objs, st, styles[0], banned, captions, s)
    inverted = _inverted(objs, st, styles, captions, s)
    name = f"{split}_{i:05d}"
    _draw(objs, rng, s).save(out_dir / "images" / f"{name}.png", format="PNG", compress_level=6)
    return {
        "image": f"images/{name}.png",
        "text": captions,
        "negatives": negatives,
        "negative_kinds": kinds,
        **({"caption_negatives": inverted} if inverted is not None else {}),
        "id": name,
        "relation": rel,
        "objects": [o.to_json() for o in objs],
    }


def _write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def write_shapes_dataset(
    out_dir: str | os.PathLike[str],
    n_train: int = 2000,
    n_val: int = 300,
    n_test: int = 300,
    seed: int = 0,
    image_size: int = 64,
    dup_rate: float = 0.0,
    leak_rate: float = 0.0,
    workers: int = 1,
) -> dict[str, Any]:
    """Write the shapes data set (see module docstring) and return counts and held-out combos.

    `workers` > 1 renders the images in that many processes; every record depends only on
    (seed, split, index), so the files are the same bytes for any number of workers.

    `dup_rate` > 0 appends round(dup_rate * n_train) planted near-duplicates of train records to
    train, `leak_rate` > 0 appends copies of round(leak_rate * n_test) test records (see
    `plant_duplicates`). Existing files of the same names are overwritten; other files in
    `out_dir` are left alone.
    """
    for name, rate in (("dup_rate", dup_rate), ("leak_rate", leak_rate)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {rate}")
    sizes = {"train": n_train, "val": n_val, "test": n_test}
    for name, n in sizes.items():
        if n < 0:
            raise ValueError(f"n_{name} must be >= 0, got {n}")
    if image_size < 32:
        raise ValueError(f"image_size must be >= 32 to fit three shapes, got {image_size}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    held = held_out_combos(seed)
    jobs = [(split, i, seed, image_size, held, out) for split, n in sizes.items() for i in range(n)]
    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            made = pool.starmap(_make_record, jobs, chunksize=max(1, len(jobs) // (8 * workers)))
    else:
        made = [_make_record(*job) for job in jobs]
    by_split: dict[str, list[dict[str, Any]]] = {split: [] for split in sizes}
    for job, rec in zip(jobs, made, strict=True):
        by_split[job[0]].append(rec)
    planted_counts = plant_duplicates(out, by_split, seed, image_size, dup_rate, leak_rate)
    for split, records in by_split.items():
        _write_jsonl(out / f"{split}.jsonl", records)
    meta = {
        "seed": seed,
        "image_size": image_size,
        "colors": list(COLORS),
        "shapes": list(SHAPES),
        "sizes": list(SIZES),
        "relations": list(RELATIONS),
        "held_out": [list(c) for c in held],
        "counts": sizes,
    }
    if dup_rate or leak_rate:
        meta["planted"] = planted_counts
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return {**sizes, "images": sum(sizes.values()), "held_out": [f"{c} {s}" for c, s in held]}


def plant_duplicates(
    out: Path,
    by_split: dict[str, list[dict[str, Any]]],
    seed: int,
    s: int,
    dup_rate: float,
    leak_rate: float,
) -> dict[str, int]:
    """Append planted near-duplicates and test leaks to `by_split["train"]` (in place).

    Duplicate k copies a random earlier train record with kind `planted.KINDS + ("rerender",)`
    [k % 8] (rerender: the same shapes drawn again on another background) and one word edit
    per caption; leak k copies test record k of a seeded shuffle (image exact or transformed,
    captions unchanged or edited). Each planted record has `planted: {"kind", "of"}`.
    """
    train, test = by_split["train"], by_split["test"]
    rng = random.Random(sample_seed(seed, 0, 0, salt="synth-plant"))
    kinds = (*planted.KINDS, "rerender")
    n_dup, n_leak = round(dup_rate * len(train)), round(leak_rate * len(test))
    new: list[dict[str, Any]] = []
    for k in range(n_dup if train else 0):
        src = train[rng.randrange(len(train))]
        new.append(_planted_copy(out, src, f"train_dup_{k:05d}", kinds[k % len(kinds)], rng, s))
    for k, src in enumerate(rng.sample(test, n_leak)):
        kind = ("exact", "jpeg30", "resized", "flip")[k % 4]
        new.append(_planted_copy(out, src, f"train_leak_{k:05d}", kind, rng, s, leak=True))
    train += new
    return {"duplicates": n_dup if train else 0, "leaks": n_leak}


def _planted_copy(
    out: Path, src: dict[str, Any], name: str, kind: str, rng: random.Random, s: int,
    leak: bool = False,
) -> dict[str, Any]:  # fmt: skip
    if kind == "rerender":
        objs = [
            _Obj(o["shape"], o["color"], o["size"], o["x"], o["y"], o["r"]) for o in src["objects"]
        ]
        img = _draw(objs, rng, s)
    else:
        img = planted.transform(Image.open(out / src["image"]), kind, rng)
    img.save(out / "images" / f"{name}.png", format="PNG", compress_level=6)
    edit = not leak or rng.random() < 0.5
    texts = [planted.noisy_caption(t, rng) if edit else t for t in src["text"]]
    rec = {**src, "image": f"images/{name}.png", "text": texts, "id": name}
    rec["planted"] = {"kind": "leak" if leak else kind, "transform": kind, "of": src["id"]}
    return rec


def owned_files(out_dir: str | os.PathLike[str]) -> list[Path]:
    """The files of a shapes data set in `out_dir` (what `--force` replaces); nothing else."""
    out = Path(out_dir)
    names = [f"{s}.jsonl{t}" for s in SPLITS for t in ("", ".tmp")] + ["meta.json"]
    files = [out / n for n in names if (out / n).is_file()]
    images = out / "images"
    if images.is_dir():
        pattern = re.compile(rf"({'|'.join(SPLITS)})_((dup|leak)_)?\d{{5,}}\.png")
        files += sorted(p for p in images.iterdir() if p.is_file() and pattern.fullmatch(p.name))
    return files


def prepare_output_folder(out_dir: str | os.PathLike[str], force: bool) -> None:
    """Refuse a non-empty `out_dir` unless `force`; with `force`, delete the shapes data set
    files already there (stale images of a larger earlier set included), keep anything else."""
    if not str(out_dir).strip():
        raise OutputError("--out is empty; give the dataset folder, e.g. --out data/shapes")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file; give a folder for the dataset")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    if not force:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise OutputError(
            f"--out {out} is not empty (it holds {shown}); writing there would mix two data "
            "sets. Choose an empty folder, or pass --force to replace the shapes data set in it "
            "(only its own files are deleted)."
        )
    for path in owned_files(out):
        path.unlink()
    images = out / "images"
    if images.is_dir() and not any(images.iterdir()):
        images.rmdir()


def synth_command(
    out: str,
    n_train: int,
    n_val: int,
    n_test: int,
    seed: int,
    image_size: int = 64,
    dup_rate: float = 0.0,
    leak_rate: float = 0.0,
    force: bool = False,
    workers: int = 1,
) -> dict[str, Any]:
    """`vltrain data synth`: write the shapes data set to `out` (an empty folder, or any
    folder with `force`, see `prepare_output_folder`) and print a one-line summary."""
    prepare_output_folder(out, force)
    result = write_shapes_dataset(
        out, n_train, n_val, n_test, seed, image_size, dup_rate, leak_rate, workers
    )
    print(
        f"wrote {result['images']} images to {out} (train={n_train} val={n_val} test={n_test}); "
        f"held-out combos: {', '.join(result['held_out'])}"
    )
    return result
