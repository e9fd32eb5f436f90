"""Retrieval evaluation on a separate corpus (BEIR layout): queries, documents, graded qrels.

Files (one folder per split, or three paths)::

    queries.jsonl   {"_id": "q1", "text"?: "...", "image"?: "rel.png", "instruction"?: "...",
                     "group"?: "..."}
    corpus.jsonl    {"_id": "d1", "text"?: "...", "title"?: "...", "image"?: "rel.png"}
    qrels.tsv       query-id <TAB> corpus-id <TAB> score   (a header line; score >= 0 ints)

Metrics, exact over the whole corpus with the search kernel's total order (score desc, lower
doc index first; `vltrain.eval.topk`):

    R@k      fraction of queries with ANY relevant doc (score > 0) in the top k
    MRR@10   mean 1/rank of the best-ranked relevant doc (0 beyond 10)
    nDCG@10  graded: DCG = sum_i grade(doc_i) / log2(i + 1) over the top 10, divided by the DCG
             of the grades sorted descending (trec_eval's linear gain, as BEIR reports it)

Queries without any relevant doc are left out (BEIR does the same) and counted. Docs judged
non-relevant (score 0, e.g. a query's hard negatives) give `hardneg_acc`: how often the
query's best relevant doc outscores each of them. Queries that name a ``group`` (a kind of
query: the synthetic pages' title vs body-phrase queries, a task of a multi-task set) also get
R@1, R@5 and MRR@10 over each group alone (`group_metrics`), so one number does not hide which
kind of query a model fails.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from vltrain.config.core import ConfigError
from vltrain.core import distributed
from vltrain.data.batches import to_device
from vltrain.data.images import DEFAULT_MAX_PIXELS, BadSample
from vltrain.data.pairs import (
    Side,
    check_side_modality,
    encode_side,
    load_side,
    modality,
    read_corpus,
    side_inputs,
)
from vltrain.data.readers import DataError
from vltrain.data.samplers import EvalShardSampler
from vltrain.eval.protocols import Batcher, Encoder, Placement
from vltrain.eval.topk import (
    TOP_LIST,
    check_embeddings,
    chunk_sizes,
    cpu_workers,
    positive_table,
    scan,
)

KS = (1, 5, 10, 100)
FILES = ("queries.jsonl", "corpus.jsonl", "qrels.tsv")
#: metrics `CorpusEvaluator.evaluate` returns, besides the per-group and hard-negative ones
METRICS = (
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


@dataclass
class CorpusSplit:
    """Queries and documents in file order, and each query's graded relevant docs."""

    query_ids: list[str]
    queries: list[Side]
    doc_ids: list[str]
    docs: list[Side]
    qrels: list[dict[int, float]]  # per query: doc row -> grade (> 0 only)
    judged_negatives: list[list[int]]  # per query: doc rows judged non-relevant (grade 0)
    n_no_relevant: int  # queries in queries.jsonl without a relevant doc (left out)
    groups: list[str | None]  # per query: its "group" in queries.jsonl, None without one
    missing: dict[str, list[str]] = field(default_factory=dict)  # qrels ids absent from files


def is_corpus_dir(path: str | os.PathLike[str]) -> bool:
    """True for a folder holding queries.jsonl, corpus.jsonl and qrels.tsv."""
    p = Path(path)
    return bool(str(path)) and p.is_dir() and all((p / f).is_file() for f in FILES)


def read_qrels(path: str | os.PathLike[str]) -> list[tuple[str, str, float]]:
    """(query id, doc id, grade) rows of a BEIR qrels.tsv (header line optional); grades are
    numbers, > 0 relevant (fractional ones too: truncated to int they read as 0)."""
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (offset {e.start}); save it as UTF-8") from None
    rows = []
    for lineno, line in enumerate(lines, start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) == 4:  # TREC layout: qid 0 docid score
            parts = [parts[0], parts[2], parts[3]]
        if len(parts) != 3:
            raise DataError(f"{path}:{lineno}: expected 'query-id corpus-id score'")
        try:
            grade = float(parts[2])  # a fractional grade (0.5) is relevant, its own gain
            if not math.isfinite(grade):
                raise ValueError(grade)
        except ValueError:
            if lineno == 1:
                continue  # the header
            raise DataError(f"{path}:{lineno}: score {parts[2]!r} is not a number") from None
        rows.append((parts[0], parts[1], grade))
    return rows


