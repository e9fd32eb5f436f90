"""Contrastive losses over image/text embeddings, with negatives gathered across ranks.

Every rank gathers all ranks' features (with gradient) and computes the loss of the whole
global batch; `all_gather_with_grad` makes the resulting DDP-averaged gradient equal to the
single-process gradient of that loss. Hard-negative texts join the text side as extra columns.

Losses are picked by registry key (`LOSSES`): ``infonce`` (CLIP), ``siglip`` (sigmoid) and
``qwen3vl`` (Qwen3-VL-Embedding's masked multi-term InfoNCE, vltrain.objectives.qwen3vl). All
compute their logits in fp32 with autocast off: a bf16 logit at scale 100 is off by ~0.5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.core import distributed
from vltrain.objectives.chance import infonce_chance, siglip_chance
from vltrain.objectives.qwen3vl import DUPLICATE_COSINE, TERMS, qwen3vl_loss


@dataclass
class Features:
    """Global (all-rank) features of one step."""

    image: Tensor  # (N, E)
    text: Tensor  # (N, E) positive text of each image
    negatives: Tensor | None  # (M, E) hard-negative texts, any owner
    pairs: Tensor | None = None  # (N, E) a second caption of each image (caption_contrast)


def gather_features(
    image: Tensor,
    text: Tensor,
    negatives: Tensor | None,
    gather: bool,
    pairs: Tensor | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> Features:
    """The one place losses get features from other ranks (with gradient), as open_clip's
    ``gather_features``: `rank` and `world_size` are explicit; with one process, or `gather`
    off, the local features come back as they are.

    Every rank takes part in every gather, also a rank without hard negatives this step (it
    contributes zero rows, taken from `image` so the gather's backward all-reduce runs on every
    rank alike); `negatives` comes back None only when no rank has any. `pairs` (second
    captions) is gathered when given; every rank gives it or none does (a config option).
    """
    if not gather or world_size == 1:
        return Features(image, text, negatives, pairs)
    if world_size != distributed.world_size() or rank != distributed.rank():
        raise ValueError(
            f"gather_features: rank {rank} of {world_size} is not this process "
            f"(rank {distributed.rank()} of {distributed.world_size()})"
        )
    image_all, _ = distributed.all_gather_with_grad(image)
    text_all, _ = distributed.all_gather_with_grad(text)
    local_neg = image[:0] if negatives is None else negatives  # (0, E) keeps the graph
    neg_all, _ = distributed.all_gather_with_grad(local_neg)
    pairs_all = None if pairs is None else distributed.all_gather_with_grad(pairs)[0]
    return Features(image_all, text_all, neg_all if neg_all.shape[0] else None, pairs_all)


def init_temperature(
    loss: nn.Module, temperature: float, learn: bool, max_logit_scale: float
) -> None:
    """Give a softmax loss its ``logit_scale`` = log(1 / temperature) (a parameter when
    `learn`, else a buffer) and the clamp ``max_log_scale`` its ``scale()`` applies."""
    init = torch.tensor(math.log(1.0 / temperature))
    if learn:
        loss.logit_scale = nn.Parameter(init)
    else:
        loss.register_buffer("logit_scale", init)
    loss.max_log_scale = math.log(max_logit_scale)


def process_group(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size) a loss gathers over: as given, else this process's."""
    return (
        distributed.rank() if rank is None else rank,
        distributed.world_size() if world_size is None else world_size,
    )


def caption_contrast_loss(f: Features, scale: Tensor) -> Tensor:
    """Caption-caption InfoNCE (``objective.caption_contrast``), symmetric: each image's
    caption picks the same image's second caption among all N second captions and the M hard
    negatives, and each second caption picks the caption among the N captions and the same M
    negatives. Two wordings of one scene must meet and a hard negative (e.g. the relation
    inverted) must stay apart, a signal the text tower gets without the image tower's help.
    fp32, at the image-text loss's scale. Chance: ln(N + M)."""
    assert f.pairs is not None
    text, pairs = f.text.float(), f.pairs.float()
    labels = torch.arange(text.shape[0], device=text.device)
    negs = None if f.negatives is None else f.negatives.float()
    fwd = pairs if negs is None else torch.cat([pairs, negs])  # (N + M, E)
    bwd = text if negs is None else torch.cat([text, negs])
    loss = F.cross_entropy(scale * text @ fwd.t(), labels)
    return 0.5 * (loss + F.cross_entropy(scale * pairs @ bwd.t(), labels))


