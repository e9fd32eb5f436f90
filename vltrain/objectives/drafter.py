"""The block-drafter objective (DFlash) and its deployment-faithful metrics.

Shapes: B rows, T tokens, J anchors per row, K = block size, V vocabulary.

- Anchors: positions t where token t and token t + 1 are both supervised
  (``vltrain.data.draft_data.sample_anchors``).
- Labels: slot k of the block anchored at a predicts token ``a + k``; slot 0 carries no loss
  (``block_labels``).
- Weights: ``w_k = exp(-max(k - 1, 0) / gamma)`` for k >= 1 (``position_weights``), gamma
  from the block size by ``default_gamma`` unless configured; optionally D-PACE
  (``dpace_weights``, arXiv 2605.18810).
- Loss: ``sum(CE * w) / sum(w)`` over supervised slots; CE against the label, or against the
  target's own distribution (soft labels).

Metrics (``block_metrics``): per-slot accuracy and top-4 / top-8 accuracy, the *exact* per-block
acceptance length (the prefix of slots matching their labels, + 1: what greedy speculative
decoding accepts when the labels are the target's greedy tokens) next to the marginal-product
estimate ``1 + sum_k prod_{i<=k} acc_i`` other trainers report, and top-k streaks (the prefix
whose labels lie in the drafter's top k: what a tree of width k can accept); with a reduced
draft vocabulary, ``vocab_coverage`` (the share of labels inside it; the others are misses).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def default_gamma(block_size: int) -> float:
    """The position-decay gamma for a block size: the line through DFlash's published values.

    ``gamma = 1 + 3 * block_size / 8``: 8 -> 4, 16 -> 7 (SpecForge / DFlash defaults), 10 ->
    4.75 (Model-Optimizer documents 5). For tree (DDTree) deployment later slots matter more;
    gamma 10 is recommended there (``drafter.gamma``).
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    return 1.0 + 3.0 * block_size / 8.0


