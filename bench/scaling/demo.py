"""The scaling demo (docs/scaling.md): an isoFLOP sweep of the captioner decoder on the
synthetic shapes data, its fit, plots and prediction, and the check that the predicted size
at a new budget beats the sizes on either side of it.

    PYTHONPATH=. python bench/scaling/demo.py --data DATA --out OUT \
        [--budgets 5e10,1e11,2e11] [--sizes 15k,40k,100k,250k,600k] [--predict 4e11]

`vltrain data synth --out DATA` makes the data. Everything is resumable (rerun to continue).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def vltrain(*args: str) -> None:
    cmd = [sys.executable, "-m", "vltrain", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--budgets", default="5e10,1e11,2e11")
    p.add_argument("--sizes", default="15k,40k,100k,250k,600k")
    p.add_argument("--predict", type=float, default=4e11)
    p.add_argument("--bootstrap", type=int, default=100)
    p.add_argument("--spread", type=float, default=3.0, help="neighbours at N_opt / x, N_opt * x")
    a = p.parse_args()
    out = Path(a.out)
    data = [f"data.train={a.data}/train.jsonl", f"data.eval={a.data}/val.jsonl"]
    config = str(HERE / "caption_sweep.yaml")
    t0 = time.time()
    vltrain(
        "scaling",
        "sweep",
        config,
        *data,
        "--budgets",
        a.budgets,
        "--sizes",
        a.sizes,
        "--out",
        str(out / "sweep"),
    )
    t_sweep = time.time() - t0
    vltrain(
        "scaling",
        "fit",
        str(out / "sweep"),
        "--bootstrap",
        str(a.bootstrap),
        "--predict",
        str(a.predict),
        "--json",
        str(out / "fit.json"),
        "--plots",
        str(out / "plots"),
    )
    fit = json.loads((out / "fit.json").read_text())
    n_opt = fit["N_opt"]
    # The check: the predicted size and its neighbours, each trained at the new budget.
    from vltrain.runs.sweep import predicted_config

    checks = {}
    for name, n in (
        ("smaller", n_opt / a.spread),
        ("predicted", n_opt),
        ("larger", n_opt * a.spread),
    ):
        target = out / f"check_{name}.yaml"
        size = predicted_config(out / "sweep", n, a.predict, target)
        checks[name] = size.label
    sizes = ",".join(dict.fromkeys(checks.values()))
    vltrain(
        "scaling",
        "sweep",
        config,
        *data,
        "--budgets",
        str(a.predict),
        "--sizes",
        sizes,
        "--out",
        str(out / "check"),
    )
    import csv

    rows = {r["size"]: r for r in csv.DictReader(open(out / "check" / "runs.csv"))}
    result = {
        name: {"size": s, "params": float(rows[s]["params"]), "loss": float(rows[s]["loss"])}
        for name, s in checks.items()
    }
    pred = result["predicted"]["loss"]
    result["predicted_beats_neighbours"] = all(
        pred <= result[k]["loss"] for k in ("smaller", "larger")
    )
    result["sweep_seconds"] = round(t_sweep, 1)
    result["total_seconds"] = round(time.time() - t0, 1)
    (out / "check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
