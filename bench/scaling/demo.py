"""The scaling demo (docs/scaling.md): an isoFLOP sweep of the captioner decoder on the
synthetic shapes data with facts in its captions, its fit, plots and prediction, and the check
that the predicted size at a new budget beats the sizes on either side of it, on 3 seeds.

    vltrain data synth --out SHAPES --n-train 40000 --n-val 512 --n-test 16 --seed 1
    PYTHONPATH=. python bench/scaling/facts.py SHAPES DATA
    PYTHONPATH=. python bench/scaling/demo.py --data DATA --out OUT \
        [--budgets 1e11,3e11,9e11] [--sizes 1x32,1x48,1x64,1x96,1x128] [--predict 1.8e12] \
        [--spread 2.5] [--check-seeds 0,1,2] [--jobs 2] [dotted.overrides ...]

Everything is resumable (rerun to continue; a rerun of a finished demo only refits and
replots). Design (docs/scaling.md "Demo" says why each choice): captions with two Zipf-drawn
facts each (bench/scaling/facts.py), so a larger decoder has something to gain; one family,
depth 1, widths 32..128 (~2x steps in N); budgets spanning 9x, every run past its first ~50
steps; 40,000 training records; 512 validation records; two runs at a time (`--jobs 2`, one
thread each); the prediction from the approach with the narrower bootstrap interval; the
check trains the predicted size and its neighbours at N_opt / 2.5 and N_opt x 2.5 on 3 seeds
each and reports the margins against their standard errors (and paired by seed).
`OUT/check.png`: the sweep's isoFLOP curves with the check runs at the new budget.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
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


def sweep(
    config: str, data: list[str], budgets: str, sizes: str, out: Path, jobs: int,
    seeds: str | None = None,
) -> list[dict]:  # fmt: skip
    extra = ["--jobs", str(jobs)] + (["--seeds", seeds] if seeds else [])
    vltrain("scaling", "sweep", config, *data, "--budgets", budgets, "--sizes", sizes,
            "--out", str(out), *extra)  # fmt: skip
    with open(out / "runs.csv", newline="") as f:
        return list(csv.DictReader(f))


def plot_check(sweep_csv: Path, check: dict, budget: float, path: Path) -> None:
    """The sweep's losses per budget against N, and the check's runs at `budget` (the mean
    over seeds of each size, and each seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(sweep_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(8, 4))
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
    for k in ("smaller", "predicted", "larger"):  # every seed's loss, the mean marked above
        seeds = check[k].get("losses", [])
        ax.plot([check[k]["params"]] * len(seeds), seeds, ".", color="grey", ms=4)
    ax.plot([], [], "k*", label=f"check C={budget:.2g}: seed mean (star: predicted), seeds")
    ax.set(xscale="log", xlabel="non-embedding parameters N", ylabel="eval loss",
           title="isoFLOP sweep and the prediction check")  # fmt: skip
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budgets", default="1e11,3e11,9e11")
    p.add_argument("--sizes", default="1x32,1x48,1x64,1x96,1x128")
    p.add_argument("--predict", type=float, default=1.8e12)
    p.add_argument("--bootstrap", type=int, default=100)
    p.add_argument("--spread", type=float, default=2.5, help="neighbours at N_opt / x, N_opt * x")
    p.add_argument("--check-seeds", default="0,1,2", help="seeds of every check run")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (vltrain scaling sweep)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    a = p.parse_args()
    out = Path(a.out)
    data = [f"data.train={a.data}/train.jsonl", f"data.eval={a.data}/val.jsonl", *a.overrides]
    config = str(HERE / "caption_sweep.yaml")
    t0 = time.time()
    sweep(config, data, a.budgets, a.sizes, out / "sweep", a.jobs)
    t_sweep = time.time() - t0
    vltrain("scaling", "fit", str(out / "sweep"), "--bootstrap", str(a.bootstrap),
            "--predict", str(a.predict), "--json", str(out / "fit.json"),
            "--plots", str(out / "plots"))  # fmt: skip
    fit = json.loads((out / "fit.json").read_text())
    n_opt = fit["N_opt_predicted"]
    # the check: the predicted size and its neighbours at the new budget, each on every seed
    from vltrain.runs.sweep import predicted_config

    checks = {}
    for name, n in (("smaller", n_opt / a.spread), ("predicted", n_opt),
                    ("larger", n_opt * a.spread)):  # fmt: skip
        checks[name] = predicted_config(
            out / "sweep", n, a.predict, out / f"check_{name}.yaml"
        ).label
    rows = sweep(config, data, str(a.predict), ",".join(dict.fromkeys(checks.values())),
                 out / "check", a.jobs, a.check_seeds)  # fmt: skip
    result: dict = {}
    for name, size in checks.items():
        got = [r for r in rows if r["size"] == size]
        losses = [float(r["loss"]) for r in got]
        result[name] = {
            "size": size,
            "params": float(got[0]["params"]),
            "losses": losses,
            "seeds": [int(r["seed"]) for r in got],
            "loss": statistics.mean(losses),
            "std": statistics.stdev(losses) if len(losses) > 1 else None,
        }
    pred = result["predicted"]
    margins = [result[k]["loss"] - pred["loss"] for k in ("smaller", "larger")]
    result["predicted_by"] = fit["predicted_by"]
    result["N_opt_predicted"] = n_opt
    result["N_opt_predicted_ci"] = fit.get("N_opt_predicted_ci")
    result["predicted_beats_neighbours"] = all(m > 0 for m in margins)
    result["margins"] = margins
    # the margin between two means of k seeds each, in units of its standard error
    k = len(pred["losses"])
    if k > 1:
        ses = [
            math.sqrt((pred["std"] ** 2 + result[n]["std"] ** 2) / k) for n in ("smaller", "larger")
        ]
        result["margins_over_standard_error"] = [m / se for m, se in zip(margins, ses, strict=True)]
        # paired by seed (same data order and init seed on both sides)
        paired = []
        for n in ("smaller", "larger"):
            d = [x - y for x, y in zip(result[n]["losses"], pred["losses"], strict=True)]
            paired.append(statistics.mean(d) / (statistics.stdev(d) / math.sqrt(k)))
        result["paired_t"] = paired
    result["sweep_seconds"] = round(t_sweep, 1)
    result["total_seconds"] = round(time.time() - t0, 1)
    (out / "check.json").write_text(json.dumps(result, indent=2))
    plot_check(out / "sweep" / "runs.csv", result, a.predict, out / "check.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
