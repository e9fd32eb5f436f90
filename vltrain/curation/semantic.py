"""Semantic near-duplicates from embeddings, SemDeDup-style, with a kept witness.

Embeddings are split into clusters (spherical k-means, seeded, when there are more than
`cluster_size` items; one cluster otherwise). Inside a cluster every item's nearest neighbours
come from the exact top-k kernel (`vltrain.eval.topk.topk_similarity`). Items are then visited
in a fixed order (input order by default) and an item is removed only if a neighbour that is
ALREADY KEPT has cosine > 1 - eps; that neighbour is its witness. So every removed item has a
kept copy above the threshold, by construction, and the first item of each duplicate group (in
the visiting order) is the one kept.

The official SemDeDup code instead removes item j when ANY earlier item in the cluster is above
the threshold, even one that was itself removed: in a chain A~B, B~C (A and C not similar) it
drops both B and C although nothing similar to C is kept. `official_semdedup_keep` reproduces
that rule for the tests that show the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vltrain.eval.topk import topk_similarity


@dataclass(frozen=True)
class Removal:
    """Item `index` removed as a near-duplicate of kept item `witness` at cosine `score`."""

    index: int
    witness: int
    score: float


def spherical_kmeans(x: Tensor, k: int, seed: int = 0, iters: int = 20) -> Tensor:
    """(N,) cluster ids of unit-norm rows of x (N, D); seeded init from distinct rows."""
    g = torch.Generator().manual_seed(seed)
    cent = x[torch.randperm(x.shape[0], generator=g)[:k]].clone()  # (k, D)
    assign = torch.zeros(x.shape[0], dtype=torch.long)
    for _ in range(iters):
        assign = (x @ cent.T).argmax(1)  # (N,)
        new = torch.zeros_like(cent).index_add_(0, assign, x)
        norms = new.norm(dim=1, keepdim=True)
        cent = torch.where(norms > 0, new / norms.clamp_min(1e-12), cent)
    return assign


def witness_dedup(
    emb: Tensor,
    eps: float,
    k: int = 16,
    cluster_size: int = 20_000,
    seed: int = 0,
    pinned: Tensor | None = None,
) -> list[Removal]:
    """Removals among embeddings emb (N, D) at cosine > 1 - eps.

    Visiting order: `pinned` items (N,) bool first (they are always kept: witnesses of removals
    made by other stages), then the rest, each group in input order. Neighbours beyond the
    `k` nearest are not considered, which can only keep more, never break the witness rule.
    """
    n = emb.shape[0]
    if n == 0:
        return []
    emb = torch.nn.functional.normalize(emb.float(), dim=1)
    n_clusters = max(1, -(-n // cluster_size))
    assign = (
        spherical_kmeans(emb, n_clusters, seed)
        if n_clusters > 1
        else torch.zeros(n, dtype=torch.long)
    )
    removals: list[Removal] = []
    for c in assign.unique().tolist():
        members = (assign == c).nonzero().flatten()  # ascending: input order
        pin = pinned[members] if pinned is not None else torch.zeros(len(members), dtype=torch.bool)
        order = torch.cat([members[pin], members[~pin]])  # pinned first, each in input order
        removals += _dedup_cluster(emb[order], order.tolist(), 1.0 - eps, k, int(pin.sum()))
    return sorted(removals, key=lambda r: r.index)


def _dedup_cluster(emb: Tensor, ids: list[int], thr: float, k: int, n_pinned: int) -> list[Removal]:
    """Greedy pass in row order over one cluster; the first n_pinned rows are kept outright."""
    scores, idx = topk_similarity(emb, emb, min(k, len(ids)))  # (n, k) each, self included
    kept = torch.zeros(len(ids), dtype=torch.bool)
    kept[:n_pinned] = True
    out = []
    for i in range(n_pinned, len(ids)):
        best = None
        for s, j in zip(scores[i].tolist(), idx[i].tolist(), strict=True):
            if s <= thr:
                break  # sorted by score: nothing further qualifies
            if j < i and kept[j]:
                best = (j, s)
                break  # the highest-scoring kept neighbour (ties: lower index)
        if best is None:
            kept[i] = True
        else:
            out.append(Removal(ids[i], ids[best[0]], best[1]))
    return out


def official_semdedup_keep(emb: Tensor, eps: float) -> list[bool]:
    """SemDeDup's released rule on one cluster: drop j if max_{i<j} cos(i, j) > 1 - eps."""
    emb = torch.nn.functional.normalize(emb.float(), dim=1)
    sim = (emb @ emb.T).triu(diagonal=1)  # (N, N): upper triangle only
    return (sim.max(0).values <= 1.0 - eps).tolist()
