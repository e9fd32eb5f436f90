"""`vltrain data synth --out DIR`: the synthetic shapes image-caption dataset."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "synth",
        help="write the synthetic 'shapes' image-caption dataset",
        description="Write DIR/{train,val,test}.jsonl and DIR/images/. The test "
        "split uses (color, shape) combinations never seen in train.",
    )
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--n-train", type=int, default=2000)
    s.add_argument("--n-val", type=int, default=300)
    s.add_argument("--n-test", type=int, default=300)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--image-size", type=int, default=64)
    s.add_argument(
        "--dup-rate", type=float, default=0.0, help="append this fraction of planted train dups"
    )
    s.add_argument(
        "--leak-rate", type=float, default=0.0, help="copy this fraction of test records to train"
    )
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.data.synth import synth_command

    counts = synth_command(
        args.out,
        args.n_train,
        args.n_val,
        args.n_test,
        args.seed,
        image_size=args.image_size,
        dup_rate=args.dup_rate,
        leak_rate=args.leak_rate,
    )
    print(f"wrote {counts} to {args.out}")
    return 0