def read_split(
    queries: str | os.PathLike[str], corpus: str | os.PathLike[str], qrels: str | os.PathLike[str]
) -> CorpusSplit:
    """Read the three files. A qrels row naming a query or document absent from its file
    cannot be scored: it is left out and its id counted in `missing` (``queries``, ``docs``;
    one entry per row), which the metrics report (`missing_metrics`)."""
    q = read_corpus(queries)
    d = read_corpus(corpus)
    doc_row = {doc_id: i for i, doc_id in enumerate(d)}
    grades: dict[str, dict[int, float]] = {}
    zeros: dict[str, list[int]] = {}
    missing: dict[str, list[str]] = {"queries": [], "docs": []}
    for qid, did, grade in read_qrels(qrels):
        if qid not in q:
            missing["queries"].append(qid)
            continue
        if did not in doc_row:
            missing["docs"].append(did)
            continue
        if grade > 0:
            grades.setdefault(qid, {})[doc_row[did]] = grade
        else:
            zeros.setdefault(qid, []).append(doc_row[did])
    kept = [qid for qid in q if qid in grades]
    if not kept:
        why = (
            f"{queries} holds no queries"
            if not q
            else f"no query of {queries} ({len(q)}) has a relevant document (score > 0) in "
            f"{qrels} that {corpus} holds"
        )
        raise DataError(
            f"nothing to evaluate: {why}; check that the query and document ids of the qrels "
            "match the two files"
        )
    return CorpusSplit(
        query_ids=kept,
        queries=[q[qid] for qid in kept],
        doc_ids=list(d),
        docs=list(d.values()),
        qrels=[grades[qid] for qid in kept],
        judged_negatives=[zeros.get(qid, []) for qid in kept],
        n_no_relevant=len(q) - len(kept),
        groups=[q[qid].get("group") for qid in kept],
        missing=missing,
    )


def missing_metrics(split: CorpusSplit) -> dict[str, float]:
    """The qrels rows naming ids absent from the queries or corpus file, as metrics."""
    return {f"qrels_missing_{k}": float(len(v)) for k, v in sorted(split.missing.items())}


def missing_warning(split: CorpusSplit, qrels: str | os.PathLike[str]) -> str | None:
    """One line naming the qrels rows left out for absent ids (a few of each), or None."""
    parts = []
    for kind, ids in sorted(split.missing.items()):
        if ids:
            shown = ", ".join(repr(i) for i in sorted(set(ids))[:3])
            file = "corpus" if kind == "docs" else "queries"
            parts.append(f"{len(ids)} rows name {kind} absent from the {file} file ({shown})")
    if not parts:
        return None
    return f"warning: {qrels}: {'; '.join(parts)}; they are left out of the metrics"


def read_split_dir(folder: str | os.PathLike[str]) -> CorpusSplit:
    """`read_split` of ``folder/{queries.jsonl, corpus.jsonl, qrels.tsv}``."""
    p = Path(folder)
    if not is_corpus_dir(p):
        raise DataError(f"{folder} is not a folder with {', '.join(FILES)}")
    return read_split(*(p / f for f in FILES))


def graded_ndcg(top_ids: Tensor, qrels: list[dict[int, float]], k: int = TOP_LIST) -> Tensor:
    """(Q,) nDCG@k with linear gains from top ids (Q, L) and per-query graded qrels."""
    discount = 1.0 / torch.log2(torch.arange(2, k + 2, dtype=torch.float64))  # (k,)
    out = torch.zeros(len(qrels), dtype=torch.float64)
    for i, (ids, rel) in enumerate(zip(top_ids[:, :k].tolist(), qrels, strict=True)):
        gains = torch.tensor([float(rel.get(j, 0)) for j in ids], dtype=torch.float64)
        ideal = torch.tensor(sorted(rel.values(), reverse=True)[:k], dtype=torch.float64)
        idcg = float((ideal * discount[: len(ideal)]).sum())
        out[i] = float((gains * discount[: len(gains)]).sum()) / idcg
    return out


def rank_metrics(ranks: Tensor, ks: tuple[int, ...]) -> dict[str, float]:
    """R@k for each k and MRR@10 from per-query ranks of the best relevant doc (Q,), float64."""
    m = {f"R@{k}": float((ranks <= k).double().mean()) for k in ks}
    m["MRR@10"] = float(torch.where(ranks <= 10, 1.0 / ranks, torch.zeros_like(ranks)).mean())
    return m


