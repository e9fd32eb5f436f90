"""What a page tower reads, and a word-pair code both towers share (`model.head: word_pairs`).

Part of the synthetic-page reading model, the CPU demonstration model of the page-retrieval
workload (docs/retrieval.md): the built-in towers learn to read the words drawn on the
synthetic pages (`vltrain.data.synth_pages`), so the workload (pair records, image hard
negatives, corpus evaluation, mining) trains and is tested on a CPU. Its parts: the targets
(`vltrain.data.reading`), the readers and the word-pair head (`vltrain.models.word_pairs`) and
the reading loss (`vltrain.objectives.reading`). The reference workload itself fine-tunes a VLM
embedder (``model.kind: vlm``), which needs none of them.

`Reading` is the image tower's reading of its grid: a token per cell (`objective.reading` trains
it from the records' word boxes) and, with the word-pair head, the token that follows on the
cell's line. The page embedding of a max head is a bag of words: it keeps which words a page
has, not which sit together, and a two-word query's words both occur on ~7 of 10,000 synthetic
pages, so even a perfect reader places about 1 query in 7 first (bench/RESULTS.md, "Page
retrieval", rounds 4-7). `WordPairHead` keeps the pairs instead: a (token, next token) pair has
the code relu(F[token] + S[next] + c), D wide, with F, S and c shared by both towers. A query is
the max over the codes of its adjacent tokens; a page is the max, over its `keep` most
word-like cells, of the code of each cell's read token and read next token (soft: the readers'
probabilities through F and S). One vector per side, so retrieval stays the exact top-k kernel.

That code overlaps the code of a pair sharing one token (cosine ~0.45 after training), so a
page showing one query word in its large title rivals the page holding the query's body
phrase. `pair_code="product"` binds the two tokens instead: F[token] * S[next] elementwise,
signed, and a side is the sum of its pairs' (or kept cells') codes. Pairs sharing one token are
then near orthogonal, and a page's score for a query is about the number of its cells that read
the query's pair (bench/RESULTS.md, "Page retrieval", round 9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.models.layers import init_weights

#: cells of a page coded: the most word-like (a synthetic 96-px page holds ~12 words of 2-5
#: cells; coding every cell of the 12x12 grid costs ~3x the CNN's step)
KEEP_CELLS = 24
#: channels of the row convolution that lets a cell see the next word on its line
LINE_CHANNELS = 128
#: the row convolution's width in cells: +-2 cells (+-16 px on a 96-px page in 8-px cells)
LINE_SPAN = 5
#: how a pair's two tokens make its code (`model.pair_code`): "add", relu(F[a] + S[b] + c) with
#: a max over pairs and cells; "product", F[a] * S[b] (elementwise) with a sum over them
PAIR_CODES = ("add", "product")


@dataclass
class Reading:
    """The image tower's reading of its grid, for `vltrain.objectives.reading`."""

    tokens: Tensor
    """(B, P, V + 1) logits: the token drawn at each cell; the last class is background."""
    context: Tensor | None = None
    """(B, P, C): what the next-token reader reads (the word-pair head only)."""
    read_next: nn.Module | None = None
    """context rows (N, C) -> logits (N, V + 1) of the next token on the line; the last class
    is the end of the line (the word-pair head only)."""

    def cat(self, other: Reading) -> Reading:
        """This reading's images, then `other`'s (the same tower's)."""
        if (self.context is None) != (other.context is None):
            raise ValueError("Reading.cat: one reading has next-token context, the other not")
        context = None if self.context is None else torch.cat([self.context, other.context])
        return Reading(torch.cat([self.tokens, other.tokens]), context, self.read_next)

    def following(self, cells: Tensor) -> Tensor:
        """Next-token logits (N, V + 1) of the cells where `cells` (B, P) is true."""
        if self.context is None or self.read_next is None:
            raise ValueError("Reading.following: this tower reads no next tokens")
        return self.read_next(self.context.flatten(0, 1)[cells.flatten()])