def _no_autocast(t: Tensor) -> Any:
    return torch.autocast(device_type=t.device.type, enabled=False)


def _candidates(f: Features) -> Tensor:
    """Text-side columns: the N positives, then the M hard negatives. (N + M, E) fp32."""
    cols = f.text if f.negatives is None else torch.cat([f.text, f.negatives.to(f.text.dtype)])
    return cols.float()


def prefix_features(f: Features, dim: int) -> Features:
    """Every embedding of `f` cut to its first `dim` features and re-normalised (a Matryoshka
    prefix, as `VLMEmbedder.truncate`)."""

    def cut(t: Tensor | None) -> Tensor | None:
        return None if t is None else F.normalize(t[:, :dim], dim=-1)

    return Features(cut(f.image), cut(f.text), cut(f.negatives), cut(f.pairs))  # type: ignore[arg-type]


def matryoshka_loss(
    loss_fn: Any, f: Features, dims: tuple[int, ...]
) -> tuple[Tensor, dict[str, Tensor]]:
    """Matryoshka representation learning (Kusupati et al. 2022): the mean of `loss_fn` over
    the full embeddings and each prefix in `dims` (sentence-transformers' MatryoshkaLoss sums
    them: the same gradient direction, a (len(dims) + 1)-fold scale); the full width's metrics,
    plus ``loss_d<dim>`` per prefix. Without `dims`, `loss_fn(f)`."""
    loss, metrics = loss_fn(f)
    if not dims:
        return loss, metrics
    full = loss
    for dim in dims:
        part, _ = loss_fn(prefix_features(f, dim))
        metrics[f"loss_d{dim}"] = part.detach()
        loss = loss + part
    metrics["loss_full"] = full.detach()
    return loss / (len(dims) + 1), metrics


