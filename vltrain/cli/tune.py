"""`vltrain tune CONFIG [overrides]`: hyperparameter search with Optuna."""

from __future__ import annotations

import argparse

from vltrain.cli.options import path_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vltrain.runs.tune.command import DESCRIPTION as TUNE_DESCRIPTION
    from vltrain.runs.tune.command import USAGE, add_tune_options

    tu = sub.add_parser(
        "tune",
        help="hyperparameter search with Optuna (resumable, pruned)",
        description=TUNE_DESCRIPTION,
        usage=USAGE,
    )
    add_tune_options(tu)
    tu.add_argument(
        "config", type=path_arg, help="YAML config with a tune section (see configs/tune.yaml)"
    )
    tu.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="overrides",
        help="dotted key=value overrides (options may also follow the config)",
    )
    tu.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.runs.tune.command import tune_command

    return tune_command(args)
