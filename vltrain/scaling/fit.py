"""Scaling-law fits: Chinchilla's approach 2 (isoFLOP parabolas) and approach 3 (a parametric
L(N, D) = E + A / N^alpha + B / D^beta fitted with a Huber loss on log L), with bootstrap
intervals. Hoffmann et al. 2022, appendix D; Besiroglu et al. 2024 (Epoch AI) for the refit.
"""

from __future__ import annotations

import csv
import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize
from scipy.special import logsumexp

from vltrain.config.core import ConfigError, check_choice
from vltrain.scaling.identify import identifiability_warnings

HUBER_DELTA = 1e-3
#: `huber_delta="auto"`: delta = this x the robust standard deviation of the log residuals
#: (Huber's constant: 95% of least squares' efficiency under Gaussian noise, while a run
#: further out than delta still pulls on the fit only linearly)
AUTO_DELTA_K = 1.345
#: approach 3's initialisation grid (Hoffmann et al.'s, every other point in e, a, b)
GRID = {
    "e": (-1.0, 0.0, 1.0),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
}


@dataclass
class Runs:
    """Training runs: non-embedding parameters N, tokens D, final loss L, budget group C."""

    params: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    budget: np.ndarray | None = None
    """The isoFLOP group of each run (its budget), None when the runs form no groups."""

    def take(self, idx: np.ndarray) -> Runs:
        b = None if self.budget is None else self.budget[idx]
        return Runs(self.params[idx], self.tokens[idx], self.loss[idx], b)

    def __len__(self) -> int:
        return len(self.loss)


