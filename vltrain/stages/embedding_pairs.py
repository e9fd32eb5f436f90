"""Pair records and corpus evaluation for the contrastive stage (held by it, composition).

A pair batch (`vltrain.data.pairs.PairCollate`) has three sides, ``query``, ``positive`` and
``negatives``, each ``{"modality", "inputs"}``; the loss sees them as `Features(query,
positive, negatives)`, so an image hard negative is one more column of the doc side, gathered
across ranks like the positives. Under GradCache every side (negatives too) is encoded in
chunks of ``objective.grad_cache_chunk`` rows: memory is one chunk's graph, not batch x K.

Corpus evaluation (`CorpusEvaluator`): each rank embeds its contiguous shard of the queries and
of the documents, the shards are gathered once, and every rank runs the same exact search, so
no rank waits at a barrier on work only one rank does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.data.images import DEFAULT_MAX_PIXELS, BadSample
from vltrain.data.pairs import (
    PairCollate,
    PairDataset,
    Side,
    is_pair_file,
    load_side,
    modality,
    read_corpus,
    read_pair_records,
    side_inputs,
    side_texts,
)
from vltrain.data.reading import ReadingTargets
from vltrain.data.samplers import EvalShardSampler
from vltrain.engine.runtime import RunContext, to_device
from vltrain.eval import corpus
from vltrain.models.backbones import HF_KINDS, check_side_modality, encode_side
from vltrain.models.word_pairs import Reading
from vltrain.objectives.grad_cache import grad_cache, length_sorted_chunks, split_rows

SIDES = ("query", "positive", "negatives")
CORPUS_METRICS = (
    "eval_R@*",
    "eval_MRR@10",
    "eval_nDCG@10",
    "eval_mean_rank",
    "eval_median_rank",
    "eval_n_queries",
    "eval_n_docs",
    "eval_chance_R@*",
    "eval_encode_s",
)


def uses_pairs(cfg: Config) -> bool:
    """True when data.train holds query/positive records (not image-caption records)."""
    return is_pair_file(cfg.data.train)


def check_config(cfg: Config) -> None:
    """Load-time rules for pair data and corpus evaluation."""
    if uses_pairs(cfg) and cfg.objective.caption_contrast:
        raise ConfigError(
            "objective.caption_contrast pairs two captions of one image (image-caption records); "
            f"data.train={cfg.data.train} holds query/positive records: set it to 0"
        )
    if uses_pairs(cfg) and cfg.data.image_cache_mb:
        raise ConfigError(
            "data.image_cache_mb keeps decoded images of image-caption records; "
            f"data.train={cfg.data.train} holds query/positive records: set it to 0"
        )
    for key in ("eval", "test"):
        path = getattr(cfg.data, key)
        if path and Path(path).is_dir() and not corpus.is_corpus_dir(path):
            raise ConfigError(
                f"data.{key}={path} is a folder but lacks {', '.join(corpus.FILES)} (a BEIR split)"
            )
        if path and is_pair_file(path):
            raise ConfigError(
                f"data.{key}={path} holds query/positive records; evaluate pair data on a "
                f"corpus: point data.{key} at a folder with {', '.join(corpus.FILES)}"
            )
    corpus_eval = any(corpus.is_corpus_dir(p) for p in (cfg.data.eval, cfg.data.test) if p)
    if corpus_eval and cfg.train.best_metric in ("", "eval_R@1_mean"):
        raise ConfigError(
            "data.eval is a corpus folder: its metrics are eval_R@1, eval_R@5, eval_nDCG@10, ... "
            "(not eval_R@1_mean); set train.best_metric=eval_R@1 (or another of them)"
        )
    if cfg.objective.reading and not uses_pairs(cfg):
        raise ConfigError(
            f"objective.reading reads the 'words' boxes of query/positive records' image "
            f"sides; data.train={cfg.data.train} holds none (`vltrain data synth --kind pages` "
            "writes such records): set objective.reading=0"
        )
    if cfg.objective.reading and cfg.objective.grad_cache_chunk:
        raise ConfigError(
            "objective.reading > 0 with objective.grad_cache_chunk > 0: the reading loss reads "
            "the positive images' grid in the plain step; set objective.grad_cache_chunk=0"
        )
    if cfg.data.train_corpus and not Path(cfg.data.train_corpus).is_file():
        raise ConfigError(f"data.train_corpus={cfg.data.train_corpus} does not exist")


def pair_dataset(cfg: Config, path: str | Path, train: bool, hard_negatives: int) -> PairDataset:
    """Pair records of `path` for this backbone; image+text sides need a VLM (ConfigError)."""
    ds = PairDataset(
        path,
        cfg.data.image_size,
        cfg.run.seed,
        hard_negatives=hard_negatives,
        train=train,
        native=cfg.model.kind in HF_KINDS,
        corpus=cfg.data.train_corpus,
    )
    for role, kind in ds.modalities.items():
        check_side_modality(cfg.model.kind, role, kind, str(path))
    if train and cfg.objective.reading and ds.modalities["positive"] != "image":
        raise ConfigError(
            f"objective.reading trains the image tower to read the positive images, but the "
            f"positives of {path} are {ds.modalities['positive']} sides: set objective.reading=0"
        )
    return ds


def _training_records(cfg: Config) -> tuple[list[dict[str, Any]], dict[str, Side] | None]:
    """The training records (document ids resolved) and data.train_corpus's documents."""
    corpus = read_corpus(cfg.data.train_corpus) if cfg.data.train_corpus else None
    return read_pair_records(cfg.data.train, corpus), corpus


