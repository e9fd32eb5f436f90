"""`vltrain quickstart`: synthetic data -> CLIP -> captioner -> RL -> report, on a CPU."""

from __future__ import annotations

import argparse

from vltrain.cli.options import non_negative_int, path_arg, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser(
        "quickstart",
        help="synthetic data -> CLIP -> captioner pretrain/finetune -> RL -> report, on a CPU",
        description="Writes the synthetic shapes dataset, trains the built-in dual encoder "
        "contrastively (retrieval and hard-negative accuracy), then a captioner from its vision "
        "tower (pretrain -> finetune, BLEU-4/CIDEr-D with greedy and beam decoding), then RL on "
        "a CIDEr-D reward, and prints every stage's metrics on val and on the held-out "
        "compositional test split (also written to OUT/report.md).",
    )
    q.add_argument(
        "--out", type=path_arg, default="runs/quickstart", help="folder for data and runs"
    )
    q.add_argument(
        "--size",
        default="tiny",
        choices=("tiny", "tiny_vit", "small"),
        help="towers: tiny (CNN image tower + 1-block text transformer; under 5 min for all "
        "stages on a 2-core CPU), tiny_vit (the 2-layer patch-8 ViT instead), small (4-layer "
        "ViT and text tower; slower)",
    )
    q.add_argument("--steps", type=positive_int, default=700, help="CLIP training steps")
    q.add_argument("--n-train", type=positive_int, default=12000, help="synthetic training images")
    q.add_argument(
        "--caption-steps",
        type=non_negative_int,
        default=300,
        help="captioner pretrain+finetune steps after the CLIP stage (0: skip, and skip RL)",
    )
    q.add_argument(
        "--rl-steps",
        type=non_negative_int,
        default=50,
        help="RL steps after the captioner (0: skip)",
    )
    q.add_argument(
        "--n-eval", type=positive_int, default=300, help="synthetic val and test images each"
    )
    q.add_argument("--batch-size", type=positive_int, default=128, help="batch size")
    q.add_argument(
        "--num-workers",
        type=non_negative_int,
        default=None,
        help="DataLoader worker processes (default: 0 on a CPU with 2 cores or fewer, where a "
        "worker takes time from the training threads; else 1)",
    )
    q.add_argument(
        "overrides",
        nargs="*",
        help="extra dotted config overrides, e.g. run.precision=bf16 (see configs/quickstart.yaml)",
    )
    q.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.runs.quickstart import run_quickstart

    run_quickstart(
        out=args.out,
        size=args.size,
        steps=args.steps,
        n_train=args.n_train,
        n_eval=args.n_eval,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        extra=args.overrides,
        caption_steps=args.caption_steps,
        caption_extra=args.overrides,
        rl_steps=args.rl_steps,
    )
    return 0
