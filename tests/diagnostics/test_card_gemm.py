"""The GEMM rate the quickstart prints beside its times."""

from __future__ import annotations

import torch

from vltrain.diagnostics import card


def test_cpu_gemm_gflops_counts_the_flops_it_timed(monkeypatch) -> None:
    """2 n^3 FLOPs per product, divided by the time the products took (a fake clock)."""
    ticks = iter([0.0, 0.1, 0.2, 0.3, 0.4])  # t0, then one read per check, then the end
    monkeypatch.setattr(card.time, "perf_counter", lambda: next(ticks))
    calls = []
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: calls.append(1) or real(a, b))
    rate = card.cpu_gemm_gflops(seconds=0.3, n=8)
    reps = len(calls) - 1  # the warm-up is not timed
    # two products before the clock is read, one more after 0.1 and after 0.2; 0.3 stops it
    assert reps == 4
    assert rate == 2 * 8**3 * 4 / 0.4 / 1e9  # timed from t0 to the final read, 0.4
