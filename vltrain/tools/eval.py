"""Corpus retrieval evaluation of a trained contrastive model: `vltrain eval`.

The queries and documents are embedded through the run's own evaluation path (its batcher,
image decoding, instructions and visual-token budget), then searched exactly over the whole
corpus (`vltrain.eval.corpus`). One process; evaluation inside training is sharded over ranks
with the same code (`CorpusEvaluator`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from vltrain.config.core import ConfigError
from vltrain.core.files import atomic_write_text, check_not_input, check_output_path
from vltrain.eval.corpus import read_split
from vltrain.tools.loading import load_trained


def eval_command(
    checkpoint: str,
    queries: str,
    corpus: str,
    qrels: str,
    out: str | None = None,
    ranks: str | None = None,
    batch_size: int = 0,
    device: str = "cpu",
) -> dict[str, float]:
    """Metrics (R@1/5/10/100, MRR@10, nDCG@10, ...) of `checkpoint` on the three files;
    `out`: the metrics as JSON; `ranks`: one line per query with its rank and top-10 ids."""
    for name, path in (("--queries", queries), ("--corpus", corpus), ("--qrels", qrels)):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{name} {path} does not exist")
    inputs = [queries, corpus, qrels]
    for option, path in (("--out", out), ("--ranks", ranks)):
        if path:
            check_output_path(path, option)
            check_not_input(path, inputs, option)
            inputs.append(path)  # --out and --ranks must not name one file either
    cfg, stage, model = load_trained(checkpoint, device=device)
    evaluator = getattr(stage, "corpus", None)
    if evaluator is None:
        raise ConfigError(
            f"{checkpoint} is a '{cfg.stage}' run; vltrain eval needs a contrastive one"
        )
    if batch_size:
        evaluator.batch_size = batch_size
    split = read_split(queries, corpus, qrels)
    t0 = time.perf_counter()
    with torch.no_grad():
        metrics = evaluator.evaluate_split(model.encoder, split, ranks_path=ranks)
    metrics["total_s"] = time.perf_counter() - t0
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(metrics, indent=1) + "\n")
    return metrics
