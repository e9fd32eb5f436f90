"""The scaling demo (docs/scaling.md): an isoFLOP sweep of the captioner decoder on the
synthetic shapes data, its fit, plots and prediction, the seed-to-seed noise of one point,
and the check that the predicted size at a new budget beats the sizes on either side of it.

    vltrain data synth --out DATA --n-train 40000 --n-val 512 --n-test 16 --seed 1
    PYTHONPATH=. python bench/scaling/demo.py --data DATA --out OUT \
        [--budgets 1e11,3e11,9e11] [--sizes 1x48,1x64,2x64,2x96,3x112] [--predict 1.8e12]

Everything is resumable (rerun to continue; a rerun of a finished demo only refits and
replots). Design (docs/scaling.md "Demo" says why each choice): budgets spanning 9x, all past
the steep first ~50 steps of training (the 2e10 budget of the second design was not); sizes
in ~2x steps with depth never decreasing; 40,000 training records so no run sees an image
more than ~3 times; 512 validation records; the prediction from the approach with the
narrower bootstrap interval (`--predict-with narrower`); neighbours one sweep step
(`--spread`) either side; the seed-to-seed spread of one point measured, so a check decided
by less than that is reported as within noise. `OUT/check.png`: the sweep's isoFLOP curves
with the three check runs at the new budget.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def vltrain(*args: str) -> None:
    cmd = [sys.executable, "-m", "vltrain", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def sweep(config: str, data: list[str], budgets: str, sizes: str, out: Path, *extra: str) -> dict:
    vltrain("scaling", "sweep", config, *data, *extra, "--budgets", budgets, "--sizes", sizes,
            "--out", str(out))  # fmt: skip
    with open(out / "runs.csv", newline="") as f:
        return {(float(r["budget"]), r["size"]): r for r in csv.DictReader(f)}


def plot_check(sweep_csv: Path, check: dict, budget: float, path: Path) -> None:
    """The sweep's losses per budget against N, and the check's three runs at `budget`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(sweep_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in sorted({float(r["budget"]) for r in rows}):
        pts = sorted(
            (float(r["params"]), float(r["loss"])) for r in rows if float(r["budget"]) == c
        )
        ax.plot(*zip(*pts, strict=True), "o-", label=f"sweep C={c:.2g}")
    pts = sorted(
        (check[k]["params"], check[k]["loss"], k) for k in ("smaller", "predicted", "larger")
    )
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "k--", lw=0.8)
    for n, loss, name in pts:
        ax.plot(
            n,
            loss,
            "*" if name == "predicted" else "s",
            color="k",
            ms=11 if name == "predicted" else 6,
        )
    ax.plot([], [], "k*", label=f"check C={budget:.2g} (star: predicted)")
    ax.set(xscale="log", xlabel="non-embedding parameters N", ylabel="eval loss",
           title="isoFLOP sweep and the prediction check")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budgets", default="1e11,3e11,9e11")
    p.add_argument("--sizes", default="1x48,1x64,2x64,2x96,3x112")
    p.add_argument("--predict", type=float, default=1.8e12)
    p.add_argument("--bootstrap", type=int, default=100)
    p.add_argument("--spread", type=float, default=2.0, help="neighbours at N_opt / x, N_opt * x")
    p.add_argument("--noise-seeds", type=int, default=2, help="extra seeds of one sweep point")
    a = p.parse_args()
    out = Path(a.out)
    data = [f"data.train={a.data}/train.jsonl", f"data.eval={a.data}/val.jsonl"]
    config = str(HERE / "caption_sweep.yaml")
    t0 = time.time()
    sweep(config, data, a.budgets, a.sizes, out / "sweep")
    t_sweep = time.time() - t0
    vltrain("scaling", "fit", str(out / "sweep"), "--bootstrap", str(a.bootstrap),
            "--predict", str(a.predict), "--json", str(out / "fit.json"),
            "--plots", str(out / "plots"))  # fmt: skip
    fit = json.loads((out / "fit.json").read_text())
    n_opt = fit["N_opt_predicted"]
    # seed-to-seed spread of the middle point (same data order rule, other init and order)
    budgets = [float(x) for x in a.budgets.split(",")]
    mid_budget = budgets[len(budgets) // 2]
    with open(out / "sweep" / "runs.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if float(r["budget"]) == mid_budget]
    mid = rows[len(rows) // 2]
    losses = [float(mid["loss"])]
    for s in range(1, a.noise_seeds + 1):
        got = sweep(config, data, str(mid_budget), mid["size"], out / f"seed{s}", f"run.seed={s}")
        losses.append(float(got[(mid_budget, mid["size"])]["loss"]))
    noise = {"budget": mid_budget, "size": mid["size"], "losses": losses,
             "std": statistics.stdev(losses) if len(losses) > 1 else None}  # fmt: skip
    # the check: the predicted size and its neighbours, each trained at the new budget
    from vltrain.runs.sweep import predicted_config

    checks = {}
    for name, n in (("smaller", n_opt / a.spread), ("predicted", n_opt),
                    ("larger", n_opt * a.spread)):  # fmt: skip
        checks[name] = predicted_config(
            out / "sweep", n, a.predict, out / f"check_{name}.yaml"
        ).label
    got = sweep(
        config, data, str(a.predict), ",".join(dict.fromkeys(checks.values())), out / "check"
    )
    result = {
        name: {
            "size": s,
            "params": float(got[(a.predict, s)]["params"]),
            "loss": float(got[(a.predict, s)]["loss"]),
        }  # fmt: skip
        for name, s in checks.items()
    }
    pred = result["predicted"]["loss"]
    margins = [result[k]["loss"] - pred for k in ("smaller", "larger")]
    result["predicted_by"] = fit["predicted_by"]
    result["N_opt_predicted"] = n_opt
    result["N_opt_predicted_ci"] = fit.get("N_opt_predicted_ci")
    result["predicted_beats_neighbours"] = all(m >= 0 for m in margins)
    result["margins"] = margins
    result["seed_noise"] = noise
    if noise["std"] is not None:
        result["margins_over_seed_std"] = [m / noise["std"] for m in margins]
    result["sweep_seconds"] = round(t_sweep, 1)
    result["total_seconds"] = round(time.time() - t0, 1)
    (out / "check.json").write_text(json.dumps(result, indent=2))
    plot_check(out / "sweep" / "runs.csv", result, a.predict, out / "check.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
