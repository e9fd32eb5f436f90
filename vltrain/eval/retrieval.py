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
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

try:  # optional: faster CPU matmul for this shape (see _score_block)
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with most torch installs
    _np = None
try:  # optional: single-threaded BLAS inside the parallel CPU workers (see _scan)
    import threadpoolctl as _threadpoolctl
except ImportError:  # pragma: no cover - a declared dependency
    _threadpoolctl = None

# Bytes allowed for one score block; a (512, 36_430) fp32 block is ~71 MiB.
_BLOCK_BYTES = 96 * 2**20
_MAX_QUERY_CHUNK = 512
# Parallel CPU workers in `_scan` (each holds one block; the block budget is shared).
_MAX_WORKERS = 8
# Docs per block for CPU top-k without ranks (see _topk_chunk_sizes).
_TOPK_DOC_CHUNK = 8192
# Columns per candidate group in `_grouped_topk`.
_GROUP = 16
_TOP_LIST = 10  # length of the top list that nDCG@10 / MRR@10 / ranks_path use


def _check_embeddings(queries: Tensor, docs: Tensor) -> tuple[Tensor, Tensor]:
    """Validate shapes/values; returns fp32 (or fp64) contiguous views on the same device."""
    for name, x in (("queries", queries), ("docs", docs)):
        if not isinstance(x, Tensor) or x.dim() != 2:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 2-D tensor (rows, dim); got {got}.")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a float tensor; got {x.dtype}. Cast with .float().")
        if x.shape[0] == 0:
            raise ValueError(f"{name} is empty (0 rows); nothing to retrieve.")
    if queries.shape[1] != docs.shape[1]:
        raise ValueError(
            f"queries dim {queries.shape[1]} != docs dim {docs.shape[1]}; embed both sides "
            "with the same model/projection."
        )
    if queries.device != docs.device:
        raise ValueError(f"queries on {queries.device} but docs on {docs.device}; move one.")
    dtype = torch.float64 if torch.float64 in (queries.dtype, docs.dtype) else torch.float32
    # bf16/fp16 inputs are upcast: the exact-order guarantees are stated for fp32 scores.
    queries, docs = (x.detach().to(dtype).contiguous() for x in (queries, docs))
    for name, x in (("queries", queries), ("docs", docs)):
        # One reduction instead of an elementwise mask: any NaN/inf makes the sum non-finite;
        # a finite sum that overflows is re-checked elementwise before anything is reported.
        if not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} contains NaN or inf; fix the embedding model/inputs first.")
    return queries, docs


