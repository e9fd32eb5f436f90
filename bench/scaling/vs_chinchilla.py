"""Side by side: vltrain's approach-3 fit vs `chinchilla` 0.2.0's fit on identical simulated
isoFLOP points (planted Epoch AI parameters + multiplicative noise), over seeds.

    PYTHONPATH=$PWD python bench/scaling/vs_chinchilla.py [--seeds 5] [--noise 0.01] --out F.json

Reports, per library, the median over seeds of the absolute error of the exponent
a = beta / (alpha + beta), of E, alpha, beta, and of log A, log B (A and B span orders of
magnitude and trade off against alpha and beta, so their error is reported in log space, with
the median relative error beside it), and the median seconds per fit. `chinchilla` fits with
BFGS from every point of its grid and its default loss (an asymmetric MAE that fits the floor
of the loss distribution); the same grid as vltrain's (log-form e, a, b) is passed to it.
vltrain fits with L-BFGS-B from the best 8 grid points on a Huber (delta 1e-3) log loss.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time

import numpy as np

from vltrain.scaling.fit import GRID, fit_parametric
from vltrain.scaling.simulate import EPOCH_AI, isoflop_grid

KEYS = ("E", "A", "B", "alpha", "beta")


def chinchilla_fit(runs) -> dict[str, float]:
    from chinchilla import Chinchilla

    with tempfile.TemporaryDirectory() as tmp:
        cc = Chinchilla(
            tmp, param_grid={k: list(v) for k, v in GRID.items()}, log_level=logging.ERROR
        )
        for n, d, c, loss in zip(runs.params, runs.tokens, runs.budget, runs.loss, strict=True):
            cc.database.append(N=float(n), D=float(d), C=float(c), loss=float(loss))
        cc.fit(parallel=False)
        # its parameters come back as numpy long doubles
        return {k: float(getattr(cc, k)) for k in KEYS}


def errors(q: dict[str, float]) -> dict[str, float]:
    """Absolute errors against the planted parameters (A, B in log space and relative)."""
    t = EPOCH_AI
    q = {k: float(q[k]) for k in KEYS}
    out = {"a": abs(q["beta"] / (q["alpha"] + q["beta"]) - t["beta"] / (t["alpha"] + t["beta"]))}
    for k in ("E", "alpha", "beta"):
        out[k] = abs(q[k] - t[k])
    for k in ("A", "B"):
        out[f"log_{k}"] = abs(math.log(q[k] / t[k]))
        out[f"rel_{k}"] = abs(q[k] / t[k] - 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--noise", type=float, default=0.01)
    p.add_argument("--out", default="vs_chinchilla.json", help="results JSON")
    a = p.parse_args()
    fits = {"vltrain": fit_parametric, "chinchilla": chinchilla_fit}
    per_seed: dict[str, list[dict]] = {name: [] for name in fits}
    for seed in range(a.seeds):
        runs = isoflop_grid(EPOCH_AI, np.logspace(18, 22, 5), noise=a.noise, seed=seed)
        for name, fn in fits.items():
            t = time.perf_counter()
            q = fn(runs)
            row = {"seed": seed, "seconds": time.perf_counter() - t}
            row.update({k: float(q[k]) for k in KEYS}, error=errors(q))
            per_seed[name].append(row)
            print(name, json.dumps(row), file=sys.stderr, flush=True)
    summary = {}
    for name, rows in per_seed.items():
        med = {k: float(np.median([r["error"][k] for r in rows])) for k in rows[0]["error"]}
        med["seconds_per_fit"] = float(np.median([r["seconds"] for r in rows]))
        summary[name] = med
    text = json.dumps(
        {
            "planted": EPOCH_AI,
            "grid": "5 budgets 1e18..1e22 x 7 sizes (N_opt/8 .. 8 N_opt)",
            "seeds": a.seeds,
            "noise": a.noise,
            "median_abs_error": summary,
            "per_seed": per_seed,
        },
        indent=2,
    )
    with open(a.out, "w") as f:
        f.write(text)
    print(json.dumps(summary, indent=2), file=sys.stderr)  # chinchilla's console eats stdout


if __name__ == "__main__":
    main()
