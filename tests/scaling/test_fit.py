"""Scaling-law fits recover planted parameters; approach 2 warns on an asymmetric grid."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vltrain.cli import main
from vltrain.config.core import ConfigError
from vltrain.scaling import fit
from vltrain.scaling.simulate import EPOCH_AI, isoflop_grid
from vltrain.scaling.sizes import Size, parse_size, size_for_params, width_for_params

BUDGETS = np.logspace(18, 22, 5)
TRUE_A = EPOCH_AI["beta"] / (EPOCH_AI["alpha"] + EPOCH_AI["beta"])


def test_approach3_recovers_planted_exponent():
    runs = isoflop_grid(EPOCH_AI, BUDGETS, per_budget=7, noise=0.005, seed=1)
    p = fit.fit_parametric(runs)
    assert p["beta"] / (p["alpha"] + p["beta"]) == pytest.approx(TRUE_A, abs=0.02)
    assert p["E"] == pytest.approx(EPOCH_AI["E"], rel=0.05)


def test_approach2_recovers_exponent_on_a_centred_grid():
    runs = isoflop_grid(EPOCH_AI, BUDGETS, per_budget=9, spread=4.0, noise=0.002, seed=2)
    groups, p2, warnings = fit.fit_isoflop(runs)
    assert p2["a"] == pytest.approx(TRUE_A, abs=0.02)
    assert p2["a"] + p2["b"] == pytest.approx(1.0, abs=0.02)  # C = 6 N D on every group
    assert not warnings


def test_asymmetric_grid_warns_and_is_biased():
    """A grid drifting off the optimum (Open-Athena's scenario) is flagged; the centred one is
    not (the negative control above)."""
    budgets = BUDGETS
    rng = np.random.default_rng(0)
    n, d, c = [], [], []
    for i, b in enumerate(budgets):  # the sampling centre drifts with the budget
        n_opt, _ = fit.optimal_allocation(EPOCH_AI, b)
        for f in np.logspace(-1, 1, 7) * 3.0 ** (i - 2):
            n.append(n_opt * f)
            d.append(b / (6 * n_opt * f))
            c.append(b)
    n, d, c = map(np.array, (n, d, c))
    loss = fit.predict_loss(EPOCH_AI, n, d) * np.exp(rng.normal(0, 0.001, len(n)))
    _, p2, warnings = fit.fit_isoflop(fit.Runs(n, d, loss, c))
    assert any("asymmetric grid" in w for w in warnings)


def test_bootstrap_interval_covers_truth_and_exclusion_drops_outliers():
    runs = isoflop_grid(EPOCH_AI, BUDGETS[:3], per_budget=6, noise=0.005, seed=3)
    runs.loss[4] *= 1.5  # one broken run
    res = fit.fit_all(runs, bootstrap=8, exclude_worst=1, target=1e23, seed=0)
    assert res.excluded == [4]
    lo, hi = res.ci["a_approach3"]
    assert lo <= hi
    assert lo - 0.03 <= TRUE_A <= hi + 0.03
    assert set(res.ci) >= {"E", "A", "B", "alpha", "beta", "a", "b", "N_opt"}


#: the law planted in the review's data (4 budgets x 7 sizes, 0.3% noise, seed 0)
REVIEW_LAW = {"E": 1.8, "A": 400.0, "B": 2000.0, "alpha": 0.34, "beta": 0.37}


def _stalling_refit(sub: fit.Runs, delta: float, start: np.ndarray) -> dict[str, float]:
    """The bootstrap's refit before the fix: one L-BFGS-B run from the full-data optimum (plus
    the best grid point) at scipy's default tolerances, which stop a few steps from it."""
    return fit.fit_parametric(sub, delta, [start], n_best=1, continuation=False, options={})


def test_bootstrap_refits_reach_the_optimum():
    """Each resample's refit ends at least as low as a cold fit (8 grid starts + continuation)
    of the same resample; the old refit ends above it on most (the negative control)."""
    runs = isoflop_grid(REVIEW_LAW, BUDGETS[:4], per_budget=7, noise=0.003, seed=0)
    start = fit._theta(fit.fit_parametric(runs))
    rng = np.random.default_rng(0)
    worse_before = 0
    for _ in range(6):
        sub = runs.take(fit._resample(runs, rng))
        cold = fit.fit_parametric(sub)["objective"]
        assert fit._refit(sub, fit.HUBER_DELTA, start)["objective"] <= cold * (1 + 1e-6)
        worse_before += _stalling_refit(sub, fit.HUBER_DELTA, start)["objective"] > cold * 1.001
    assert worse_before >= 4