def read_runs_csv(path: str | Path) -> Runs:
    """Columns `params`, `tokens` (or `flops`: tokens = flops / (6 params)) and `loss`;
    optional `budget` names each run's isoFLOP group (else `flops`, grouped within 5%)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(f))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save "
            "it as UTF-8 CSV"
        ) from None
    if not rows:
        raise ConfigError(f"{path} holds no runs")
    cols = set(rows[0])
    missing = {"params", "loss"} - cols
    if missing or not ({"tokens", "flops"} & cols):
        raise ConfigError(
            f"{path}: needs columns params, loss and tokens or flops; has {sorted(cols)}"
        )

    def col(name: str) -> np.ndarray:
        values = []
        for row, r in enumerate(rows, start=2):  # the header is line 1
            cell = r.get(name)
            try:
                values.append(float(cell))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                what = "is missing" if cell in (None, "") else f"is {cell!r}, not a number"
                raise ConfigError(
                    f"{path}:{row}: column {name!r} {what}; fill in the value or delete the row"
                ) from None
        return np.array(values)

    size = "tokens" if "tokens" in cols else "flops"  # D, or the FLOPs it follows from
    params, given, loss = col("params"), col(size), col("loss")
    values = np.stack([params, given, loss])  # (3, R): the cells as written
    nan = np.isnan(values)
    bad = ((values <= 0) | np.isinf(values)) & ~nan.any(axis=0)
    problems = []
    for cells, what in ((nan, "NaN"), (bad, "non-positive or infinite values")):
        lines = [int(i) + 2 for i in np.nonzero(cells.any(axis=0))[0]]  # CSV line numbers
        if lines:
            names = ("params", size, "loss")
            where = ", ".join(n for n, c in zip(names, cells.any(axis=1), strict=True) if c)
            problems.append(f"rows {lines} hold {what} (in {where})")
    if problems:
        raise ConfigError(f"{path}: {'; '.join(problems)}; fix or delete those rows")
    tokens = given if size == "tokens" else given / (6 * params)
    budget = col("budget") if "budget" in cols else None
    if budget is None and "flops" in cols:
        budget = group_budgets(col("flops"))
    return Runs(params, tokens, loss, budget)


#: counted FLOPs within this relative distance of a group's smallest are one isoFLOP budget
BUDGET_TOLERANCE = 0.05


def group_budgets(flops: np.ndarray, tolerance: float = BUDGET_TOLERANCE) -> np.ndarray:
    """isoFLOP groups from counted FLOPs: a run belongs to the group of the smallest value it
    lies within `tolerance` (relative) of, since counted FLOPs miss a budget by a fraction of
    a step (e.g. 4.96e10 and 4.99e10 for a 5e10 budget). Each group is named by its median."""
    order = np.argsort(flops)
    label = np.empty(len(flops), dtype=int)
    start, g = flops[order[0]], 0
    for i in order:
        if flops[i] > start * (1 + tolerance):
            start, g = flops[i], g + 1
        label[i] = g
    names = np.array([np.median(flops[label == k]) for k in range(g + 1)])
    return names[label]


# ------------------------------------------------------------------------------ approach 3


def _objective(
    theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float
) -> tuple[float, np.ndarray]:
    """Sum of Huber(LSE(a - alpha log N, b - beta log D, e) - log L) and its gradient."""
    e, a, b, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])  # (3, R)
    pred = logsumexp(terms, axis=0)  # (R,)
    r = pred - log_l
    absr = np.abs(r)
    loss = np.where(absr <= delta, 0.5 * r**2, delta * (absr - 0.5 * delta)).sum()
    w = np.exp(terms - pred) * np.clip(r, -delta, delta)  # (3, R): dHuber/dterm
    grad = np.array(
        [w[2].sum(), w[0].sum(), w[1].sum(), -(w[0] * log_n).sum(), -(w[1] * log_d).sum()]
    )
    return float(loss), grad


def _grid_objective(runs: Runs, delta: float) -> tuple[np.ndarray, np.ndarray]:
    grid = np.array(list(itertools.product(*GRID.values())))  # (G, 5)
    log_n, log_d, log_l = np.log(runs.params), np.log(runs.tokens), np.log(runs.loss)
    e, a, b, al, be = (grid[:, i : i + 1] for i in range(5))
    pred = np.logaddexp(np.logaddexp(a - al * log_n, b - be * log_d), e)  # (G, R)
    r = np.abs(pred - log_l)
    vals = np.where(r <= delta, 0.5 * r**2, delta * (r - 0.5 * delta)).sum(1)
    return grid, vals


#: the smooth problem whose solution starts a small-delta fit (near least squares for log-noise
#: up to a few %)
CONTINUATION_DELTA = 0.1
#: L-BFGS-B's stopping rules: run every start to its optimum. scipy's defaults stop once a step
#: lowers the objective by < 2.2e-9 x max(|f|, 1); with f ~1e-4 (Huber, delta 1e-3, on log
#: residuals ~1e-2) that is 2e-5 of f, which a crawl along a flat valley drops under early.
#: Measured with the defaults: bootstrap refits started at the full-data optimum ended up to
#: 21% above their own on 24 of 30 resamples (intervals 20-900x too narrow), and the demo sweeps
#: bench/scaling/demo_runs.csv and tests/scaling/data/shapes_sweep.csv stopped 4% and 60%
#: above their optimum (the latter at alpha = 2.0, the grid's edge, for 0.53).
CONVERGED = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 15000}


def fit_parametric(
    runs: Runs,
    delta: float = HUBER_DELTA,
    starts: Sequence[np.ndarray] = (),
    n_best: int = 8,
    continuation: bool = True,
    options: dict[str, float] | None = None,
) -> dict[str, float]:
    """Approach 3: L-BFGS from the `n_best` grid points (plus `starts`); E, A, B, alpha, beta.

    `continuation`: for delta < CONTINUATION_DELTA, also start from the solution at
    CONTINUATION_DELTA. A delta far below the noise makes the surface nearly piecewise
    linear, where L-BFGS-B stalls and every grid start can end in a wrong basin; the smooth
    problem's optimum lies in the right one. Same loss, one more start. `options`: L-BFGS-B's
    stopping rules (CONVERGED when None)."""
    if len(runs) < 5:
        raise ConfigError(f"approach 3 fits 5 parameters: needs at least 5 runs, got {len(runs)}")
    inits = list(starts)
    if n_best:
        grid, vals = _grid_objective(runs, delta)
        inits += list(grid[np.argsort(vals)[:n_best]])
    if continuation and delta < CONTINUATION_DELTA:
        smooth = fit_parametric(
            runs, CONTINUATION_DELTA, starts, n_best, continuation=False, options=options
        )
        inits.append(_theta(smooth))
    if not inits:
        raise ValueError("fit_parametric: no start (n_best=0 and no starts)")
    args = (np.log(runs.params), np.log(runs.tokens), np.log(runs.loss), delta)
    options = CONVERGED if options is None else options
    best = None
    for x0 in inits:
        res = optimize.minimize(
            _objective, x0, args=args, jac=True, method="L-BFGS-B", options=options
        )
        if np.isfinite(res.fun) and (best is None or res.fun < best.fun):
            best = res
    e, a, b, alpha, beta = best.x
    return {
        "E": math.exp(e),
        "A": math.exp(a),
        "B": math.exp(b),
        "alpha": float(alpha),
        "beta": float(beta),
        "objective": float(best.fun),
    }


def _theta(p: dict[str, float]) -> np.ndarray:
    """(log E, log A, log B, alpha, beta): the parameterisation the optimiser works in. The
    optimiser is unbounded in log space, so a fit with no visible floor can return an E that
    underflowed to 0 (log E below -745); its log is taken at the smallest positive float,
    where E is as negligible as it was."""
    logs = [math.log(max(p[k], sys.float_info.min)) for k in ("E", "A", "B")]
    return np.array([*logs, p["alpha"], p["beta"]])


def residual_scale(runs: Runs, p: dict[str, float]) -> float:
    """Robust standard deviation of fit `p`'s log residuals: 1.4826 x their median absolute
    deviation, scaled by sqrt(R / (R - 5)) for the five fitted parameters."""
    r = np.log(predict_loss(p, runs.params, runs.tokens)) - np.log(runs.loss)  # (R,)
    mad = float(np.median(np.abs(r - np.median(r))))
    return 1.4826 * mad * math.sqrt(len(r) / max(len(r) - 5, 1))


def refit_auto_delta(runs: Runs, p3: dict[str, float]) -> tuple[dict[str, float], float]:
    """Approach 3 again with delta = AUTO_DELTA_K x the residual scale of `p3` (a fit with
    HUBER_DELTA), started from `p3` and the grid. With delta 1e-3 far below the noise
    (log-loss noise ~1e-2 is common) the Huber loss is an absolute-error loss, which uses
    Gaussian-like noise at ~64% efficiency; sized to the noise it is ~95% efficient and
    still bounds the pull of an outlier."""
    delta = max(AUTO_DELTA_K * residual_scale(runs, p3), 1e-6)
    return fit_parametric(runs, delta=delta, starts=[_theta(p3)]), delta


def predict_loss(p: dict[str, float], n: np.ndarray, d: np.ndarray) -> np.ndarray:
    return p["E"] + p["A"] / np.power(n, p["alpha"]) + p["B"] / np.power(d, p["beta"])


def optimal_allocation(p: dict[str, float], flops: float) -> tuple[float, float]:
    """N_opt, D_opt minimising L(N, D) under C = 6 N D (Hoffmann et al. eq. 4)."""
    alpha, beta = p["alpha"], p["beta"]
    g = (alpha * p["A"] / (beta * p["B"])) ** (1.0 / (alpha + beta))
    n = g * (flops / 6.0) ** (beta / (alpha + beta))
    return n, flops / (6.0 * n)


# ------------------------------------------------------------------------------ approach 2


@dataclass
class IsoFlopGroup:
    budget: float
    log_n: np.ndarray
    loss: np.ndarray
    coef: np.ndarray
    """Parabola c2 x^2 + c1 x + c0 in x = log N."""
    n_opt: float
    d_opt: float
    asymmetry: float
    """Where the optimum lies in the sampled log-N range: 0 = centre, +-1 = an edge."""


def fit_isoflop(runs: Runs) -> tuple[list[IsoFlopGroup], dict[str, float], list[str]]:
    """Approach 2: a parabola in log N per budget -> N_opt(C), D_opt(C) = C^a, C^b.

    Returns the groups, {a, b, log_kn, log_kd} and warnings (grid asymmetry, bad groups)."""
    if runs.budget is None:
        raise ConfigError("approach 2 needs isoFLOP groups (a budget or flops column)")
    groups, warnings = [], []
    for c in sorted(set(runs.budget.tolist())):
        sel = runs.budget == c
        distinct = len(set(runs.params[sel].tolist()))
        if distinct < 3:
            warnings.append(f"budget {c:.3g}: {distinct} sizes, a parabola needs 3; skipped")
            continue
        x, y = np.log(runs.params[sel]), runs.loss[sel]
        x0 = x.mean()  # centred: a parabola in raw log N (~20) is poorly conditioned
        c2, c1, c0 = np.polyfit(x - x0, y, 2)
        coef = np.array([c2, c1 - 2 * c2 * x0, c0 - c1 * x0 + c2 * x0**2])  # in raw x
        if coef[0] <= 0:
            warnings.append(f"budget {c:.3g}: the losses curve down (no minimum); skipped")
            continue
        x_opt = -coef[1] / (2 * coef[0])
        slope = np.polyfit(x, np.log(runs.tokens[sel]), 1)  # log D along the isoFLOP line
        lo, hi = x.min(), x.max()
        asym = float((x_opt - (lo + hi) / 2) / ((hi - lo) / 2))
        groups.append(
            IsoFlopGroup(c, x, y, coef, math.exp(x_opt), math.exp(np.polyval(slope, x_opt)), asym)
        )
        if abs(asym) > 0.5:
            where = "outside" if abs(asym) > 1 else "off-centre in"
            warnings.append(
                f"budget {c:.3g}: the fitted optimum N={math.exp(x_opt):.3g} lies {where} the "
                f"sampled sizes (asymmetry {asym:+.2f}); approach 2's exponent is biased by an "
                "asymmetric grid: add sizes on the "
                + ("larger" if asym > 0 else "smaller")
                + " side"
            )
    if len(groups) < 2:
        raise ConfigError(f"approach 2 needs 2 budgets with a minimum; {'; '.join(warnings)}")
    log_c = np.log([g.budget for g in groups])
    a, kn = np.polyfit(log_c, np.log([g.n_opt for g in groups]), 1)
    b, kd = np.polyfit(log_c, np.log([g.d_opt for g in groups]), 1)
    return (
        groups,
        {"a": float(a), "b": float(b), "log_kn": float(kn), "log_kd": float(kd)},
        warnings,
    )


# ------------------------------------------------------------------------------ exclusion


def _worst_by_residual(runs: Runs, p3: dict[str, float], k: int) -> list[int]:
    """The k runs approach 3 fits worst (largest |log residual|)."""
    resid = np.abs(np.log(predict_loss(p3, runs.params, runs.tokens)) - np.log(runs.loss))
    return sorted(int(i) for i in np.argsort(resid)[::-1][:k])


def _worst_by_loss(runs: Runs, p3: dict[str, float], k: int) -> list[int]:
    """The k runs with the highest loss (Besiroglu et al.'s protocol: they drop the 5
    highest-loss runs of Hoffmann et al.'s Figure 4, ties included)."""
    cut = np.sort(runs.loss)[-k]
    return [int(i) for i in np.nonzero(runs.loss >= cut)[0]]


#: how `--exclude-worst K` picks the runs it drops
EXCLUSION_RULES = {"residual": _worst_by_residual, "loss": _worst_by_loss}


# ------------------------------------------------------------------------------ bootstrap


@dataclass
class FitResult:
    approach3: dict[str, float]
    approach2: dict[str, float] | None
    groups: list[IsoFlopGroup]
    ci: dict[str, list[float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    excluded: list[int] = field(default_factory=list)
    target: dict[str, Any] = field(default_factory=dict)
    huber_delta: float = HUBER_DELTA
    """The delta approach 3 was fitted with (HUBER_DELTA, a given one, or the auto one)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: self.approach3[k] for k in ("E", "A", "B", "alpha", "beta")}
        out["a_approach3"] = out["beta"] / (out["alpha"] + out["beta"])
        out["b_approach3"] = out["alpha"] / (out["alpha"] + out["beta"])
        if self.approach2:
            out["a"], out["b"] = self.approach2["a"], self.approach2["b"]
            out["isoflop"] = [
                {"budget": g.budget, "N_opt": g.n_opt, "D_opt": g.d_opt, "asymmetry": g.asymmetry}
                for g in self.groups
            ]
        out.update(self.target)
        out["ci"] = self.ci
        out["warnings"] = self.warnings
        out["excluded_runs"] = self.excluded
        out["huber_delta"] = self.huber_delta
        return out


def _targets(p3: dict, p2: dict | None, target: float | None) -> dict[str, float]:
    if not target:
        return {}
    n3, d3 = optimal_allocation(p3, target)
    out = {"target_flops": target, "N_opt": n3, "D_opt": d3}
    if p2:
        out["N_opt_approach2"] = math.exp(p2["log_kn"]) * target ** p2["a"]
        out["D_opt_approach2"] = math.exp(p2["log_kd"]) * target ** p2["b"]
    return out


def fit_all(
    runs: Runs,
    bootstrap: int = 0,
    exclude_worst: int = 0,
    target: float | None = None,
    seed: int = 0,
    level: float = 0.95,
    exclude_by: str = "residual",
    predict_with: str = "narrower",
    huber_delta: float | str = HUBER_DELTA,
) -> FitResult:
    """Both approaches, the `exclude_worst` worst runs dropped (by approach 3's residual, or
    by loss: `EXCLUSION_RULES`), bootstrap intervals (runs resampled with replacement, within
    each budget group when there are groups), the allocation at `target` FLOPs by the
    approach `predict_with` picks (:func:`choose_prediction`). `huber_delta`: a number, or
    "auto" (:func:`refit_auto_delta`, after the exclusion; the bootstrap keeps that delta)."""
    check_choice("--exclude-by", exclude_by, EXCLUSION_RULES)
    if not (huber_delta == "auto" or (isinstance(huber_delta, float) and huber_delta > 0)):
        raise ConfigError(f"--huber-delta {huber_delta!r}: expected a positive number or auto")
    excluded: list[int] = []
    if exclude_worst and exclude_worst >= len(runs) - 4:  # before any fit
        raise ConfigError(
            f"--exclude-worst {exclude_worst} leaves {max(len(runs) - exclude_worst, 0)} of "
            f"{len(runs)} runs; approach 3 needs at least 5: lower it to at most "
            f"{max(len(runs) - 5, 0)}"
        )
    p3 = fit_parametric(runs)
    if exclude_worst:
        excluded = EXCLUSION_RULES[exclude_by](runs, p3, exclude_worst)
        runs = runs.take(np.setdiff1d(np.arange(len(runs)), excluded))
        p3 = fit_parametric(runs)
    delta = HUBER_DELTA
    if huber_delta == "auto":
        p3, delta = refit_auto_delta(runs, p3)
    elif huber_delta != HUBER_DELTA:
        delta = float(huber_delta)
        p3 = fit_parametric(runs, delta=delta, starts=[_theta(p3)])
    unidentified = identifiability_warnings(runs.params, runs.tokens, runs.budget, BUDGET_TOLERANCE)
    warnings = unidentified + degenerate_warnings(p3, runs)
    p2, groups, approach2_warnings = _approach2(runs)
    warnings += approach2_warnings
    result = FitResult(
        p3,
        p2,
        groups,
        warnings=warnings,
        excluded=excluded,
        target=_targets(p3, p2, target),
        huber_delta=delta,
    )
    if bootstrap:
        result.ci = _bootstrap(runs, p3, bootstrap, target, seed, level, p2 is not None, delta)
    if target:
        result.target.update(choose_prediction(result, predict_with))
        result.target["prediction_identified"] = not unidentified
        if unidentified:
            result.warnings.append(
                f"the prediction at C = {target:.3g} (N_opt, D_opt) is not identified by these "
                "runs (the warnings above say why): it is the assumed form's guess, not a "
                "measurement"
            )
    return result


def _approach2(runs: Runs) -> tuple[dict[str, float] | None, list[IsoFlopGroup], list[str]]:
    """Approach 2 where the runs allow it; else None and why it was skipped."""
    budgets = [] if runs.budget is None else sorted(set(runs.budget.tolist()))
    if len(budgets) < 2:
        held = f"one budget ({budgets[0]:.3g})" if budgets else "no budget or flops column"
        why = (
            f"approach 2 skipped: the runs hold {held}; it fits a parabola per budget and "
            "needs at least 2 budgets with 3 or more sizes each"
        )
        return None, [], [why]
    try:
        groups, p2, warnings = fit_isoflop(runs)
    except ConfigError as e:
        return None, [], [f"approach 2 skipped: {e}"]
    return p2, groups, warnings


def degenerate_warnings(p3: dict[str, float], runs: Runs) -> list[str]:
    """What makes approach 3's extrapolation suspect: a floor E that vanished (no floor is
    visible in the runs, so the fit is a pure power law), or an exponent at the edge of
    plausibility (<= 0.02: that term is flat; >= 2: past the initialisation grid)."""
    out = []
    if p3["E"] < 1e-3 * float(np.min(runs.loss)):
        out.append(
            f"approach 3: E = {p3['E']:.3g}, no loss floor is visible in these runs: the fit "
            "is a pure power law and its extrapolation assumes the loss keeps falling; "
            "widen the budgets, or compare approach 2"
        )
    for k in ("alpha", "beta"):
        if not 0.02 < p3[k] < 2.0:
            out.append(
                f"approach 3: {k} = {p3[k]:.3g} is at the edge of plausibility: that term is "
                "poorly determined by these runs"
            )
    return out


# ------------------------------------------------------------------------------ prediction

#: approach -> (its N_opt, D_opt keys in FitResult.target)
PREDICTORS = {"approach3": ("N_opt", "D_opt"), "approach2": ("N_opt_approach2", "D_opt_approach2")}


def _log_width(ci: dict[str, list[float]], key: str) -> float:
    lo, hi = ci.get(key, (0.0, 0.0))
    return math.log(hi / lo) if lo > 0 and hi > 0 else math.inf


def choose_prediction(result: FitResult, predict_with: str = "narrower") -> dict[str, Any]:
    """Which approach's N_opt(C) the prediction (and `--predict`'s config) uses: `approach3`,
    `approach2`, or `narrower`: the one whose bootstrap interval on N_opt at C is narrower
    in log (approach 3 without a bootstrap or without isoFLOP groups). With few runs the five
    parameters of approach 3 are poorly determined (E trades off against B / D^beta), while
    approach 2 only interpolates measured minima; the bootstrap says which is the case."""
    check_choice("--predict-with", predict_with, {**PREDICTORS, "narrower": None})
    t = result.target
    have = [k for k, (n, _) in PREDICTORS.items() if n in t]
    if predict_with == "narrower":
        widths = {k: _log_width(result.ci, PREDICTORS[k][0]) for k in have}
        name = min(have, key=lambda k: (widths[k], k != "approach3"))
    elif predict_with in have:
        name = predict_with
    else:
        raise ConfigError(f"--predict-with {predict_with}: the runs hold no isoFLOP groups")
    n_key, d_key = PREDICTORS[name]
    out = {"predicted_by": name, "N_opt_predicted": t[n_key], "D_opt_predicted": t[d_key]}
    if n_key in result.ci:
        out["N_opt_predicted_ci"] = result.ci[n_key]
    return out


def _resample(runs: Runs, rng: np.random.Generator) -> np.ndarray:
    if runs.budget is None:
        return rng.integers(0, len(runs), len(runs))
    parts = []
    for c in np.unique(runs.budget):
        idx = np.nonzero(runs.budget == c)[0]
        parts.append(rng.choice(idx, len(idx), replace=True))
    return np.concatenate(parts)


def _refit(sub: Runs, delta: float, start: np.ndarray) -> dict[str, float]:
    """Approach 3 on a resample: from the full-data optimum `start`, and from the resample's
    own smooth (delta 0.1) optimum started there, each run to convergence (CONVERGED). A
    refit that stops near its start makes the intervals as narrow as the optimiser's first
    steps, not as wide as the data's spread."""
    return fit_parametric(sub, delta, starts=[start], n_best=0)


def _bootstrap(
    runs: Runs,
    p3: dict,
    n: int,
    target: float | None,
    seed: int,
    level: float,
    with_p2: bool,
    delta: float = HUBER_DELTA,
) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    start = _theta(p3)
    samples: dict[str, list[float]] = {}
    for _ in range(n):
        sub = runs.take(_resample(runs, rng))
        q3 = _refit(sub, delta, start)
        row = {k: q3[k] for k in ("E", "A", "B", "alpha", "beta")}
        row["a_approach3"] = q3["beta"] / (q3["alpha"] + q3["beta"])
        q2 = None
        if with_p2:
            try:
                _, q2, _ = fit_isoflop(sub)
                row.update(a=q2["a"], b=q2["b"])
            except ConfigError:
                pass  # a resample whose groups lost their minimum: no approach-2 sample
        row.update({k: v for k, v in _targets(q3, q2, target).items() if k != "target_flops"})
        for k, v in row.items():
            samples.setdefault(k, []).append(v)
    lo, hi = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    return {
        k: [float(np.percentile(v, lo)), float(np.percentile(v, hi))] for k, v in samples.items()
    }
