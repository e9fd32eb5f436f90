"""A synthetic page-screenshot retrieval workload: `vltrain data synth --kind pages`.

Each page is a small image with a title (two words) and a few body lines of words from a fixed
400-word vocabulary, drawn with Pillow's bundled font at varied sizes, positions, alignments
and grey levels. A query names the page's content: its title, or a two-word phrase of its body.
A hard negative of a query is a page that shares most of its words with the positive but not
the queried words (one of them is swapped), so only reading the queried words tells them apart.

Layout written under OUT::

    train.jsonl                     {"query": {"text"}, "positive": {"image", "words"},
                                    "negatives": [...]}; words: [[word, x0, y0, x1, y1], ...]
    train_corpus.jsonl              every training page as a document (for `vltrain mine`)
    {val,test}/queries.jsonl        {"_id", "text", "group", "font_px"}: group "title" or
                                    "body" (the phrase's place: metrics per group), font_px
                                    its font size (for analysis; evaluation ignores it)
    {val,test}/corpus.jsonl         {"_id", "image"}: positives, their hard negatives, distractors
    {val,test}/qrels.tsv            query-id corpus-id score (1: the page; 0: its hard negatives)
    pages/<split>/*.png

Everything is deterministic in the seed. Titles are split between train and held-out by a hash
of the word pair, so no held-out page's title was ever a training title.
"""

from __future__ import annotations

import functools
import json
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

_ONSETS = "b c d f g h k l m n p r s t v z".split()
_VOWELS = "a e i o u".split()
_CODAS = ["", "n", "r", "s", "l"]
VOCAB_SIZE = 400
#: draws before a held-out split gives up keeping each query's phrase on one page
MAX_DRAWS = 1000


def vocabulary(n: int = VOCAB_SIZE) -> list[str]:
    """A fixed list of `n` pronounceable 4-5 letter words (independent of any seed)."""
    rng = random.Random(1234)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(2))
        w += rng.choice(_CODAS)
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


@dataclass
class Page:
    title: list[str]  # 2 words
    lines: list[list[str]]  # body lines of 2-3 words
    style: dict[str, Any] = field(default_factory=dict)

    def words(self) -> list[str]:
        return self.title + [w for line in self.lines for w in line]


def held_out_title(title: list[str]) -> bool:
    """About one title pair in five is reserved for val/test pages."""
    return zlib.crc32(" ".join(title).encode()) % 5 == 0


