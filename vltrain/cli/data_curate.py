"""`vltrain data curate|dedup|decontam|filter IN.jsonl --out OUT.jsonl`: data curation."""

from __future__ import annotations

import argparse

from vltrain.cli.options import positive_int
from vltrain.curation.filters import CaptionRules, ImageRules

#: subcommand -> (steps it runs, help)
_COMMANDS = {
    "curate": (("filter", "decontam", "dedup"), "filter, decontaminate and deduplicate"),
    "dedup": (("dedup",), "remove exact, near and semantic duplicates"),
    "decontam": (("decontam",), "remove records that leak eval-set captions or images"),
    "filter": (("filter",), "caption/image sanity and CLIP-score filtering"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    for name, (steps, help_) in _COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_,
            description=f"{help_[0].upper()}{help_[1:]}. Kept records are copied to --out byte "
            "for byte (images copied when --out is in another folder); removed ones go to "
            "OUT.removed.jsonl with their reason and the record they duplicate. Defaults are "
            "the recommended thresholds (docs/curation.md).",
        )
        _add_args(p, steps)
        p.set_defaults(fn=run, steps=steps)


def _add_args(p: argparse.ArgumentParser, steps: tuple[str, ...]) -> None:
    from vltrain.curation.pipeline import CurateOptions

    d = CurateOptions()
    p.add_argument("input", help="input JSONL")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--report", help="folder for summary.json and report.html")
    p.add_argument("--workers", type=int, default=1, help="feature processes")  # checked
    p.add_argument("--seed", type=int, default=d.seed, help="seed of every hash")
    p.add_argument("--checkpoint", help="contrastive run/checkpoint: semantic dedup, CLIP score")
    p.add_argument("--batch-size", type=positive_int, default=128, help="embedding batch size")
    if "decontam" in steps:
        p.add_argument("--against", nargs="+", default=[], help="eval JSONL files")
        p.add_argument("--leak-n", type=int, default=d.leak_n, help="shared word n-gram = leak")
        p.add_argument("--leak-jaccard", type=float, default=d.leak_jaccard)
        p.add_argument("--bloom-fp-rate", type=float, default=d.bloom_fp_rate)
    if "dedup" in steps or "decontam" in steps:
        p.add_argument("--shingle-n", type=int, default=d.shingle_n, help="caption word n-gram")
        p.add_argument("--num-perm", type=int, default=d.num_perm, help="MinHash permutations")
        p.add_argument("--caption-threshold", type=float, default=d.caption_threshold)
        p.add_argument("--phash-radius", type=int, default=d.phash_radius)
        p.add_argument("--dhash-radius", type=int, default=d.dhash_radius)
        p.add_argument(
            "--crop-radius", type=int, default=d.crop_radius, help="crop-window pHash (0: off)"
        )
    if "dedup" in steps:
        p.add_argument(
            "--caption-dups",
            choices=("flag", "drop"),
            default=d.caption_dups,
            help="caption duplicates whose images differ: report only (flag) or remove (drop)",
        )
        p.add_argument("--semantic-eps", type=float, default=d.semantic_eps)
    if "filter" in steps:
        c, i = CaptionRules(), ImageRules()
        p.add_argument("--min-words", type=int, default=c.min_words)
        p.add_argument("--max-words", type=int, default=c.max_words)
        p.add_argument("--min-side", type=int, default=i.min_side)
        p.add_argument("--clip-threshold", type=float, help="keep CLIP score >= this")
        p.add_argument("--clip-top-fraction", type=float, help="keep this best fraction (0.3)")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from vltrain.curation.curate import curate, removed_path
    from vltrain.curation.pipeline import CurateOptions

    opts = CurateOptions(steps=args.steps, seed=args.seed, workers=args.workers)
    for key in (
        "leak_n", "leak_jaccard", "bloom_fp_rate", "shingle_n", "num_perm", "caption_threshold",
        "phash_radius", "dhash_radius", "crop_radius", "caption_dups", "semantic_eps",
        "clip_threshold", "clip_top_fraction",
    ):  # fmt: skip
        if hasattr(args, key):
            opts = replace(opts, **{key: getattr(args, key)})
    if hasattr(args, "min_words"):
        opts = replace(
            opts,
            caption_rules=replace(
                opts.caption_rules, min_words=args.min_words, max_words=args.max_words
            ),
            image_rules=replace(opts.image_rules, min_side=args.min_side),
        )
    opts.check()
    needs_model = opts.clip_threshold is not None or opts.clip_top_fraction is not None
    embedder = None
    if args.checkpoint:
        from vltrain.tools.curation import CheckpointEmbedder

        embedder = CheckpointEmbedder(args.checkpoint, args.batch_size)
    elif needs_model:
        from vltrain.data.readers import DataError

        raise DataError("CLIP-score filtering needs --checkpoint (a trained contrastive run)")
    s = curate(args.input, args.out, getattr(args, "against", []), opts, embedder, args.report)
    if "lsh" in s and "dedup" in opts.steps:
        print(
            f"caption LSH: {s['lsh']['bands']} bands x {s['lsh']['rows']} rows: "
            f"{s['lsh']['s_curve']}"
        )
    if "bloom" in s:
        b = s["bloom"]
        print(
            f"eval Bloom filter: {b['ngrams']} n-grams, {b['n_bits']} bits, "
            f"{b['n_hashes']} hashes, "
            f"fp rate configured {b['configured_fp_rate']:g}, measured {b['measured_fp_rate']:g}"
        )
    for reason, n in s["removed_by_reason"].items():
        print(f"  removed {n:6d}  {reason}")
    print(
        f"kept {s['kept']} of {s['records']} records -> {args.out}; removed -> "
        f"{removed_path(Path(args.out))}"
    )
    return 0