def corpus_metrics(
    query_emb: Tensor,
    doc_emb: Tensor,
    qrels: list[dict[int, int]],
    ks: tuple[int, ...] = KS,
) -> tuple[dict[str, float], Tensor, Tensor]:
    """R@k, MRR@10, nDCG@10 (graded), mean/median rank; also per-query ranks (Q,) and top-10
    ids (Q, min(10, N)), all from one pass over the score blocks."""
    queries, docs = check_embeddings(query_emb, doc_emb)
    table = positive_table(
        [list(r) for r in qrels], queries.shape[0], docs.shape[0], queries.device
    )
    qc, dc = chunk_sizes(queries.shape[0], docs.shape[0], None, None, cpu_workers(queries.device))
    n_top = min(TOP_LIST, docs.shape[0])  # R@k for larger k comes from the exact ranks
    _, top_ids, ranks = scan(queries, docs, n_top, table, qc, dc)
    r = ranks.double().cpu()
    m = rank_metrics(r, ks)
    m["nDCG@10"] = float(graded_ndcg(top_ids.cpu(), qrels).mean())
    m["mean_rank"], m["median_rank"] = float(r.mean()), float(r.median())
    m["n_queries"], m["n_docs"] = float(queries.shape[0]), float(docs.shape[0])
    return m, ranks.cpu(), top_ids.cpu()


def metric_suffix(name: str) -> str:
    """`name` as a metric-key suffix: every run of characters other than letters and digits
    becomes one underscore (``"body phrase"`` -> ``body_phrase``)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name)


def group_metrics(ranks: Tensor, groups: list[str | None]) -> dict[str, float]:
    """R@1, R@5, MRR@10 and the query count of each group alone, keyed ``R@1_<group>`` etc.,
    from the per-query ranks (Q,) of `corpus_metrics`; queries without a group are only in the
    overall numbers. Empty when no query names a group."""
    if len(groups) != ranks.shape[0]:
        raise ValueError(f"group_metrics: {len(groups)} groups for {ranks.shape[0]} ranks")
    out: dict[str, float] = {}
    r = ranks.double().cpu()
    keys: dict[str, str] = {}
    for name in sorted({g for g in groups if g is not None}):
        key = metric_suffix(name)
        if key in keys:
            raise ValueError(
                f"query groups {keys[key]!r} and {name!r} both become metric suffix {key!r}; "
                "rename one"
            )
        keys[key] = name
        rg = r[torch.tensor([g == name for g in groups])]
        out.update({f"{k}_{key}": v for k, v in rank_metrics(rg, (1, 5)).items()})
        out[f"n_queries_{key}"] = float(rg.numel())
    return out


def judged_negative_wins(
    query_emb: Tensor, doc_emb: Tensor, qrels: list[dict[int, int]], negatives: list[list[int]]
) -> list[tuple[int, int]]:
    """Per query: (judged non-relevant docs its best relevant doc outscores strictly, judged
    non-relevant docs); (0, 0) for a query without such judgments."""
    out = []
    for i, (rel, negs) in enumerate(zip(qrels, negatives, strict=True)):
        if not negs:
            out.append((0, 0))
            continue
        q = query_emb[i].float()  # (E,)
        best = (doc_emb[list(rel)].float() @ q).max()
        out.append((int((doc_emb[negs].float() @ q < best).sum()), len(negs)))
    return out


def judged_negative_accuracy(
    query_emb: Tensor, doc_emb: Tensor, qrels: list[dict[int, int]], negatives: list[list[int]]
) -> float | None:
    """Fraction of (query, judged non-relevant doc) pairs where the query's best relevant doc
    scores strictly higher (hard-negative accuracy); None when no query has such judgments."""
    return wins_fraction(judged_negative_wins(query_emb, doc_emb, qrels, negatives))


def wins_fraction(wins: list[tuple[int, int]]) -> float | None:
    """Pooled (wins, judged) of `judged_negative_wins` as one accuracy; None if none judged."""
    hits, total = sum(h for h, _ in wins), sum(t for _, t in wins)
    return hits / total if total else None


def chance_recall(qrels: list[dict[int, int]], n_docs: int, k: int) -> float:
    """Expected R@k of a random ranking: P(some relevant doc in a random k of n_docs)."""
    total = 0.0
    for rel in qrels:
        p = len(rel)
        miss = math.comb(n_docs - p, k) / math.comb(n_docs, k) if n_docs - p >= k else 0.0
        total += 1.0 - miss
    return total / max(len(qrels), 1)


def write_ranks(
    path: str | os.PathLike[str],
    query_ids: list[str],
    doc_ids: list[str],
    ranks: Tensor,
    top_ids: Tensor,
    hardneg: list[tuple[int, int]] | None = None,
) -> None:
    """One JSON line per query: {"query": id, "rank": r, "top": [doc ids, best first]}, plus
    "hardneg": [wins, judged] (`judged_negative_wins`) for a query with judged non-relevant
    docs, so the queries that lose to their hard negatives can be found and compared."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    hardneg = hardneg or [(0, 0)] * len(query_ids)
    with p.open("w") as f:
        rows = zip(query_ids, ranks.tolist(), top_ids.tolist(), hardneg, strict=True)
        for qid, r, ids, (won, judged) in rows:
            row = {"query": qid, "rank": r, "top": [doc_ids[j] for j in ids[:TOP_LIST]]}
            if judged:
                row["hardneg"] = [won, judged]
            f.write(json.dumps(row) + "\n")


