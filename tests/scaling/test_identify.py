"""`scaling fit` says what its runs cannot identify (one budget, too few points, a constant N
or D), says when approach 2 was skipped and why, and flags a prediction that rests on it; an
ordinary isoFLOP sweep gets none of it (the negative control)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vltrain.cli import main
from vltrain.scaling import fit
from vltrain.scaling.identify import identifiability_warnings
from vltrain.scaling.simulate import isoflop_grid

LAW = {"E": 1.8, "A": 400.0, "B": 2000.0, "alpha": 0.34, "beta": 0.37}
BUDGETS = np.logspace(18, 21, 4)


def _messages(runs: fit.Runs) -> list[str]:
    return identifiability_warnings(runs.params, runs.tokens, runs.budget)


def test_an_isoflop_sweep_is_identified():
    """The negative control for every test below: 4 budgets x 7 sizes warn of nothing."""
    runs = isoflop_grid(LAW, BUDGETS, per_budget=7, noise=0.003, seed=0)
    assert _messages(runs) == []
    res = fit.fit_all(runs, target=1e22)
    assert res.warnings == [] and res.target["prediction_identified"] is True


def test_one_budget_warns_skips_approach2_and_flags_the_prediction():
    runs = isoflop_grid(LAW, BUDGETS[:1], per_budget=7, noise=0.003, seed=0)
    res = fit.fit_all(runs, target=1e22)
    said = "\n".join(res.warnings)
    assert "all runs are one budget (1e+18 FLOPs)" in said
    assert "how N_opt moves with compute (the exponent a) is not measured" in said
    assert "approach 2 skipped: the runs hold one budget (1e+18)" in said
    assert res.approach2 is None
    assert res.target["prediction_identified"] is False
    assert "the prediction at C = 1e+22 (N_opt, D_opt) is not identified" in said
    # the same line without a budget column is found from N and D alone
    runs.budget = None
    assert "all runs lie on one isoFLOP line" in "\n".join(_messages(runs))


def test_as_many_points_as_parameters_warns():
    """5 distinct (N, D) points for 5 parameters warn; so do 6 rows holding 5 points (a
    repeated run adds no point); 6 distinct points on 2 budgets do not."""
    runs = isoflop_grid(LAW, BUDGETS[:2], per_budget=3, noise=0.003, seed=0)
    assert not any("distinct" in m for m in _messages(runs))
    five = runs.take(np.arange(5))
    assert "5 parameters to 5 distinct (N, D) points" in _messages(five)[0]
    repeated = runs.take(np.array([0, 1, 2, 3, 4, 4]))
    assert "to 5 distinct (N, D) points" in _messages(repeated)[0]
    assert fit.fit_all(five, target=1e22).target["prediction_identified"] is False


@pytest.mark.parametrize(
    ("fixed", "says"),
    [
        ("tokens", "D is the same for every run (1e+09 tokens): beta and B are not identifiable"),
        ("params", "N is the same for every run (1e+07 parameters): alpha and A are not"),
    ],
)
def test_a_constant_n_or_d_names_the_lost_term(fixed, says):
    varied = np.logspace(6, 8, 7)  # (7,)
    const = np.full(7, 1e9 if fixed == "tokens" else 1e7)
    n, d = (varied, const) if fixed == "tokens" else (const, varied)
    runs = fit.Runs(n, d, fit.predict_loss(LAW, n, d))
    res = fit.fit_all(runs, target=1e22)
    assert says in res.warnings[0]
    assert any(
        "approach 2 skipped: the runs hold no budget or flops column" in w for w in res.warnings
    )
    assert res.target["prediction_identified"] is False


def test_a_fixed_tokens_per_parameter_ratio_warns():
    """D = 20 N (Chinchilla's ratio at every size): N and D never vary apart; D = 20 N and
    D = 5 N together do (the negative control)."""
    n = np.logspace(6, 9, 7)
    assert "N and D only move together (D ~ N^1.00" in _messages(fit.Runs(n, 20 * n, n))[0]
    both = fit.Runs(np.r_[n, n], np.r_[20 * n, 5 * n], np.r_[n, n])
    assert _messages(both) == []


def test_cli_prints_the_warnings_on_stderr_and_flags_the_prediction(tmp_path, capsys):
    runs = isoflop_grid(LAW, BUDGETS[:1], per_budget=7, noise=0.003, seed=0)
    csv = tmp_path / "one.csv"
    rows = zip(runs.budget, runs.params, runs.tokens, runs.loss, strict=True)
    csv.write_text(
        "budget,params,tokens,loss\n" + "".join(f"{c},{n},{d},{x}\n" for c, n, d, x in rows)
    )
    out = tmp_path / "fit.json"
    assert main(["scaling", "fit", str(csv), "--predict", "1e22", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "warning: all runs are one budget" in printed.err
    assert "warning: approach 2 skipped" in printed.err
    assert "warning:" not in printed.out
    assert "(not identified by these runs: see the warnings)" in printed.out
    got = json.loads(out.read_text())
    assert got["prediction_identified"] is False
    assert any("approach 2 skipped" in w for w in got["warnings"])
