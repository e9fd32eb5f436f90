"""Side by side: vltrain's approach-3 fit vs `chinchilla` 0.2.0's fit on identical simulated
isoFLOP points (planted Epoch AI parameters + multiplicative noise), over seeds.

    PYTHONPATH=$PWD python bench/scaling/vs_chinchilla.py [--seeds 20] [--noise 0.01] \
        [--cache bench/scaling/chinchilla_fits.json] --out F.json

Reports, per library, the median over seeds of the absolute error of the exponent
a = beta / (alpha + beta), of E, alpha, beta, and of log A, log B (A and B span orders of
magnitude and trade off against alpha and beta, so their error is reported in log space, with
the median relative error beside it), and the median seconds per fit. `chinchilla` fits with
BFGS from every point of its grid and its default loss (an asymmetric MAE that fits the floor
of the loss distribution); the same grid as vltrain's (log-form e, a, b) is passed to it.
vltrain fits with L-BFGS-B from the best 8 grid points on a Huber (delta 1e-3) log loss
(`vltrain`), and with the delta sized to the residuals (`vltrain_auto_delta`, the fit's
`--huber-delta auto`). `--cache F` memoises chinchilla's fits per seed (minutes each), so
`--seeds 20` after `--seeds 5` fits only the new seeds; `--libs` picks the fits to run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vltrain.scaling.fit import GRID, fit_parametric, refit_auto_delta
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


def cached(fn, cache_path: str | None, key: str):
    """`fn` memoised in a JSON file (chinchilla takes minutes per fit; its fits do not change
    when vltrain's do, so a rerun after a vltrain change reuses them)."""

    def call(runs) -> tuple[dict[str, float], float]:
        store = {}
        if cache_path and Path(cache_path).exists():
            store = json.loads(Path(cache_path).read_text())
        if key in store:
            return store[key]["fit"], store[key]["seconds"]
        t = time.perf_counter()
        q = {k: float(v) for k, v in fn(runs).items() if k in KEYS}
        sec = time.perf_counter() - t
        if cache_path:  # reread: another process may have added seeds meanwhile
            store = json.loads(Path(cache_path).read_text()) if Path(cache_path).exists() else {}
            store[key] = {"fit": q, "seconds": sec}
            Path(cache_path).write_text(json.dumps(store, indent=1, sort_keys=True))
        return q, sec

    return call


def seed_list(spec: str) -> list[int]:
    """`5` (seeds 0-4), `5-19` or `0,3,7`."""
    if "," in spec:
        return [int(x) for x in spec.split(",")]
    if "-" in spec:
        lo, hi = spec.split("-")
        return list(range(int(lo), int(hi) + 1))
    return list(range(int(spec)))


def vltrain_auto_fit(runs) -> dict[str, float]:
    """vltrain with `--huber-delta auto`: the 1e-3 fit, then delta = 1.345 x its residual
    scale and a refit (vltrain.scaling.fit.refit_auto_delta)."""
    return refit_auto_delta(runs, fit_parametric(runs))[0]


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


def _in_cache(path: str, seed: int, noise: float) -> bool:
    return Path(path).exists() and f"seed={seed} noise={noise}" in json.loads(
        Path(path).read_text()
    )


def _medians(rows: list[dict]) -> dict[str, float]:
    med = {k: float(np.median([r["error"][k] for r in rows])) for k in rows[0]["error"]}
    med["seconds_per_fit"] = float(np.median([r["seconds"] for r in rows]))
    return med


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="5", help="`20` (0-19), `5-19` or `0,3,7`")
    p.add_argument("--noise", type=float, default=0.01)
    p.add_argument(
        "--libs", default="vltrain,vltrain_auto_delta,chinchilla", help="comma list of fits"
    )
    p.add_argument("--cache", default=None, help="JSON memo of chinchilla's fits per seed")
    p.add_argument(
        "--cached-only",
        action="store_true",
        help="chinchilla only on the seeds in --cache (medians then also on the common seeds)",
    )
    p.add_argument("--out", default="vs_chinchilla.json", help="results JSON")
    a = p.parse_args()
    seeds = seed_list(a.seeds)
    fits = {
        "vltrain": fit_parametric,
        "vltrain_auto_delta": vltrain_auto_fit,
        "chinchilla": chinchilla_fit,
    }
    fits = {k: fits[k] for k in a.libs.split(",")}
    per_seed: dict[str, list[dict]] = {name: [] for name in fits}
    for seed in seeds:
        runs = isoflop_grid(EPOCH_AI, np.logspace(18, 22, 5), noise=a.noise, seed=seed)
        for name, fn in fits.items():
            cache = a.cache if name == "chinchilla" else None
            if cache and a.cached_only and not _in_cache(cache, seed, a.noise):
                continue
            q, sec = cached(fn, cache, f"seed={seed} noise={a.noise}")(runs)
            row = {"seed": seed, "seconds": sec}
            row.update({k: float(q[k]) for k in KEYS}, error=errors(q))
            per_seed[name].append(row)
            print(name, json.dumps(row), file=sys.stderr, flush=True)
    summary = {name: _medians(rows) for name, rows in per_seed.items()}
    common = set.intersection(*({r["seed"] for r in rows} for rows in per_seed.values()))
    on_common = {
        name: _medians([r for r in rows if r["seed"] in common]) for name, rows in per_seed.items()
    }
    text = json.dumps(
        {
            "planted": EPOCH_AI,
            "grid": "5 budgets 1e18..1e22 x 7 sizes (N_opt/8 .. 8 N_opt)",
            "seeds": seeds,
            "noise": a.noise,
            "median_abs_error": summary,
            "seeds_per_lib": {name: len(rows) for name, rows in per_seed.items()},
            "common_seeds": sorted(common),
            "median_abs_error_on_common_seeds": on_common,
            "per_seed": per_seed,
        },
        indent=2,
    )
    with open(a.out, "w") as f:
        f.write(text)
    print(json.dumps(summary, indent=2), file=sys.stderr)  # chinchilla's console eats stdout


if __name__ == "__main__":
    main()
