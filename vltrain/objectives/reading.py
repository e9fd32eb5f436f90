"""A dense reading loss: each cell of the image tower's grid classifies the token drawn there.

Contrastive training alone does not teach a small tower to read the words of a page: on the
synthetic pages every full-page run sat at ln(batch) for hundreds of steps (bench/RESULTS.md,
"Page retrieval", rounds 2-3), while the same tower with this loss reads 8-13 px words within a
few hundred steps and retrieval follows (round 4). The targets come from the words' boxes on the
image (`vltrain.data.reading.ReadingTargets`): a token per word cell, a background class for the
rest, cells of images without words ignored. The head is one linear map of the grid tokens
(a 1x1 convolution), trained with the encoder and used by nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.data.reading import IGNORE
from vltrain.models.layers import init_weights

#: weight of the background class: ~90% of a page's cells hold no word, and at weight 1 the
#: head first learns to say "background" everywhere (the reference's setting, round 4)
BACKGROUND_WEIGHT = 0.1


class ReadingLoss(nn.Module):
    """``forward(grid (B, P, W), targets (B, P)) -> (weight * cross-entropy, metrics)``."""

    def __init__(self, width: int, vocab_size: int, weight: float) -> None:
        super().__init__()
        if weight <= 0:
            raise ValueError(f"ReadingLoss: weight must be positive, got {weight}")
        self.weight = weight
        self.head = nn.Linear(width, vocab_size + 1)  # the last class: background
        init_weights(self.head)
        class_weight = torch.ones(vocab_size + 1)
        class_weight[-1] = BACKGROUND_WEIGHT
        self.register_buffer("class_weight", class_weight, persistent=False)

    def forward(self, grid: Tensor, targets: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        if grid.shape[:2] != targets.shape:
            raise ValueError(
                f"ReadingLoss: the tower's grid {tuple(grid.shape[:2])} does not match the "
                f"reading targets {tuple(targets.shape)} (a grid cell per target)"
            )
        logits = self.head(grid.float())  # (B, P, V + 1)
        flat, target = logits.flatten(0, 1), targets.flatten()
        if bool((target >= 0).any()):
            loss = F.cross_entropy(flat, target, weight=self.class_weight, ignore_index=IGNORE)
        else:  # no image of this batch lists its words: zero, but the head stays in the graph
            loss = flat.sum() * 0.0
        words = (target >= 0) & (target < self.head.out_features - 1)  # not ignored, not background
        hit = (flat.argmax(-1) == target) & words
        acc = hit.sum() / words.sum().clamp(min=1)
        return self.weight * loss, {"reading_loss": loss.detach(), "reading_acc": acc.detach()}