def _chunk_sizes(
    n_q: int, n_docs: int, chunk_size: int | None, doc_chunk_size: int | None, workers: int = 1
) -> tuple[int, int]:
    """(query chunk, doc chunk). Default: whole doc rows, as many queries as fit the budget,
    which `workers` parallel CPU workers (one block each) share."""
    for name, v in (("chunk_size", chunk_size), ("doc_chunk_size", doc_chunk_size)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1 or None (auto); got {v}.")
    budget = _BLOCK_BYTES // max(workers, 1)
    if doc_chunk_size is None:
        min_rows = min(n_q, 64) if chunk_size is None else min(n_q, chunk_size)
        fits = min_rows * n_docs * 4 <= budget
        doc_chunk_size = n_docs if fits else max(1, budget // (4 * max(min_rows, 1)))
    doc_chunk_size = min(doc_chunk_size, n_docs)
    if chunk_size is None:
        chunk_size = max(1, min(_MAX_QUERY_CHUNK, budget // (4 * doc_chunk_size)))
    return min(chunk_size, n_q), doc_chunk_size


def _topk_chunk_sizes(n_q: int, n_docs: int, workers: int) -> tuple[int, int]:
    """CPU top-k blocks: _TOPK_DOC_CHUNK docs by as many queries as the shared budget allows,
    cut into equal chunks that split evenly over the workers.

    Wide but not whole-row blocks: on the 2-core EPYC dev box (1,144 x 8,192) blocks ran the
    4,575 x 36,430 x 1,024 search in 2.2 s against 2.6 s for whole rows (345 x 36,430), the
    single-threaded GEMM being equally fast and the smaller output staying nearer the cache.
    """
    dc = min(n_docs, _TOPK_DOC_CHUNK)
    max_rows = max(1, _BLOCK_BYTES // max(workers, 1) // (4 * dc))
    rounds = math.ceil(n_q / (workers * max_rows))
    return max(1, math.ceil(n_q / (workers * rounds))), dc


def _sort_total_order(vals: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Sort each row by (score desc, doc index asc)."""
    idx_sorted, perm = idx.sort(dim=1)  # (R, M)
    vals_by_idx = vals.gather(1, perm)  # (R, M)
    vals_out, perm2 = vals_by_idx.sort(dim=1, descending=True, stable=True)  # (R, M)
    return vals_out, idx_sorted.gather(1, perm2)


def _block_topk(scores: Tensor, k: int, col_offset: int) -> tuple[Tensor, Tensor]:
    """Exact top-min(k, M) of a (R, M) block under the total order; indices are global."""
    n_cols = scores.shape[1]
    if n_cols <= k:
        idx = torch.arange(n_cols, device=scores.device).expand_as(scores)  # (R, M)
        return _sort_total_order(scores, idx + col_offset)
    if n_cols // _GROUP >= 8 * (k + 1):
        return _grouped_topk(scores, k, col_offset)
    return _plain_topk(scores, k, col_offset)


def _plain_topk(scores: Tensor, k: int, col_offset: int) -> tuple[Tensor, Tensor]:
    """`_block_topk` by one `torch.topk` over all M columns (needs M > k)."""
    vals, idx = scores.topk(k + 1, dim=1)  # (R, k+1), sorted by value
    # torch.topk picks an arbitrary subset of docs tied at the k-th value. Rows where the k-th
    # and (k+1)-th values are equal are re-selected so the lowest-index tied docs win.
    tie = (vals[:, k - 1] == vals[:, k]).nonzero().squeeze(1)  # (T,)
    vals, idx = vals[:, :k], idx[:, :k]
    if tie.numel():
        sub = scores[tie]  # (T, M)
        kth = vals[tie, k - 1 :]  # (T, 1)
        need = k - (vals[tie] > kth).sum(1, keepdim=True)  # (T, 1) tied slots to fill
        eq = sub == kth  # (T, M)
        drop = eq & (eq.cumsum(1) > need)  # ties beyond the lowest `need` indices
        vals[tie], idx[tie] = sub.masked_fill(drop, -math.inf).topk(k, dim=1)
    return _sort_total_order(vals, idx + col_offset)


def _grouped_topk(scores: Tensor, k: int, col_offset: int) -> tuple[Tensor, Tensor]:
    """`_block_topk` that selects among ~k x _GROUP candidate columns instead of all M.

    Columns are split into n = M // G groups {j, j + n, j + 2n, ...} (G = _GROUP; the last M % G
    columns are always candidates). A group's max is an elementwise max of G contiguous slabs,
    one cheap vectorised pass. Every true top-k doc lies in one of the k groups with the largest
    maxima, unless its score ties the (k+1)-th group max u: the candidates' k-th value is >= u,
    and rows where it equals u, or where candidates tie at the k-th place, are redone exactly
    by `_plain_topk`.
    """
    n_rows, n_cols = scores.shape
    n_groups = n_cols // _GROUP
    grouped = scores[:, : n_groups * _GROUP].view(n_rows, _GROUP, n_groups)  # (R, G, n)
    gmax, gidx = grouped.amax(1).topk(k + 1, dim=1)  # (R, k+1) largest group maxima
    spread = torch.arange(_GROUP, device=scores.device) * n_groups  # (G,)
    cols = (gidx[:, :k, None] + spread).reshape(n_rows, k * _GROUP)  # (R, kG) member columns
    tail = torch.arange(n_groups * _GROUP, n_cols, device=scores.device)  # (M % G,)
    cols = torch.cat([cols, tail.expand(n_rows, -1)], 1)  # (R, C)
    vals, pick = scores.gather(1, cols).topk(k + 1, dim=1)  # (R, k+1)
    idx = cols.gather(1, pick[:, :k])  # (R, k)
    redo = ((vals[:, k - 1] == vals[:, k]) | (vals[:, k - 1] == gmax[:, k])).nonzero().squeeze(1)
    vals = vals[:, :k]
    if redo.numel():
        exact = _plain_topk(scores[redo], k, 0)
        vals[redo], idx[redo] = exact
    return _sort_total_order(vals, idx + col_offset)


def _merge_topk(a: tuple[Tensor, Tensor] | None, b: tuple[Tensor, Tensor], k: int):
    """Exact top-k of the union of two candidate sets (each already exact for its docs)."""
    if a is None:
        return b
    vals, idx = _sort_total_order(torch.cat([a[0], b[0]], 1), torch.cat([a[1], b[1]], 1))
    return vals[:, :k], idx[:, :k]


def topk_similarity(
    queries: Tensor,
    docs: Tensor,
    k: int,
    chunk_size: int | None = None,
    doc_chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact inner-product top-k of every query over all docs.

    Args:
        queries: (Q, D) float embeddings (normalize them first for cosine similarity).
        docs: (N, D) float embeddings.
        k: results per query; 1 <= k <= N (k > N raises: there are not k docs to return).
        chunk_size: queries per block (None: auto, from a ~96 MiB block budget).
        doc_chunk_size: docs per block (None: all docs when a block of whole rows fits the
            budget); partial top-ks of doc blocks are merged exactly.

    Returns:
        scores (Q, k) and long doc indices (Q, k), sorted by score descending; equal scores are
        ordered by lower doc index first, and the SET is exact too (a doc tied with the k-th
        score is included only if its index is lower than the other tied docs').
    """
    queries, docs = _check_embeddings(queries, docs)
    n_docs = docs.shape[0]
    if not 1 <= k <= n_docs:
        raise ValueError(f"k={k} must be in [1, N={n_docs}] (the number of docs); lower k.")
    workers = _cpu_workers(queries.device)
    if chunk_size is None and doc_chunk_size is None and queries.device.type == "cpu":
        qc, dc = _topk_chunk_sizes(queries.shape[0], n_docs, workers)
    else:
        qc, dc = _chunk_sizes(queries.shape[0], n_docs, chunk_size, doc_chunk_size, workers)
    vals, idx, _ = _scan(queries, docs, k, None, qc, dc)
    return vals, idx


def _score_block(q: Tensor, d: Tensor, buf: Tensor) -> Tensor:
    """q @ d.T into a reused buffer (fresh 50+ MiB allocations cost page faults per chunk).

    On CPU the product goes through numpy's BLAS when numpy is installed: for this
    (512 x 1024) @ (1024 x 36k) shape torch's MKL sgemm measured ~1.3x slower than numpy's
    OpenBLAS on an AMD EPYC host (bench/bench_retrieval.py). Either way every score is computed
    once and every result below is derived from these same values.
    """
    out = buf[: q.shape[0], : d.shape[0]]
    if not out.is_contiguous():
        out = torch.empty(q.shape[0], d.shape[0], dtype=buf.dtype, device=buf.device)
    if _np is not None and out.device.type == "cpu":
        _np.matmul(q.numpy(), d.numpy().T, out=out.numpy())  # (R, M), shares memory with out
        return out
    return torch.mm(q, d.T, out=out)  # (R, M)


def _positive_table(
    positives: Sequence[Sequence[int]], n_q: int, n_docs: int, device: torch.device
) -> Tensor:
    """(Q, P) long table of deduplicated positive doc ids, padded with -1."""
    if len(positives) != n_q:
        raise ValueError(f"positives has {len(positives)} entries but there are {n_q} queries.")
    rows = []
    for i, pos in enumerate(positives):
        ids = sorted({int(p) for p in pos})
        if not ids:
            raise ValueError(f"query {i} has no positives; drop it or give it a relevant doc.")
        if ids[0] < 0 or ids[-1] >= n_docs:
            raise ValueError(f"query {i} has positive {ids} outside [0, N={n_docs}).")
        rows.append(ids)
    width = max(len(r) for r in rows)
    padded = [r + [-1] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.long, device=device)  # (Q, P)


def _best_positive(
    scores: Tensor, pos: Tensor, col_offset: int, best: tuple[Tensor, Tensor] | None
) -> tuple[Tensor, Tensor]:
    """Fold a (R, M) block into the running (score, doc id) of each row's first positive."""
    local = pos - col_offset  # (R, P)
    inside = (local >= 0) & (local < scores.shape[1])  # (R, P)
    s = scores.gather(1, local.clamp(0, scores.shape[1] - 1))  # (R, P)
    s = s.masked_fill(~inside, -math.inf)
    if best is not None:
        s = torch.cat([best[0][:, None], s], 1)  # (R, 1+P)
        ids = torch.cat([best[1][:, None], pos], 1)
    else:
        ids = pos
    top = s.max(1, keepdim=True).values  # (R, 1)
    big = torch.iinfo(torch.long).max
    # padding (-1) never wins: its score is -inf, and every row has a positive somewhere.
    first = ids.masked_fill((s != top) | (ids < 0), big).min(1).values  # (R,)
    return top.squeeze(1), first


def _count_above(
    scores: Tensor, col_offset: int, s: Tensor, p: Tensor, ties: str, buf: Tensor
) -> Tensor:
    """Per row: docs in this block ranked above doc p (score s) under the chosen tie rule."""
    gt = torch.gt(scores, s[:, None], out=buf[: scores.shape[0], : scores.shape[1]])
    count = gt.sum(1, dtype=torch.int32).long()  # (R,)
    if ties == "optimistic":
        return count
    ge = torch.ge(scores, s[:, None], out=buf[: scores.shape[0], : scores.shape[1]])
    n_eq = ge.sum(1, dtype=torch.int32).long() - count  # (R,)
    own = ((p >= col_offset) & (p < col_offset + scores.shape[1])).long()  # p itself is equal
    rows = (n_eq > own).nonzero().squeeze(1)  # rows with another doc tied with p
    if rows.numel():
        cols = torch.arange(scores.shape[1], device=scores.device) + col_offset  # (M,)
        lower = (scores[rows] == s[rows, None]) & (cols[None, :] < p[rows, None])  # (T, M)
        count[rows] += lower.sum(1)
    return count


def _scan(
    queries: Tensor,
    docs: Tensor,
    k: int,
    pos_table: Tensor | None,
    qc: int,
    dc: int,
    ties: str = "index",
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """One pass over score blocks: top-k (if k > 0) and ranks (if pos_table is given).

    On CPU with several torch threads, the query chunks are split into one contiguous range per
    thread and each range runs on its own Python thread with single-threaded BLAS and torch ops:
    matmul and selection then overlap across cores with no synchronisation inside a GEMM.
    Every result is still derived from the (chunk x doc block) scores of this one pass.
    """
    starts = list(range(0, queries.shape[0], qc))
    workers = _cpu_workers(queries.device, len(starts))
    if workers <= 1:
        parts = [_scan_range(queries, docs, k, pos_table, qc, dc, ties, starts)]
    else:
        groups = [starts[i::workers] for i in range(workers)]  # interleaved: balanced tails
        with _single_threaded_kernels(), ThreadPoolExecutor(workers) as pool:
            futures = [
                pool.submit(_scan_range, queries, docs, k, pos_table, qc, dc, ties, g)
                for g in groups
            ]
            parts = [f.result() for f in futures]
    order = [q0 for g in (groups if workers > 1 else [starts]) for q0 in g]
    rows = torch.tensor(order).argsort()  # chunk results back into query order
    out: list[Tensor | None] = []
    for j in range(3):
        chunks = [c for part in parts for c in part[j]]
        out.append(torch.cat([chunks[i] for i in rows.tolist()]) if chunks else None)
    return out[0], out[1], out[2]


def _cpu_workers(device: torch.device, n_chunks: int | None = None) -> int:
    """Parallel query ranges: one per torch thread (at most _MAX_WORKERS) on CPU, else 1."""
    if device.type != "cpu" or _threadpoolctl is None:
        return 1
    n = min(torch.get_num_threads(), _MAX_WORKERS)
    return max(1, n if n_chunks is None else min(n, n_chunks))


@contextmanager
def _single_threaded_kernels():
    """BLAS and torch intra-op kernels on one thread each while the workers run."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _threadpoolctl.threadpool_limits(1, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(n)


def _scan_range(
    queries: Tensor,
    docs: Tensor,
    k: int,
    pos_table: Tensor | None,
    qc: int,
    dc: int,
    ties: str,
    starts: list[int],
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """`_scan` over the query chunks that begin at `starts`, with this worker's own buffers."""
    n_docs = docs.shape[0]
    buf = torch.empty(qc, dc, dtype=queries.dtype, device=queries.device)
    mask_buf = torch.empty(qc if pos_table is not None else 0, dc, dtype=torch.bool)
    mask_buf = mask_buf.to(queries.device)
    vals_out, idx_out, ranks_out = [], [], []
    for q0 in starts:
        q = queries[q0 : q0 + qc]  # (R, D)
        pos = pos_table[q0 : q0 + qc] if pos_table is not None else None
        best_pos = None
        if pos is not None and dc < n_docs:
            # Pass 1 (doc-chunked only): best positive score from the SAME blocks as pass 2.
            for d0 in range(0, n_docs, dc):
                if bool(((pos >= d0) & (pos < d0 + dc)).any()):
                    scores = _score_block(q, docs[d0 : d0 + dc], buf)
                    best_pos = _best_positive(scores, pos, d0, best_pos)
        top, count = None, None
        for d0 in range(0, n_docs, dc):
            scores = _score_block(q, docs[d0 : d0 + dc], buf)  # (R, M)
            if k > 0:
                top = _merge_topk(top, _block_topk(scores, k, d0), k)
            if pos is not None:
                if dc >= n_docs:
                    best_pos = _best_positive(scores, pos, 0, None)
                c = _count_above(scores, d0, best_pos[0], best_pos[1], ties, mask_buf)
                count = c if count is None else count + c
        if top is not None:
            vals_out.append(top[0])
            idx_out.append(top[1])
        if count is not None:
            ranks_out.append(count + 1)
    return vals_out, idx_out, ranks_out


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
    queries, docs = _check_embeddings(queries, docs)
    table = _positive_table(positives, queries.shape[0], docs.shape[0], queries.device)
    workers = _cpu_workers(queries.device)
    qc, dc = _chunk_sizes(queries.shape[0], docs.shape[0], chunk_size, doc_chunk_size, workers)
    return _scan(queries, docs, 0, table, qc, dc, ties)[2]


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
        table = _positive_table(positives, len(positives), n_docs, torch.device("cpu"))
    if not ranks.shape[0] == top_ids.shape[0] == table.shape[0]:
        raise ValueError(
            f"ranks ({ranks.shape[0]}), top_ids ({top_ids.shape[0]}) and positives "
            f"({table.shape[0]}) must describe the same queries."
        )
    out = {f"R@{k}": (ranks <= k).double() for k in ks}
    out["MRR@10"] = torch.where(ranks <= 10, 1.0 / ranks, torch.zeros_like(ranks))
    ids = top_ids[:, :_TOP_LIST].cpu()  # (Q, L)
    rel = (ids[:, :, None] == table[:, None, :]).any(-1).double()  # (Q, L); pads (-1) never match
    discount = 1.0 / torch.log2(torch.arange(2, _TOP_LIST + 2, dtype=torch.float64))  # (10,)
    n_rel = (table >= 0).sum(1).clamp(max=_TOP_LIST)  # (Q,)
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
    queries, docs = _check_embeddings(query_emb, doc_emb)
    table = _positive_table(positives, queries.shape[0], docs.shape[0], queries.device)
    workers = _cpu_workers(queries.device)
    qc, dc = _chunk_sizes(queries.shape[0], docs.shape[0], chunk_size, None, workers)
    n_top = min(_TOP_LIST, docs.shape[0])
    _, top_ids, ranks = _scan(queries, docs, n_top, table, qc, dc)
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
