"""The loss Qwen3-VL-Embedding is trained with: InfoNCE over five kinds of terms, false negatives
masked (``objective.loss=qwen3vl``).

Followed: the InfoNCE of the Qwen3 Embedding report (Zhang et al. 2025, arXiv 2506.05176; read
here through public transcriptions of it, not the PDF), which the Qwen3-VL-Embedding report
(Li et al. 2026, arXiv 2601.04720) trains its first stage with::

    L   = -1/N sum_i log( exp(s(q_i, d_i+) / tau) / Z_i )
    Z_i = exp(s(q_i, d_i+) / tau)                          the positive (never masked)
        + sum_k     m_ik exp(s(q_i, d_ik-) / tau)          its K hard negatives
        + sum_{j!=i} m_ij exp(s(q_i, q_j) / tau)           in-batch query-query
        + sum_{j!=i} m_ij exp(s(d_i+, d_j) / tau)          in-batch doc-doc
        + sum_{j!=i} m_ij exp(s(q_i, d_j) / tau)           in-batch query-doc
    m_ij = 0 if s_ij > s(q_i, d_i+) + margin or d_j == d_i+, else 1

s is the cosine similarity, s_ij the term's own score, margin 0.1 in the reports. Stage 2
(``terms="two"``) keeps the positive, the hard negatives and the query-doc terms, masked alike,
as issue 54 summarises the Qwen3-VL-Embedding report's second stage. Where the papers leave a
choice open, vltrain takes these:

- d_j are the other rows' positives; query i's hard negatives are its own K (rows
  ``i*K .. i*K+K-1`` of the gathered negatives), never another query's;
- "d_j == d_i+" compares texts in the report; the loss sees embeddings, so a document is the
  positive when its cosine with d_i+ is >= `duplicate_cosine` (default `DUPLICATE_COSINE`:
  identical inputs embed alike up to rounding). Without this clause a copy of
  the positive, which scores exactly s(q_i, d_i+), would stay in Z_i as a negative. It
  applies to the document terms (hard negatives, doc-doc, query-doc). A model that embeds
  distinct documents alike (a random one: cosines of 0.9999 between pages) has them all
  masked as copies; ``masked_fraction`` shows it, and a threshold above 1 turns the clause off;
- the mask is a constant of the step (no gradient flows through the comparison);
- tau = 1 / logit scale, learnable and clamped like InfoNCE's.

Pure tensor functions: `Qwen3VLLoss` (vltrain.objectives.contrastive) gathers the features and
calls `qwen3vl_loss`, so GradCache and cross-rank gathering compose as for InfoNCE.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vltrain.config.core import ConfigError

#: a document whose cosine with the positive reaches this is the positive (the reports'
#: "d_j == d_i+"): copies of one page differ by rounding only (fp32: ~1e-7; bf16 estimated,
#: not measured, at ~1e-5)
DUPLICATE_COSINE = 0.9999

#: objective.terms -> the term blocks each row's softmax runs over (besides the positive)
TERMS = {
    "five": ("query_doc", "hard_negatives", "query_query", "doc_doc"),
    "two": ("query_doc", "hard_negatives"),
}


def negatives_per_query(n: int, m: int, per_query: int | None) -> int:
    """K, the hard negatives each of `n` queries owns among `m` (rows i*K .. i*K+K-1 are query
    i's). `per_query` None: m / n. Raises ValueError when the rows do not split evenly."""
    if m == 0:
        return 0
    k = m // n if per_query is None else per_query
    if k * n != m:
        want = "a multiple of the queries" if per_query is None else f"{per_query} per query"
        raise ValueError(
            f"objective.loss=qwen3vl pairs each query with its own hard negatives: got {m} for "
            f"{n} queries, need {want} (objective.hard_negatives); every record needs at least "
            "that many negatives"
        )
    return k


def check_negatives_per_query(objective: Any, records: list[dict[str, Any]], source: str) -> None:
    """objective.loss=qwen3vl gives each query its own objective.hard_negatives negatives:
    every training record of `source` must have that many (ConfigError before any step).
    Image-caption records count their shared negatives plus the fewest of any caption's own."""
    k = objective.hard_negatives
    if objective.loss != "qwen3vl" or not k:
        return

    def count(rec: dict[str, Any]) -> int:
        own = [len(c) for c in rec.get("caption_negatives") or []]
        return len(rec.get("negatives") or []) + min(own, default=0)

    short = [rec.get("id", i) for i, rec in enumerate(records) if count(rec) < k]
    if short:
        raise ConfigError(
            f"objective.loss=qwen3vl gives each query its own objective.hard_negatives={k} "
            f"hard negatives, but {len(short)} of {len(records)} records of {source} have "
            f"fewer (first: id {short[0]}); mine more (`vltrain mine --k {k}`), drop those "
            "records, or lower objective.hard_negatives"
        )


def qwen3vl_blocks(
    q: Tensor,
    d: Tensor,
    neg: Tensor | None,
    terms: str,
    per_query: int | None = None,
    duplicate_cosine: float = DUPLICATE_COSINE,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Each term block's cosine scores and its "is the positive" flags (documents only).

    q, d (N, E) unit-norm queries and positives; neg (N*K, E) or None. Returns {block: (N, C)}
    scores and {block: (N, C) bool} duplicate flags; the query-doc block holds the positive on
    its diagonal, the in-batch blocks their j == i entries (excluded later).
    """
    if terms not in TERMS:
        raise ValueError(f"terms must be one of {sorted(TERMS)}, got {terms!r}")
    n, e = q.shape
    k = negatives_per_query(n, 0 if neg is None else neg.shape[0], per_query)
    doc_doc = d @ d.t()  # (N, N)
    scores = {"query_doc": q @ d.t()}  # (N, N)
    dup = {"query_doc": doc_doc >= duplicate_cosine}
    if k:
        negs = neg.reshape(n, k, e)  # (N, K, E): query i's own negatives
        scores["hard_negatives"] = torch.einsum("ne,nke->nk", q, negs)  # (N, K)
        dup["hard_negatives"] = torch.einsum("ne,nke->nk", d, negs) >= duplicate_cosine
    if "query_query" in TERMS[terms]:
        scores["query_query"] = q @ q.t()  # (N, N)
        dup["query_query"] = torch.zeros_like(doc_doc, dtype=torch.bool)  # queries are not docs
        scores["doc_doc"] = doc_doc
        dup["doc_doc"] = dup["query_doc"]
    return scores, dup


def qwen3vl_loss(
    q: Tensor,
    d: Tensor,
    neg: Tensor | None,
    scale: Tensor,
    terms: str = "five",
    margin: float = 0.1,
    mask: bool = True,
    per_query: int | None = None,
    duplicate_cosine: float = DUPLICATE_COSINE,
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """The masked multi-term InfoNCE of the module docstring, fp32; (loss, metrics).

    `scale` = 1 / tau. Metrics: ``acc_i2t`` (the positive outscores every document term that
    counts), ``masked_fraction`` (masked terms / negative terms) and ``chance_loss`` (the loss
    of uninformative logits over the terms that count: mean_i ln |Z_i terms|).
    """
    q, d = q.float(), d.float()
    neg = None if neg is None else neg.float()
    n = q.shape[0]
    scores, dup = qwen3vl_blocks(q, d, neg, terms, per_query, duplicate_cosine)
    eye = torch.eye(n, dtype=torch.bool, device=q.device)  # (N, N)
    pos = scores["query_doc"].diagonal()  # (N,)
    threshold = (pos + margin).detach()[:, None]  # (N, 1)
    logits, keep, candidates = [], [], []
    for name in [b for b in TERMS[terms] if b in scores]:
        s = scores[name]  # (N, C)
        # negative terms of the block: every hard negative; in-batch blocks leave out j == i
        cand = torch.ones_like(s, dtype=torch.bool) if name == "hard_negatives" else ~eye
        drop = (s.detach() > threshold) | dup[name] if mask else torch.zeros_like(cand)
        valid = cand & ~drop
        logits.append(s)
        keep.append(valid | eye if name == "query_doc" else valid)  # the positive always counts
        candidates.append(cand)
    all_s = torch.cat(logits, dim=1)  # (N, C)
    all_keep = torch.cat(keep, dim=1)  # (N, C)
    z = (scale * all_s).masked_fill(~all_keep, -math.inf)
    labels = torch.arange(n, device=q.device)  # the positive: column i of the query-doc block
    loss = F.cross_entropy(z, labels)
    n_doc = n + (scores["hard_negatives"].shape[1] if "hard_negatives" in scores else 0)
    acc = (z[:, :n_doc].argmax(1) == labels).float().mean()
    cand = torch.cat(candidates, dim=1)  # (N, C)
    masked = (cand & ~all_keep).sum() / cand.sum().clamp(min=1)
    counts = all_keep.sum(1).double()  # (N,) terms in each Z_i
    return loss, {
        "acc_i2t": acc.detach(),
        "masked_fraction": masked.detach(),
        "chance_loss": float(counts.log().mean()),
    }
