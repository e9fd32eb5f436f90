"""The exact inner-product search kernel: blockwise scores, top-k and rank counting.

Everything is exact under one total order of documents per query: higher inner product first,
ties broken by the LOWER doc index (see vltrain.eval.retrieval for the metrics built on it).
Scores are computed blockwise, one matmul per (query chunk x doc chunk) block (numpy's BLAS on
CPU when available, else `torch.mm`); the full (Q, N) score matrix is never held in memory. On
CPU, query ranges run on one Python thread per core with single-threaded BLAS.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import Tensor

try:  # optional: faster CPU matmul for this shape (see _score_block)
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with most torch installs
    _np = None
try:  # optional: single-threaded BLAS inside the parallel CPU workers (see scan)
    import threadpoolctl as _threadpoolctl
except ImportError:  # pragma: no cover - a declared dependency
    _threadpoolctl = None

# Bytes allowed for one score block; a (512, 36_430) fp32 block is ~71 MiB.
_BLOCK_BYTES = 96 * 2**20
_MAX_QUERY_CHUNK = 512
# Parallel CPU workers in `scan` (each holds one block; the block budget is shared).
_MAX_WORKERS = 8
# Docs per block for CPU top-k without ranks (see _topk_chunk_sizes).
_TOPK_DOC_CHUNK = 8192
# Columns per candidate group in `_grouped_topk`.
_GROUP = 16
TOP_LIST = 10  # length of the top list that nDCG@10 / MRR@10 / ranks_path use


def check_embeddings(queries: Tensor, docs: Tensor) -> tuple[Tensor, Tensor]:
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


def chunk_sizes(
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
    queries, docs = check_embeddings(queries, docs)
    n_docs = docs.shape[0]
    if not 1 <= k <= n_docs:
        raise ValueError(f"k={k} must be in [1, N={n_docs}] (the number of docs); lower k.")
    workers = cpu_workers(queries.device)
    if chunk_size is None and doc_chunk_size is None and queries.device.type == "cpu":
        qc, dc = _topk_chunk_sizes(queries.shape[0], n_docs, workers)
    else:
        qc, dc = chunk_sizes(queries.shape[0], n_docs, chunk_size, doc_chunk_size, workers)
    vals, idx, _ = scan(queries, docs, k, None, qc, dc)
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


def positive_table(
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


def scan(
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
    workers = cpu_workers(queries.device, len(starts))
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


def cpu_workers(device: torch.device, n_chunks: int | None = None) -> int:
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
    """`scan` over the query chunks that begin at `starts`, with this worker's own buffers."""
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
