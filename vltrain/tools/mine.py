"""Hard-negative mining with a trained contrastive model: `vltrain mine`.

Queries are images, the corpus is every caption of the data file. For each image we walk its
ranked captions inside the rank window [range_min, range_max), skip its own captions (and
any caption with the same text), skip likely false negatives (score above `margin` x the score
of its best positive caption), and keep the first `k`. The output JSONL is the input with
`negatives` filled in, so `objective.hard_negatives` can train on it directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vltrain.data.records import DataError
from vltrain.data.sources import read_source
from vltrain.eval.topk import topk_similarity
from vltrain.files import atomic_write_lines, check_not_input, check_output_path
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


def _embed(
    stage: Any, model: Any, data: Path, batch_size: int
) -> tuple[list[dict], Tensor, list[int], Tensor, list[str], Tensor]:
    """Image embeddings of good records, and embeddings of every caption (with its owner),
    through the stage's evaluation path (the backbone's own batcher and image decoding)."""
    ds = stage.eval_dataset(data, hard_negatives=0)
    with torch.no_grad():
        shard, _, texts = stage.embed_shard(model, ds, batch_size=batch_size)
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
            if float(scores[row, rank]) > opts.margin * pos_score:
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
    if read_source(data).images is not None:
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
    _, stage, model = load_trained(checkpoint)
    records, img, owners, txt, texts, txt_owner = _embed(stage, model, data_p, opts.batch_size)
    mined = mine_negatives(img, owners, txt, texts, txt_owner, opts)
    counts = [len(mined.get(i, [])) for i in range(len(records))]
    rows = (
        json.dumps(mine_record(rec, mined.get(i, []), opts.append)) for i, rec in enumerate(records)
    )
    atomic_write_lines(out_p, rows)
    full = sum(c == opts.k for c in counts)
    return {
        "records": len(records),
        "mined_mean": sum(counts) / max(len(counts), 1),
        "records_with_k": full,
    }
