"""`vltrain data synth --out DIR`: the synthetic shapes image-caption dataset."""

from __future__ import annotations

import argparse

from vltrain.cli.options import image_size, non_negative_int, path_arg, positive_int, probability


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "synth",
        help="write the synthetic 'shapes' image-caption dataset",
        description="Write DIR/{train,val,test}.jsonl and DIR/images/. The test "
        "split uses (color, shape) combinations never seen in train. DIR must be empty "
        "(or new) unless --force.",
    )
    s.add_argument("--out", required=True, type=path_arg, help="output folder (empty or new)")
    s.add_argument("--n-train", type=positive_int, default=2000, help="training records")
    s.add_argument("--n-val", type=non_negative_int, default=300, help="validation records")
    s.add_argument("--n-test", type=non_negative_int, default=300, help="test records")
    s.add_argument("--seed", type=non_negative_int, default=0)
    s.add_argument("--image-size", type=image_size, default=64, help="pixels (>= 32)")
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
        help="append this fraction of planted train dups",
    )
    s.add_argument(
        "--leak-rate",
        type=probability,
        default=0.0,
        help="copy this fraction of test records to train",
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
        force=args.force,
    )
    print(f"wrote {counts} to {args.out}")
    return 0
