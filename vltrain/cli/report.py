"""`vltrain report RUN [RUN ...] -o report.html`: one self-contained HTML page."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="one self-contained HTML report of runs: card, curves, findings, eval and ablations",
        description="Writes one HTML file (inline SVG plots, no network): a card per run "
        "(commit, machine, versions, time), config diff, loss/eval/LR/grad-norm/throughput "
        "curves with doctor findings marked, per-bucket loss, per-checkpoint eval table, and "
        "an ablation table across runs (the first run is the baseline).",
    )
    p.add_argument("runs", nargs="+", help="run directories (or a pipeline root)")
    p.add_argument("-o", "--output", default="report.html", help="the HTML file to write")
    p.add_argument("--title", default="vltrain report", help="page title")
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.core.files import check_not_input, check_output_path
    from vltrain.runs.run_report import write_report

    check_output_path(args.output, "-o")
    check_not_input(args.output, args.runs, "-o")
    path = write_report(args.runs, args.output, title=args.title)
    print(f"wrote {path}")
    return 0