@pytest.mark.slow
def test_bootstrap_intervals_cover_the_truth(monkeypatch):
    """On the review's data (a known law, seeded noise) the 95% intervals from 100 resamples
    contain every planted parameter, the exponent a and N_opt at 1e22. Negative control: the
    old refit's intervals (the optimiser's first steps, not the data's spread: median widths
    20-25x narrower on alpha and beta, 700-900x on A and B) contain no parameter nor a. Over
    30 such datasets (seeds 0-29) the converged refits' intervals contained each of these on
    27-29 of 30, the old ones on 0-15."""
    runs = isoflop_grid(REVIEW_LAW, BUDGETS[:4], per_budget=7, noise=0.003, seed=0)
    truth = dict(REVIEW_LAW)
    truth["a_approach3"] = REVIEW_LAW["beta"] / (REVIEW_LAW["alpha"] + REVIEW_LAW["beta"])
    truth["N_opt"] = fit.optimal_allocation(REVIEW_LAW, 1e22)[0]
    ci = fit.fit_all(runs, bootstrap=100, target=1e22, seed=0).ci
    assert {k for k, v in truth.items() if ci[k][0] <= v <= ci[k][1]} == set(truth), ci
    monkeypatch.setattr(fit, "_refit", _stalling_refit)
    ci = fit.fit_all(runs, bootstrap=100, target=1e22, seed=0).ci
    truth.pop("N_opt")  # the old interval holds it here (on 15 of the 30 datasets)
    assert not {k for k, v in truth.items() if ci[k][0] <= v <= ci[k][1]}, ci


def test_a_fit_runs_to_its_optimum():
    """The scaling demo's third sweep (tests/scaling/data/shapes_sweep.csv, 15 runs): run to
    convergence the fit reaches the optimum that 60 grid starts reach (golden values, the
    objective to 1e-6 relative). Negative control: with scipy's default stopping rules every
    start stopped early, the best at alpha = 2.0 (the grid's edge) with an objective 60%
    higher: the 'degenerate' approach 3 docs/scaling.md once reported for this sweep."""
    runs = fit.read_runs_csv(Path(__file__).parent / "data" / "shapes_sweep.csv")
    p = fit.fit_parametric(runs)
    assert p["objective"] == pytest.approx(3.2994e-4, rel=1e-4)
    assert (p["alpha"], p["beta"]) == pytest.approx((0.531, 0.2256), abs=2e-3)
    early = fit.fit_parametric(runs, options={})  # scipy's defaults
    assert early["objective"] > 1.5 * p["objective"] and early["alpha"] > 1.99


def test_a_nan_cell_is_called_nan(tmp_path):
    csv = tmp_path / "runs.csv"
    csv.write_text("params,flops,loss\n1e6,1e15,3.0\n2e6,1e15,nan\nnan,1e15,2.8\n3e6,0,2.7\n")
    with pytest.raises(ConfigError) as e:
        fit.read_runs_csv(csv)
    assert str(e.value) == (
        f"{csv}: rows [3, 4] hold NaN (in params, loss); rows [5] hold non-positive or "
        "infinite values (in flops); fix or delete those rows"
    )


