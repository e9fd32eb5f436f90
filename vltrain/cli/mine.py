"""`vltrain mine`: hard-negative mining with a trained contrastive model."""

from __future__ import annotations

import argparse

from vltrain.cli.options import finite_float, non_negative_int, path_arg, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser(
        "mine",
        help="mine hard-negative captions with a trained contrastive model",
        description="Encode every image (query) and caption (corpus) of --data, take the "
        "top-ranked captions that are not the image's own inside the rank window, drop likely "
        "false negatives (score above margin x the best positive's, i.e. not below it by "
        "(1 - margin) x |positive|), and write --out with "
        "`negatives` filled in (train on it with objective.hard_negatives=K).",
    )
    m.add_argument(
        "--checkpoint", required=True, type=path_arg, help="run dir or checkpoint folder"
    )
    m.add_argument("--data", required=True, type=path_arg, help="input JSONL")
    m.add_argument(
        "--out", required=True, type=path_arg, help="output JSONL (same folder as --data)"
    )
    m.add_argument("--k", type=positive_int, default=5, help="negatives per record")
    m.add_argument(
        "--range-min", type=non_negative_int, default=0, help="first rank considered (0-based)"
    )
    m.add_argument("--range-max", type=positive_int, default=100, help="ranks considered stop here")
    m.add_argument(
        "--margin",
        type=finite_float,
        default=0.95,
        help="skip candidates scoring above margin x the positive's score (for a positive "
        "<= 0: above it minus (1 - margin) x its magnitude)",
    )
    m.add_argument("--batch-size", type=positive_int, default=128, help="images encoded together")
    m.add_argument("--append", action="store_true", help="keep the records' own negatives")
    m.add_argument(
        "--corpus",
        help="query/positive records: mine document ids from this corpus.jsonl (any modality)",
    )
    m.add_argument("--qrels", help="with --corpus: qrels.tsv whose positives are never mined")
    m.set_defaults(fn=run, parser=m)


def run(args: argparse.Namespace) -> int:
    from vltrain.tools.mine import MineOptions, mine_command, mine_pairs_command

    if args.range_min >= args.range_max:  # a cross-option rule: a parser error all the same
        args.parser.error(
            f"--range-min {args.range_min} must be below --range-max {args.range_max} "
            "(ranks range_min .. range_max-1 are searched)"
        )
    opts = MineOptions(
        k=args.k,
        range_min=args.range_min,
        range_max=args.range_max,
        margin=args.margin,
        batch_size=args.batch_size,
        append=args.append,
    )
    if args.corpus:
        stats = mine_pairs_command(
            args.checkpoint, args.data, args.corpus, args.out, opts, qrels=args.qrels
        )
    else:
        stats = mine_command(args.checkpoint, args.data, args.out, opts)
    print(
        f"wrote {args.out}: {stats['records']} records, {stats['mined_mean']:.2f} negatives "
        f"per record on average, {stats['records_with_k']} with all {args.k}"
    )
    return 0
