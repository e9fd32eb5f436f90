"""Plots of a fit: isoFLOP curves with their parabolas, N_opt vs C, loss contours (PNG)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vltrain.scaling.fit import FitResult, Runs, optimal_allocation, predict_loss


def save_plots(runs: Runs, result: FitResult, folder: Path) -> list[Path]:
    """Write isoflop.png, nopt.png and contours.png into `folder`; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for g in result.groups:
        (line,) = ax.plot(np.exp(g.log_n), g.loss, "o", label=f"C={g.budget:.2g}")
        x = np.linspace(g.log_n.min() - 0.2, g.log_n.max() + 0.2, 100)
        ax.plot(np.exp(x), np.polyval(g.coef, x), "-", color=line.get_color())
        ax.axvline(g.n_opt, color=line.get_color(), ls=":", lw=0.8)
    ax.set(
        xscale="log",
        xlabel="non-embedding parameters N",
        ylabel="eval loss",
        title="isoFLOP curves (approach 2)",
    )
    ax.legend(fontsize=7)
    paths.append(_save(fig, folder / "isoflop.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    budgets = sorted(set(runs.budget.tolist())) if runs.budget is not None else []
    if budgets:
        cs = np.logspace(np.log10(min(budgets)) - 0.5, np.log10(max(budgets)) + 0.5, 50)
        ax.plot(
            cs, [optimal_allocation(result.approach3, c)[0] for c in cs], "-", label="approach 3"
        )
    if result.approach2:
        p2 = result.approach2
        ax.plot(
            [g.budget for g in result.groups],
            [g.n_opt for g in result.groups],
            "s",
            label="isoFLOP minima",
        )
        ax.plot(
            cs, np.exp(p2["log_kn"]) * cs ** p2["a"], "--", label=f"approach 2: a={p2['a']:.2f}"
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="training FLOPs C",
        ylabel="N_opt",
        title="compute-optimal model size",
    )
    ax.legend(fontsize=7)
    paths.append(_save(fig, folder / "nopt.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    n = np.logspace(np.log10(runs.params.min()) - 0.5, np.log10(runs.params.max()) + 0.5, 80)
    d = np.logspace(np.log10(runs.tokens.min()) - 0.5, np.log10(runs.tokens.max()) + 0.5, 80)
    nn_, dd = np.meshgrid(n, d)
    cont = ax.contourf(nn_, dd, predict_loss(result.approach3, nn_, dd), levels=20)
    fig.colorbar(cont, ax=ax, label="fitted loss")
    ax.scatter(runs.params, runs.tokens, c="w", s=10, edgecolors="k")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="N",
        ylabel="D (tokens)",
        title="approach 3: L(N, D) contours",
    )
    paths.append(_save(fig, folder / "contours.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
