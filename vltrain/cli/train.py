"""`vltrain train CONFIG.yaml [dotted.key=value ...]` (also under torchrun)."""

from __future__ import annotations

import argparse

from vltrain.cli.options import path_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train",
        help="train a stage from a YAML config",
        description="Train from CONFIG.yaml with dotted overrides, e.g. "
        "`vltrain train configs/clip.yaml optim.lr=3e-4 data.batch_size=32`. "
        "Runs the same under `torchrun --nproc_per_node=N -m vltrain train ...`.",
    )
    t.add_argument("config", type=path_arg, help="YAML config (see configs/ and docs/config.md)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    t.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.core import distributed
    from vltrain.runs import train
    from vltrain.stages import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    try:
        train(cfg)
    except BaseException:
        distributed.shutdown()
        raise
    distributed.shutdown(finished=True)
    return 0