class CorpusEvaluator:
    """Sharded corpus evaluation through a backbone's batcher (in training and `vltrain eval`).

    Each rank embeds its contiguous shard of the queries and of the documents, the shards are
    gathered once, and every rank runs the same exact search, so no rank waits at a barrier on
    work only one rank does. `batch_size` per rank; sides decode at `image_size` (`native`:
    PIL images at their own size, for HF backbones); `model_kind` says which side modalities
    the encoder takes (`check_side_modality`); `matryoshka_dims`: also score the embeddings
    truncated to these widths (``d<dim>_*``, `vltrain.eval.variants`).
    """

    def __init__(
        self,
        batcher: Batcher,
        where: Placement,
        batch_size: int,
        image_size: int,
        native: bool,
        model_kind: str,
        matryoshka_dims: tuple[int, ...] = (),
    ) -> None:
        self.batcher, self.where, self.batch_size = batcher, where, batch_size
        self.image_size, self.native, self.model_kind = image_size, native, model_kind
        self.matryoshka_dims = tuple(matryoshka_dims)
        self._splits: dict[str, CorpusSplit] = {}

    def split(self, folder: str | os.PathLike[str]) -> CorpusSplit:
        """The split in `folder`, read once; rank 0 warns of qrels rows naming absent ids."""
        key = str(folder)
        if key not in self._splits:
            self._splits[key] = read_split_dir(folder)
            warning = missing_warning(self._splits[key], Path(folder) / "qrels.tsv")
            if warning and self.where.is_main:
                print(f"vltrain: {warning}", file=sys.stderr)
        return self._splits[key]

    def embed(
        self, encoder: Encoder, sides: list[Side], role: str, batch_size: int = 0
    ) -> tuple[Tensor, Tensor, int]:
        """This rank's shard of `sides` embedded, gathered over ranks: (n, E) in file order,
        their rows (n,), and the number of bad sides (left out) over all ranks.

        Sides decode `batch_size` at a time but go through the encoder one by one: a batched
        forward pads prompts and images to the batch's longest and runs kernels whose
        reduction order depends on the batch's shape, so an embedding would move in its last
        bits with the batch size and the world size (invariant 11). Alone, each side's
        embedding depends only on the side.
        """
        kinds = {modality(s) for s in sides}
        if len(kinds) != 1:
            raise ConfigError(f"the {role} side of the corpus mixes modalities {sorted(kinds)}")
        kind = kinds.pop()
        check_side_modality(self.model_kind, role, kind, "corpus evaluation")
        bs = batch_size or self.batch_size
        where = self.where
        emb, rows, n_bad = [], [], 0
        for keys in EvalShardSampler(len(sides), bs, where.rank, where.world_size):
            good, idx = [], []
            for _, _, i in keys:
                try:
                    label = f"{role} {i}"
                    good.append(
                        load_side(sides[i], self.image_size, self.native, DEFAULT_MAX_PIXELS, label)
                    )
                    idx.append(i)
                except BadSample:
                    n_bad += 1
            for side, i in zip(good, idx, strict=True):
                instr = [sides[i].get("instruction", "")]
                inputs, _ = side_inputs(self.batcher, role, kind, [side], instr)
                with torch.no_grad():
                    e = encode_side(encoder, kind, to_device(inputs, where.device))  # (1, E)
                emb.append(e.float().cpu())
                rows.append(torch.tensor([i]))
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
        self,
        encoder: Encoder,
        folder: str | os.PathLike[str],
        ranks_path: str | os.PathLike[str] | None = None,
    ) -> dict[str, float]:
        """Metrics of this module over the split in `folder`; every rank returns the same
        numbers. `ranks_path`: per-query ranks and top ids (rank 0 writes)."""
        return self.evaluate_split(encoder, self.split(folder), ranks_path)

    def embed_split(self, encoder: Encoder, split: CorpusSplit) -> SplitEmbeddings:
        """Every query and document of `split` embedded (sharded, gathered), with the qrels
        renumbered to the rows that decoded; every rank returns the same."""
        t0 = time.perf_counter()
        q_emb, q_rows, q_bad = self.embed(encoder, split.queries, "query")
        d_emb, d_rows, d_bad = self.embed(encoder, split.docs, "doc")
        encode_s = time.perf_counter() - t0
        for rows, sides, role in ((q_rows, split.queries, "queries"), (d_rows, split.docs, "docs")):
            if len(rows) == 0:  # every rank alike (gathered)
                raise DataError(
                    f"none of the {len(sides)} {role} of the evaluation corpus decodes (missing "
                    "images, paths relative to the wrong folder, empty texts?): nothing to "
                    "evaluate"
                )
        doc_pos = {int(r): i for i, r in enumerate(d_rows.tolist())}  # corpus row -> emb row
        qrels, judged, keep = [], [], []
        for i, r in enumerate(q_rows.tolist()):
            rel = {doc_pos[d]: g for d, g in split.qrels[r].items() if d in doc_pos}
            if rel:  # a query whose relevant docs are all undecodable cannot be scored
                qrels.append(rel)
                judged.append([doc_pos[d] for d in split.judged_negatives[r] if d in doc_pos])
                keep.append(i)
        return SplitEmbeddings(
            queries=q_emb[keep],
            docs=d_emb,
            qrels=qrels,
            judged=judged,
            query_ids=[split.query_ids[int(q_rows[i])] for i in keep],
            doc_ids=[split.doc_ids[int(r)] for r in d_rows.tolist()],
            groups=[split.groups[int(q_rows[i])] for i in keep],
            bad=q_bad + d_bad,
            encode_s=encode_s,
        )

    def evaluate_split(
        self,
        encoder: Encoder,
        split: CorpusSplit,
        ranks_path: str | os.PathLike[str] | None = None,
    ) -> dict[str, float]:
        """`evaluate` of an already-read split."""
        emb = self.embed_split(encoder, split)
        ranks = ranks_path if self.where.is_main else None
        metrics = score_split(emb, ranks)
        if self.matryoshka_dims:  # d<dim>_*: the truncated embeddings, scored the same way
            from vltrain.eval.variants import variant_metrics  # imports this module

            metrics.update(variant_metrics(emb, self.matryoshka_dims))
        metrics.update(missing_metrics(split))
        metrics["encode_s"] = emb.encode_s
        return metrics


