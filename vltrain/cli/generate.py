"""`vltrain generate`: caption images with a trained captioner checkpoint."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vltrain.tools.generate import add_generate_options

    g = sub.add_parser(
        "generate",
        help="caption images with a trained captioner checkpoint",
        description="Rebuild the model from the config.yaml of the run that owns CHECKPOINT, "
        "load its weights and tokenizer, and print (or --out) one JSON line per image: "
        '{"image": ..., "caption": ...}.',
    )
    add_generate_options(g)
    g.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.tools.generate import generate_command

    return generate_command(args)
