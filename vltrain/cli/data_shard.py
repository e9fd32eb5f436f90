"""`vltrain data shard IN.jsonl --out DIR --shard-size N`: records -> webdataset tar shards."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "shard",
        help="write image-text records as webdataset tar shards for streaming",
        description="Write DIR/shard-000000.tar, ... (members <key>.png|jpg and <key>.json with "
        "the record's other fields) plus DIR/shardindex.json (samples per shard). Train from "
        "them with data.train=DIR; see docs/streaming.md.",
    )
    s.add_argument(
        "records",
        help="records as training reads them: .jsonl, COCO .json, .csv, a folder of images "
        "with a captions file, .parquet or a datasets folder",
    )
    s.add_argument("--out", required=True, help="output folder (must hold no shards yet)")
    s.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    s.add_argument(
        "--image-column", default="image", help="image column of a CSV / parquet / datasets input"
    )
    s.add_argument(
        "--text-column", default="text", help="caption column of a CSV / parquet / datasets input"
    )
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.data.shards import write_shards

    report = write_shards(
        args.records,
        args.out,
        args.shard_size,
        image_column=args.image_column,
        text_column=args.text_column,
    )
    print(f"wrote {report.samples} samples in {len(report.shards)} shards to {args.out}")
    if report.missing_images:
        print(
            f"records without a readable image (written without one; training counts them as "
            f"bad samples): {report.missing_images}"
        )
    return 0
