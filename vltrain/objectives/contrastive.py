"""Contrastive losses over image/text embeddings, with negatives gathered across ranks.

Every rank gathers all ranks' features (with gradient) and computes the loss of the whole
global batch; `all_gather_with_grad` makes the resulting DDP-averaged gradient equal to the
single-process gradient of that loss. Hard-negative texts join the text side as extra columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.engine import distributed as D


@dataclass
class Features:
    """Global (all-rank) features of one step."""

    image: Tensor  # (N, E)
    text: Tensor  # (N, E) positive text of each image
    negatives: Tensor | None  # (M, E) hard-negative texts, any owner


def gather_features(image: Tensor, text: Tensor, negatives: Tensor | None,
                    gather: bool) -> Features:
    """The one place losses get features from other ranks (with gradient)."""
    if not gather:
        return Features(image, text, negatives)
    image, _ = D.all_gather_with_grad(image)
    text, _ = D.all_gather_with_grad(text)
    if negatives is not None:
        negatives, _ = D.all_gather_with_grad(negatives)
    return Features(image, text, negatives)


class InfoNCELoss(nn.Module):
    """CLIP's symmetric InfoNCE with a learnable, clamped temperature.

    image->text: each image against every text of the global batch plus every hard negative.
    text->image: each text against every image (negatives are texts, so they add nothing here).
    """

    def __init__(self, temperature: float = 0.07, learn_temperature: bool = True,
                 max_logit_scale: float = 100.0, symmetric: bool = True,
                 label_smoothing: float = 0.0, gather: bool = True) -> None:
        super().__init__()
        init = torch.tensor(math.log(1.0 / temperature))
        if learn_temperature:
            self.logit_scale = nn.Parameter(init)
        else:
            self.register_buffer("logit_scale", init)
        self.max_log_scale = math.log(max_logit_scale)
        self.symmetric = symmetric
        self.label_smoothing = label_smoothing
        self.gather = gather

    def no_weight_decay(self) -> list[str]:
        return ["logit_scale"]

    def scale(self) -> Tensor:
        return self.logit_scale.clamp(max=self.max_log_scale).exp()

    def forward(self, image: Tensor, text: Tensor,
                negatives: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Unit-norm embeddings (B, E) per rank -> (loss, metrics) of the global batch."""
        f = gather_features(image, text, negatives, self.gather)
        return self.loss_from_features(f)

    def loss_from_features(self, f: Features) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of already-gathered features (also used by GradCache)."""
        scale = self.scale()
        n = f.image.shape[0]
        candidates = f.text if f.negatives is None else torch.cat([f.text, f.negatives])
        logits_i2t = scale * f.image.float() @ candidates.float().t()  # (N, N + M)
        labels = torch.arange(n, device=logits_i2t.device)
        loss_i2t = F.cross_entropy(logits_i2t, labels, label_smoothing=self.label_smoothing)
        metrics = {"acc_i2t": (logits_i2t.argmax(1) == labels).float().mean().detach()}
        loss = loss_i2t
        if self.symmetric:
            logits_t2i = logits_i2t[:, :n].t()  # (N, N)
            loss_t2i = F.cross_entropy(logits_t2i, labels, label_smoothing=self.label_smoothing)
            metrics["acc_t2i"] = (logits_t2i.argmax(1) == labels).float().mean().detach()
            loss = 0.5 * (loss_i2t + loss_t2i)
        metrics["logit_scale"] = scale.detach()
        return loss, metrics


LOSSES: dict[str, type[nn.Module]] = {"infonce": InfoNCELoss}


def build_loss(name: str, **kwargs: object) -> nn.Module:
    """A contrastive loss by registry key."""
    if name not in LOSSES:
        raise KeyError(f"unknown contrastive loss '{name}'; known: {sorted(LOSSES)}")
    return LOSSES[name](**kwargs)
