"""Exact retrieval evaluation at corpus scale (inner-product search, chunked, on CPU or GPU).

Every result here is exact under one total order of documents per query:

    doc a ranks above doc b  <=>  score(a) > score(b), or score(a) == score(b) and a < b

i.e. higher inner product first, ties broken by the LOWER doc index. `topk_similarity`,
`rank_of_positives` (default `ties="index"`) and the metrics all use this order, so R@k computed
from ranks always agrees with the top-k lists. Scores are computed blockwise, one matmul per
(query chunk x doc chunk) block (numpy's BLAS on CPU when available, else `torch.mm`); the full
(Q, N) score matrix is never held in memory. A score's last bits can depend on the block shape
and BLAS, so results that must agree (top-k lists and ranks in `evaluate_retrieval`) are derived
from the same blocks; compare against other libraries with a tolerance for near-equal scores.

Metrics (COCO protocol: a query is a hit at k if ANY of its positives is in its top k):
    R@k      fraction of queries whose best-ranked positive has rank <= k
    MRR@10   mean of 1/rank of the best-ranked positive, 0 when rank > 10
    nDCG@10  binary relevance, DCG = sum over positives at 1-based position i <= 10 of
             1/log2(i + 1); ideal DCG uses min(#positives, 10) positives at the top.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from vltrain.eval.topk import (
    TOP_LIST,
    check_embeddings,
    chunk_sizes,
    cpu_workers,
    positive_table,
    scan,
)


def rank_of_positives(
    queries: Tensor,
    docs: Tensor,
    positives: Sequence[Sequence[int]],
    chunk_size: int | None = None,
    doc_chunk_size: int | None = None,
    ties: str = "index",
) -> Tensor:
    """Exact 1-based rank over the whole corpus of each query's best-ranked positive.

    Args:
        queries: (Q, D); docs: (N, D); positives: for each query, its relevant doc ids (at
            least one each; duplicates are ignored).
        ties: "index" (default): rank under the module's total order, i.e.
            1 + #{docs with a strictly higher score} + #{docs with an equal score and a lower
            index than the best positive}; agrees exactly with `topk_similarity` lists.
            "optimistic": 1 + #{docs with a strictly higher score} (ties count in your favour).

    Returns:
        (Q,) long ranks in [1, N].

    Cost: one pass over the score blocks when whole doc rows fit a block (the default up to
    ~390k docs); with doc chunking the blocks holding positives are scored twice.
    """
    if ties not in ("index", "optimistic"):
        raise ValueError(f"ties must be 'index' or 'optimistic'; got {ties!r}.")
    queries, docs = check_embeddings(queries, docs)
    table = positive_table(positives, queries.shape[0], docs.shape[0], queries.device)
    workers = cpu_workers(queries.device)
    qc, dc = chunk_sizes(queries.shape[0], docs.shape[0], chunk_size, doc_chunk_size, workers)
    return scan(queries, docs, 0, table, qc, dc, ties)[2]


def per_query_metrics(
    ranks: Tensor, top_ids: Tensor, positives: Sequence[Sequence[int]] | Tensor, ks: Sequence[int]
) -> dict[str, Tensor]:
    """Per-query metric values (float64, shape (Q,)); their means are the reported metrics.

    `ranks` (Q,) come from `rank_of_positives` (ties="index") and `top_ids` (Q, L) from
    `topk_similarity` with L = min(10, N), both from the same scores. `positives` is a list of
    doc-id lists or a (Q, P) long table padded with -1. Per-query values let sharded evaluation
    all-reduce sums and counts instead of gathering embeddings.
    """
    ranks = ranks.double().cpu()
    if isinstance(positives, Tensor):
        table = positives.long().cpu()
    else:
        n_docs = 1 + max((max(p) for p in positives if len(p)), default=0)
        table = positive_table(positives, len(positives), n_docs, torch.device("cpu"))
    if not ranks.shape[0] == top_ids.shape[0] == table.shape[0]:
        raise ValueError(
            f"ranks ({ranks.shape[0]}), top_ids ({top_ids.shape[0]}) and positives "
            f"({table.shape[0]}) must describe the same queries."
        )
    out = {f"R@{k}": (ranks <= k).double() for k in ks}
    out["MRR@10"] = torch.where(ranks <= 10, 1.0 / ranks, torch.zeros_like(ranks))
    ids = top_ids[:, :TOP_LIST].cpu()  # (Q, L)
    rel = (ids[:, :, None] == table[:, None, :]).any(-1).double()  # (Q, L); pads (-1) never match
    discount = 1.0 / torch.log2(torch.arange(2, TOP_LIST + 2, dtype=torch.float64))  # (10,)
    n_rel = (table >= 0).sum(1).clamp(max=TOP_LIST)  # (Q,)
    ideal = torch.cat([torch.zeros(1, dtype=torch.float64), discount.cumsum(0)])[n_rel]  # (Q,)
    out["nDCG@10"] = (rel * discount[: rel.shape[1]]).sum(1) / ideal
    return out


def evaluate_retrieval(
    query_emb: Tensor,
    doc_emb: Tensor,
    positives: Sequence[Sequence[int]],
    ks: Sequence[int] = (1, 5, 10),
    max_queries: int | None = None,
    chunk_size: int | None = None,
    ranks_path: str | Path | None = None,
) -> dict[str, float]:
    """Exact retrieval metrics: R@k for each k, MRR@10, nDCG@10, mean/median rank, n_queries.

    One pass over the score blocks computes both the top-10 list and the exact rank of each
    query's best positive (total order: score desc, lower doc index first). `max_queries` keeps
    the FIRST n queries (deterministic). R@k is exact for any k, also k > 10 or k >= N (then 1).
    If `ranks_path` is given, writes one JSON line per query:
    {"query": i, "rank": r, "top10": [doc ids]} (fewer than 10 ids when N < 10).
    """
    if any(int(k) < 1 for k in ks):
        raise ValueError(f"every k in ks must be >= 1; got {tuple(ks)}.")
    if max_queries is not None:
        if max_queries < 1:
            raise ValueError(f"max_queries must be >= 1 or None; got {max_queries}.")
        query_emb, positives = query_emb[:max_queries], list(positives)[:max_queries]
    queries, docs = check_embeddings(query_emb, doc_emb)
    table = positive_table(positives, queries.shape[0], docs.shape[0], queries.device)
    workers = cpu_workers(queries.device)
    qc, dc = chunk_sizes(queries.shape[0], docs.shape[0], chunk_size, None, workers)
    n_top = min(TOP_LIST, docs.shape[0])
    _, top_ids, ranks = scan(queries, docs, n_top, table, qc, dc)
    per_query = per_query_metrics(ranks, top_ids, table, ks)
    metrics = {name: float(v.mean()) for name, v in per_query.items()}
    metrics["mean_rank"] = float(ranks.double().mean())
    metrics["median_rank"] = float(ranks.double().median())
    metrics["n_queries"] = float(queries.shape[0])
    if ranks_path is not None:
        _write_ranks(Path(ranks_path), ranks, top_ids)
    return metrics


def _write_ranks(path: Path, ranks: Tensor, top_ids: Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, (r, ids) in enumerate(zip(ranks.tolist(), top_ids.tolist(), strict=True)):
            f.write(json.dumps({"query": i, "rank": r, "top10": ids}) + "\n")


def image_text_retrieval(
    image_emb: Tensor,
    text_emb: Tensor,
    text_to_image: Tensor,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int | None = None,
) -> dict[str, float]:
    """COCO-protocol image<->text retrieval: keys `i2t_R@k`, `t2i_R@k`, `*_MRR@10`, `*_nDCG@10`.

    image_emb (I, D), text_emb (T, D), text_to_image (T,) long: the image each caption
    describes. i2t: an image is a hit at k if ANY of its captions is in its top k (nDCG uses all
    of its captions as relevant). t2i: each caption has exactly one relevant image. Every image
    needs at least one caption. Also returns `*_mean_rank`, `*_median_rank`, `*_n_queries`.
    """
    t2i = torch.as_tensor(text_to_image).long().cpu()
    n_img = image_emb.shape[0]
    if t2i.dim() != 1 or t2i.numel() != text_emb.shape[0]:
        raise ValueError(
            f"text_to_image must be (T,)=({text_emb.shape[0]},); got {tuple(t2i.shape)}."
        )
    if t2i.numel() and (int(t2i.min()) < 0 or int(t2i.max()) >= n_img):
        raise ValueError(f"text_to_image has ids outside [0, I={n_img}).")
    captions: list[list[int]] = [[] for _ in range(n_img)]
    for t, i in enumerate(t2i.tolist()):
        captions[i].append(t)
    missing = [i for i, c in enumerate(captions) if not c]
    if missing:
        raise ValueError(
            f"{len(missing)} images have no caption (first: {missing[:5]}); drop them from "
            "image_emb or add their captions."
        )
    i2t = evaluate_retrieval(image_emb, text_emb, captions, ks, chunk_size=chunk_size)
    single = [[i] for i in t2i.tolist()]
    t2i_m = evaluate_retrieval(text_emb, image_emb, single, ks, chunk_size=chunk_size)
    out = {f"i2t_{k}": v for k, v in i2t.items()}
    out.update({f"t2i_{k}": v for k, v in t2i_m.items()})
    return out
