"""Keep a drafter run's learning curve in the repository, and compare two curves step by step.

A drafter run on this CPU takes hours and its folder (checkpoints, metrics.jsonl) lives under
bench/out/, which a new machine does not have: round 11's run and round 10's checkpoints were
lost that way. What a later round needs from an earlier one is its curve, to compare at equal
steps (same seed, data order and learning-rate schedule): the eval rows of metrics.jsonl and the
training loss and tau averaged over the steps before each eval. ``save`` writes that (a few KB)
to bench/data/drafter_curves/NAME.json; ``compare`` prints two curves side by side at the steps
both evaluated, from run folders or saved names.

    python bench/drafter_curves.py save bench/out/drafter/RUN --name round12_l4
    python bench/drafter_curves.py compare round10 round12_l4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

KEEP = Path(__file__).parent / "data" / "drafter_curves"
COLUMNS = ("train_loss", "train_tau", "eval_tau", "eval_tau_decode", "eval_loss", "eval_acc_1")
CONFIG_KEYS = ("drafter", "optim", "train", "data")


def curve_of_run(run: Path, window: int = 250) -> dict:
    """The eval rows of ``run``/metrics.jsonl, each with the mean training loss and tau over the
    ``window`` steps up to it, and the run's drafter / optim / train / data settings."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in rows if "loss" in r]
    evals = []
    for r in rows:
        if "eval_tau" not in r:
            continue
        near = [t for t in train if r["step"] - window < t["step"] <= r["step"]]
        row = {k: v for k, v in r.items() if k == "step" or k.startswith("eval_")}
        for key, src in (("train_loss", "loss"), ("train_tau", "train_tau")):
            vals = [t[src] for t in near if src in t]
            row[key] = sum(vals) / len(vals) if vals else None
        evals.append(row)
    cfg = (
        yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else {}
    )
    settings = {k: cfg.get(k) for k in CONFIG_KEYS if k in cfg}
    last = train[-1]["step"] if train else 0
    return {
        "run": run.name,
        "last_step": last,
        "window": window,
        "config": settings,
        "evals": evals,
    }


def load(ref: str) -> dict:
    """A run folder, a saved curve's name (bench/data/drafter_curves/NAME.json) or a JSON path."""
    p = Path(ref)
    if (p / "metrics.jsonl").is_file():
        return curve_of_run(p)
    for cand in (p, KEEP / f"{ref}.json"):
        if cand.is_file():
            return json.loads(cand.read_text())
    raise SystemExit(f"{ref}: neither a run folder with metrics.jsonl nor a saved curve in {KEEP}")


def compare(a: dict, b: dict, columns: tuple[str, ...] = COLUMNS) -> list[dict]:
    """Rows at the steps both curves evaluated: each column's value in a, in b, and b - a."""
    at = {r["step"]: r for r in b["evals"]}
    out = []
    for ra in a["evals"]:
        rb = at.get(ra["step"])
        if rb is None:
            continue
        row = {"step": ra["step"]}
        for c in columns:
            va, vb = ra.get(c), rb.get(c)
            row[c] = (va, vb, None if va is None or vb is None else vb - va)
        out.append(row)
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="write a run's curve to bench/data/drafter_curves/NAME.json")
    s.add_argument("run", type=Path)
    s.add_argument("--name", required=True)
    s.add_argument("--note", default="", help="what the run was (kept in the file)")
    c = sub.add_parser("compare", help="two curves at equal steps (a, b, b - a)")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    if args.cmd == "save":
        curve = curve_of_run(args.run)
        curve["note"] = args.note
        KEEP.mkdir(parents=True, exist_ok=True)
        out = KEEP / f"{args.name}.json"
        out.write_text(json.dumps(curve, indent=1) + "\n")
        print(f"{out}: {len(curve['evals'])} evals up to step {curve['last_step']}")
        return 0
    a, b = load(args.a), load(args.b)
    rows = compare(a, b)
    if not rows:
        print(f"no step evaluated by both {a['run']} and {b['run']}", file=sys.stderr)
        return 1
    print(f"a = {a['run']}, b = {b['run']}; each cell a / b / b - a")
    print("| step | " + " | ".join(COLUMNS) + " |")
    print("|---:|" + "---:|" * len(COLUMNS))
    for r in rows:
        cells = [" / ".join(_fmt(v) for v in r[c]) for c in COLUMNS]
        print(f"| {r['step']:,} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