def position_weights(block_size: int, gamma: float) -> Tensor:
    """(K,) float32: 0 for slot 0, ``exp(-(k - 1) / gamma)`` for slot k >= 1."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma)
    w[0] = 0.0
    return w


def dpace_weights(ce: Tensor, valid: Tensor, alpha: float = 0.5) -> Tensor:
    """D-PACE weights (..., K) from per-slot CE (..., K), detached.

    ``q = exp(-CE)`` (the slot's label probability), ``q~ = (1 - alpha) q + alpha``,
    ``prefix_k = prod_{1<=i<=k} q~_i`` and ``w_k = sum_{j>=k} prefix_j`` over valid slots:
    a slot weighs by how much accepted length depends on it. Slot 0 and invalid slots get 0.
    """
    q = torch.exp(-ce.detach().float()).masked_fill(~valid, 1.0)
    q = (1 - alpha) * q + alpha
    q[..., 0] = 1.0
    prefix = torch.cumprod(q, dim=-1) * valid
    suffix = prefix.flip(-1).cumsum(-1).flip(-1)
    return suffix * valid


def block_labels(
    labels: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """Labels (B, J, K) and their validity: slot k of anchor a is token ``a + k`` (k >= 1).

    ``labels`` (B, T) holds token ids where supervised and -100 elsewhere. Slots past the end,
    on unsupervised tokens, slot 0 and invalid anchors are invalid.
    """
    b, t = labels.shape
    k = torch.arange(block_size, device=labels.device)
    idx = anchors[:, :, None] + k  # (B, J, K)
    inside = idx < t
    lab = labels.gather(1, idx.clamp(max=t - 1).flatten(1)).view(idx.shape)
    valid = inside & (lab >= 0) & (k > 0) & anchor_valid[:, :, None]
    return lab.masked_fill(~valid, 0), valid


def block_soft_labels(
    target: Tensor | tuple[Tensor, Tensor], anchors: Tensor, block_size: int
) -> Tensor | tuple[Tensor, Tensor]:
    """Soft labels of every block slot: for slot k of anchor a, the target's distribution over
    token ``a + k``, read after token ``a + k - 1`` (slot 0 reads position a - 1; it carries no
    loss).

    ``target`` is its logits (B, T, V): returns probabilities (B, J, K, V). Or its top-k
    tokens, a pair (ids, log-probs) of (B, T, k) each
    (``vltrain.inference.feature_cache.TopK``): returns the pair (ids, probabilities renormalised
    over those k), (B, J, K, k) each, which the loss reads without a vocabulary-wide tensor.
    ``anchors`` (B, J) index the same T positions.
    """
    k = torch.arange(block_size, device=anchors.device)
    idx = (anchors[:, :, None] + k - 1).clamp(min=0)  # (B, J, K)
    rows = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
    if isinstance(target, tuple):
        ids, logp = target
        idx = idx.clamp(max=ids.shape[1] - 1)
        return ids[rows, idx], torch.softmax(logp[rows, idx], -1)
    return torch.softmax(target[rows, idx.clamp(max=target.shape[1] - 1)].float(), -1)


def slot_loss(
    logits: Tensor,
    labels: Tensor,
    valid: Tensor,
    soft: Tensor | tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Per-slot cross-entropy (B, J, K) fp32, 0 where invalid; ``soft`` (B, J, K, V) probs, or
    a sparse pair (indices into the logits, probs), (B, J, K, k) each."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if soft is None:
        ce = -logp.gather(-1, labels[..., None])[..., 0]
    elif isinstance(soft, tuple):
        ce = -(soft[1].float() * logp.gather(-1, soft[0])).sum(-1)
    else:
        ce = -(soft.float() * logp).sum(-1)
    return ce * valid


def weighted_loss(
    ce: Tensor, valid: Tensor, weights: Tensor, dpace: float = 0.0, inside: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(sum of weighted CE, sum of weights) of a chunk; weights (K,) or D-PACE when dpace > 0.

    ``inside`` (default ``valid``): the valid slots that carry a loss; a valid slot outside it
    (a label a reduced draft vocabulary cannot propose) gets no weight and, for D-PACE, counts
    as a certain miss (q = 0) in the prefix of the slots after it.
    """
    inside = valid if inside is None else inside
    if dpace > 0:
        miss = valid & ~inside
        w = dpace_weights(ce.detach().masked_fill(miss, float("inf")), valid, dpace) * inside
    else:
        w = weights.to(ce.device)[None, None, :] * inside
    return (ce * w).sum(), w.sum()


def block_metrics(logits: Tensor, labels: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Sums over blocks of the drafter's metrics for one chunk (detached, fp64).

    Returns ``blocks`` (blocks with >= 1 valid slot), ``accept`` (sum of exact acceptance
    lengths: 1 + the matching prefix), ``slot_correct`` / ``slot_top4`` / ``slot_top8`` /
    ``slot_n`` (K,) per slot, ``streak4`` / ``streak8`` (sum of top-k prefix lengths).
    """
    logits = logits.detach()
    top = logits.topk(min(8, logits.shape[-1]), dim=-1).indices  # (B, J, K, 8)
    hit = top == labels[..., None]
    out: dict[str, Tensor] = {}
    has = valid[..., 1:].any(-1)  # (B, J)
    for name, ok in (
        ("correct", hit[..., :1].any(-1)),
        ("top4", hit[..., :4].any(-1)),
        ("top8", hit.any(-1)),
    ):
        ok = ok & valid
        out[f"slot_{name}"] = ok.sum((0, 1)).double()
        # a block's prefix stops at its first wrong or invalid slot (slot 0 always "matches")
        ok = ok.clone()
        ok[..., 0] = True
        run = torch.cumprod(ok.long(), dim=-1).sum(-1)  # (B, J): 1 + matching prefix
        key = {"correct": "accept", "top4": "streak4", "top8": "streak8"}[name]
        out[key] = (run * has).sum().double()
    out["slot_n"] = valid.sum((0, 1)).double()
    out["blocks"] = has.sum().double()
    return out


def summarize_metrics(sums: dict[str, Tensor]) -> dict[str, float]:
    """Eval metrics from summed ``block_metrics``: tau (exact), tau_marginal, accuracies."""
    blocks = max(float(sums["blocks"]), 1.0)
    n = sums["slot_n"].clamp(min=1.0)
    acc = sums["slot_correct"] / n  # (K,)
    acc[0] = 1.0
    live = sums["slot_n"] > 0
    marginal = 1.0 + float(torch.cumprod(acc[1:] * live[1:], 0).sum())
    out = {
        "vocab_coverage": float(sums["slot_in_vocab"].sum() / sums["slot_n"].sum().clamp(min=1))
        if "slot_in_vocab" in sums
        else 1.0,
        "tau": float(sums["accept"]) / blocks,
        "tau_marginal": marginal,
        "streak4": float(sums["streak4"]) / blocks,
        "streak8": float(sums["streak8"]) / blocks,
        "acc": float(sums["slot_correct"][1:].sum() / n[1:].sum()),
        "top4": float(sums["slot_top4"][1:].sum() / n[1:].sum()),
        "top8": float(sums["slot_top8"][1:].sum() / n[1:].sum()),
    }
    for k in range(1, len(acc)):
        if bool(live[k]):
            out[f"acc_{k}"] = float(acc[k])
    return out


def finite_mean(total: Tensor, weight: Tensor) -> Tensor:
    """``total / weight``, 0 (with a gradient path) when nothing was weighted."""
    return total / weight.clamp(min=1e-12) if float(weight) > 0 else total * 0.0


__all__ = [
    "BlockDraftLoss",
    "block_labels",
    "block_metrics",
    "default_gamma",
    "dpace_weights",
    "finite_mean",
    "position_weights",
    "slot_loss",
    "summarize_metrics",
    "weighted_loss",
]


class BlockDraftLoss(nn.Module):
    """The trainable module of the drafter stage: the drafter plus its chunked loss.

    ``forward`` runs the drafter over the anchors in chunks of ``chunk_blocks`` blocks, each
    chunk under activation checkpointing when there are several, so activation memory (and the
    (B, chunk, K, V) logits) does not grow with the anchor count. Returns the weighted CE sum,
    the weight sum and the summed ``block_metrics``.
    """

    def __init__(
        self,
        drafter: nn.Module,
        gamma: float,
        chunk_blocks: int = 64,
        dpace: float = 0.0,
    ) -> None:
        super().__init__()
        self.drafter = drafter
        self.gamma, self.chunk_blocks, self.dpace = gamma, chunk_blocks, dpace
        k = drafter.cfg.block_size
        self.register_buffer("weights", position_weights(k, gamma), persistent=False)

    def _chunk(self, feats, ctx_pos, ctx_valid, a_ids, a_pos, labels, valid, soft):
        hidden = self.drafter(feats, ctx_pos, ctx_valid, a_ids, a_pos)  # (B, j, K, W)
        logits = self.drafter.logits(hidden)  # (B, j, K, V or draft_vocab)
        # a reduced draft vocabulary: labels as its indices; one outside it (-1) carries no
        # loss and never matches in the metrics (the drafter cannot propose it)
        labels = self.drafter.to_draft(labels)
        inside = carries = valid & (labels >= 0)
        if isinstance(soft, tuple):  # the target's top-k: (token ids, probs)
            ids = self.drafter.to_draft(soft[0])
            probs = soft[1] * (ids >= 0)
            mass = probs.sum(-1, keepdim=True)
            soft = ids.clamp(min=0), probs / mass.clamp(min=1e-12)
            # no mass left inside the draft vocabulary: nothing to learn, like an outside label
            carries = inside & (mass[..., 0] > 0)
        elif soft is not None and self.drafter.cfg.draft_vocab:
            soft = soft[..., self.drafter.vocab_ids]
            soft = soft / soft.sum(-1, keepdim=True).clamp(min=1e-12)
        ce = slot_loss(logits, labels.clamp(min=0), carries, soft)
        loss, weight = weighted_loss(ce, valid, self.weights, self.dpace, carries)
        m = block_metrics(logits, labels, valid)
        m["slot_in_vocab"] = inside.sum((0, 1)).double()
        return loss, weight, *(m[name] for name in METRIC_KEYS)

    def forward(
        self,
        features: Tensor,
        ctx_pos: Tensor,
        ctx_valid: Tensor,
        anchor_ids: Tensor,
        anchor_pos: Tensor,
        labels: Tensor,
        valid: Tensor,
        soft: Tensor | tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Features (B, S, F) at ctx_pos/ctx_valid (B, S); anchors (B, J); labels (B, J, K);
        ``soft``: soft labels (B, J, K, V), or (target ids, probs) of (B, J, K, k) each."""
        j = anchor_ids.shape[1]
        step = self.chunk_blocks if self.chunk_blocks > 0 else j
        loss = weight = features.new_zeros((), dtype=torch.float32)
        sums: dict[str, Tensor] = {}
        for lo in range(0, j, step):
            sl = slice(lo, lo + step)
            args = (
                features,
                ctx_pos,
                ctx_valid,
                anchor_ids[:, sl],
                anchor_pos[:, sl],
                labels[:, sl],
                valid[:, sl],
                _blocks(soft, sl),
            )
            if j > step and torch.is_grad_enabled():
                out = checkpoint(self._chunk, *args, use_reentrant=False)
            else:
                out = self._chunk(*args)
            loss, weight = loss + out[0], weight + out[1].detach()
            for name, v in zip(METRIC_KEYS, out[2:], strict=True):
                sums[name] = sums.get(name, 0) + v.detach()
        return loss, weight, sums


def _blocks(soft: Tensor | tuple[Tensor, Tensor] | None, sl: slice) -> Any:
    """Anchors ``sl`` of soft labels (dense or sparse)."""
    if soft is None:
        return None
    return tuple(t[:, sl] for t in soft) if isinstance(soft, tuple) else soft[:, sl]


METRIC_KEYS = (
    "accept",
    "streak4",
    "streak8",
    "slot_correct",
    "slot_top4",
    "slot_top8",
    "slot_n",
    "blocks",
    "slot_in_vocab",
)
