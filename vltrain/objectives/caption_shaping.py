"""Reward shaping and degeneration statistics of sampled captions (the rl stage logs them).

* :func:`length_penalty`: ``coeff * n`` (linear, a cost per token) or ``coeff * |n - target|``
  (pull towards a target length), ``n`` the caption's sampled tokens without EOS. The stage
  subtracts it from the reward before the baseline, so it shapes the advantages like any reward.
* :func:`repeated_ngram_rate`: rep-n of Welleck et al. (2019, unlikelihood training),
  ``1 - |distinct n-grams| / |n-grams|`` within one caption; 0 for a caption shorter than n
  words. A policy that games CIDEr-D by repeating phrases shows up here first.
* :func:`caption_stats`: the mean rep-4 rate and the mean caption length in words.

Words are the PTB tokens the reward scores (lower-cased, punctuation dropped), so the
statistics do not depend on the model's tokenizer. Details in ``docs/rl.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vltrain.eval.ptb_tokenize import ptb_tokenize_caption

__all__ = ["caption_stats", "length_penalty", "repeated_ngram_rate"]


def length_penalty(tokens: Tensor, coeff: float, target: int = 0) -> Tensor:
    """Per-caption penalty (N,) float32 from caption lengths ``tokens`` (N,) (EOS excluded).

    ``target == 0``: ``coeff * tokens``; ``target > 0``: ``coeff * |tokens - target|``.
    """
    if coeff < 0 or target < 0:
        raise ValueError(f"length penalty needs coeff >= 0 and target >= 0, got {coeff}, {target}")
    n = tokens.float()
    return coeff * ((n - target).abs() if target > 0 else n)


def repeated_ngram_rate(words: Sequence[str], n: int = 4) -> float:
    """``1 - distinct / total`` over the n-grams of one caption's ``words``; 0 if none."""
    if n < 1:
        raise ValueError(f"n-gram order must be >= 1, got {n}")
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def caption_stats(captions: Sequence[str], n: int = 4) -> dict[str, Tensor]:
    """``rep{n}_rate`` (mean over captions) and ``caption_words`` (mean PTB words)."""
    words = [ptb_tokenize_caption(c).split() for c in captions]
    rep = [repeated_ngram_rate(w, n) for w in words]
    lens = [float(len(w)) for w in words]
    count = max(len(words), 1)
    return {
        f"rep{n}_rate": torch.tensor(sum(rep) / count, dtype=torch.float64),
        "caption_words": torch.tensor(sum(lens) / count, dtype=torch.float64),
    }