class WordPairHead(nn.Module):
    """``page(grid (B, P, W)) -> (code (B, D), Reading)`` and ``text(ids, mask) -> (B, D)``.

    The readers tell `classes` tokens apart (the run's reading vocabulary) plus one: background
    for the token reader, the end of a line for the next-token reader. `token_class` maps each
    tokenizer id to its class, or to ``classes + 1`` for a token no page shows (a text can hold
    it; it has its own code rows, which only texts train). Ids below `specials` are not tokens
    of a text. The grid is `side` x `side` cells, row-major."""

    def __init__(
        self,
        width: int,
        classes: int,
        dim: int,
        side: int,
        *,
        token_class: Tensor,
        specials: int,
        norm: nn.Module,
        keep: int = KEEP_CELLS,
        pair_code: str = "add",
    ) -> None:
        super().__init__()
        if min(width, classes, dim, side, keep) <= 0 or pair_code not in PAIR_CODES:
            raise ValueError(
                f"WordPairHead: width, classes, dim, side and keep must be positive and "
                f"pair_code one of {PAIR_CODES}, got {(width, classes, dim, side, keep)}, "
                f"{pair_code!r}"
            )
        checkable = token_class.numel() and not token_class.is_meta  # (FLOP counts: meta)
        lo, hi = (int(token_class.min()), int(token_class.max())) if checkable else (0, 0)
        if token_class.ndim != 1 or lo < 0 or hi > classes + 1:
            raise ValueError(
                f"WordPairHead: token_class must map every tokenizer id to 0..{classes + 1}"
            )
        self.side, self.keep, self.specials, self.end = side, keep, specials, classes
        self.pair_code = pair_code
        self.register_buffer("token_class", token_class.long(), persistent=False)
        self.read = nn.Linear(width, classes + 1)  # the last class: background
        self.line = nn.Sequential(
            nn.Conv2d(
                width, LINE_CHANNELS, (1, LINE_SPAN), padding=(0, LINE_SPAN // 2), bias=False
            ),
            norm,
            nn.GELU(),
        )
        self.read_next = nn.Linear(width + LINE_CHANNELS, classes + 1)  # last: end of line
        init_weights(self.read)
        init_weights(self.read_next)
        # unit-scale rows: a pair's code starts as a random projection of the two tokens, a
        # little below zero on average so relu keeps about a third of it; the last row: a
        # token no page shows
        self.first = nn.Parameter(torch.randn(classes + 2, dim) / math.sqrt(dim))
        self.second = nn.Parameter(torch.randn(classes + 2, dim) / math.sqrt(dim))
        # a product code needs no offset: it is signed, and pairs that share one token are
        # near orthogonal (E[F[a] * S[b] . F[a] * S[b']] = 0 for independent rows S[b], S[b'])
        self.bias = (
            nn.Parameter(torch.full((dim,), -0.5 / math.sqrt(dim))) if pair_code == "add" else None
        )

    def reading(self, grid: Tensor) -> Reading:
        """The cells' token logits and the context the next-token reader reads."""
        b, p, w = grid.shape
        if p != self.side * self.side:
            raise ValueError(
                f"WordPairHead: a grid of {p} cells is not the {self.side}x{self.side} it was "
                "built for"
            )
        tokens = self.read(grid)  # (B, P, C + 1)
        rows = grid.transpose(1, 2).reshape(b, w, self.side, self.side)
        line = self.line(rows).flatten(2).transpose(1, 2)  # (B, P, LINE_CHANNELS)
        return Reading(tokens, torch.cat([grid, line.to(grid.dtype)], -1), self.read_next)

    def page(self, grid: Tensor) -> tuple[Tensor, Reading]:
        """The page's code (B, D) and its `Reading`."""
        read = self.reading(grid)
        return self.code(read), read

    @torch.no_grad()
    def kept_cells(self, logits: Tensor) -> Tensor:
        """(B, K) indices of the `keep` cells least likely background, from token logits
        (B, P, C + 1): the cells a page's code is made of."""
        background = logits[..., -1] - logits.logsumexp(-1)  # (B, P)
        return background.topk(min(self.keep, logits.shape[1]), dim=1, largest=False).indices

    def code(self, read: Reading) -> Tensor:
        """The max (a sum for the product code), over the `keep` cells least likely
        background, of the code of each cell's read token and read next token (both soft: the
        readers' probabilities)."""
        cur, nxt = self.kept_logits(read)
        return self.code_of(cur.softmax(-1), nxt.softmax(-1))

    def kept_logits(self, read: Reading) -> tuple[Tensor, Tensor]:
        """Token and next-token logits (B, K, C + 1), fp32, of the cells `kept_cells` picks."""
        logits = read.tokens.float()
        keep = self.kept_cells(logits)
        if read.context is None:
            raise ValueError("WordPairHead.code: the reading has no next-token context")
        cur = logits.gather(1, keep[..., None].expand(-1, -1, logits.shape[-1]))
        ctx = read.context.gather(1, keep[..., None].expand(-1, -1, read.context.shape[-1]))
        return cur, self.read_next(ctx).float()

    def code_of(self, cur: Tensor, nxt: Tensor) -> Tensor:
        """A page's code (B, D) from its kept cells' token and next-token probabilities."""
        first, second = (rows[:-1] for rows in self.rows())  # a page shows no unread token
        return self.pool(self.combine(cur @ first, nxt @ second), 1)

    def rows(self) -> tuple[Tensor, Tensor]:
        """The code rows F and S of every class. The product code centres each over the classes
        a page shows: a component every S row shares would make F[a] * S[b] and F[a] * S[x]
        alike (cosine 0.10 after training; centring the trained rows alone placed 0.05 more
        queries first, bench/RESULTS.md, "Page retrieval", round 9)."""
        if self.pair_code == "add":
            return self.first, self.second
        first, second = self.first, self.second
        return first - first[:-1].mean(0, keepdim=True), second - second[:-1].mean(0, keepdim=True)

    def combine(self, first: Tensor, second: Tensor) -> Tensor:
        """The code of pairs whose tokens' rows are `first` and `second` (..., D)."""
        if self.pair_code == "product":
            return first * second
        assert self.bias is not None
        return F.relu(first + second + self.bias)

    def pool(self, codes: Tensor, dim: int) -> Tensor:
        """Codes of a side's pairs (or cells) -> the side's code: a max of the relu codes
        (they are >= 0, so a zero row changes nothing), a sum of the product codes."""
        return codes.amax(dim) if self.pair_code == "add" else codes.sum(dim)

    def text(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The max (a sum for the product code) over the codes of adjacent token pairs (B, D);
        a text of one token pairs it with the end of a line; specials and padding take no
        part."""
        real = input_ids >= self.specials
        if attention_mask is not None:
            real &= attention_mask.bool()
        # one column more: a last real token (no eos after it) still has a right neighbour
        input_ids = F.pad(input_ids, (0, 1), value=0)
        real = F.pad(real, (0, 1), value=False)
        alone = real.sum(1, keepdim=True) == 1  # (B, 1)
        cls = self.token_class[input_ids]  # (B, T)
        nxt = torch.where(real[:, 1:], cls[:, 1:], self.end)
        valid = real[:, :-1] & (real[:, 1:] | alone)  # (B, T - 1)
        first, second = self.rows()
        code = self.combine(first[cls[:, :-1]], second[nxt])
        return self.pool(code * valid[..., None], 1)  # a zero row changes no max and no sum
