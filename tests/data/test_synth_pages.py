"""`vltrain data synth --kind pages`: every held-out query's phrase is on its page and on no
other page of the corpus, so the qrels (one relevant page per query) are complete."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from vltrain.data import synth_pages
from vltrain.data.synth_pages import Page, make_page, phrases, vocabulary


def _split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vocab: list[str]) -> tuple:
    """One split written with `render` recording the pages it draws (no images saved)."""
    drawn: list[Page] = []

    def record(page: Page, size: int, boxes: object = None) -> Page:
        drawn.append(page)
        return page

    monkeypatch.setattr(synth_pages, "render", record)
    monkeypatch.setattr(synth_pages, "_save", lambda img, out, rel: rel)
    rng = random.Random("7-val")
    synth_pages.write_split(tmp_path, "val", 60, 3000, 2, 96, rng, vocab)
    lines = (tmp_path / "val" / "queries.jsonl").read_text().splitlines()
    queries = [json.loads(x) for x in lines]
    return drawn, queries


def test_each_query_phrase_is_on_exactly_one_corpus_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a 40-word vocabulary makes collisions common: without the redraws most of these queries'
    # phrases would sit on other pages too (the control below counts them)
    vocab = vocabulary()[:40]
    drawn, queries = _split(tmp_path, monkeypatch, vocab)
    assert len(drawn) == 60 * 3 + 3000 and len(queries) == 60
    counts = Counter(p for page in drawn for p in set(phrases(page)))
    qrels = (tmp_path / "val" / "qrels.tsv").read_text().splitlines()[1:]
    positive = {q: d for q, d, s in (x.split("\t") for x in qrels) if s == "1"}
    corpus = (tmp_path / "val" / "corpus.jsonl").read_text().splitlines()
    docs = [json.loads(x)["_id"] for x in corpus]
    by_id = dict(zip(docs, drawn, strict=True))
    for q in queries:
        phrase = tuple(q["text"].split())
        assert counts[phrase] == 1, q
        assert phrases(by_id[positive[q["_id"]]]).count(phrase) == 1
    # control: free draws from the same vocabulary repeat most query phrases
    rng = random.Random(0)
    free = Counter(p for _ in range(3000) for p in set(phrases(make_page(rng, vocab, 96, True))))
    repeated = sum(free[tuple(q["text"].split())] > 0 for q in queries)
    assert repeated > len(queries) // 2, repeated


def test_a_split_too_crowded_for_unique_phrases_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(synth_pages, "render", lambda page, size, boxes=None: page)
    monkeypatch.setattr(synth_pages, "_save", lambda img, out, rel: rel)
    monkeypatch.setattr(synth_pages, "MAX_DRAWS", 50)
    rng = random.Random(0)
    with pytest.raises(ValueError, match="too many queries for the vocabulary"):
        synth_pages.write_split(tmp_path, "val", 200, 0, 1, 96, rng, vocabulary()[:8])


def test_queries_name_their_group_and_font_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn, queries = _split(tmp_path, monkeypatch, vocabulary())
    corpus = (tmp_path / "val" / "corpus.jsonl").read_text().splitlines()
    by_id = dict(zip((json.loads(x)["_id"] for x in corpus), drawn, strict=True))
    qrels = (tmp_path / "val" / "qrels.tsv").read_text().splitlines()[1:]
    positive = {q: d for q, d, s in (x.split("\t") for x in qrels) if s == "1"}
    assert {q["group"] for q in queries} == {"title", "body"}
    for q in queries:
        page = by_id[positive[q["_id"]]]
        words = q["text"].split()
        if q["group"] == "title":
            assert words == page.title and q["font_px"] == page.style["title_px"]
        else:
            assert any(line[k : k + 2] == words for line in page.lines for k in range(len(line)))
            assert q["font_px"] == page.style["body_px"]