def test_fit_cli_contract(tmp_path):
    """`vltrain scaling fit FILE.csv --exclude-worst K --bootstrap B --json OUT.json` on a
    flops-only CSV whose counted FLOPs miss each budget by up to 1% (as a sweep's do):
    tokens = flops / (6 params), the budgets regrouped, approach 3's E A B alpha beta and
    approach 2's a b as numbers at the top level, intervals under `ci`."""
    runs = isoflop_grid(EPOCH_AI, BUDGETS[:3], per_budget=5, noise=0.003, seed=4)
    jitter = np.random.default_rng(0).uniform(0.99, 1.0, len(runs))
    csv = tmp_path / "runs.csv"
    lines = ["params,flops,loss"] + [
        f"{n},{6 * n * d * j},{loss}"
        for n, d, j, loss in zip(runs.params, runs.tokens, jitter, runs.loss, strict=True)
    ]
    csv.write_text("\n".join(lines) + "\n")
    read = fit.read_runs_csv(csv)
    assert len(set(read.budget.tolist())) == 3  # the jittered FLOPs form the 3 budgets
    assert np.allclose(read.tokens, runs.tokens * jitter)
    out = tmp_path / "fit.json"
    args = ["scaling", "fit", str(csv), "--exclude-worst", "1", "--bootstrap", "3"]
    assert main([*args, "--json", str(out), "--plots", str(tmp_path / "plots")]) == 0
    got = json.loads(out.read_text())
    for key in ("E", "A", "B", "alpha", "beta", "a", "b"):
        assert isinstance(got[key], float), key
        lo, hi = got["ci"][key]
        assert lo <= hi, key
    assert len(got["excluded_runs"]) == 1
    assert got["huber_delta"] == fit.HUBER_DELTA  # the default: Hoffmann et al.'s protocol
    assert got["a"] == pytest.approx(TRUE_A, abs=0.1)
    assert (tmp_path / "plots" / "isoflop.png").stat().st_size > 1000


def test_group_budgets_negative_control():
    """Budgets 10% apart stay apart; FLOPs within 5% of a budget join it."""
    got = fit.group_budgets(np.array([1.0, 0.99, 1.1, 1.11, 2.0]))
    assert len(set(got.tolist())) == 3
    assert got[0] == got[1] and got[2] == got[3] != got[0]


def test_exclude_by_unknown_rule_names_the_choices():
    runs = isoflop_grid(EPOCH_AI, BUDGETS[:3], per_budget=5, noise=0.003, seed=4)
    with pytest.raises(fit.ConfigError, match="did you mean 'loss'"):
        fit.fit_all(runs, exclude_worst=1, exclude_by="losss")


def test_size_rule():
    assert parse_size("2x128") == Size(2, 128)
    for target in (5e4, 1e5, 1e6):
        s = size_for_params(target)
        assert abs(np.log(s.block_params / target)) < 0.35
        assert 32 <= s.width / s.layers <= 128
    assert parse_size("100k") == size_for_params(1e5)
    # inside a fixed-depth family: the nearest width, a multiple of 16
    assert width_for_params(88e3 - 4000, 1) == Size(1, 80)
    assert width_for_params(Size(3, 96).block_params, 3) == Size(3, 96)
    with pytest.raises(ConfigError, match="positive"):
        width_for_params(0, 1)


def test_prediction_uses_the_approach_with_the_narrower_interval():
    """`narrower` follows the bootstrap: approach 2 when its N_opt interval is tighter, approach
    3 when that one is (the negative control), either by name; no groups -> approach 3."""
    res = fit.FitResult(
        {},
        {"a": 0.5},
        [],
        target={"N_opt": 1e5, "D_opt": 1.0, "N_opt_approach2": 6e4, "D_opt_approach2": 2.0},
    )
    res.ci = {"N_opt": [1e4, 1e6], "N_opt_approach2": [4e4, 9e4]}
    assert fit.choose_prediction(res)["predicted_by"] == "approach2"
    assert fit.choose_prediction(res)["N_opt_predicted"] == 6e4
    res.ci = {"N_opt": [9e4, 1.1e5], "N_opt_approach2": [4e4, 9e4]}
    assert fit.choose_prediction(res)["predicted_by"] == "approach3"
    assert fit.choose_prediction(res, "approach2")["D_opt_predicted"] == 2.0
    res.ci = {}  # no bootstrap: approach 3 (both widths unknown)
    assert fit.choose_prediction(res)["predicted_by"] == "approach3"
    with pytest.raises(fit.ConfigError, match="did you mean 'approach2'"):
        fit.choose_prediction(res, "approach_2")


