"""Reading targets: which token a vision grid cell shows, from the words' boxes on the image.

Part of the synthetic-page reading model, the CPU demonstration model of the page-retrieval
workload (docs/retrieval.md): the built-in towers learn to read the words drawn on the
synthetic pages (`vltrain.data.synth_pages`), so the workload (pair records, image hard
negatives, corpus evaluation, mining) trains and is tested on a CPU. Its parts: the targets
(`vltrain.data.reading`), the readers and the word-pair head (`vltrain.models.word_pairs`) and
the reading loss (`vltrain.objectives.reading`). The reference workload itself fine-tunes a VLM
embedder (``model.kind: vlm``), which needs none of them.

An image side may list the words drawn on it, ``"words": [[text, x0, y0, x1, y1], ...]`` with the
box in fractions of the image (0-1, so any resize keeps them; the synthetic pages write them,
a real screenshot's come from its PDF text layer or an OCR pass). `ReadingTargets` turns a
batch's word lists into one class per grid cell for `vltrain.objectives.reading`: every cell
whose centre lies in a word's box (at least the cell under the box's centre) gets the token of
the word it covers at that height (a word's tokens split its box left to right by their
characters), the other cells the background class, and the cells of an image without words
are ignored (-100). A token's class is its index in the run's reading vocabulary (the token ids
the training pages show, `reading_tokens`, saved beside the tokenizer); the background is the
class after them. With ``following``, each word cell also gets the token that follows on its
line (the word's next token, else the first token of the next word when it starts on the same
line to the right, else the end-of-line class, numbered as the background), which the word-pair
head (`vltrain.models.word_pairs`) reads; other cells are ignored there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from vltrain.data.readers import DataError

#: the target of a cell that takes no part in the loss (an image whose record lists no words)
IGNORE = -100

Word = tuple[str, float, float, float, float]


def parse_words(obj: object, where: str) -> list[Word]:
    """An image side's ``words``: a list of ``[text, x0, y0, x1, y1]`` with 0 <= x0 <= x1 <= 1
    and 0 <= y0 <= y1 <= 1; raises DataError naming `where` otherwise."""
    if not isinstance(obj, list):
        raise DataError(
            f"{where}: 'words' must be a list of [text, x0, y0, x1, y1], got {obj!r:.80}"
        )
    out: list[Word] = []
    for item in obj:
        ok = isinstance(item, list | tuple) and len(item) == 5 and isinstance(item[0], str)
        box = item[1:] if ok else ()
        ok = ok and all(isinstance(v, int | float) and 0.0 <= v <= 1.0 for v in box)
        if not ok or box[0] > box[2] or box[1] > box[3]:
            raise DataError(
                f"{where}: a 'words' entry must be [text, x0, y0, x1, y1] with the box in "
                f"fractions of the image (0 <= x0 <= x1 <= 1, 0 <= y0 <= y1 <= 1), got {item!r:.80}"
            )
        out.append((item[0], *(float(v) for v in box)))  # type: ignore[arg-type]
    return out


def box_cells(box: Sequence[float], grid: int) -> tuple[range, range]:
    """Rows and columns of the `grid` x `grid` cells whose centres lie in `box` (fractions),
    widened to include the cell under the box's centre (a box thinner than a cell)."""
    x0, y0, x1, y1 = (v * grid for v in box)
    cx = min(grid - 1, int((x0 + x1) / 2))
    cy = min(grid - 1, int((y0 + y1) / 2))
    lo_x, hi_x = min(math.ceil(x0 - 0.5), cx), max(math.floor(x1 - 0.5), cx)
    lo_y, hi_y = min(math.ceil(y0 - 0.5), cy), max(math.floor(y1 - 0.5), cy)
    return range(max(0, lo_y), min(grid, hi_y + 1)), range(max(0, lo_x), min(grid, hi_x + 1))


def next_on_line(words: Sequence[Word], k: int) -> Word | None:
    """The word after ``words[k]`` (reading order, as drawn or OCR'd) when it continues its
    line: its vertical centre lies within word k's box, and it starts after word k ends (a
    quarter of word k's width of overlap allowed) by at most two line heights (a word across
    a column gap does not continue the line)."""
    if k + 1 >= len(words):
        return None
    _, x0, y0, x1, y1 = words[k]
    nxt = words[k + 1]
    same_row = y0 <= (nxt[2] + nxt[4]) / 2 <= y1
    gap = nxt[1] - x1
    return nxt if same_row and -0.25 * (x1 - x0) <= gap <= 2 * (y1 - y0) else None


