"""The contrastive model: an encoder and its loss in one module, and its embedding forwards.

`ContrastiveModel` holds the encoder (the built-in dual encoder or an HF embedder), the loss
(`vltrain.objectives.contrastive`) and, for `objective.reading`, the reading loss, so DDP sees
one forward and the loss's temperature trains with the encoder. Its forward embeds either kind
of contrastive batch (`vltrain.data.batches`):

- image-caption batches: images, captions, hard-negative texts and second captions; the text
  sets go through one grouped pass (`encode_text_sets`);
- pair batches (`embed_pairs`): query, positive and negative sides, each of any modality and
  one encoder call; the loss sees them as (query, positive, negatives), so an image hard
  negative is one more column of the doc side, gathered across ranks like the positives.

GradCache (`vltrain.objectives.grad_cache`) encodes the same sides (`TEXT_SIDES`, and a pair
batch's `vltrain.data.pairs.ROLES`) in chunks instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.data.batches import ImageTextBatch, PairBatch, length_sorted_chunks
from vltrain.data.pairs import encode_side
from vltrain.models.word_pairs import Reading

#: an image-caption batch's text sides, (ids key, mask key): captions, hard negatives, and
#: second captions (objective.caption_contrast)
TEXT_SIDES = (
    ("input_ids", "attention_mask"),
    ("neg_ids", "neg_mask"),
    ("pair_ids", "pair_mask"),
)


class ContrastiveModel(nn.Module):
    """Encoder + loss in one module, so DDP sees one forward and the loss's temperature trains;
    with `reading` (a `vltrain.objectives.reading.ReadingLoss`), the grid of the positive and
    image-negative pages also learns to read (`objective.reading`). Weights saved when the
    reader lived in the loss (``reading.head.*``) load into the encoder's
    (``encoder.reader.*``)."""

    def __init__(
        self, encoder: nn.Module, loss: nn.Module, reading: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.loss = loss
        self.reading = reading
        self._register_load_state_dict_pre_hook(_reader_moved)

    def embed(self, batch: ImageTextBatch) -> tuple[Tensor, Tensor, Tensor | None]:
        """Unit-norm image (B, E), text (B, E) and hard-negative (M, E) embeddings."""
        return self._embed(batch, second=False)[:3]

    def _embed(
        self, batch: ImageTextBatch, second: bool
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """`embed`'s three and, with `second`, the second captions' (B, E) of
        `objective.caption_contrast`; the texts in one grouped pass (`encode_text_sets`)."""
        img = self.encoder.encode_image(batch["images"])
        sides = TEXT_SIDES if second else TEXT_SIDES[:2]
        present = [(i, m) for i, m in sides if batch.get(i) is not None]
        sets = encode_text_sets(self.encoder, [(batch[i], batch[m]) for i, m in present])
        emb = {i: e for (i, _), e in zip(present, sets, strict=True)}
        return img, emb["input_ids"], emb.get("neg_ids"), emb.get("pair_ids")

    def forward(self, batch: ImageTextBatch | PairBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if is_pair_batch(batch) and self.reading is not None and "reading" in batch:
            q, p, n, read = embed_pairs_reading(self.encoder, batch)
            loss, metrics = self.loss(q, p, n)
            read_loss, read_metrics = self.reading(read, batch["reading"])
            return loss + read_loss, {**metrics, **read_metrics}
        if is_pair_batch(batch):  # query / positive / negatives sides of any modality
            return self.loss(*embed_pairs(self.encoder, batch))
        img, txt, neg, second = self._embed(batch, second=True)
        if second is not None:
            return self.loss(img, txt, neg, pairs=second)
        return self.loss(img, txt, neg)


def _reader_moved(state: dict[str, Any], prefix: str, *_: Any) -> None:
    """``reading.head.*`` (the reader's name before it moved into the encoder) ->
    ``encoder.reader.*``."""
    for name in [k for k in state if k.startswith(prefix + "reading.head.")]:
        state[prefix + "encoder.reader." + name[len(prefix + "reading.head.") :]] = state.pop(name)


def encode_text_sets(encoder: nn.Module, sets: Sequence[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """``encoder.encode_text(ids, mask)`` of each right-padded (ids, mask) set, e.g. a batch's
    captions, second captions and hard negatives, in that order.

    An encoder that ignores trailing padding (``ignores_trailing_padding``) gets all rows in
    one length-sorted pass, in chunks as large as the first set and each cut to its longest
    row (`length_sorted_chunks`): with captions of 8-20 tokens that drops about a third of the
    token positions padding each set to its own longest row computes (the quickstart's three
    sets of 128: text forward + backward 0.17 -> 0.14 s, AMD EPYC). The embeddings are the
    per-set ones up to float rounding. Other encoders, and any while text dropout draws masks
    (``text_dropout_active``: the draws would follow the sorted rows), get one call per set.
    """
    grouped = getattr(encoder, "ignores_trailing_padding", False)
    if len(sets) < 2 or not grouped or getattr(encoder, "text_dropout_active", True):
        return [encoder.encode_text(ids, mask) for ids, mask in sets]
    width = max(ids.shape[1] for ids, _ in sets)

    def widen(t: Tensor) -> Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))  # (B, width), zeros after

    ids = torch.cat([widen(i) for i, _ in sets])  # (N, width)
    mask = torch.cat([widen(m) for _, m in sets])  # (N, width)
    chunks, order = length_sorted_chunks((ids, mask), sets[0][0].shape[0])
    emb = torch.cat([encoder.encode_text(*c) for c in chunks])  # (N, E), sorted rows
    emb = emb[order.argsort()]  # (N, E), the input order
    return list(emb.split([i.shape[0] for i, _ in sets]))


def is_pair_batch(batch: ImageTextBatch | PairBatch) -> bool:
    """True for a pair batch (query/positive records), False for an image-caption batch."""
    return "query" in batch


def embed_pairs(encoder: nn.Module, batch: PairBatch) -> tuple[Tensor, Tensor, Tensor | None]:
    """Query (B, E), positive (B, E) and hard-negative (M, E) embeddings of a pair batch."""
    q, p = _embed_side(encoder, batch, "query"), _embed_side(encoder, batch, "positive")
    return q, p, _embed_side(encoder, batch, "negatives")


def embed_pairs_reading(
    encoder: nn.Module, batch: PairBatch
) -> tuple[Tensor, Tensor, Tensor | None, Reading]:
    """`embed_pairs` with what the tower reads on the positive images and then on the image
    negatives (each side its own pass, as `embed_pairs` encodes them), for `objective.reading`."""
    q = _embed_side(encoder, batch, "query")
    p, read = encoder.encode_image_read(batch["positive"]["inputs"])
    side = batch.get("negatives")
    if side is None or side["modality"] != "image":
        return q, p, _embed_side(encoder, batch, "negatives"), read
    n, read_n = encoder.encode_image_read(side["inputs"])
    return q, p, n, read.cat(read_n)


def _embed_side(encoder: nn.Module, batch: PairBatch, name: str) -> Tensor | None:
    """One side of a pair batch through `encode_side` (None: the batch has no such side)."""
    side = batch.get(name)
    return None if side is None else encode_side(encoder, side["modality"], side["inputs"])
