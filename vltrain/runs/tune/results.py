"""What a search leaves in its study dir: the trials table, best.yaml, summary and plots."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any, Protocol

import yaml

from vltrain.config.core import to_dict
from vltrain.runs.report import cell, markdown_table


class Search(Protocol):
    """What the results read of a search (`vltrain.runs.tune.search.Search` is one)."""

    config_path: str
    tune: Any  # the config's tune section
    metric: str
    direction: str
    name: str
    study_dir: Path
    storage_spec: Any  # storage.StorageSpec
    plan: Any  # trial.TrialPlan
    study: Any  # the optuna study


def trial_rows(study: Any) -> list[dict[str, Any]]:
    """One row per trial: number, state, value, duration, reason and params."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        reason = t.user_attrs.get("prune_reason") or t.user_attrs.get("fail_reason") or ""
        last_step = max(t.intermediate_values) if t.intermediate_values else None
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "value": t.value,
                "last_step": last_step,
                "seconds": round(t.duration.total_seconds(), 1) if t.duration else None,
                "reason": reason,
                "run_dir": t.user_attrs.get("run_dir", ""),
                **{f"params.{k}": v for k, v in t.params.items()},
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]], metric: str, unit: str) -> str:
    """Markdown table of trials (params, value, state, duration)."""
    keys = sorted({k for r in rows for k in r if k.startswith("params.")})
    head = ["#", "state", metric, f"last {unit}", "seconds", *(k[7:] for k in keys)]
    cols = ("number", "state", "value", "last_step", "seconds", *keys)
    return markdown_table(head, ([cell(r.get(c), spec=".4g") for c in cols] for r in rows))


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def write_best_yaml(search: Search, best: Any) -> Path:
    """`best.yaml`: the base config (full budget) with the best trial's params merged."""
    out = search.study_dir / "best.yaml"
    cfg = search.plan.best_config(best.params, search.study_dir / "best_run")
    header = (
        f"# Best configuration of study '{search.name}': trial {best.number}, "
        f"{search.metric} = {best.value:.6g} ({search.direction}).\n"
        f"# The base config {search.config_path} with these searched values:\n"
        + "".join(f"#   {k}: {v!r}\n" for k, v in best.params.items())
        + f"# Train it as stage 1:  vltrain train {out}\n"
    )
    out.write_text(header + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return out


def save_plots(study: Any, out_dir: Path) -> tuple[list[str], list[str]]:
    """Optimisation history, parameter importances and intermediate values as HTML (plotly)
    and PNG (matplotlib); returns (files written, notes on plots skipped)."""
    from optuna.trial import TrialState

    written, notes = [], []
    names = ["optimization_history", "param_importances", "intermediate_values"]
    if len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) < 2:
        names.remove("param_importances")
        notes.append("param_importances: needs at least 2 completed trials")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna's matplotlib backend is "experimental"
        try:
            import optuna.visualization as vis

            for name in names:
                try:
                    fig = getattr(vis, f"plot_{name}")(study)
                    fig.write_html(out_dir / f"{name}.html", include_plotlyjs="directory")
                    written.append(f"{name}.html")
                except Exception as e:
                    notes.append(f"{name}.html: {e}")
        except ImportError:
            notes.append("HTML plots need plotly: pip install 'vltrain[tune]'")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            import optuna.visualization.matplotlib as vm

            for name in names:
                try:
                    ax = getattr(vm, f"plot_{name}")(study)
                    fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
                    fig.savefig(out_dir / f"{name}.png", dpi=100, bbox_inches="tight")
                    plt.close(fig)
                    written.append(f"{name}.png")
                except Exception as e:
                    notes.append(f"{name}.png: {e}")
        except ImportError:
            notes.append("PNG plots need matplotlib: pip install 'vltrain[tune]'")
    return written, notes


def write_results(search: Search, seconds: float) -> dict[str, Any]:
    """Write trials.csv/.md, best.yaml, summary.json and plots; print the table and best."""
    from optuna.trial import TrialState

    study, out = search.study, search.study_dir
    out.mkdir(parents=True, exist_ok=True)
    rows = trial_rows(study)
    table = format_table(rows, search.metric, search.plan.unit)
    _write_csv(rows, out / "trials.csv")
    (out / "trials.md").write_text(table + "\n")
    counts = {
        s.name: sum(r["state"] == s.name for r in rows)
        for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)
    }
    summary: dict[str, Any] = {
        "study": search.name,
        "storage": search.storage_spec.display,
        "study_dir": str(out),
        "metric": search.metric,
        "direction": search.direction,
        "states": counts,
        "seconds_this_session": round(seconds, 1),
        "best": None,
    }
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    lines = [table, ""]
    if complete:
        best = study.best_trial
        path = write_best_yaml(search, best)
        summary["best"] = {
            "number": best.number,
            "value": best.value,
            "params": best.params,
            "run_dir": best.user_attrs.get("run_dir", ""),
        }
        summary["best_yaml"] = str(path)
        lines += [
            f"best: trial {best.number}, {search.metric} = {best.value:.4f}",
            *(f"  {k}: {v!r}" for k, v in best.params.items()),
            f"best config: {path}  (train it: vltrain train {path})",
        ]
    else:
        lines.append("no trial completed: best.yaml not written")
    if search.tune.plots and rows:
        written, notes = save_plots(study, out)
        summary["plots"], summary["plot_notes"] = written, notes
        if written:
            lines.append(f"plots: {', '.join(written)} in {out}")
    lines.append(f"states: {counts}; this session {seconds:.0f} s")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print("\n".join(lines), flush=True)
    return summary
