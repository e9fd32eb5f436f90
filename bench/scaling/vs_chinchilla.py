"""Side by side: vltrain's approach-3 fit vs `chinchilla` 0.2.0's fit on identical simulated
isoFLOP points (planted Epoch AI parameters + multiplicative noise), over seeds.

    PYTHONPATH=$PWD python bench/scaling/vs_chinchilla.py [--seeds 10] [--noise 0.01] --out F.json

Reports the median absolute error of the exponent a = beta / (alpha + beta) and of alpha,
beta per library. `chinchilla` fits with BFGS from its grid and an asymmetric MAE (its
defaults); the same grid as vltrain's (in log form e, a, b) is passed to it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time

import numpy as np

from vltrain.scaling.fit import GRID, fit_parametric
from vltrain.scaling.simulate import EPOCH_AI, isoflop_grid


def chinchilla_fit(runs) -> dict[str, float]:
    from chinchilla import Chinchilla

    with tempfile.TemporaryDirectory() as tmp:
        cc = Chinchilla(
            tmp, param_grid={k: list(v) for k, v in GRID.items()}, log_level=logging.ERROR
        )
        for n, d, c, loss in zip(runs.params, runs.tokens, runs.budget, runs.loss, strict=True):
            cc.database.append(N=float(n), D=float(d), C=float(c), loss=float(loss))
        cc.fit(parallel=False)
        return {"E": cc.E, "A": cc.A, "B": cc.B, "alpha": cc.alpha, "beta": cc.beta}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--noise", type=float, default=0.01)
    p.add_argument("--out", default="vs_chinchilla.json", help="results JSON")
    a = p.parse_args()
    true_a = EPOCH_AI["beta"] / (EPOCH_AI["alpha"] + EPOCH_AI["beta"])
    errs: dict[str, dict[str, list[float]]] = {"vltrain": {}, "chinchilla": {}}
    secs = {"vltrain": 0.0, "chinchilla": 0.0}
    for seed in range(a.seeds):
        runs = isoflop_grid(EPOCH_AI, np.logspace(18, 22, 5), noise=a.noise, seed=seed)
        for name, fn in (("vltrain", fit_parametric), ("chinchilla", chinchilla_fit)):
            t = time.time()
            q = fn(runs)
            secs[name] += time.time() - t
            e = errs[name]
            e.setdefault("a", []).append(abs(q["beta"] / (q["alpha"] + q["beta"]) - true_a))
            e.setdefault("alpha", []).append(abs(q["alpha"] - EPOCH_AI["alpha"]))
            e.setdefault("beta", []).append(abs(q["beta"] - EPOCH_AI["beta"]))
    out = {name: {k: float(np.median(v)) for k, v in e.items()} for name, e in errs.items()}
    for name in out:
        out[name]["seconds_per_fit"] = secs[name] / a.seeds
    text = json.dumps({"seeds": a.seeds, "noise": a.noise, "median_abs_error": out}, indent=2)
    with open(a.out, "w") as f:
        f.write(text)
    print(text, file=sys.stderr)  # chinchilla's rich console swallows stdout here


if __name__ == "__main__":
    main()
