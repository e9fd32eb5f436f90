"""`vltrain data synth [--kind shapes|pages] --out DIR`: synthetic datasets."""

from __future__ import annotations

import argparse

from vltrain.cli.options import (
    image_size,
    non_negative_int,
    path_arg,
    positive_int,
    probability,
    record_count,
)


def train_count(text: str) -> int:
    """--n-train: a record count >= 1."""
    return positive_int(str(record_count(text)))


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "synth",
        help="write a synthetic dataset (shapes captions, or page-screenshot retrieval)",
        description="shapes: DIR/{train,val,test}.jsonl and DIR/images/; the test split uses "
        "(color, shape) combinations never seen in train. pages: DIR/train.jsonl (text query "
        "-> page image, image hard negatives) and DIR/{val,test}/{queries.jsonl, corpus.jsonl, "
        "qrels.tsv} over held-out pages (docs/retrieval.md). DIR must be empty (or new) unless "
        "--force.",
    )
    s.add_argument("--kind", choices=("shapes", "pages"), default="shapes")
    s.add_argument("--out", required=True, type=path_arg, help="output folder (empty or new)")
    s.add_argument("--n-train", type=train_count, default=2000, help="training records")
    s.add_argument("--n-val", type=record_count, default=300, help="validation records")
    s.add_argument("--n-test", type=record_count, default=300, help="test records")
    s.add_argument("--seed", type=non_negative_int, default=0)
    s.add_argument(
        "--image-size", type=image_size, default=None, help="pixels (>= 32; shapes 64, pages 96)"
    )
    s.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty folder, deleting the shapes data set files already there "
        "(other files are kept)",
    )
    s.add_argument(
        "--dup-rate",
        type=probability,
        default=0.0,
        help="shapes: append this fraction of planted train dups",
    )
    s.add_argument(
        "--leak-rate",
        type=probability,
        default=0.0,
        help="shapes: copy this fraction of test records to train",
    )
    s.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="shapes: render in this many processes (the same files for any number)",
    )
    s.add_argument(
        "--negatives", type=non_negative_int, default=3, help="pages: hard-negative pages each"
    )
    s.add_argument(
        "--distractors", type=record_count, default=1000, help="pages: extra corpus pages"
    )
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    if args.kind == "pages":
        from vltrain.data.synth_pages import pages_command

        counts = pages_command(
            args.out,
            args.n_train,
            args.n_val,
            args.n_test,
            args.seed,
            image_size=args.image_size or 96,
            negatives=args.negatives,
            distractors=args.distractors,
        )
        print(f"wrote {counts} to {args.out}")
        return 0
    from vltrain.data.synth import synth_command

    counts = synth_command(
        args.out,
        args.n_train,
        args.n_val,
        args.n_test,
        args.seed,
        image_size=args.image_size or 64,
        dup_rate=args.dup_rate,
        leak_rate=args.leak_rate,
        force=args.force,
        workers=args.workers,
    )
    print(f"wrote {counts} to {args.out}")
    return 0
