"""`vltrain data synth [--kind shapes|pages] --out DIR`: synthetic datasets."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "synth",
        help="write a synthetic dataset (shapes captions, or page-screenshot retrieval)",
        description="shapes: DIR/{train,val,test}.jsonl and DIR/images/; the test split uses "
        "(color, shape) combinations never seen in train. pages: DIR/train.jsonl (text query "
        "-> page image, image hard negatives) and DIR/{val,test}/{queries.jsonl, corpus.jsonl, "
        "qrels.tsv} over held-out pages (docs/retrieval.md).",
    )
    s.add_argument("--kind", choices=("shapes", "pages"), default="shapes")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--n-train", type=int, default=2000)
    s.add_argument("--n-val", type=int, default=300)
    s.add_argument("--n-test", type=int, default=300)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--image-size", type=int, default=None, help="shapes: 64, pages: 96")
    s.add_argument("--negatives", type=int, default=3, help="pages: hard-negative pages each")
    s.add_argument("--distractors", type=int, default=1000, help="pages: extra corpus pages")
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
        args.out, args.n_train, args.n_val, args.n_test, args.seed, image_size=args.image_size or 64
    )
    print(f"wrote {counts} to {args.out}")
    return 0