def training_texts(cfg: Config) -> list[str]:
    """Every text of the training records (and of data.train_corpus), for the BPE tokenizer."""
    records, corpus = _training_records(cfg)
    texts = side_texts(records)
    if corpus:
        texts += [s["text"] for s in corpus.values() if isinstance(s["text"], str)]
    return texts


def training_words(cfg: Config) -> list[str]:
    """The words listed on the training records' image sides (what the reading loss reads)."""
    out: list[str] = []
    for rec in _training_records(cfg)[0]:
        for side in (rec["query"], *rec["positives"], *rec["negatives"]):
            out += [w[0] for w in side.get("words") or ()]
    return out


def collate(batcher: Any, ds: PairDataset, reading: ReadingTargets | None = None) -> PairCollate:
    return PairCollate(batcher, ds.modalities, reading)


def is_pair_batch(batch: dict[str, Any]) -> bool:
    return "query" in batch


def embed_pairs(encoder: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor | None]:
    """Query (B, E), positive (B, E) and hard-negative (M, E) embeddings of a pair batch."""
    q, p = _embed_side(encoder, batch, "query"), _embed_side(encoder, batch, "positive")
    return q, p, _embed_side(encoder, batch, "negatives")


def embed_pairs_reading(
    encoder: nn.Module, batch: dict[str, Any]
) -> tuple[Tensor, Tensor, Tensor | None, Reading]:
    """`embed_pairs` with what the tower reads on the positive images and then on the image
    negatives (each side its own pass, as `embed_pairs` encodes them), for `objective.reading`."""
    q = _embed_side(encoder, batch, "query")
    p, read = encoder.encode_image_read(batch["positive"]["inputs"])
    side = batch.get("negatives")
    if side is None or side["modality"] != "image":
        return q, p, _embed_side(encoder, batch, "negatives"), read
    n, read_n = encoder.encode_image_read(side["inputs"])
    return q, p, n, read.cat(read_n)


def _embed_side(encoder: nn.Module, batch: dict[str, Any], name: str) -> Tensor | None:
    """One side of a pair batch through `encode_side` (None: the batch has no such side)."""
    side = batch.get(name)
    return None if side is None else encode_side(encoder, side["modality"], side["inputs"])


def pair_grad_cache(
    model: nn.Module, batch: dict[str, Any], chunk: int, scale: float
) -> tuple[Tensor, dict[str, Any]]:
    """GradCache over the query, positive and negative sides (each chunked by `chunk` rows;
    text sides length-sorted for towers that ignore trailing padding). `model` is plain."""
    enc, loss = model.encoder, model.loss
    by_length = getattr(enc, "ignores_trailing_padding", False)
    encoders: list[Callable[..., Tensor]] = []
    chunks: list[list[Any]] = []
    orders: list[Tensor | None] = []
    for name in SIDES:
        side = batch.get(name)
        if side is None:
            continue
        kind, inputs = side["modality"], side["inputs"]
        order = None
        if kind == "text":  # (ids (B, T), mask (B, T)), passed as two arguments per chunk
            encoders.append(enc.encode_text)
            if by_length:
                parts, order = length_sorted_chunks(tuple(inputs), chunk)
            else:
                parts = split_rows(tuple(inputs), chunk)
        else:  # pixels, or a VLM prompt dict (flattened patches split by image)
            encoders.append(enc.encode_image)
            parts = split_rows(inputs, chunk)
        chunks.append(parts)
        orders.append(order)

    def loss_fn(e: list[Tensor]) -> tuple[Tensor, dict[str, Any]]:
        return loss(e[0], e[1], e[2] if len(e) > 2 else None)

    return grad_cache(encoders, chunks, loss_fn, scale, orders=orders)