class InfoNCELoss(nn.Module):
    """CLIP's symmetric InfoNCE with a learnable, clamped temperature.

    image->text: each image against every text of the global batch plus every hard negative.
    text->image: each text against every image (negatives are texts, so they add nothing here).
    """

    def __init__(
        self,
        temperature: float = 0.07,
        learn_temperature: bool = True,
        max_logit_scale: float = 100.0,
        symmetric: bool = True,
        label_smoothing: float = 0.0,
        gather: bool = True,
        caption_contrast: float = 0.0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """`rank`/`world_size`: the process group the features are gathered over (default:
        this process's, read at construction)."""
        super().__init__()
        if caption_contrast < 0:
            raise ValueError(f"caption_contrast must be >= 0, got {caption_contrast}")
        init_temperature(self, temperature, learn_temperature, max_logit_scale)
        self.symmetric = symmetric
        self.label_smoothing = label_smoothing
        self.gather = gather
        self.caption_contrast = caption_contrast
        self.rank, self.world_size = process_group(rank, world_size)
        self.matryoshka_dims: tuple[int, ...] = ()  # prefixes trained too (`matryoshka_loss`)

    @classmethod
    def from_config(cls, o: Any) -> InfoNCELoss:
        """Build from an `ObjectiveConfig`."""
        return cls(
            temperature=o.temperature,
            learn_temperature=o.learn_temperature,
            max_logit_scale=o.max_logit_scale,
            symmetric=o.symmetric,
            label_smoothing=o.label_smoothing,
            gather=o.gather,
            caption_contrast=o.caption_contrast,
        )

    def no_weight_decay(self) -> list[str]:
        return ["logit_scale"]

    def scale(self) -> Tensor:
        return self.logit_scale.clamp(max=self.max_log_scale).exp()

    def forward(
        self,
        image: Tensor,
        text: Tensor,
        negatives: Tensor | None = None,
        pairs: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Unit-norm embeddings (B, E) per rank -> (loss, metrics) of the global batch;
        `pairs` (B, E): second captions, for the caption-caption term (training batches)."""
        if not self.caption_contrast:
            pairs = None
        f = gather_features(
            image, text, negatives, self.gather, pairs, rank=self.rank, world_size=self.world_size
        )
        return matryoshka_loss(self.loss_from_features, f, self.matryoshka_dims)

    def loss_from_features(self, f: Features) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of already-gathered features (also used by GradCache)."""
        with _no_autocast(f.image):
            scale = self.scale()
            n = f.image.shape[0]
            logits_i2t = scale * f.image.float() @ _candidates(f).t()  # (N, N + M)
            labels = torch.arange(n, device=logits_i2t.device)
            loss = F.cross_entropy(logits_i2t, labels, label_smoothing=self.label_smoothing)
            metrics = {"acc_i2t": (logits_i2t.argmax(1) == labels).float().mean().detach()}
            if self.symmetric:
                logits_t2i = logits_i2t[:, :n].t()  # (N, N)
                loss_t2i = F.cross_entropy(logits_t2i, labels, label_smoothing=self.label_smoothing)
                metrics["acc_t2i"] = (logits_t2i.argmax(1) == labels).float().mean().detach()
                loss = 0.5 * (loss + loss_t2i)
            chance = infonce_chance(n, logits_i2t.shape[1] - n, self.symmetric)
            if f.pairs is not None and self.caption_contrast:
                caption = caption_contrast_loss(f, scale)
                loss = loss + self.caption_contrast * caption
                metrics["caption_loss"] = caption.detach()
                chance += self.caption_contrast * math.log(logits_i2t.shape[1])
        metrics["logit_scale"] = scale.detach()
        # the doctor's `contrastive_chance` check compares the loss with this (global batch)
        metrics["chance_loss"] = chance
        return loss, metrics


class SigLIPLoss(nn.Module):
    """SigLIP's pairwise sigmoid loss (Zhai et al. 2023) with learnable scale t and bias b.

    ``loss = -sum_ij log sigmoid(z_ij * (t * x_i . y_j + b)) / N`` over the global batch (N
    images, gathered from all ranks), z_ij = +1 on the diagonal and -1 elsewhere. Hard negatives
    are extra negative pairs: every image against every hard-negative text (z = -1), the same
    columns InfoNCE adds; the normaliser stays N (the paper's per-image sum). A hard negative of
    image i is almost surely also a negative of image j, so nothing is lost by pairing it with
    all images, and no per-sample ownership has to travel with the batch.
    """

    def __init__(
        self,
        init_scale: float = 10.0,
        init_bias: float = -10.0,
        learn_temperature: bool = True,
        max_logit_scale: float = 100.0,
        gather: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """`rank`/`world_size`: as for `InfoNCELoss`."""
        super().__init__()
        if init_scale <= 0:
            raise ValueError(f"SigLIP init_scale must be > 0, got {init_scale}")
        init = torch.tensor(math.log(init_scale))
        if learn_temperature:
            self.logit_scale = nn.Parameter(init)
        else:
            self.register_buffer("logit_scale", init)
        self.logit_bias = nn.Parameter(torch.tensor(float(init_bias)))
        self.max_log_scale = math.log(max_logit_scale)
        self.gather = gather
        self.rank, self.world_size = process_group(rank, world_size)
        self.matryoshka_dims: tuple[int, ...] = ()  # prefixes trained too (`matryoshka_loss`)

    @classmethod
    def from_config(cls, o: Any) -> SigLIPLoss:
        """Build from an `ObjectiveConfig` (temperature/symmetric/label_smoothing unused)."""
        return cls(
            init_scale=o.siglip_init_scale,
            init_bias=o.siglip_init_bias,
            learn_temperature=o.learn_temperature,
            max_logit_scale=o.max_logit_scale,
            gather=o.gather,
        )

    def no_weight_decay(self) -> list[str]:
        return ["logit_scale", "logit_bias"]

    def scale(self) -> Tensor:
        return self.logit_scale.clamp(max=self.max_log_scale).exp()

    def forward(
        self, image: Tensor, text: Tensor, negatives: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Unit-norm embeddings (B, E) per rank -> (loss, metrics) of the global batch."""
        f = gather_features(
            image, text, negatives, self.gather, rank=self.rank, world_size=self.world_size
        )
        return matryoshka_loss(self.loss_from_features, f, self.matryoshka_dims)

    def loss_from_features(self, f: Features) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of already-gathered features (also used by GradCache)."""
        with _no_autocast(f.image):
            scale, bias = self.scale(), self.logit_bias.float()
            n = f.image.shape[0]
            logits = scale * f.image.float() @ _candidates(f).t() + bias  # (N, N + M)
            z = -torch.ones_like(logits)
            z[:, :n].fill_diagonal_(1.0)
            loss = -F.logsigmoid(z * logits).sum() / n
            labels = torch.arange(n, device=logits.device)
            metrics = {
                "acc_i2t": (logits.argmax(1) == labels).float().mean().detach(),
                "acc_t2i": (logits[:, :n].argmax(0) == labels).float().mean().detach(),
            }
        metrics["logit_scale"] = scale.detach()
        metrics["logit_bias"] = bias.detach()
        metrics["chance_loss"] = siglip_chance(n, logits.shape[1] - n)
        return loss, metrics


class Qwen3VLLoss(nn.Module):
    """Qwen3-VL-Embedding's loss (`vltrain.objectives.qwen3vl`): query i (``image``, the first
    side) against its positive (``text``), its own hard negatives and, with ``terms="five"``,
    the in-batch query-query, doc-doc and query-doc terms; ``terms="two"`` keeps the query-doc
    and hard-negative terms. Terms scoring above the positive + `margin`, and copies of the
    positive, are masked (`mask=False`: none). Learnable, clamped temperature as InfoNCE's."""

    def __init__(
        self,
        temperature: float = 0.07,
        learn_temperature: bool = True,
        max_logit_scale: float = 100.0,
        terms: str = "five",
        margin: float = 0.1,
        mask: bool = True,
        negatives_per_query: int | None = None,
        duplicate_cosine: float = DUPLICATE_COSINE,
        gather: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """`negatives_per_query`: K, each query's own hard negatives (rows i*K .. i*K+K-1);
        None: negatives / queries. `duplicate_cosine`: a document this close to the positive
        is a copy of it (masked; > 1: no such clause). `rank`/`world_size`: as for
        `InfoNCELoss`."""
        super().__init__()
        if terms not in TERMS:
            raise ValueError(f"terms must be one of {sorted(TERMS)}, got {terms!r}")
        if not margin >= 0:
            raise ValueError(f"the false-negative margin must be >= 0, got {margin}")
        init_temperature(self, temperature, learn_temperature, max_logit_scale)
        self.terms, self.margin, self.mask = terms, margin, mask
        self.negatives_per_query, self.duplicate_cosine = negatives_per_query, duplicate_cosine
        self.gather = gather
        self.rank, self.world_size = process_group(rank, world_size)
        self.matryoshka_dims: tuple[int, ...] = ()  # prefixes trained too (`matryoshka_loss`)

    @classmethod
    def from_config(cls, o: Any) -> Qwen3VLLoss:
        """Build from an `ObjectiveConfig` (K = objective.hard_negatives)."""
        return cls(
            temperature=o.temperature,
            learn_temperature=o.learn_temperature,
            max_logit_scale=o.max_logit_scale,
            terms=o.terms,
            margin=o.false_negative_margin,
            mask=o.false_negative_mask,
            negatives_per_query=o.hard_negatives,
            duplicate_cosine=o.false_negative_duplicate_cosine,
            gather=o.gather,
        )

    def no_weight_decay(self) -> list[str]:
        return ["logit_scale"]

    def scale(self) -> Tensor:
        return self.logit_scale.clamp(max=self.max_log_scale).exp()

    def forward(
        self, image: Tensor, text: Tensor, negatives: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Unit-norm queries (B, E), positives (B, E) and hard negatives (B*K, E) per rank ->
        (loss, metrics) of the global batch."""
        f = gather_features(
            image, text, negatives, self.gather, rank=self.rank, world_size=self.world_size
        )
        return matryoshka_loss(self.loss_from_features, f, self.matryoshka_dims)

    def loss_from_features(self, f: Features) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of already-gathered features (also used by GradCache)."""
        with _no_autocast(f.image):
            scale = self.scale()
            loss, metrics = qwen3vl_loss(
                f.image,
                f.text,
                f.negatives,
                scale,
                self.terms,
                self.margin,
                self.mask,
                self.negatives_per_query or None,
                self.duplicate_cosine,
            )
        metrics["logit_scale"] = scale.detach()
        return loss, metrics


LOSSES: dict[str, type[nn.Module]] = {
    "infonce": InfoNCELoss,
    "siglip": SigLIPLoss,
    "qwen3vl": Qwen3VLLoss,
}


def build_loss(name: str, **kwargs: object) -> nn.Module:
    """A contrastive loss by registry key."""
    if name not in LOSSES:
        raise KeyError(f"unknown contrastive loss '{name}'; known: {sorted(LOSSES)}")
    return LOSSES[name](**kwargs)


def build_loss_from_config(objective: Any) -> nn.Module:
    """The loss `objective.loss` names, with the options of an `ObjectiveConfig` it uses."""
    if objective.loss not in LOSSES:
        raise KeyError(f"unknown objective.loss '{objective.loss}'; known: {sorted(LOSSES)}")
    return LOSSES[objective.loss].from_config(objective)
