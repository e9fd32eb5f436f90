"""Reading targets: which token a vision grid cell shows, from the words' boxes on the image.

An image side may list the words drawn on it, ``"words": [[text, x0, y0, x1, y1], ...]`` with the
box in fractions of the image (0-1, so any resize keeps them; the synthetic pages write them,
a real screenshot's come from its PDF text layer or an OCR pass). `ReadingTargets` turns a
batch's word lists into one class per grid cell for `vltrain.objectives.reading`: every cell
whose centre lies in a word's box (at least the cell under the box's centre) gets the token of
the word it covers at that height (a word's tokens split its box left to right by their
characters), the other cells the background class (the tokenizer's vocabulary size), and the
cells of an image without words are ignored (-100).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from vltrain.data.records import DataError

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


class ReadingTargets:
    """Word lists of a batch's images -> targets (B, grid * grid), row-major like the tower's
    grid tokens. Picklable (DataLoader workers build the targets beside the images)."""

    def __init__(self, tokenizer: Any, grid: int) -> None:
        self.tokenizer, self.grid = tokenizer, grid
        self.background = tokenizer.vocab_size
        self._pieces: dict[str, list[tuple[int, int, int]]] = {}

    def __call__(self, words: Sequence[Sequence[Word] | None]) -> torch.Tensor:
        g = self.grid
        out = torch.full((len(words), g, g), IGNORE, dtype=torch.long)
        for i, ws in enumerate(words):
            if not ws:
                continue
            out[i] = self.background
            for text, *box in ws:
                self._place(out[i], text, box)
        return out.view(len(words), g * g)

    def _place(self, target: torch.Tensor, text: str, box: list[float]) -> None:
        """Write `text`'s tokens into the cells of `box`, each over its share of the width."""
        pieces = self._pieces.get(text)
        if pieces is None:
            pieces = self._pieces[text] = self.tokenizer.pieces(text) or [(0, 0, 1)]
        n_chars = max(pieces[-1][2], 1)
        rows, cols = box_cells(box, self.grid)
        x0, x1 = box[0] * self.grid, box[2] * self.grid
        for c in cols:
            frac = min(max((c + 0.5 - x0) / max(x1 - x0, 1e-6), 0.0), 1.0 - 1e-6)
            char = frac * n_chars
            token = next((t for t, _, end in pieces if char < end), pieces[-1][0])
            target[rows.start : rows.stop, c] = token
