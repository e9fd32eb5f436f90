"""Exact top-k retrieval: vltrain.eval.retrieval vs faiss-cpu IndexFlatIP, same data, same run.

    python bench/bench_retrieval.py [--runs 3] [--sweep] [--out bench/results_retrieval.md]

4,575 queries x 36,430 docs, dim 1,024, random normalized fp32 (seed 0), k=10. Runs are
interleaved (vltrain, faiss, vltrain, faiss, ...) so machine noise hits both sides alike; the
table reports medians. Top-k lists are compared row by row; rows whose lists differ are split
into "tie order only" (the two score sequences agree within 1e-5 at every position, i.e. only
near-equal scores swapped) and "real" differences (should be 0).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from vltrain.diagnostics.card import cpu_model
from vltrain.eval import topk
from vltrain.eval.retrieval import evaluate_retrieval
from vltrain.eval.topk import topk_similarity

Q, N, DIM, K = 4_575, 36_430, 1_024, 10


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(Q, DIM, generator=g), dim=1)  # (Q, D)
    d = torch.nn.functional.normalize(torch.randn(N, DIM, generator=g), dim=1)  # (N, D)
    return q, d


CPU_S: dict[str, list[float]] = {}  # process CPU seconds per method (robust-ish to sharing)


def _timed(fn, name: str = ""):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    CPU_S.setdefault(name, []).append(time.process_time() - c0)
    return time.perf_counter() - t0, out


def _faiss_search(q: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    index = faiss.IndexFlatIP(DIM)
    index.add(d)
    return index.search(q, K)


def _compare(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[np.ndarray, np.ndarray]):
    """(rows identical, rows differing only by near-tie order, rows really different)."""
    o_vals, o_idx = ours[0].numpy(), ours[1].numpy()
    f_vals, f_idx = theirs
    differ = (o_idx != f_idx).any(1)
    near = np.abs(o_vals - f_vals).max(1) <= 1e-5
    return int((~differ).sum()), int((differ & near).sum()), int((differ & ~near).sum())


def _topk_torch_mm(q: torch.Tensor, d: torch.Tensor):
    """The same function with its CPU numpy-matmul path switched off (torch.mm / MKL)."""
    saved, topk._np = topk._np, None
    try:
        return topk_similarity(q, d, K)
    finally:
        topk._np = saved


def _machine() -> str:
    model = cpu_model()
    threads = f"{torch.get_num_threads()} torch / {faiss.omp_get_max_threads()} faiss threads"
    return f"{model} ({os.cpu_count()} CPUs), {threads}"


def _sweep(q: torch.Tensor, d: torch.Tensor, runs: int) -> None:
    for cs in (128, 256, 512, 1024):
        ts = [_timed(lambda cs=cs: topk_similarity(q, d, K, chunk_size=cs))[0] for _ in range(runs)]
        print(f"chunk_size={cs}: median {statistics.median(ts):.2f}s  runs {_fmt(ts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="also time several chunk sizes")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = ap.parse_args()

    load0 = os.getloadavg()[0]
    q, d = _data()
    q_np, d_np = q.numpy(), d.numpy()
    if args.sweep:
        _sweep(q, d, args.runs)
    t_ours, t_torch, t_faiss, t_eval = [], [], [], []
    ours = theirs = via_torch = None
    for _ in range(args.runs):
        t, ours = _timed(lambda: topk_similarity(q, d, K), "ours")
        t_ours.append(t)
        t, via_torch = _timed(lambda: _topk_torch_mm(q, d), "torch")
        t_torch.append(t)
        t, theirs = _timed(lambda: _faiss_search(q_np, d_np), "faiss")
        t_faiss.append(t)
    positives = [[i % N, (7 * i + 3) % N] if i % 3 == 0 else [i % N] for i in range(Q)]
    for _ in range(args.runs):
        t, metrics = _timed(lambda: evaluate_retrieval(q, d, positives), "eval")
        t_eval.append(t)
    same, tie_only, real = _compare(ours, theirs)
    same_t, tie_t, real_t = _compare(ours, (via_torch[0].numpy(), via_torch[1].numpy()))
    m_ours, m_torch, m_faiss, m_eval = (
        statistics.median(t) for t in (t_ours, t_torch, t_faiss, t_eval)
    )
    gflop = 2 * Q * N * DIM / 1e9
    lines = [
        f"Exact top-{K} inner product, {Q:,} queries x {N:,} docs, dim {DIM:,}, fp32 "
        f"(median of {args.runs} interleaved runs).",
        "",
        "| method | median s | min s | runs (s) | median CPU s | GFLOP/s (median) "
        "| speedup vs faiss (median) |",
        "|---|---|---|---|---|---|---|",
        f"| vltrain `topk_similarity` | {m_ours:.2f} | {min(t_ours):.2f} | {_fmt(t_ours)} "
        f"| {_cpu('ours')} | {gflop / m_ours:.0f} | {m_faiss / m_ours:.2f}x |",
        f"| same, torch.mm (MKL) matmul path | {m_torch:.2f} | {min(t_torch):.2f} "
        f"| {_fmt(t_torch)} | {_cpu('torch')} | {gflop / m_torch:.0f} | {m_faiss / m_torch:.2f}x |",
        f"| faiss `IndexFlatIP` add+search | {m_faiss:.2f} | {min(t_faiss):.2f} "
        f"| {_fmt(t_faiss)} | {_cpu('faiss')} | {gflop / m_faiss:.0f} | 1.00x |",
        f"| vltrain `evaluate_retrieval` (top-10 + exact ranks + metrics) | {m_eval:.2f} "
        f"| {min(t_eval):.2f} | {_fmt(t_eval)} | {_cpu('eval')} | {gflop / m_eval:.0f} | - |",
        "",
        f"Top-{K} lists vs faiss: {same}/{Q} rows identical, {tie_only} differ only in the order "
        f"of near-equal scores (|diff| <= 1e-5), {real} really differ. numpy-matmul vs "
        f"torch.mm path: {same_t} identical, {tie_t} tie order only, {real_t} really differ.",
        f"evaluate_retrieval on random data (sanity): R@10 {metrics['R@10']:.5f}, "
        f"chance {10 / N:.5f}.",
        f"Load average (1 min) before/after: {load0:.1f}/{os.getloadavg()[0]:.1f} "
        "(other jobs share the CPUs; times are wall clock).",
        "",
        f"Machine: {_machine()}. Versions: python {platform.python_version()}, "
        f"torch {torch.__version__}, faiss {faiss.__version__}, numpy {np.__version__}.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


def _cpu(name: str) -> str:
    return f"{statistics.median(CPU_S[name]):.2f}"


def _fmt(ts: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in ts)


if __name__ == "__main__":
    main()
