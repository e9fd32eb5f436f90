"""`vltrain doctor RUN_DIR`: re-run the training doctor's checks over a run, offline."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check a finished or running run for silent failures (exit 0 ok, 1 warn, 2 error)",
        description="Replays RUN_DIR/doctor_steps.jsonl (or metrics.jsonl) through the doctor's "
        "checks and adds the online findings of doctor.jsonl; prints one line per finding at "
        "warn level or above (--all: info too). Exit code: 0 nothing at warn or above, 1 "
        "warnings, 2 errors.",
    )
    p.add_argument("run_dir", help="a run directory (holds config.yaml)")
    p.add_argument("--json", action="store_true", help="one JSON object per finding")
    p.add_argument("--all", action="store_true", help="also print info findings")
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.diagnostics.doctor import analyse_run
    from vltrain.diagnostics.record import severity_rank

    found = analyse_run(args.run_dir)
    shown = [f for f in found if args.all or severity_rank(f.severity) >= 1]
    for f in shown:
        print(json.dumps(asdict(f), default=str) if args.json else f.line())
    worst = max((severity_rank(f.severity) for f in found), default=0)
    if not shown and not args.json:
        print(f"doctor: {args.run_dir}: no findings at warn level or above")
    return worst  # 0 info/none, 1 warn, 2 error