@pytest.mark.slow
def test_auto_huber_delta_follows_the_noise_and_stays_robust():
    """`huber_delta="auto"` sizes delta to the residuals (1.345 x their robust std: ~0.013 for
    1% log-noise, where the fixed 1e-3 makes the fit an absolute-error fit); a planted broken
    run still barely moves it, while least squares (delta 10) is pulled off: the negative
    control that the robustness is the Huber loss's, not the data's (alpha 0.25 for 0.35)."""
    runs = isoflop_grid(EPOCH_AI, BUDGETS, per_budget=7, noise=0.01, seed=11)
    res = fit.fit_all(runs, huber_delta="auto")
    assert res.huber_delta == pytest.approx(fit.AUTO_DELTA_K * 0.01, rel=0.35)
    broken = isoflop_grid(EPOCH_AI, BUDGETS, per_budget=7, noise=0.01, seed=11)
    broken.loss[[3, 17]] *= 1.4  # two broken runs
    a_of = lambda p: p["beta"] / (p["alpha"] + p["beta"])  # noqa: E731
    robust = fit.fit_all(broken, huber_delta="auto")
    assert a_of(robust.approach3) == pytest.approx(TRUE_A, abs=0.02)
    assert robust.approach3["alpha"] == pytest.approx(EPOCH_AI["alpha"], abs=0.02)
    squares = fit.fit_all(broken, huber_delta=10.0).approach3
    assert abs(squares["alpha"] - EPOCH_AI["alpha"]) > 0.05  # least squares is pulled off
    with pytest.raises(fit.ConfigError, match="--huber-delta"):
        fit.fit_all(runs, huber_delta="big")


@pytest.mark.slow
def test_auto_huber_delta_is_more_efficient_on_gaussian_noise():
    """Over 8 simulated sweeps (seeds of their own, not the benchmark's) the auto delta's
    median errors in alpha and beta are below the fixed 1e-3's: the absolute-error fit that
    a delta 10x under the noise amounts to wastes about a third of the information."""
    errs = {"fixed": [], "auto": []}
    for seed in range(100, 108):
        runs = isoflop_grid(EPOCH_AI, BUDGETS, per_budget=7, noise=0.01, seed=seed)
        p = fit.fit_parametric(runs)
        q, _ = fit.refit_auto_delta(runs, p)
        for name, r in (("fixed", p), ("auto", q)):
            errs[name].append([abs(r[k] - EPOCH_AI[k]) for k in ("alpha", "beta")])
    med = {k: np.median(np.array(v), axis=0) for k, v in errs.items()}  # (2,) alpha, beta
    assert (med["auto"] < med["fixed"]).all(), med


def test_huber_delta_flag_rejects_a_typo_before_fitting(tmp_path, capsys):
    csv = tmp_path / "runs.csv"
    csv.write_text("params,tokens,loss\n" + "".join(f"{n},1e6,2.0\n" for n in range(1, 7)))
    assert main(["scaling", "fit", str(csv), "--huber-delta", "atuo"]) == 2
    assert "--huber-delta 'atuo': expected a number like 1e-3, or auto" in capsys.readouterr().err


@pytest.mark.slow
def test_a_fit_whose_floor_underflows_still_bootstraps():
    """A measured sweep (tests/scaling/data/facts_width_sweep.csv: the scaling demo's captioner
    on fact captions, 3 budgets x 5 widths) has no visible loss floor: approach 3's log E
    runs off towards -inf. Its bootstrap and refits start from that fit, which once crashed
    on log(0). Where L-BFGS stops in log space depends on the stopping rule and the CPU's
    rounding (with scipy's default rules E underflowed to 0.0 on the AMD EPYC and stopped at
    1.8e-120 on an AVX-512 Intel Xeon; run to convergence, 3.5e-16 on the Xeon), so the
    exact zero is also fed to the start directly."""
    runs = fit.read_runs_csv(Path(__file__).parent / "data" / "facts_width_sweep.csv")
    p3 = fit.fit_parametric(runs)
    assert p3["E"] < 1e-12  # the degenerate floor this guards
    start = fit._theta({**p3, "E": 0.0})  # the underflowed floor, whatever this CPU gave
    assert np.isfinite(start).all() and start[0] < -700
    refit = fit.fit_parametric(runs, starts=[start])
    assert refit["objective"] <= p3["objective"] + 1e-12 and refit["alpha"] > 0
    res = fit.fit_all(runs, bootstrap=4, target=1.8e12, seed=0)
    assert any("no loss floor is visible" in w for w in res.warnings)  # said, not hidden
    assert np.isfinite(res.ci["N_opt"]).all()
    assert all(np.isfinite(v).all() for v in res.ci.values())
    again = fit.fit_all(runs, huber_delta="auto", target=1.8e12)  # refits start from it too
    assert again.approach3["alpha"] > 0
