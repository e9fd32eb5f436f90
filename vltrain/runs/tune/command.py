"""The `vltrain tune` command line: options may come before or after the dotted overrides."""

from __future__ import annotations

import argparse
from typing import Any

DESCRIPTION = (
    "Search the hyperparameters declared in CONFIG's tune.space with Optuna. Each trial trains "
    "with the full engine in its own run dir under run.out_dir/STUDY; a median pruner stops "
    "unpromising trials; results live in SQLite (or --storage) so re-running with --study NAME "
    "resumes a killed search. Writes trials.csv/.md, plots and best.yaml (the base config with "
    "the best parameters, for `vltrain train`). See docs/tuning.md."
)
#: one usage line for both parsers below: the re-parse of the trailing arguments knows no
#: `config` positional, and argparse would print its usage without it
USAGE = "%(prog)s [-h] [--trials N] [--storage URL] [--study NAME] config [overrides ...]"


def _trials(text: str) -> int:
    """--trials: an integer >= 1, checked by the parser."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def add_tune_options(p: argparse.ArgumentParser) -> None:
    """The options of `vltrain tune` (shared by the CLI parser and the re-parse below)."""
    p.add_argument(
        "--trials",
        type=_trials,
        default=None,
        metavar="N",
        help="trials to finish in the study (overrides tune.trials)",
    )
    p.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help="'journal', 'journal:PATH', a SQLAlchemy URL or env:VAR "
        "(default: SQLite in the study dir; overrides tune.storage)",
    )
    p.add_argument(
        "--study",
        default=None,
        metavar="NAME",
        help="study name; reuse it to resume (overrides tune.study)",
    )


def parse_rest(args: argparse.Namespace) -> dict[str, Any]:
    """Split the trailing arguments into options and dotted overrides."""
    p = argparse.ArgumentParser(prog="vltrain tune", usage=USAGE, add_help=False)
    add_tune_options(p)
    p.add_argument("overrides", nargs="*")
    rest = p.parse_intermixed_args(args.rest)
    return {
        "trials": rest.trials if rest.trials is not None else args.trials,
        "storage": rest.storage if rest.storage is not None else args.storage,
        "study": rest.study if rest.study is not None else args.study,
        "overrides": rest.overrides,
    }


def tune_command(args: argparse.Namespace) -> int:
    """Run the search described by the parsed `vltrain tune` arguments."""
    from vltrain.runs.tune.search import run_search

    opts = parse_rest(args)
    if opts["trials"] is not None and opts["trials"] < 1:
        from vltrain.config.core import ConfigError

        raise ConfigError(f"--trials must be >= 1, got {opts['trials']}")
    run_search(
        args.config,
        opts["overrides"],
        trials=opts["trials"],
        storage=opts["storage"],
        study=opts["study"],
    )
    return 0