def _style(rng: random.Random, size: int) -> dict[str, Any]:
    return {
        "title_px": rng.randint(size // 9, size // 7),
        "body_px": rng.randint(size // 12, size // 9),
        "x": rng.randint(1, size // 10),
        "y": rng.randint(1, size // 10),
        "align": rng.choice(["left", "center"]),
        "bg": rng.randint(215, 255),
        "fg": rng.randint(0, 70),
        "rule": rng.random() < 0.5,  # a line under the title
    }


def make_page(rng: random.Random, vocab: list[str], size: int, held_out: bool) -> Page:
    """A page whose title lies on the requested side of the train/held-out split."""
    while True:
        title = rng.sample(vocab, 2)
        if held_out_title(title) == held_out:
            break
    n_lines = rng.randint(3, 4)
    lines = [rng.sample(vocab, rng.randint(2, 3)) for _ in range(n_lines)]
    return Page(title, lines, _style(rng, size))


@functools.lru_cache(maxsize=64)
def _font(px: int) -> Any:
    """Pillow's bundled font at `px` (loading it costs about a third of drawing a page)."""
    return ImageFont.load_default(size=px)


def render(
    page: Page, size: int, boxes: list[tuple[str, int, int, int, int]] | None = None
) -> Image.Image:
    """Draw the page (title, optional rule, body lines) on a size x size canvas.

    With `boxes`, appends each drawn word's `(word, x0, y0, x1, y1)` in pixels (the line of its
    font box; words may run past the canvas edge, boxes are not clipped): the supervision a
    reading objective needs, from the same layout that draws the page."""
    st = page.style
    img = Image.new("L", (size, size), st["bg"])
    draw = ImageDraw.Draw(img)
    title_font = _font(st["title_px"])
    body_font = _font(st["body_px"])

    def put(words: list[str], y: int, font: Any) -> int:
        text = " ".join(words)
        w = draw.textlength(text, font=font)
        x = st["x"] if st["align"] == "left" else max(0, int((size - w) / 2))
        draw.text((x, y), text, fill=st["fg"], font=font)
        if boxes is not None:
            for k, word in enumerate(words):
                x0 = x + (draw.textlength(" ".join(words[:k]) + " ", font=font) if k else 0)
                x1 = x0 + draw.textlength(word, font=font)
                boxes.append((word, int(x0), y, int(round(x1)), y + int(font.size)))
        return y + int(font.size * 1.15)

    y = put(page.title, st["y"], title_font)
    if st["rule"]:
        draw.line([(st["x"], y + 1), (size - st["x"], y + 1)], fill=st["fg"], width=1)
        y += 3
    for line in page.lines:
        y = put(line, y, body_font)
    return img.convert("RGB")


def make_query(rng: random.Random, page: Page) -> tuple[str, tuple[int, int]]:
    """A query naming the title (half the time) or a 2-word body phrase; and its span
    (line index, -1 for the title; first word's position)."""
    if rng.random() < 0.5:
        return " ".join(page.title), (-1, 0)
    li = rng.randrange(len(page.lines))
    line = page.lines[li]
    j = rng.randrange(len(line) - 1)
    return f"{line[j]} {line[j + 1]}", (li, j)


def hard_negative(rng: random.Random, page: Page, span: tuple[int, int], vocab: list[str]) -> Page:
    """The page with one queried word swapped (and one other body word), same layout."""
    neg = Page(list(page.title), [list(x) for x in page.lines], dict(page.style))
    li, j = span
    target = neg.title if li < 0 else neg.lines[li]
    k = rng.choice([j, j + 1]) if li >= 0 else rng.randrange(2)
    used = set(page.words())
    target[k] = rng.choice([w for w in vocab if w not in used])
    other = rng.randrange(len(neg.lines))
    if other != li:
        line = neg.lines[other]
        line[rng.randrange(len(line))] = rng.choice([w for w in vocab if w not in used])
    return neg


def _save(img: Image.Image, out: Path, rel: str) -> str:
    img.save(out / rel, optimize=False, compress_level=1)
    return rel


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def page_side(page: Page, size: int, out: Path, rel: str) -> dict[str, Any]:
    """An image side for `page`, saved at `rel`, with its drawn words' boxes (`words`: the
    reading supervision of `objective.reading`, in fractions of the image, clipped to it)."""
    boxes: list[tuple[str, int, int, int, int]] = []
    image = _save(render(page, size, boxes), out, rel)
    words = [
        [w, *(round(min(1.0, max(0.0, v / size)), 4) for v in box)]
        for w, *box in boxes
        if box[0] < size and box[1] < size
    ]
    return {"image": image, "words": words}


def write_train(
    out: Path, n: int, negatives: int, size: int, rng: random.Random, vocab: list[str]
) -> None:
    """train.jsonl (text query -> page image with its words' boxes, image hard negatives) and
    train_corpus.jsonl."""
    (out / "pages" / "train").mkdir(parents=True, exist_ok=True)
    records, docs = [], []
    for i in range(n):
        page = make_page(rng, vocab, size, held_out=False)
        query, span = make_query(rng, page)
        positive = page_side(page, size, out, f"pages/train/{i:06d}.png")
        pos = positive["image"]
        negs = []
        for k in range(negatives):
            neg = hard_negative(rng, page, span, vocab)
            negs.append(page_side(neg, size, out, f"pages/train/{i:06d}_n{k}.png"))
        records.append(
            {
                "query": {"text": query},
                "positive": positive,
                "negatives": negs,
                "id": f"train-{i}",
            }
        )
        docs.append({"_id": f"t{i:06d}", "image": pos})
        docs += [{"_id": f"t{i:06d}_n{k}", "image": p["image"]} for k, p in enumerate(negs)]
    _write_jsonl(out / "train.jsonl", records)
    _write_jsonl(out / "train_corpus.jsonl", docs)


def phrases(page: Page) -> list[tuple[str, str]]:
    """The page's phrases: every pair of adjacent words on one line (title or body line)."""
    lines = (page.title, *page.lines)
    return [(line[k], line[k + 1]) for line in lines for k in range(len(line) - 1)]


def write_split(
    out: Path,
    split: str,
    n_queries: int,
    n_distractors: int,
    negatives: int,
    size: int,
    rng: random.Random,
    vocab: list[str],
) -> None:
    """`split`/{queries.jsonl, corpus.jsonl, qrels.tsv}: held-out pages only.

    A query's phrase is drawn on its page and on no other page of the split's corpus (pages
    that would repeat a query's phrase are drawn again), so the qrels are complete: with
    10,000 free distractors 46% of the queries' phrases also sat on another page, which the
    qrels called irrelevant, and a perfect reader could reach R@1 0.75 at most."""
    folder = out / split
    (folder / "pages").mkdir(parents=True, exist_ok=True)
    queries, docs, qrels = [], [], []
    taken: set[tuple[str, str]] = set()  # the queries' phrases
    seen: set[tuple[str, str]] = set()  # every phrase drawn so far

    def fresh(draw: Any) -> Page:
        """`draw()` again until the page repeats no query's phrase."""
        for _ in range(MAX_DRAWS):
            page = draw()
            if taken.isdisjoint(phrases(page)):
                return page
        raise too_crowded()

    def too_crowded() -> ValueError:
        return ValueError(
            f"synth pages: {MAX_DRAWS} pages in a row repeated a query's phrase ({len(taken)} "
            f"queries, {len(seen)} phrases drawn, {len(vocab)} words): too many queries for "
            "the vocabulary to keep each query's phrase on one page; ask for fewer"
        )

    for i in range(n_queries):
        for _ in range(MAX_DRAWS):
            page = fresh(lambda: make_page(rng, vocab, size, held_out=True))
            query, span = make_query(rng, page)
            phrase = tuple(query.split())
            if phrase not in seen and phrases(page).count(phrase) == 1:  # type: ignore[arg-type]
                break
        else:
            raise too_crowded()
        taken.add(phrase)  # type: ignore[arg-type]
        seen.update(phrases(page))
        doc = f"{split}-{i:06d}"
        docs.append({"_id": doc, "image": _save(render(page, size), folder, f"pages/{doc}.png")})
        group = "title" if span[0] < 0 else "body"
        px = page.style[f"{group}_px"]
        queries.append({"_id": f"q{i:06d}", "text": query, "group": group, "font_px": px})
        qrels.append((f"q{i:06d}", doc, 1))
        for k in range(negatives):
            nid = f"{doc}_n{k}"
            neg = fresh(lambda: hard_negative(rng, page, span, vocab))  # noqa: B023
            seen.update(phrases(neg))
            docs.append({"_id": nid, "image": _save(render(neg, size), folder, f"pages/{nid}.png")})
            qrels.append((f"q{i:06d}", nid, 0))
    for j in range(n_distractors):
        page = fresh(lambda: make_page(rng, vocab, size, held_out=True))
        did = f"{split}-x{j:06d}"
        docs.append({"_id": did, "image": _save(render(page, size), folder, f"pages/{did}.png")})
    _write_jsonl(folder / "queries.jsonl", queries)
    _write_jsonl(folder / "corpus.jsonl", docs)
    lines = ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{s}" for q, d, s in qrels]
    (folder / "qrels.tsv").write_text("\n".join(lines) + "\n")


def pages_command(
    out: str,
    n_train: int = 4000,
    n_val: int = 200,
    n_test: int = 200,
    seed: int = 0,
    image_size: int = 96,
    negatives: int = 3,
    distractors: int = 1000,
) -> dict[str, int]:
    """Write the pages workload (module docstring); returns the counts written."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    write_train(root, n_train, negatives, image_size, random.Random(f"{seed}-train"), vocab)
    for split, n in (("val", n_val), ("test", n_test)):
        rng = random.Random(f"{seed}-{split}")
        write_split(root, split, n, distractors, negatives, image_size, rng, vocab)
    docs = (1 + negatives) * max(n_val, n_test) + distractors
    return {"train": n_train, "val": n_val, "test": n_test, "corpus_docs": docs}
