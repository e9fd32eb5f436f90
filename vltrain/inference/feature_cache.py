"""Target features kept per record: a frozen target's forward computed once, not every epoch.

A drafter step needs the target's hidden states at a few layers for every position of its
sequences. The target is frozen, so a record gets the same features in every epoch; on a CPU
that forward (a 135M target over the whole sequence, its LM head included) costs more than the
drafter's own forward and backward. ``FeatureCache`` computes a record's features the first
time it is met, alone and unpadded (so the cached values do not depend on which batch first
met the record, and a resumed run reads the same features), keeps them with the target's
greedy tokens, and assembles later batches from memory. The logits are not kept (49k floats a
token), so ``drafter.soft_labels`` cannot be combined with it.

Memory: (P + T) x n x W floats per record (SmolLM2, 3 layers: 7 KB a token, ~1.7 MB for a
250-token answer); the features live on the CPU and move to the batch's device when used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vltrain.data.chat import IGNORE_INDEX
from vltrain.inference.spec_targets import Context


def greedy_tokens(logits: Tensor, text_mask: Tensor) -> Tensor:
    """The target's token after each real position (B, T); IGNORE_INDEX after padding."""
    return logits.argmax(-1).masked_fill(~text_mask.bool(), IGNORE_INDEX)


class FeatureCache:
    """Per-record target features (a record = the batch's ``index``), one split's worth."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.rows: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        self.computed = 0  # forwards run (a test counts them)

    def __len__(self) -> int:
        return len(self.rows)

    def _one(self, batch: dict[str, Tensor], i: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(features, positions, valid, greedy) of row i, computed alone at its own length."""
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i : i + 1, :n]
        ones = torch.ones_like(ids)
        if "images" in batch:
            ctx, logits, _ = self.target.features(batch["images"][i : i + 1], ids, ones)
        else:
            ctx, logits, _ = self.target.features(ids, ones)
        self.computed += 1
        return (
            ctx.features[0].cpu(),
            ctx.positions[0].cpu(),
            ctx.valid[0].cpu(),
            greedy_tokens(logits, ones)[0].cpu(),
        )

    def features(self, batch: dict[str, Tensor]) -> tuple[Context, Tensor, int]:
        """(Context (B, P + T, F), greedy (B, T), prefix length P) of a right-padded batch."""
        keys = batch["index"].tolist()
        for i, key in enumerate(keys):
            if key not in self.rows:
                self.rows[key] = self._one(batch, i)
        rows = [self.rows[k] for k in keys]
        b, t = batch["input_ids"].shape
        p = rows[0][0].shape[0] - rows[0][3].shape[0]  # prefix = context rows - text rows
        dev = batch["input_ids"].device
        feats = rows[0][0].new_zeros(b, p + t, rows[0][0].shape[1])
        pos = torch.zeros(b, p + t, dtype=torch.long)
        valid = torch.zeros(b, p + t, dtype=torch.bool)
        greedy = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
        for i, (f, ps, v, g) in enumerate(rows):
            feats[i, : len(f)], pos[i, : len(f)], valid[i, : len(f)] = f, ps, v
            greedy[i, : len(g)] = g
        return Context(feats.to(dev), pos.to(dev), valid.to(dev)), greedy.to(dev), p
