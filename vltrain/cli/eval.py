"""`vltrain eval RUN_OR_CHECKPOINT --queries Q --corpus C --qrels R`: corpus retrieval metrics."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "eval",
        help="evaluate a contrastive model on a corpus (BEIR queries, corpus, qrels)",
        description="Embed every query and document through the run's evaluation path, search "
        "the whole corpus exactly and print one JSON object with R@1, R@5, R@10, R@100, "
        "MRR@10, nDCG@10 (graded) and hardneg_acc (docs judged 0 in qrels).",
    )
    e.add_argument("checkpoint", help="run dir or checkpoint folder")
    e.add_argument("--queries", required=True, help="queries.jsonl ({_id, text?, image?})")
    e.add_argument("--corpus", required=True, help="corpus.jsonl ({_id, text?, image?})")
    e.add_argument("--qrels", required=True, help="qrels.tsv (query-id corpus-id score)")
    e.add_argument("--out", help="also write the metrics JSON here")
    e.add_argument("--ranks", help="per-query rank and top-10 doc ids (JSONL)")
    e.add_argument("--batch-size", type=int, default=0, help="0: the run's eval batch size")
    e.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: each rank's GPU)")
    e.add_argument(
        "--dims",
        default="",
        help="also score Matryoshka prefixes, e.g. 64,128 (d64_R@1, ...; re-normalised)",
    )
    e.add_argument(
        "--int8",
        action="store_true",
        help="also score int8 embeddings (per-vector symmetric scale): int8_R@1, ...",
    )
    e.set_defaults(fn=run)


def parse_dims(text: str) -> tuple[int, ...]:
    """``"64,128"`` -> (64, 128); a clear error for anything else."""
    from vltrain.config.core import ConfigError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--dims {text!r}: give comma-separated sizes, e.g. 64,128") from None


def run(args: argparse.Namespace) -> int:
    from vltrain.core import distributed
    from vltrain.tools.eval import eval_command

    try:  # under torchrun: sharded; the final barrier only after every rank succeeded
        metrics = eval_command(
            args.checkpoint,
            args.queries,
            args.corpus,
            args.qrels,
            out=args.out,
            ranks=args.ranks,
            batch_size=args.batch_size,
            device=args.device,
            dims=parse_dims(args.dims),
            int8=args.int8,
        )
    except BaseException:
        distributed.shutdown()
        raise
    if distributed.is_main():
        print(json.dumps(metrics))
    distributed.shutdown(finished=True)
    return 0