class CorpusEvaluator:
    """Sharded corpus evaluation through a stage's batcher (in training and `vltrain eval`)."""

    def __init__(self, cfg: Config, ctx: RunContext, batcher: Any) -> None:
        self.cfg, self.ctx, self.batcher = cfg, ctx, batcher
        self._splits: dict[str, corpus.CorpusSplit] = {}

    def split(self, folder: str | Path) -> corpus.CorpusSplit:
        key = str(folder)
        if key not in self._splits:
            self._splits[key] = corpus.read_split_dir(folder)
        return self._splits[key]

    def embed(
        self, model: nn.Module, sides: list[Side], role: str, batch_size: int = 0
    ) -> tuple[Tensor, Tensor, int]:
        """This rank's shard of `sides` embedded, gathered over ranks: (n, E) in file order,
        their rows (n,), and the number of bad sides (left out) over all ranks."""
        kinds = {modality(s) for s in sides}
        if len(kinds) != 1:
            raise ConfigError(f"the {role} side of the corpus mixes modalities {sorted(kinds)}")
        kind = kinds.pop()
        check_side_modality(self.cfg.model.kind, role, kind, "corpus evaluation")
        bs = batch_size or self.cfg.data.eval_batch_size or self.cfg.data.batch_size
        native = self.cfg.model.kind in HF_KINDS
        emb, rows, n_bad = [], [], 0
        enc = model.encoder
        for keys in EvalShardSampler(len(sides), bs, self.ctx.rank, self.ctx.world_size):
            good, idx = [], []
            for _, _, i in keys:
                try:
                    good.append(
                        load_side(
                            sides[i],
                            self.cfg.data.image_size,
                            native,
                            DEFAULT_MAX_PIXELS,
                            f"{role} {i}",
                        )
                    )
                    idx.append(i)
                except BadSample:
                    n_bad += 1
            if not good:
                continue
            instr = [s.get("instruction", "") for s in (sides[i] for i in idx)]
            inputs, _ = side_inputs(self.batcher, role, kind, good, instr)
            with torch.no_grad():
                e = encode_side(enc, kind, to_device(inputs, self.ctx.device))  # (b, E)
            emb.append(e.float().cpu())
            rows.append(torch.tensor(idx))
        local = torch.cat(emb) if emb else torch.zeros(0, 1)
        width = torch.tensor([local.shape[1] if emb else 0])
        dim = int(distributed.all_reduce_max(width)) if distributed.is_distributed() else int(width)
        if not emb:
            local = torch.zeros(0, dim)
        all_emb = distributed.all_gather_no_grad(local)
        all_rows = distributed.all_gather_no_grad(
            torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        )
        bad = torch.tensor([float(n_bad)])
        bad = distributed.all_reduce_sum(bad) if distributed.is_distributed() else bad
        return all_emb, all_rows.long(), int(bad)

    def evaluate(
        self, model: nn.Module, folder: str | Path, ranks_path: str | Path | None = None
    ) -> dict[str, float]:
        """Metrics of `vltrain.eval.corpus` over the split in `folder`; every rank returns
        the same numbers. `ranks_path`: per-query ranks and top ids (rank 0 writes)."""
        return self.evaluate_split(model, self.split(folder), ranks_path)

    def evaluate_split(
        self, model: nn.Module, split: corpus.CorpusSplit, ranks_path: str | Path | None = None
    ) -> dict[str, float]:
        """`evaluate` of an already-read split."""
        t0 = time.perf_counter()
        q_emb, q_rows, q_bad = self.embed(model, split.queries, "query")
        d_emb, d_rows, d_bad = self.embed(model, split.docs, "doc")
        encode_s = time.perf_counter() - t0
        doc_pos = {int(r): i for i, r in enumerate(d_rows.tolist())}  # corpus row -> emb row
        qrels, judged, keep = [], [], []
        for i, r in enumerate(q_rows.tolist()):
            rel = {doc_pos[d]: g for d, g in split.qrels[r].items() if d in doc_pos}
            if rel:  # a query whose relevant docs are all undecodable cannot be scored
                qrels.append(rel)
                judged.append([doc_pos[d] for d in split.judged_negatives[r] if d in doc_pos])
                keep.append(i)
        metrics, ranks, top = corpus.corpus_metrics(q_emb[keep], d_emb, qrels)
        wins = corpus.judged_negative_wins(q_emb[keep], d_emb, qrels, judged)
        acc = corpus.wins_fraction(wins)
        if acc is not None:
            metrics["hardneg_acc"] = acc
        metrics["chance_R@1"] = corpus.chance_recall(qrels, d_emb.shape[0], 1)
        metrics.update(corpus.group_metrics(ranks, [split.groups[int(q_rows[i])] for i in keep]))
        metrics["bad_samples"] = float(q_bad + d_bad)
        metrics["encode_s"] = encode_s
        if ranks_path is not None and self.ctx.is_main:
            query_ids = [split.query_ids[int(q_rows[i])] for i in keep]
            doc_ids = [split.doc_ids[int(r)] for r in d_rows.tolist()]
            corpus.write_ranks(ranks_path, query_ids, doc_ids, ranks, top, wins)
        return metrics
