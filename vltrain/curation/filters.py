"""Record filters: caption sanity (language-free), image size, and CLIP-score selection.

Caption rules look only at characters and word counts, never at a language model: too few or
too many words, too few letters (URLs, numbers, markup), one word repeated over most of the
caption. CLIP-score keeps records whose image-text cosine under a trained model is at least a
threshold, or the top fraction by score as DataComp's baseline does (ties at the cut broken by
input order, so the kept set is deterministic).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vltrain.curation.text import words


@dataclass(frozen=True)
class CaptionRules:
    """Language-free caption sanity limits; a record fails if its FIRST caption fails."""

    min_words: int = 2
    """fewer words than this: removed (reason caption_short)"""
    max_words: int = 256
    """more words than this: removed (caption_long)"""
    min_alpha_fraction: float = 0.5
    """letters / non-space characters below this: removed (caption_not_text)"""
    max_word_repeat: float = 0.6
    """share of the most frequent word above this (with >= 4 words): removed (caption_repeat)"""


@dataclass(frozen=True)
class ImageRules:
    """Image size limits checked on the decoded image."""

    min_side: int = 16
    """shorter side below this many pixels: removed (image_small)"""
    max_aspect: float = 6.0
    """long side / short side above this: removed (image_aspect)"""


def caption_problem(text: str, rules: CaptionRules) -> str | None:
    """The reason a caption fails, or None."""
    toks = words(text)
    if len(toks) < rules.min_words:
        return "caption_short"
    if len(toks) > rules.max_words:
        return "caption_long"
    chars = [c for c in text if not c.isspace()]
    if sum(c.isalpha() for c in chars) < rules.min_alpha_fraction * len(chars):
        return "caption_not_text"
    if len(toks) >= 4 and Counter(toks).most_common(1)[0][1] > rules.max_word_repeat * len(toks):
        return "caption_repeat"
    return None


def image_problem(width: int, height: int, rules: ImageRules) -> str | None:
    """The reason an image fails the size rules, or None."""
    if min(width, height) < rules.min_side:
        return "image_small"
    if max(width, height) > rules.max_aspect * max(1, min(width, height)):
        return "image_aspect"
    return None


def clip_score_keep(
    scores: Sequence[float], threshold: float | None = None, top_fraction: float | None = None
) -> np.ndarray:
    """(N,) bool: kept by threshold (score >= t) or by top fraction (ceil(f N) best)."""
    s = np.asarray(scores, dtype=np.float64)
    if (threshold is None) == (top_fraction is None):
        raise ValueError("give exactly one of a CLIP-score threshold or a top fraction")
    if threshold is not None:
        return s >= threshold
    if not 0.0 < top_fraction <= 1.0:
        raise ValueError(f"top fraction must be in (0, 1], got {top_fraction}")
    n_keep = int(np.ceil(top_fraction * len(s)))
    order = np.lexsort((np.arange(len(s)), -s))  # score desc, then input order
    keep = np.zeros(len(s), dtype=bool)
    keep[order[:n_keep]] = True
    return keep
