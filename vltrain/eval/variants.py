"""Retrieval metrics of transformed embeddings: Matryoshka prefixes and int8 quantisation.

The corpus is embedded once (`CorpusEvaluator.embed_split`); each setting transforms the
gathered embeddings and scores them with the same exact search (`corpus.score_split`), so the
settings differ only by the transformation:

    d<dim>_*       the first `dim` coordinates of every embedding, re-normalised
    int8_*         every embedding quantised to int8 with its own symmetric scale
    d<dim>_int8_*  both: a prefix, then int8
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from vltrain.config.core import ConfigError
from vltrain.eval.corpus import SplitEmbeddings, score_split

#: per-setting metrics that only repeat the full-width ones
SHARED = ("bad_samples", "n_docs", "n_queries", "chance_R@1")


def check_dims(dims: tuple[int, ...], width: object = None) -> None:
    """Prefix sizes must be positive, strictly increasing and, once the embedding width is
    known, at most that width."""
    if any(d <= 0 for d in dims) or list(dims) != sorted(set(dims)):
        raise ConfigError(f"--dims {','.join(map(str, dims))}: give increasing positive sizes")
    if isinstance(width, int) and dims and dims[-1] > width:
        raise ConfigError(f"--dims {dims[-1]} is above the embedding width {width}")


def prefix(emb: Tensor, dim: int) -> Tensor:
    """The first `dim` coordinates of each row (a Matryoshka prefix), re-normalised. (n, dim)"""
    return torch.nn.functional.normalize(emb[:, :dim], dim=-1)


def int8_roundtrip(emb: Tensor) -> Tensor:
    """Each row quantised to int8 with its own symmetric scale (max |x| -> 127) and read back
    as float32: what an int8 index scores. (n, E)"""
    scale = emb.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0  # (n, 1)
    return (emb / scale).round().clamp(-127, 127).to(torch.int8).float() * scale


def variant_metrics(
    emb: SplitEmbeddings, dims: tuple[int, ...] = (), int8: bool = False
) -> dict[str, float]:
    """Retrieval metrics of transformed embeddings, keyed by setting: ``d<dim>_*`` per
    Matryoshka prefix, ``int8_*`` for int8 embeddings of the full width, ``d<dim>_int8_*``."""
    settings: list[tuple[str, int | None, bool]] = [(f"d{d}_", d, False) for d in dims]
    if int8:
        settings += [("int8_", None, True)] + [(f"d{d}_int8_", d, True) for d in dims]
    out: dict[str, float] = {}
    for key, dim, quantise in settings:
        q, d = emb.queries, emb.docs
        if dim is not None:
            q, d = prefix(q, dim), prefix(d, dim)
        if quantise:
            q, d = int8_roundtrip(q), int8_roundtrip(d)
        m = score_split(replace(emb, queries=q, docs=d))
        out.update({key + k: v for k, v in m.items() if k not in SHARED})
    return out
