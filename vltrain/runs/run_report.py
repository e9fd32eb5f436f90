"""`vltrain report`: runs -> one self-contained HTML page (inline SVG plots, no network).

Per run: a card (commit and dirty state, machine, versions, time, CPU/GPU-hours), curves (loss
raw and smoothed with doctor findings marked, eval metrics, LR, grad norm, throughput), loss vs
batch length per bucket, the per-checkpoint eval table (best marked), test metrics (retrieval,
caption, drafter: whatever the stage reports), bad-sample counts, and the doctor's findings.
Across runs: a tune study's trials table (a study folder given), the config diff and an
ablation table (baseline = first run).
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from html import escape
from pathlib import Path
from typing import Any

import yaml

from vltrain.core.files import atomic_write_text
from vltrain.diagnostics import svg
from vltrain.diagnostics.doctor import analyse_run, load_records
from vltrain.diagnostics.record import Finding, severity_rank
from vltrain.runs.report import html_table

# 1,200 px of content plus margins fits a 1,280-px window; a table wider than that scrolls
# inside its own box (.scroll) instead of widening the page, and two 590-px plots fit a row
CSS = """body{font-family:sans-serif;margin:24px;max-width:1200px;color:#222}
p{overflow-wrap:anywhere}.scroll{overflow-x:auto;max-width:100%;margin:8px 0 16px}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;
font-size:13px;text-align:left}th{background:#f3f3f3}
tr.best td{background:#e6f4ea;font-weight:bold}.plots{display:flex;flex-wrap:wrap;gap:8px}
.card td:first-child{color:#666}h2{border-bottom:1px solid #ddd}"""
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def rounded(value: Any) -> Any:
    """A float (or a string holding one, as CSV cells do) to 4 significant digits, whole from
    10,000 up; anything else unchanged."""
    if isinstance(value, str):
        if not NUMBER.fullmatch(value.strip().lower()) or value.strip().isdigit():
            return value
        value = float(value)
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return value


def table(
    header: Sequence[str], rows: Iterable[Sequence[Any]], highlight: Iterable[int] = ()
) -> str:
    """An HTML table of rounded numbers in a box that scrolls sideways when it is too wide."""
    body = [[rounded(c) for c in row] for row in rows]
    return f'<div class="scroll">{html_table(header, body, highlight)}</div>'


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def expand_runs(paths: list[str]) -> list[Path]:
    """Run directories: each path itself if it holds config.yaml, else its sub-runs in order."""
    out = []
    for p in map(Path, paths):
        if (p / "config.yaml").is_file():
            out.append(p)
            continue
        subs = sorted(
            (d for d in p.iterdir() if (d / "config.yaml").is_file()),
            key=lambda d: d.stat().st_mtime,
        ) if p.is_dir() else []  # fmt: skip
        if not subs:
            raise FileNotFoundError(f"{p} is not a run directory (no config.yaml) nor holds runs")
        out += subs
    return out


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


class RunData:
    """Everything the report reads from one run directory."""

    def __init__(self, path: Path) -> None:
        self.path, self.name = path, path.name
        self.config = _flat(yaml.safe_load((path / "config.yaml").read_text()) or {})
        self.metrics = _jsonl(path / "metrics.jsonl")
        self.summary = _json(path / "summary.json")
        self.card = _json(path / "run_card.json")
        self.records = load_records(path)
        self.findings: list[Finding] = analyse_run(path)

    def series(self, key: str) -> tuple[list[float], list[float]]:
        rows = [r for r in self.metrics if isinstance(r.get(key), (int, float))]
        return [float(r["step"]) for r in rows], [float(r[key]) for r in rows]

    def eval_rows(self) -> list[dict[str, Any]]:
        rows: dict[int, dict[str, Any]] = {}
        for r in self.metrics:
            ev = {k: v for k, v in r.items() if k.startswith("eval_")}
            if ev:
                rows.setdefault(int(r["step"]), {}).update(ev)
        return [{"step": s, **v} for s, v in sorted(rows.items())]

    def final_metrics(self) -> dict[str, float]:
        """The best/last eval and the test metrics, flat: what the ablation table compares."""
        out = {}
        ev = self.eval_rows()
        if ev:
            out.update({k: v for k, v in ev[-1].items() if k != "step"})
        for k, v in (self.summary.get("test") or {}).items():
            out[f"test_{k}"] = v
        return {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}


def _card(run: RunData) -> str:
    c, s = run.card, run.summary
    secs = s.get("train_seconds")
    hours = (secs or 0) * c.get("world_size", 1) / 3600
    dev = c.get("gpu") or c.get("cpu", "?")
    best = rounded(s.get("best_value"))
    rows = [
        ("commit", f"{c.get('commit', '?')}{' (dirty tree)' if c.get('dirty') else ''}"),
        ("machine", f"{c.get('host', '?')}: {dev} x{c.get('world_size', 1)}"),
        ("device", str(c.get("device", "?"))),
        ("versions", f"python {c.get('python', '?')}, torch {c.get('torch', '?')}"),
        ("started", c.get("started", "?")),
        ("stage", str(run.config.get("stage", "?"))),
        ("steps", f"{s.get('steps', '?')} ({s.get('skipped_steps', 0)} skipped)"),
        ("time", f"{rounded(secs)} s; cost {hours:.3g} device-hours" if secs is not None else "?"),
        ("best", f"{s.get('best_metric')} = {best} at step {s.get('best_step')}"),
    ]  # fmt: skip
    return '<div class="scroll"><table class="card">' + "".join(
        f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in rows
    ) + "</table></div>"  # fmt: skip


def _markers(run: RunData) -> list[svg.Marker]:
    # findings use 0-based record steps; metrics.jsonl counts finished steps
    return [
        svg.Marker(f.step + 1, f"{f.check}: {f.message}", svg.SEVERITY_COLORS[f.severity])
        for f in run.findings
        if f.severity != "info"
    ][:200]


def _plots(run: RunData) -> str:
    xs, loss = run.series("loss")
    if run.records:  # the doctor's per-step records: every step, not every log_every
        xs = [float(r.step + 1) for r in run.records]  # metrics.jsonl counts finished steps
        loss = [r.loss for r in run.records]
    plots = [
        svg.Plot(
            "train loss (raw, smoothed; dashed: doctor findings)",
            [
                svg.Series("raw", xs, loss, opacity=0.35),
                svg.Series("ema", xs, svg.ema(loss), width=2.2),
            ],
            _markers(run),
        )
    ]  # fmt: skip
    ev_keys = sorted({k for r in run.eval_rows() for k in r if k != "step"})
    ev = [svg.Series(k, *run.series(k), kind="line") for k in ev_keys[:6]]
    if ev:
        plots.append(svg.Plot("eval metrics", ev))
    for key, title, log in (
        ("lr", "learning rate", False),
        ("grad_norm", "grad norm (pre-clip)", True),
        ("samples_per_s", "throughput (samples/s)", False),
    ):
        gx, gy = run.series(key)
        if key == "grad_norm" and run.records:
            gx, gy = xs, [r.grad_norm for r in run.records]
        plots.append(svg.Plot(title, [svg.Series(key, gx, gy)], log_y=log))
    with_len = [r for r in run.records if r.lengths and r.finite]
    if with_len:
        by_bucket = _buckets(with_len)
        plots.append(
            svg.Plot(
                "loss vs batch mean length (colour: length bucket)",
                [svg.Series(f"bucket {b}", x, y, kind="points") for b, (x, y) in by_bucket.items()],
                xlabel="batch mean token length",
            )
        )
    return '<div class="plots">' + "".join(svg.render(p) for p in plots) + "</div>"


def _buckets(recs: list[Any]) -> dict[int, tuple[list[float], list[float]]]:
    means = [statistics.fmean(r.lengths) for r in recs]
    edges = statistics.quantiles(means, n=3) if len(means) > 2 else []
    out: dict[int, tuple[list[float], list[float]]] = {}
    for m, r in zip(means, recs, strict=True):
        b = sum(m > e for e in edges)
        out.setdefault(b, ([], []))[0].append(m)
        out[b][1].append(r.loss)
    return dict(sorted(out.items()))


def _eval_table(run: RunData) -> str:
    rows = run.eval_rows()
    if not rows:
        return "<p>no evaluation logged</p>"
    keys = sorted({k for r in rows for k in r if k != "step"})
    ckpts = {p.name for p in (run.path / "checkpoints").glob("step_*")}
    best = run.summary.get("best_step")
    body = [
        [r["step"], "yes" if f"step_{r['step']}" in ckpts else "-"] + [r.get(k) for k in keys]
        for r in rows
    ]
    marked = [i for i, r in enumerate(rows) if r["step"] == best]
    return table(["step", "checkpoint kept", *keys], body, marked) + (
        f"<p>best ({escape(str(run.summary.get('best_metric')))}) highlighted</p>" if marked else ""
    )


def _steps(steps: list[int], shown: int = 8) -> str:
    head = ", ".join(map(str, steps[:shown]))
    return head + (f", ... {steps[-1]}" if len(steps) > shown else "")


def grouped_findings(findings: list[Finding]) -> list[list[Any]]:
    """Findings that repeat (one check, one message but for its numbers, one fix) as one row:
    severity, count, steps, check, the first one's message, fix; the most severe first."""
    groups: dict[tuple[str, str, str, str], list[Finding]] = {}
    for f in findings:
        key = (f.severity, f.check, NUMBER.sub("#", f.message), f.fix)
        groups.setdefault(key, []).append(f)
    rows = [
        [g[0].severity, len(g), _steps([f.step for f in g]), g[0].check, g[0].message, g[0].fix]
        for g in groups.values()
    ]
    return sorted(rows, key=lambda r: -severity_rank(r[0]))


def _findings_table(run: RunData) -> str:
    if not run.findings:
        return "<p>the doctor found nothing</p>"
    header = ["severity", "count", "steps", "check", "finding (the first)", "what to change"]
    return table(header, grouped_findings(run.findings))


def _extras(run: RunData) -> str:
    parts = []
    test = run.summary.get("test") or {}
    if test:
        parts.append("<h4>test metrics (retrieval / caption / drafter)</h4>")
        parts.append(table(["metric", "value"], sorted(test.items())))
    bad = {k: v for k, v in (run.summary.get("bad_samples") or {}).items() if v}
    parts.append(
        table(["bad-sample reason", "count"], sorted(bad.items()))
        if bad
        else "<p>bad samples: none</p>"
    )
    return "".join(parts)


def study_trials(folder: Path) -> str:
    """A tune study folder's trials table (its trials.csv, the best trial highlighted); '' for
    any other path. The study's trial runs are its sub-runs (`expand_runs`), reported each."""
    trials = folder / "trials.csv"
    if (folder / "config.yaml").is_file() or not trials.is_file():
        return ""
    rows = list(csv.reader(trials.read_text().splitlines()))
    if not rows:
        return ""
    best = (_json(folder / "summary.json").get("best") or {}).get("number")
    marked = [i for i, row in enumerate(rows[1:]) if row and row[0] == str(best)]
    return (
        f"<h2>tune study {escape(folder.name)}: trials</h2><p>{escape(str(folder))}</p>"
        + table(rows[0], rows[1:], marked)
        + ("<p>best trial highlighted</p>" if marked else "")
    )


def config_diff(runs: list[RunData]) -> tuple[list[str], list[list[Any]]]:
    """(header, rows) of the config keys whose values differ between runs."""
    keys = sorted(set().union(*(r.config for r in runs)))
    rows = []
    for k in keys:
        vals = [r.config.get(k) for r in runs]
        if k != "run.out_dir" and len({json.dumps(v, default=str) for v in vals}) > 1:
            rows.append([k, *[json.dumps(v, default=str) for v in vals]])
    return ["key", *[r.name for r in runs]], rows


def _variant_key(run: RunData) -> str:
    skip = ("run.out_dir", "run.seed")
    return json.dumps(
        {k: v for k, v in run.config.items() if k not in skip}, sort_keys=True, default=str
    )


def ablation(runs: list[RunData]) -> tuple[list[str], list[list[Any]]]:
    """Baseline (first run) vs each variant: the change, deltas of the compared metric and a
    verdict that weighs the delta against the seed-to-seed spread of runs differing only in
    seed (without such runs: 'no seed spread')."""
    base = runs[0]
    metric = base.summary.get("best_metric") or next(iter(base.final_metrics()), "")
    groups: dict[str, list[float]] = {}
    for r in runs:
        v = r.final_metrics().get(metric)
        if v is not None and math.isfinite(v):
            groups.setdefault(_variant_key(r), []).append(v)
    spreads = [statistics.stdev(v) for v in groups.values() if len(v) >= 2]
    spread = statistics.fmean(spreads) if spreads else None
    b = base.final_metrics().get(metric)
    rows = []
    for r in runs[1:]:
        _, diff = config_diff([base, r])
        change = ", ".join(f"{k}={row[-1]}" for k, *row in diff) if diff else "(same config)"
        v = r.final_metrics().get(metric)
        delta = None if v is None or b is None else v - b
        if delta is None:
            verdict = "no metric"
        elif spread is None:
            verdict = "no seed spread (run >= 2 seeds of one config)"
        elif abs(delta) > 2 * spread:
            verdict = f"real: |delta| > 2x seed std ({spread:.4g})"
        else:
            verdict = f"within seed noise (seed std {spread:.4g})"
        rows.append([r.name, change, b, v, delta, verdict])
    return [
        "variant",
        "change vs " + base.name,
        f"baseline {metric}",
        metric,
        "delta",
        "verdict",
    ], rows


def build_report(paths: list[str], title: str = "vltrain report") -> str:
    """The report page as one HTML string."""
    runs = [RunData(p) for p in expand_runs(paths)]
    body = [f"<h1>{escape(title)}</h1>", *filter(None, (study_trials(Path(p)) for p in paths))]
    if len(runs) > 1:
        header, rows = config_diff(runs)
        body += ["<h2>config diff</h2>", table(header, rows) if rows else "<p>identical</p>"]
    same = [r for r in runs if r.config.get("stage") == runs[0].config.get("stage")]
    if len(same) > 1:  # an ablation compares runs of one stage (a pipeline's stages are not)
        header, rows = ablation(same)
        body += ["<h2>ablation (baseline: first run)</h2>", table(header, rows)]
    for run in runs:
        body += [
            f"<h2>{escape(run.name)}</h2>", f"<p>{escape(str(run.path))}</p>",
            _card(run), _plots(run), "<h3>evaluation per checkpoint</h3>", _eval_table(run),
            "<h3>doctor findings</h3>", _findings_table(run), _extras(run),
        ]  # fmt: skip
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}'
        f"</title><style>{CSS}</style></head><body>" + "\n".join(body) + "</body></html>"
    )


def write_report(paths: list[str], output: str | Path, title: str = "vltrain report") -> Path:
    """Write the report to `output` (one self-contained HTML file)."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, build_report([str(p) for p in paths], title))
    return out
