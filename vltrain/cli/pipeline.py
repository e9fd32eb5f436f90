"""`vltrain pipeline PIPELINE.yaml [overrides]`: stages in order, restartable."""

from __future__ import annotations

import argparse

from vltrain.cli.options import path_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser(
        "pipeline",
        help="run training stages in order (pretrain -> finetune -> rl), restartable",
        description="Run the stages of PIPELINE.yaml (see configs/pipeline.yaml) in "
        "<root>/<name>, each from the previous stage's best checkpoint; finished stages are "
        "skipped and an interrupted one resumes; writes <root>/report.md.",
    )
    pl.add_argument(
        "pipeline", type=path_arg, help="pipeline YAML (stages: name, config, overrides)"
    )
    pl.add_argument("overrides", nargs="*", help="dotted key=value overrides for every stage")
    pl.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.core import distributed
    from vltrain.runs.pipeline import run_pipeline

    try:
        run_pipeline(args.pipeline, args.overrides)
    except BaseException:
        distributed.shutdown()
        raise
    distributed.shutdown(finished=True)
    return 0
