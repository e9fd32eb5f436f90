"""Losses simulated from known L(N, D) parameters on an isoFLOP grid (recovery tests, the
side-by-side with `chinchilla`): the grid is `per_budget` sizes spaced log-evenly over
[N_opt / spread * shift, N_opt * spread * shift] at each budget; noise is multiplicative."""

from __future__ import annotations

import numpy as np

from vltrain.scaling.fit import Runs, optimal_allocation, predict_loss

#: Epoch AI's refit of Hoffmann et al. (Besiroglu et al. 2024)
EPOCH_AI = {"E": 1.8172, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658}


def isoflop_grid(
    params: dict[str, float],
    budgets,
    per_budget: int = 7,
    spread: float = 8.0,
    shift: float = 1.0,
    noise: float = 0.005,
    seed: int = 0,
) -> Runs:
    rng = np.random.default_rng(seed)
    n, d, c = [], [], []
    for budget in budgets:
        n_opt, _ = optimal_allocation(params, budget)
        for f in np.logspace(-np.log10(spread), np.log10(spread), per_budget):
            size = n_opt * f * shift
            n.append(size)
            d.append(budget / (6 * size))
            c.append(budget)
    n, d, c = np.array(n), np.array(d), np.array(c)
    loss = predict_loss(params, n, d) * np.exp(rng.normal(0.0, noise, len(n)))
    return Runs(n, d, loss, c)
