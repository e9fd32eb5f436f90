"""`vltrain scaling sweep|fit`: isoFLOP sweeps of vltrain runs and Chinchilla fits."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from vltrain.cli.options import int_list, non_negative_int, positive_float, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("scaling", help="isoFLOP sweeps and scaling-law fits (docs/scaling.md)")
    ssub = s.add_subparsers(dest="scaling_command", required=True)
    w = ssub.add_parser(
        "sweep",
        help="train a budgets x sizes grid of runs (resumable)",
        description="Per budget (train.max_flops) and size, one vltrain run in "
        "OUT/C<budget>_<LxW>/; finished runs are skipped, killed ones resumed. Writes "
        "OUT/runs.csv.",
    )
    w.add_argument("config", help="base YAML config (stage caption or contrastive)")
    w.add_argument("overrides", nargs="*", help="dotted key=value overrides for every run")
    w.add_argument("--budgets", required=True, help="FLOP budgets, e.g. 1e12,2e12,4e12")
    w.add_argument(
        "--sizes", required=True, help="sizes: LAYERSxWIDTH or parameter counts (50k,200k,1M)"
    )
    w.add_argument("--out", required=True, help="sweep folder")
    w.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="train this many runs at once, each its own process (2 cores: --jobs 2 with "
        "run.threads=1); same results as one at a time",
    )
    w.add_argument(
        "--seeds",
        type=int_list,
        help="train every point once per seed, e.g. 0,1,2 (run.seed; folders ..._s<seed>): "
        "the seed-to-seed noise a fit and a check are judged against",
    )
    w.set_defaults(fn=run_sweep)
    f = ssub.add_parser(
        "fit",
        help="fit approaches 2 and 3 to a sweep folder or a CSV",
        description="CSV columns params, tokens (or flops) and loss; optional budget (else "
        "flops) groups isoFLOP runs for approach 2.",
    )
    f.add_argument("runs", help="a sweep folder (its runs.csv) or a CSV file")
    f.add_argument(
        "--exclude-worst", type=non_negative_int, default=0, help="drop the K worst-fit runs"
    )
    f.add_argument(
        "--exclude-by",
        default="residual",
        help="what makes a run 'worst': residual (approach 3's fit, default) or loss (the "
        "highest losses, Besiroglu et al.'s protocol)",
    )
    f.add_argument(
        "--bootstrap", type=non_negative_int, default=0, help="bootstrap resamples (e.g. 200)"
    )
    f.add_argument("--json", help="write the fit here")
    f.add_argument("--plots", help="folder for isoflop.png, nopt.png, contours.png")
    f.add_argument(
        "--predict", type=positive_float, help="a budget C: print N_opt, D_opt; write a config"
    )
    f.add_argument(
        "--predict-with",
        default="narrower",
        help="the approach whose N_opt(C) --predict uses: approach2, approach3, or narrower "
        "(the one with the narrower bootstrap interval; default)",
    )
    f.add_argument(
        "--huber-delta",
        default="1e-3",
        help="approach 3's Huber delta on log L: a number (default 1e-3, Hoffmann et al.'s) "
        "or auto (1.345 x the robust std of the residuals: see docs/scaling.md)",
    )
    f.add_argument("--config-out", help="where --predict writes its config (sweep folders)")
    f.add_argument("--seed", type=int, default=0)
    f.set_defaults(fn=run_fit)


def _floats(text: str) -> list[float]:
    from vltrain.config.core import ConfigError

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
        if not values or not all(math.isfinite(v) and v > 0 for v in values):
            raise ValueError
        return values
    except ValueError:
        raise ConfigError(f"--budgets {text!r}: expected FLOP budgets > 0 like 1e12,2e12") from None


def _delta(text: str) -> float | str:
    from vltrain.config.core import ConfigError

    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(
            f"--huber-delta {text!r}: expected a number like 1e-3, or auto (finite, > 0)"
        )
    return value


def run_sweep(args: argparse.Namespace) -> int:
    from vltrain.runs.sweep import sweep
    from vltrain.scaling.sizes import parse_sizes

    rows = sweep(
        args.config,
        args.overrides,
        _floats(args.budgets),
        parse_sizes([args.sizes]),
        Path(args.out),
        jobs=args.jobs,
        seeds=args.seeds,
    )
    print(f"scaling sweep: {len(rows)} runs in {Path(args.out) / 'runs.csv'}")
    return 0


def run_fit(args: argparse.Namespace) -> int:
    from vltrain.core.files import atomic_write_text, check_not_input, check_output_path
    from vltrain.scaling.fit import fit_all, read_runs_csv

    path = Path(args.runs)
    csv_path = path / "runs.csv" if path.is_dir() else path
    for option, out in (("--json", args.json), ("--config-out", args.config_out)):
        if out:
            check_output_path(out, option)
            check_not_input(out, [csv_path], option)
    runs = read_runs_csv(csv_path)
    result = fit_all(
        runs,
        args.bootstrap,
        args.exclude_worst,
        args.predict,
        args.seed,
        exclude_by=args.exclude_by,
        predict_with=args.predict_with,
        huber_delta=_delta(args.huber_delta),
    )
    out = result.to_json()
    p = result.approach3
    print(
        f"approach 3: L = {p['E']:.4g} + {p['A']:.4g}/N^{p['alpha']:.4f} + "
        f"{p['B']:.4g}/D^{p['beta']:.4f}  (a = {out['a_approach3']:.3f})"
    )
    if result.approach2:
        print(f"approach 2: N_opt ~ C^{out['a']:.3f}, D_opt ~ C^{out['b']:.3f}")
    for k, (lo, hi) in result.ci.items():
        print(f"  {k}: [{lo:.4g}, {hi:.4g}]")
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.predict:
        print(
            f"at C = {args.predict:.4g}: approach 3 N_opt = {out['N_opt']:.4g}, "
            f"D_opt = {out['D_opt']:.4g}"
            + (
                f" (approach 2: N_opt = {out['N_opt_approach2']:.4g})"
                if "N_opt_approach2" in out
                else ""
            )
        )
        print(
            f"prediction ({out['predicted_by']}): N_opt = {out['N_opt_predicted']:.4g}, "
            f"D_opt = {out['D_opt_predicted']:.4g}"
            + (
                ""
                if out["prediction_identified"]
                else " (not identified by these runs: see the warnings)"
            )
        )
        if path.is_dir() and (path / "sweep.json").is_file():
            from vltrain.runs.sweep import predicted_config

            target = Path(args.config_out or path / f"predict_C{args.predict:.3g}.yaml")
            size = predicted_config(path, out["N_opt_predicted"], args.predict, target)
            out["predicted_size"] = size.label
            print(f"wrote {target} (size {size.label}); train it with `vltrain train {target}`")
    if args.plots:
        from vltrain.scaling.plots import save_plots

        for p_ in save_plots(runs, result, Path(args.plots)):
            print(f"plot: {p_}")
    if args.json:
        atomic_write_text(args.json, json.dumps(out, indent=2))
    return 0
