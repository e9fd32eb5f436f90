"""Reading targets from word boxes: which token each grid cell shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vltrain.data.pairs import read_corpus, read_pair_records
from vltrain.data.readers import DataError
from vltrain.data.reading import IGNORE, ReadingTargets, box_cells, parse_words
from vltrain.data.tokenizer import train_bpe_tokenizer


class Pieces:
    """A tokenizer stand-in: each word is split into fixed pieces (id, start, end)."""

    vocab_size = 50

    def __init__(self, table: dict[str, list[tuple[int, int, int]]]) -> None:
        self.table = table

    def pieces(self, text: str) -> list[tuple[int, int, int]]:
        return self.table[text]


def test_box_cells_take_the_cells_whose_centres_lie_in_the_box() -> None:
    rows, cols = box_cells([0.0, 0.0, 0.5, 0.25], 4)  # cells of side 0.25; centres at .125, ...
    assert list(rows) == [0] and list(cols) == [0, 1]
    # a box thinner than a cell still labels the cell under its centre
    rows, cols = box_cells([0.55, 0.55, 0.6, 0.6], 4)
    assert list(rows) == [2] and list(cols) == [2]
    # a box touching the far edge stays on the grid
    rows, cols = box_cells([0.8, 0.9, 1.0, 1.0], 4)
    assert list(rows) == [3] and list(cols) == [3]


def test_targets_place_each_token_over_its_share_of_the_word() -> None:
    tok = Pieces({"abcd": [(7, 0, 2), (9, 2, 4)], "xy": [(5, 0, 2)]})
    targets = ReadingTargets(tok, 4)
    words = [("abcd", 0.0, 0.0, 1.0, 0.25), ("xy", 0.5, 0.5, 0.75, 0.75)]
    t = targets([words, None, []]).view(3, 4, 4)
    bg = tok.vocab_size
    assert t[0, 0].tolist() == [7, 7, 9, 9]  # the left half of the word is token 7
    assert t[0, 2].tolist() == [bg, bg, 5, bg]
    assert (t[0, 1] == bg).all() and (t[0, 3] == bg).all()
    assert (t[1] == IGNORE).all() and (t[2] == IGNORE).all()  # no words: no reading loss
    # control: another layout gives other targets
    moved = targets([[("xy", 0.0, 0.5, 0.25, 0.75)]]).view(4, 4)
    assert moved[2].tolist() == [5, bg, bg, bg]


def test_following_targets_name_the_next_token_on_the_line() -> None:
    """Each word cell's next token: the word's own next piece, else the next word's first
    piece when it continues the line, else the end of the line; other cells are ignored."""
    tok = Pieces({"abcd": [(7, 0, 2), (9, 2, 4)], "xy": [(5, 0, 2)], "pq": [(6, 0, 2)]})
    targets = ReadingTargets(tok, 4, following=True)
    words = [
        ("abcd", 0.0, 0.0, 0.5, 0.25),  # line 1: abcd xy
        ("xy", 0.5, 0.0, 1.0, 0.25),
        ("pq", 0.0, 0.5, 0.5, 0.75),  # line 2 (below): pq ends its line
    ]
    t = targets([words, None]).view(2, 2, 4, 4)
    end, bg = tok.vocab_size, tok.vocab_size
    assert t[0, 0, 0].tolist() == [7, 9, 5, 5]  # the tokens, as without `following`
    assert t[0, 1, 0].tolist() == [9, 5, end, end]  # 7 -> 9 -> xy's 5 -> end of line
    assert t[0, 1, 2].tolist() == [end, end, IGNORE, IGNORE]  # pq does not follow xy
    assert (t[0, 0, 1] == bg).all() and (t[0, 1, 1] == IGNORE).all()  # no word: ignored
    assert (t[1] == IGNORE).all()
    plain = ReadingTargets(tok, 4)([words, None])
    assert torch.equal(plain, t[:, 0].reshape(2, 16))


def test_next_on_line_needs_the_next_word_right_after_on_the_same_row() -> None:
    from vltrain.data.reading import next_on_line

    a = ("a", 0.1, 0.1, 0.3, 0.2)
    assert next_on_line([a, ("b", 0.33, 0.1, 0.5, 0.2)], 0) is not None  # a space apart
    assert next_on_line([a, ("b", 0.8, 0.1, 0.9, 0.2)], 0) is None  # across a column gap
    assert next_on_line([a, ("b", 0.1, 0.25, 0.3, 0.35)], 0) is None  # the next line
    assert next_on_line([a, ("b", 0.05, 0.1, 0.2, 0.2)], 0) is None  # starts before a ends
    assert next_on_line([a], 0) is None


def test_targets_number_tokens_by_the_reading_vocabulary() -> None:
    """With a reading vocabulary a token's class is its index there, the background the class
    after them, and a token outside it is ignored (not background)."""
    tok = Pieces({"abcd": [(7, 0, 2), (9, 2, 4)], "xy": [(5, 0, 2)], "zz": [(40, 0, 2)]})
    targets = ReadingTargets(tok, 4, following=True, tokens=[5, 7, 9])
    words = [("abcd", 0.0, 0.0, 0.5, 0.25), ("xy", 0.5, 0.0, 1.0, 0.25), ("zz", 0, 0.5, 1, 0.75)]
    t = targets([words]).view(2, 4, 4)
    assert t[0, 0].tolist() == [1, 2, 0, 0]  # 7 -> 1, 9 -> 2, 5 -> 0
    assert t[1, 0].tolist() == [2, 0, 3, 3]  # next: 9, then xy's 5, then the end of line (3)
    assert (t[0, 1] == 3).all() and (t[0, 2] == IGNORE).all()  # background; zz is not read


def test_targets_use_the_run_tokenizer_pieces() -> None:
    tok = train_bpe_tokenizer(["kalo mira", "kalo tesa"] * 50, vocab_size=300)
    pieces = tok.pieces("kalo")
    assert [tok.decode([i]).strip() for i, _, _ in pieces] and pieces[-1][2] == 4
    t = ReadingTargets(tok, 2)([[("kalo", 0.0, 0.0, 1.0, 0.5)]]).view(2, 2)
    assert t[0, 0] == pieces[0][0] and t[0, 1] == pieces[-1][0]
    assert (t[1] == tok.vocab_size).all()


@pytest.mark.parametrize(
    "bad",
    [
        "not a list",
        [["w", 0.1, 0.1, 0.2]],  # four fields
        [[3, 0.1, 0.1, 0.2, 0.2]],  # the word is not a string
        [["w", 0.3, 0.1, 0.2, 0.2]],  # x0 > x1
        [["w", 0.1, 0.1, 0.2, 1.5]],  # outside the image: pixels, not fractions
    ],
)
def test_bad_words_name_the_record(bad: object) -> None:
    with pytest.raises(DataError, match="train.jsonl:3"):
        parse_words(bad, "train.jsonl:3")
    assert parse_words([["w", 0, 0.1, 0.5, 1]], "x") == [("w", 0.0, 0.1, 0.5, 1.0)]


def test_targets_are_long_and_row_major() -> None:
    tok = Pieces({"a": [(3, 0, 1)]})
    t = ReadingTargets(tok, 3)([[("a", 0.7, 0.0, 0.99, 0.3)]])
    assert t.dtype == torch.long and t.shape == (1, 9)
    assert t[0].tolist().index(3) == 2  # row 0, column 2


def test_pair_records_carry_words_on_image_sides_only(tmp_path: Path) -> None:
    words = [["alpha", 0.1, 0.1, 0.4, 0.2]]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"_id": "d1", "image": "p1.png", "words": words}) + "\n")
    rows = [
        {"query": "alpha", "positive": {"image": "p0.png", "words": words}, "negatives": []},
        {"query": "alpha", "positive": {"doc": "d1"}},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = read_pair_records(path, read_corpus(corpus))
    assert recs[0]["positives"][0]["words"] == [("alpha", 0.1, 0.1, 0.4, 0.2)]
    assert recs[1]["positives"][0]["words"] == [("alpha", 0.1, 0.1, 0.4, 0.2)]  # via the corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "positive": {"text": "t", "words": words}}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl:1.*add 'image'"):
        read_pair_records(bad)
