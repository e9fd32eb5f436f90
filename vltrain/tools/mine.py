"""Hard-negative mining with a trained contrastive model: `vltrain mine`.

Queries are images, the corpus is every caption of the data file. For each image we walk its
ranked captions inside the rank window [range_min, range_max), skip its own captions (and
any caption with the same text), skip likely false negatives (`false_negative`: a score not
below its best positive caption's by the margin), and keep the first `k`. The output JSONL
is the input with `negatives` filled in, so `objective.hard_negatives` can train on it.

Query/positive records with ``--corpus``: queries are the records' query sides, the corpus is
any-modality documents, negatives are written as document ids (`mine_pairs_command`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vltrain.core.files import atomic_write_lines, check_not_input, check_output_path
from vltrain.data.pairs import read_corpus, read_pair_records
from vltrain.data.readers import DataError
from vltrain.data.sources import read_source
from vltrain.eval.corpus import read_qrels
from vltrain.eval.topk import topk_similarity
from vltrain.tools.loading import load_trained


@dataclass
class MineOptions:
    """What counts as a usable hard negative."""

    k: int = 5
    range_min: int = 0
    range_max: int = 100
    margin: float = 0.95
    batch_size: int = 128
    append: bool = False

    def __post_init__(self) -> None:
        if self.k < 1 or self.batch_size < 1:
            raise ValueError(f"k and batch_size must be >= 1, got {self.k}, {self.batch_size}")
        if not 0 <= self.range_min < self.range_max:
            raise ValueError(
                f"need 0 <= range_min < range_max, got {self.range_min}, {self.range_max}"
            )


def false_negative(score: float, pos: float, margin: float) -> bool:
    """A candidate scoring above ``pos - (1 - margin) * |pos|`` is probably another positive.

    The positive-aware rule of NV-Retriever (Moreira et al. 2024, TopK-PercPos: keep a
    candidate only below `margin` x the positive's score, 0.95 its best setting), written so
    it also holds for a positive scoring <= 0 (an untrained model's): there the plain
    ``margin x pos`` would lie above the positive and let a copy of the positive through.
    """
    return score > pos - (1.0 - margin) * abs(pos)


def _embed(
    stage: Any, model: Any, data: Path, batch_size: int
) -> tuple[list[dict], Tensor, list[int], Tensor, list[str], Tensor]:
    """The records merged per image path, embeddings of their good images and of every caption
    (with its owner), through the stage's evaluation path (the backbone's own batcher and
    image decoding)."""
    ds = stage.data.eval_dataset(data, hard_negatives=0, merge_images=True)
    with torch.no_grad(), stage.ctx.autocast():  # as the run's evaluation embeds
        shard, _, texts = stage.retrieval.embed_shard(model.encoder, ds, batch_size=batch_size)
    owners = [int(i) for i in shard["idx"]]
    return ds.records, shard["img"], owners, shard["txt"], texts, shard["owner"]


def mine_negatives(
    img: Tensor,
    owners: list[int],
    txt: Tensor,
    texts: list[str],
    txt_owner: Tensor,
    opts: MineOptions,
) -> dict[int, list[str]]:
    """Record index -> mined negative texts (see the module docstring for the rules)."""
    depth = min(opts.range_max, txt.shape[0])
    scores, idx = topk_similarity(img, txt, depth)  # (I, depth)
    out: dict[int, list[str]] = {}
    for row, rec in enumerate(owners):
        own = (txt_owner == rec).nonzero().flatten()
        positives = {texts[int(j)] for j in own}
        pos_score = float((txt[own] @ img[row]).max())
        chosen: list[str] = []
        for rank in range(opts.range_min, depth):
            j = int(idx[row, rank])
            cand = texts[j]
            if int(txt_owner[j]) == rec or cand in positives or cand in chosen:
                continue
            if false_negative(float(scores[row, rank]), pos_score, opts.margin):
                continue  # probably another true description of this image
            chosen.append(cand)
            if len(chosen) == opts.k:
                break
        out[rec] = chosen
    return out


def mine_record(rec: dict, negs: list[str], append: bool) -> dict:
    """`rec` with its negatives replaced by (or, `append`, extended with) the mined ones.

    `negative_kinds` labels one kind per negative: replaced negatives drop the old labels, and
    appended ones are labelled "mined", so no label ever describes another negative.
    """
    row = dict(rec)
    old = list(rec.get("negatives", [])) if append else []
    row["negatives"] = old + negs
    kinds = rec.get("negative_kinds")
    row.pop("negative_kinds", None)
    if append and isinstance(kinds, list) and len(kinds) == len(old):
        row["negative_kinds"] = list(kinds) + ["mined"] * len(negs)
    return row


def mine_command(checkpoint: str, data: str, out: str, opts: MineOptions) -> dict[str, float]:
    """Mine negatives for every record of `data` and write `out` (same folder as `data`)."""
    check_output_path(out)
    check_not_input(out, [data])
    cfg, stage, model = load_trained(checkpoint)
    source = read_source(data, cfg.data.image_column, cfg.data.text_column)
    if source.images is not None:
        raise DataError(
            f"--data {data} keeps its images inside the table (parquet / datasets folder); "
            "mine writes JSONL records with image paths, so give a .jsonl, .json or .csv file"
        )
    data_p, out_p = Path(data).resolve(), Path(out).resolve()
    if data_p.parent != out_p.parent:
        raise DataError(
            f"--out must be in the same folder as --data ({data_p.parent}) so the relative "
            "image paths stay valid"
        )
    # lines of one image path are mined as one image (no caption of it becomes a negative)
    images, img, owners, txt, texts, txt_owner = _embed(stage, model, data_p, opts.batch_size)
    records = source.records
    if not owners or txt.shape[0] < 2:
        raise DataError(
            f"--data {data}: {len(owners)} of its {len(images)} images decode, with "
            f"{txt.shape[0]} captions: too few to mine negatives from; check the "
            "image paths (relative to the file) and that it is UTF-8 JSONL"
        )
    mined = mine_negatives(img, owners, txt, texts, txt_owner, opts)
    image_of = {rec["image"]: i for i, rec in enumerate(images)}
    per_line = [mined.get(image_of[rec["image"]], []) for rec in records]
    counts = [len(m) for m in per_line]
    rows = (
        json.dumps(mine_record(rec, m, opts.append))
        for rec, m in zip(records, per_line, strict=True)
    )
    atomic_write_lines(out_p, rows)
    full = sum(c == opts.k for c in counts)
    return {
        "records": len(records),
        "mined_mean": sum(counts) / max(len(counts), 1),
        "records_with_k": full,
    }


# ---- pair records over a corpus -----------------------------------------------------------


def _content_key(side: dict[str, Any]) -> tuple[str | None, str | None]:
    """What a side shows: its resolved image path and its text (ids differ, pages do not)."""
    image = None
    if side["image"] is not None:
        image = os.path.normpath(Path(side["base"]).resolve().parent / side["image"])
    return image, side["text"]


def mine_pair_negatives(
    q_emb: Tensor, p_emb: Tensor, d_emb: Tensor, excluded: list[set[int]], opts: MineOptions
) -> list[list[int]]:
    """Per query (row of q_emb): corpus rows of its mined negatives. `p_emb` (Q, E) is each
    query's positive, for the margin filter; `excluded[i]` holds rows never to return."""
    depth = min(opts.range_max, d_emb.shape[0])
    scores, idx = topk_similarity(q_emb, d_emb, depth)  # (Q, depth)
    pos_score = (q_emb * p_emb).sum(-1)  # (Q,)
    out = []
    for i in range(q_emb.shape[0]):
        chosen: list[int] = []
        for rank in range(opts.range_min, depth):
            j = int(idx[i, rank])
            if j in excluded[i] or j in chosen:
                continue
            if false_negative(float(scores[i, rank]), float(pos_score[i]), opts.margin):
                continue  # probably an unjudged positive (a copy of the page, say)
            chosen.append(j)
            if len(chosen) == opts.k:
                break
        out.append(chosen)
    return out


def mine_pairs_command(
    checkpoint: str,
    data: str,
    corpus: str,
    out: str,
    opts: MineOptions,
    qrels: str | None = None,
) -> dict[str, float]:
    """Mine document-id negatives for the query/positive records of `data` from `corpus`.

    Excluded for each query: its positives (by doc id, and any corpus doc showing the same
    image path and text), and every doc with a positive grade for the record's id in `qrels`.
    The output keeps each record and sets ``negatives`` to ``[{"doc": id}, ...]``; train on it
    with ``data.train_corpus=CORPUS``.
    """
    data_p, out_p = Path(data).resolve(), Path(out).resolve()
    if data_p.parent != out_p.parent:
        raise DataError(f"--out must be in the same folder as --data ({data_p.parent})")
    docs = read_corpus(corpus)
    records = read_pair_records(data_p, docs)
    raw = [json.loads(x) for x in data_p.read_text().splitlines() if x.strip()]
    doc_ids = list(docs)
    row_of = {d: i for i, d in enumerate(doc_ids)}
    by_content: dict[tuple[str | None, str | None], list[int]] = {}
    for i, side in enumerate(docs.values()):
        by_content.setdefault(_content_key(side), []).append(i)
    judged: dict[str, set[int]] = {}
    for qid, did, grade in read_qrels(qrels) if qrels else []:
        if grade > 0 and did in row_of:
            judged.setdefault(qid, set()).add(row_of[did])
    _, stage, model = load_trained(checkpoint)
    ev, enc = stage.corpus, model.encoder
    with torch.no_grad(), stage.ctx.autocast():
        q_emb, q_rows, _ = ev.embed(enc, [r["query"] for r in records], "query", opts.batch_size)
        p_emb, p_rows, _ = ev.embed(
            enc, [r["positives"][0] for r in records], "doc", opts.batch_size
        )
        d_emb, d_rows, _ = ev.embed(enc, list(docs.values()), "doc", opts.batch_size)
    good = sorted(set(q_rows.tolist()) & set(p_rows.tolist()))  # records whose sides decode
    q_at = {int(r): i for i, r in enumerate(q_rows.tolist())}
    p_at = {int(r): i for i, r in enumerate(p_rows.tolist())}
    d_ids = [doc_ids[int(r)] for r in d_rows.tolist()]
    d_at = {int(r): i for i, r in enumerate(d_rows.tolist())}
    excluded = []
    for r in good:
        rec = records[r]
        rows = set(judged.get(rec["id"], set()))
        for side in rec["positives"]:
            if side.get("doc") in row_of:
                rows.add(row_of[side["doc"]])
            rows.update(by_content.get(_content_key(side), []))
        excluded.append({d_at[x] for x in rows if x in d_at})
    mined = mine_pair_negatives(
        q_emb[[q_at[r] for r in good]], p_emb[[p_at[r] for r in good]], d_emb, excluded, opts
    )
    negs = {r: [{"doc": d_ids[j]} for j in m] for r, m in zip(good, mined, strict=True)}
    counts = []
    with open(out_p, "w") as f:
        for i, obj in enumerate(raw):
            row = dict(obj)
            new = negs.get(i, [])
            counts.append(len(new))
            row["negatives"] = (list(obj.get("negatives", [])) + new) if opts.append else new
            f.write(json.dumps(row) + "\n")
    return {
        "records": len(raw),
        "mined_mean": sum(counts) / max(len(counts), 1),
        "records_with_k": sum(c == opts.k for c in counts),
    }
