"""`vltrain generate`: caption images with a trained captioner or an HF VLM, complete prompts
with an HF causal LM."""

from __future__ import annotations

import argparse

from vltrain.cli.options import (
    add_forward_option,
    non_negative_int,
    path_arg,
    positive_float,
    positive_int,
    positive_probability,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help="caption images with a trained captioner or an HF image-text-to-text model (or "
        "complete prompts with an HF LM), optionally with a drafter (speculative decoding)",
        description="Rebuild the model from the config.yaml of the run that owns CHECKPOINT, "
        "load its weights and tokenizer, and print (or --out) one JSON line per image: "
        '{"image": ..., "caption": ...}.',
    )
    add_generate_options(g)
    g.set_defaults(fn=run)


def add_generate_options(p: argparse.ArgumentParser) -> None:
    """Arguments of `vltrain generate`; numbers are checked here, by the parser."""
    p.add_argument(
        "--checkpoint", default="", help="captioner run dir, checkpoints/ or step folder"
    )
    p.add_argument("--images", nargs="*", default=[], help="image files to caption")
    p.add_argument("--eval-data", default="", help="instead: score BLEU/CIDEr-D on a caption file")
    p.add_argument("--strategy", default="greedy", choices=("greedy", "beam", "sample"))
    p.add_argument("--beams", type=positive_int, default=5, help="beam width (--strategy beam)")
    p.add_argument(
        "--temperature",
        type=positive_float,
        default=None,
        help="sampling temperature (--strategy sample; default 1.0)",
    )
    p.add_argument(
        "--top-k",
        type=non_negative_int,
        default=None,
        help="sample among the k likeliest tokens (--strategy sample; default 0: all)",
    )
    p.add_argument(
        "--top-p",
        type=positive_probability,
        default=None,
        help="nucleus sampling mass in (0, 1] (--strategy sample; default 1.0: all)",
    )
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=24, help="longest caption in tokens"
    )
    p.add_argument("--prompt", default=None, help="prompt text (sft: the user turn)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=16,
        help="images or prompts decoded together (a --draft run prices this batch)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed for --strategy sample")
    p.add_argument("--config", default="", help="run config (default: the checkpoint's run)")
    p.add_argument(
        "--out", type=path_arg, default=None, help="write JSON lines here instead of stdout"
    )
    p.add_argument("--draft", default="", help="drafter run/checkpoint: speculative decoding")
    p.add_argument(
        "--tree-budget", type=non_negative_int, default=0, help="DDTree nodes (0: chain verify)"
    )
    p.add_argument(
        "--tree-shape",
        default="chain-first",
        choices=("chain-first", "best-first"),
        help="DDTree: the argmax chain placed first (a round never accepts less than the chain) "
        "or the paper's pure best-first tree (more tokens a round on average)",
    )
    p.add_argument(
        "--spec",
        default="auto",
        choices=("auto", "chain", "tree", "none"),
        help="--draft with --model: auto (default) predicts from the drafter's measured tau and "
        "this machine's measured verify costs whether chain, tree or no drafter is fastest, and "
        "says which; chain / tree / none force one (captioners: auto decodes as asked)",
    )
    p.add_argument(
        "--model",
        default="",
        help="instead: an HF causal LM dir or .gguf file (with --prompts), or an HF "
        "image-text-to-text model dir (with --images; --prompt is the user turn)",
    )
    p.add_argument("--prompts", default="", help="--model LM: prompts JSONL ({'prompt'} a line)")
    p.add_argument("--stats", default="", help="--draft: write acceptance statistics here")
    add_forward_option(p)


def run(args: argparse.Namespace) -> int:
    from vltrain.tools.generate import generate_command

    return generate_command(args)
