"""A dense reading loss: each cell of the image tower's grid classifies the token drawn there.

Part of the synthetic-page reading model, the CPU demonstration model of the page-retrieval
workload (docs/retrieval.md): the built-in towers learn to read the words drawn on the
synthetic pages (`vltrain.data.synth_pages`), so the workload (pair records, image hard
negatives, corpus evaluation, mining) trains and is tested on a CPU. Its parts: the targets
(`vltrain.data.reading`), the readers and the word-pair head (`vltrain.models.word_pairs`) and
the reading loss (`vltrain.objectives.reading`). The reference workload itself fine-tunes a VLM
embedder (``model.kind: vlm``), which needs none of them.

Contrastive training alone does not teach a small tower to read the words of a page: on the
synthetic pages every full-page run sat at ln(batch) for hundreds of steps (bench/RESULTS.md,
"Page retrieval", rounds 2-3), while the same tower with this loss reads 8-13 px words within a
few hundred steps and retrieval follows (round 4). The targets come from the words' boxes on the
image (`vltrain.data.reading.ReadingTargets`): a token per word cell, a background class for the
rest, cells of images without words ignored. The classifier is the encoder's (its `Reading`: a
1x1 map of the grid tokens, or the word-pair head's readers, which also name the next token on
each word cell's line; that term is added with the same weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.data.reading import IGNORE
from vltrain.models.word_pairs import Reading

#: weight of the background class: ~90% of a page's cells hold no word, and at weight 1 the
#: head first learns to say "background" everywhere (the reference's setting, round 4)
BACKGROUND_WEIGHT = 0.1


class ReadingLoss(nn.Module):
    """``forward(Reading, targets (B, P) or (B, 2, P)) -> (weight * cross-entropy, metrics)``;
    with next-token targets (B, 2, P) the reading must name them too."""

    def __init__(self, vocab_size: int, weight: float) -> None:
        super().__init__()
        if weight <= 0:
            raise ValueError(f"ReadingLoss: weight must be positive, got {weight}")
        self.weight, self.classes = weight, vocab_size + 1  # the last class: background
        class_weight = torch.ones(vocab_size + 1)
        class_weight[-1] = BACKGROUND_WEIGHT
        self.register_buffer("class_weight", class_weight, persistent=False)

    def forward(self, read: Reading, targets: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        tokens, following = (targets[:, 0], targets[:, 1]) if targets.ndim == 3 else (targets, None)
        logits = read.tokens
        if logits.shape[:2] != tokens.shape or logits.shape[-1] != self.classes:
            raise ValueError(
                f"ReadingLoss: the tower reads {tuple(logits.shape)} (images, cells, classes) "
                f"but the targets are {tuple(tokens.shape)} over {self.classes} classes"
            )
        flat, target = logits.flatten(0, 1).float(), tokens.flatten()
        if bool((target >= 0).any()):
            loss = F.cross_entropy(flat, target, weight=self.class_weight, ignore_index=IGNORE)
        else:  # no image of this batch lists its words: zero, but the head stays in the graph
            loss = flat.sum() * 0.0
        words = (target >= 0) & (target < self.classes - 1)  # not ignored, not background
        hit = (flat.argmax(-1) == target) & words
        metrics = {"reading_acc": hit.sum() / words.sum().clamp(min=1)}
        if following is not None:
            cells = following >= 0
            nxt = read.following(cells).float()  # (N, V + 1): only the word cells
            want = following[cells]
            if want.numel():
                loss = loss + F.cross_entropy(nxt, want)
                metrics["reading_next_acc"] = (nxt.argmax(-1) == want).float().mean()
            else:
                loss = loss + nxt.sum() * 0.0
                metrics["reading_next_acc"] = nxt.new_zeros(())
        metrics = {k: v.detach() for k, v in metrics.items()}
        return self.weight * loss, {"reading_loss": loss.detach(), **metrics}
