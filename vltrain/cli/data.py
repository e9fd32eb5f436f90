"""`vltrain data <command>`: dataset tools. Each subcommand is a module with `add_parser` and
`run`, listed in SUBCOMMANDS."""

from __future__ import annotations

import argparse

from vltrain.cli import data_curate, data_shard, data_synth

#: `vltrain data` subcommands, in --help order
SUBCOMMANDS = (data_synth, data_shard, data_curate)


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("data", help="dataset tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(dsub)