@dataclass
class SplitEmbeddings:
    """A split's embeddings, gathered over ranks, and its qrels renumbered to their rows."""

    queries: Tensor  # (Q, E) the scorable queries, file order
    docs: Tensor  # (N, E) the documents that decoded, file order
    qrels: list[dict[int, float]]  # per query: doc row -> grade (> 0)
    judged: list[list[int]]  # per query: doc rows judged non-relevant
    query_ids: list[str]
    doc_ids: list[str]
    groups: list[str | None]
    bad: int  # sides that did not decode, over all ranks
    encode_s: float


def score_split(
    emb: SplitEmbeddings, ranks_path: str | os.PathLike[str] | None = None
) -> dict[str, float]:
    """Metrics of `emb` (`corpus_metrics`, hard-negative accuracy, chance R@1, per group, bad
    samples); `ranks_path`: also write the per-query ranks there. Scores are fp32 even inside
    a bf16 run's autocast (training evaluates under it): bf16 scores tie and reorder
    documents that fp32 ranks apart."""
    with torch.autocast(emb.queries.device.type, enabled=False):
        metrics, ranks, top = corpus_metrics(emb.queries, emb.docs, emb.qrels)
        wins = judged_negative_wins(emb.queries, emb.docs, emb.qrels, emb.judged)
    acc = wins_fraction(wins)
    if acc is not None:
        metrics["hardneg_acc"] = acc
    metrics["chance_R@1"] = chance_recall(emb.qrels, emb.docs.shape[0], 1)
    metrics.update(group_metrics(ranks, emb.groups))
    metrics["bad_samples"] = float(emb.bad)
    if ranks_path is not None:
        write_ranks(ranks_path, emb.query_ids, emb.doc_ids, ranks, top, wins)
    return metrics
