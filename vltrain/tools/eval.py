"""Corpus retrieval evaluation of a trained contrastive model: `vltrain eval`.

The queries and documents are embedded through the run's own evaluation path (its batcher,
image decoding, instructions and visual-token budget), then searched exactly over the whole
corpus (`vltrain.eval.corpus`). Under torchrun each rank embeds its shard (`CorpusEvaluator`,
as in training), the shards are gathered once and rank 0 writes the outputs; every side is
embedded alone, so the metrics are the 1-process numbers bit for bit, whatever the batch size.
`dims` adds metrics per Matryoshka prefix, `int8` per int8-quantised embedding.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from vltrain.config.core import ConfigError
from vltrain.core import distributed
from vltrain.core.files import atomic_write_text, check_not_input, check_output_path
from vltrain.engine.runtime import RunContext, resolve_device
from vltrain.eval.corpus import (
    FILES,
    missing_metrics,
    missing_warning,
    read_split,
    score_split,
)
from vltrain.eval.variants import check_dims, variant_metrics
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
    dims: tuple[int, ...] = (),
    int8: bool = False,
) -> dict[str, float]:
    """Metrics (R@1/5/10/100, MRR@10, nDCG@10, ...) of `checkpoint` on the three files;
    `out`: the metrics as JSON; `ranks`: one line per query with its rank and top-10 ids;
    `dims`: also ``d<dim>_*`` per Matryoshka prefix; `int8`: also ``int8_*``. Sharded over the
    ranks under torchrun (rank 0 writes `out` and `ranks`; every rank returns the metrics)."""
    for name, path in (("--queries", queries), ("--corpus", corpus), ("--qrels", qrels)):
        if Path(path).is_dir():
            raise FileNotFoundError(
                f"{name} {path} is a folder; name its file (e.g. {Path(path) / FILES[0]}, "
                f"{Path(path) / FILES[1]}, {Path(path) / FILES[2]})"
            )
        if not Path(path).is_file():
            raise FileNotFoundError(f"{name} {path} does not exist")
    inputs = [queries, corpus, qrels]
    for option, path in (("--out", out), ("--ranks", ranks)):
        if path:
            check_output_path(path, option)
            check_not_input(path, inputs, option)
            inputs.append(path)  # --out and --ranks must not name one file either
    check_dims(dims)
    where = resolve_device(device, "--device")  # cuda: this rank's GPU under torchrun
    distributed.init_from_env(where.type)
    cfg, stage, model = load_trained(checkpoint, device=str(where))
    evaluator = getattr(stage, "corpus", None)
    if evaluator is None:
        raise ConfigError(
            f"{checkpoint} is a '{cfg.stage}' run; vltrain eval needs a contrastive one"
        )
    check_dims(dims, getattr(model.encoder, "embed_dim", None))
    if batch_size:
        evaluator.batch_size = batch_size
    evaluator.where = RunContext(
        where,
        rank=distributed.rank(),
        world_size=distributed.world_size(),
        precision=cfg.run.precision,
        seed=cfg.run.seed,
    )
    split = read_split(queries, corpus, qrels)
    warning = missing_warning(split, qrels)
    if warning and distributed.is_main():
        print(f"vltrain eval: {warning}", file=sys.stderr)
    t0 = time.perf_counter()
    with torch.no_grad(), evaluator.where.autocast():  # bf16 runs: as their training evaluated
        emb = evaluator.embed_split(model.encoder, split)
    metrics = score_split(emb, ranks if distributed.is_main() else None)
    metrics.update(variant_metrics(emb, dims, int8))
    metrics.update(missing_metrics(split))
    metrics["encode_s"] = emb.encode_s
    metrics["total_s"] = time.perf_counter() - t0
    if out and distributed.is_main():
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(metrics, indent=1) + "\n")
    return metrics