#: the run's reading vocabulary, beside its tokenizer (`<run>/tokenizer/reading_tokens.json`)
READING_TOKENS = "reading_tokens.json"


def reading_tokens(tokenizer: Any, words: Iterable[str]) -> list[int]:
    """The token ids the training pages show (every piece of every listed word), sorted: the
    classes a reader tells apart. A BPE vocabulary holds bytes, merges and specials no page
    shows; on the synthetic pages 400 of 1,081 ids are read, and the readers' and the word-pair
    code's cost scales with the classes."""
    return sorted({i for w in set(words) for i, _, _ in tokenizer.pieces(w)})


def save_reading_tokens(directory: Path, tokens: Sequence[int]) -> None:
    (directory / READING_TOKENS).write_text(json.dumps(list(tokens)) + "\n")


def load_reading_tokens(directory: Path) -> list[int] | None:
    """The saved reading vocabulary, or None when `directory` holds none."""
    path = directory / READING_TOKENS
    return [int(i) for i in json.loads(path.read_text())] if path.is_file() else None


class ReadingTargets:
    """Word lists of a batch's images -> targets (B, grid * grid), row-major like the tower's
    grid tokens; with `following`, (B, 2, grid * grid): the tokens and the next tokens on
    their lines. Picklable (DataLoader workers build the targets beside the images)."""

    def __init__(
        self,
        tokenizer: Any,
        grid: int,
        following: bool = False,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """`tokens`: the reading vocabulary (`reading_tokens`); the class of a token is its
        index there (a token outside it is ignored) and the background the next class. None:
        every id of the tokenizer is its own class."""
        self.tokenizer, self.grid, self.following = tokenizer, grid, following
        self.classes = None if tokens is None else {t: i for i, t in enumerate(tokens)}
        # the background, and the end of a line for the next tokens
        self.background = tokenizer.vocab_size if tokens is None else len(tokens)
        self._pieces: dict[str, list[tuple[int, int, int]]] = {}

    def __call__(self, words: Sequence[Sequence[Word] | None]) -> torch.Tensor:
        g = self.grid
        out = torch.full((len(words), 2, g, g), IGNORE, dtype=torch.long)
        for i, ws in enumerate(words):
            if not ws:
                continue
            out[i, 0] = self.background
            for k, (text, *box) in enumerate(ws):
                after = next_on_line(ws, k)
                first = self._tokens(after[0])[0][0] if after is not None else self.background
                self._place(out[i], text, box, first)
        out = out.view(len(words), 2, g * g)
        return out if self.following else out[:, 0].contiguous()

    def _tokens(self, text: str) -> list[tuple[int, int, int]]:
        """`text`'s pieces with each id replaced by its class (IGNORE: not in the vocabulary)."""
        pieces = self._pieces.get(text)
        if pieces is None:
            pieces = self.tokenizer.pieces(text) or [(0, 0, 1)]
            if self.classes is not None:
                pieces = [(self.classes.get(i, IGNORE), a, b) for i, a, b in pieces]
            self._pieces[text] = pieces
        return pieces

    def _place(self, target: torch.Tensor, text: str, box: list[float], after: int) -> None:
        """Write `text`'s tokens into the cells of `box`, each over its share of the width, and
        into ``target[1]`` the token after each (`after` after the last)."""
        pieces = self._tokens(text)
        n_chars = max(pieces[-1][2], 1)
        rows, cols = box_cells(box, self.grid)
        x0, x1 = box[0] * self.grid, box[2] * self.grid
        for c in cols:
            frac = min(max((c + 0.5 - x0) / max(x1 - x0, 1e-6), 0.0), 1.0 - 1e-6)
            char = frac * n_chars
            j = next((j for j, (_, _, end) in enumerate(pieces) if char < end), len(pieces) - 1)
            nxt = pieces[j + 1][0] if j + 1 < len(pieces) else after
            target[0, rows.start : rows.stop, c] = pieces[j][0]
            target[1, rows.start : rows.stop, c] = nxt
