"""Collate image-text samples into the built-in dual encoder's inputs (`ImageTextCollate`);
an HF embedder's batcher is `vltrain.data.hf_collate.HFCollate`. Both offer the same three calls
(`__call__` for training, `image_batch` and `text_batch` for evaluation and mining) and return
`vltrain.data.batches.ImageTextBatch`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vltrain.data.batches import ImageTextBatch
from vltrain.data.tokenizer import TextTokenizer


class ImageTextCollate:
    """Built-in backbone: stack images, BPE-tokenize texts (and hard negatives); picklable."""

    def __init__(self, tokenizer: TextTokenizer, max_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_len = max_len

    def image_batch(
        self, images: list[Tensor], texts: None = None, instructions: Any = None, role: str = ""
    ) -> tuple[Tensor, None]:
        """(B, 3, S, S); the built-in towers take no instruction and no image+text input."""
        if texts is not None:
            raise ValueError("the built-in dual encoder encodes images or texts, not both")
        return torch.stack(images), None  # (B, 3, S, S)

    def text_batch(
        self, texts: list[str], instructions: Any = None, role: str = ""
    ) -> tuple[Tensor, Tensor]:
        return self.tokenizer.encode_batch(texts, self.max_len)  # (B, T), (B, T)

    def __call__(self, samples: list[dict[str, Any]]) -> ImageTextBatch:
        ids, mask = self.text_batch([s["text"] for s in samples])
        batch: ImageTextBatch = {
            "images": self.image_batch([s["image"] for s in samples])[0],
            "input_ids": ids,
            "attention_mask": mask,
            "index": torch.tensor([s["index"] for s in samples]),
        }
        return add_text_extras(batch, samples, self.text_batch)


def add_text_extras(
    batch: ImageTextBatch, samples: list[dict[str, Any]], text_batch: Any
) -> ImageTextBatch:
    """Add the samples' hard negatives (``neg_ids`` / ``neg_mask``, (M, T), when any has one)
    and second captions (``pair_ids`` / ``pair_mask``, (B, T), when all have one:
    ``objective.caption_contrast``), tokenized by ``text_batch``; returns ``batch``."""
    negs = [n for s in samples for n in s.get("negatives", [])]
    if negs:
        batch["neg_ids"], batch["neg_mask"] = text_batch(negs)
    if samples and all("text2" in s for s in samples):
        batch["pair_ids"], batch["pair_mask"] = text_batch([s["text2"] for s in samples])
    return batch
