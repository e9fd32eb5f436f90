"""`vltrain <command>`: parse, validate, dispatch; user errors print without a traceback.

Each command is a module here with `add_parser(subparsers)` and `run(args) -> exit code`,
listed once in COMMANDS.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vltrain.cli import (
    config_docs,
    data,
    generate,
    mine,
    pipeline,
    quickstart,
    scaling,
    train,
    tune,
)

#: top-level commands, in --help order
COMMANDS = (train, pipeline, data, quickstart, tune, scaling, generate, mine, config_docs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vltrain", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vltrain` console script."""
    from vltrain.config.core import ConfigError
    from vltrain.data.records import DataError, DataQualityError
    from vltrain.engine.checkpoint import CheckpointError
    from vltrain.engine.loop import TrainingAborted, TrainingStopped

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except TrainingStopped as e:  # SIGTERM/SIGINT: a checkpoint was written; not an error
        print(f"vltrain: {e}", file=sys.stderr)
        return 128 + e.signal
    except (
        ConfigError,
        DataError,
        DataQualityError,
        TrainingAborted,
        CheckpointError,
        FileNotFoundError,
    ) as e:
        print(f"vltrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vltrain: interrupted", file=sys.stderr)
        return 130
