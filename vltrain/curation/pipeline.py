"""`vltrain data curate`: filter, decontaminate and deduplicate an image-text JSONL.

Order (the first rule that fires names the reason): undecodable image -> caption/image sanity
-> CLIP score -> eval-set leak -> exact image -> exact caption -> near image (pHash/dHash) ->
near caption (MinHash) -> semantic (embeddings). Filters and decontamination come before any
deduplication, and a duplicate is removed only against a record that is kept at that moment
and stays kept (semantic deduplication never removes a witness of an earlier removal), so every
removed duplicate names a kept record in the output. Records are visited in input order: of
each duplicate group the FIRST record in the file is kept.

Two streaming passes over the input: the first computes features (in `workers` processes,
results in input order) and decides; the second copies kept lines byte for byte to OUT and
writes removed records, with reason and witness, to OUT.removed.jsonl.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from vltrain.curation.bloom import BloomFilter
from vltrain.curation.features import Features, FeatureSettings, iter_features
from vltrain.curation.filters import (
    CaptionRules,
    ImageRules,
)
from vltrain.curation.hamming import HammingIndex
from vltrain.curation.hashing import ImageHashes, crop_similarity, thumb_similarity
from vltrain.curation.minhash import LSHIndex, optimal_params
from vltrain.curation.text import jaccard, words
from vltrain.data.readers import DataError, normalise_record

#: the curate steps; `vltrain data dedup|decontam|filter` run subsets
STEPS = ("filter", "decontam", "dedup")
#: more MinHash permutations than this only cost memory (N records x num_perm x 8 bytes)
MAX_PERM = 4096


@dataclass
class CurateOptions:
    """Thresholds and switches; defaults are the recommended settings (docs/curation.md)."""

    steps: tuple[str, ...] = STEPS
    """which of filter, decontam, dedup run"""
    seed: int = 0
    """seeds every hash (results are identical across processes and runs)"""
    workers: int = 1
    """feature processes (output is the same for any count)"""
    shingle_n: int = 3
    """word n-gram size of caption shingles"""
    num_perm: int = 128
    """MinHash permutations (64-bit values)"""
    caption_threshold: float = 0.7
    """exact Jaccard at or above which captions are near-duplicates"""
    caption_dups: str = "flag"
    """near/exact caption duplicates with a different image: 'flag' (report only) or 'drop'"""
    phash_radius: int = 12
    """pHash Hamming radius of an image near-duplicate (mirrored copy included)"""
    dhash_radius: int = 14
    """dHash radius; a near-duplicate must be within both radii"""
    thumb_min_corr: float = 0.85
    """and its 16x16 colour thumbnail must correlate this well (mirror allowed)"""
    crop_radius: int = 10
    """crop near-duplicates: a crop window's pHash within this many bits of the other's whole
    pHash (both from the 64x64 thumbnail; 0 turns the crop check off)"""
    crop_min_corr: float = 0.96
    """and a window near it must correlate this well with the other (16x16 colour thumbnails)"""
    semantic_eps: float = 0.05
    """semantic duplicates: image-embedding cosine > 1 - eps (needs an embedder)"""
    leak_n: int = 13
    """word n-gram shared with an eval caption that marks a leak"""
    leak_jaccard: float = 0.8
    """caption-vs-eval-caption Jaccard (shingles) that marks a leak, for any length"""
    bloom_fp_rate: float = 1e-4
    """false-positive rate the Bloom filter is sized for (hits are verified exactly)"""
    caption_rules: CaptionRules = field(default_factory=CaptionRules)
    image_rules: ImageRules = field(default_factory=ImageRules)
    clip_threshold: float | None = None
    """keep records with image-text cosine >= this (needs an embedder)"""
    clip_top_fraction: float | None = None
    """or keep this best fraction by CLIP score (DataComp: 0.3)"""

    def check(self) -> None:
        bad = [s for s in self.steps if s not in STEPS]
        if bad:
            raise DataError(f"unknown curate step(s) {bad}; use a subset of {STEPS}")
        if self.caption_dups not in ("flag", "drop"):
            raise DataError(f"caption_dups must be 'flag' or 'drop', got {self.caption_dups!r}")
        if self.clip_threshold is not None and self.clip_top_fraction is not None:
            raise DataError("give --clip-threshold or --clip-top-fraction, not both")
        if self.workers < 1:
            raise DataError(f"--workers must be >= 1, got {self.workers}")
        if self.leak_n < 1:  # every caption shares the empty 0-gram: every record a leak
            raise DataError(f"--leak-n is a word n-gram size, >= 1 (default 8), got {self.leak_n}")
        if not 1 <= self.num_perm <= MAX_PERM:
            raise DataError(
                f"--num-perm must be in [1, {MAX_PERM}] (default 128), got {self.num_perm}"
            )
        if self.shingle_n < 1:
            raise DataError(
                f"--shingle-n is a word n-gram size >= 1 (default 3), got {self.shingle_n}"
            )
        ranges = {  # option: (low, high, high included); low is excluded, nan fails both
            "caption_threshold": (0.0, 1.0, False),
            "bloom_fp_rate": (0.0, 1.0, False),
            "leak_jaccard": (0.0, 1.0, True),
            "semantic_eps": (0.0, 2.0, True),
        }
        for name, (low, high, closed) in ranges.items():
            value = getattr(self, name)
            if not (low < value < high or (closed and value == high)):
                flag = "--" + name.replace("_", "-")
                span = f"({low:g}, {high:g}{']' if closed else ')'}"
                raise DataError(f"{flag} must be in {span}, got {value}")
        c, i = self.caption_rules, self.image_rules
        if not 0 <= c.min_words <= c.max_words:
            raise DataError(
                f"--min-words {c.min_words} and --max-words {c.max_words}: need 0 <= min <= max "
                "(every record would be removed)"
            )
        if i.min_side < 0:
            raise DataError(f"--min-side is a size in pixels, >= 0, got {i.min_side}")
        if self.clip_threshold is not None and not -1.0 <= self.clip_threshold <= 1.0:
            raise DataError(f"--clip-threshold is a cosine in [-1, 1], got {self.clip_threshold}")
        if self.clip_top_fraction is not None and not 0.0 < self.clip_top_fraction <= 1.0:
            raise DataError(
                f"--clip-top-fraction is a fraction in (0, 1], got {self.clip_top_fraction}"
            )
        for name in ("phash_radius", "dhash_radius", "crop_radius"):
            if not 0 <= getattr(self, name) < 64:
                flag = "--" + name.replace("_", "-")
                raise DataError(f"{flag} is a Hamming radius in [0, 63], got {getattr(self, name)}")


class Embedder(Protocol):
    """Embeds a JSONL file's records: image (N, E) and first-caption (N, E) unit vectors, and
    (N,) bool for records it could embed. Rows follow the file's non-blank lines."""

    def embed(self, path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass
class Decision:
    """Why a record is removed (None: kept) and what it duplicates."""

    reason: str | None = None
    witness: int | None = None
    similarity: float | None = None
    witness_source: str = "train"
    detail: str | None = None


def iter_lines(path: Path) -> Iterator[tuple[int, bytes, dict[str, Any]]]:
    """(record index, raw line bytes, normalised record) of each non-blank line."""
    index = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw.decode("utf-8-sig", "surrogateescape"))
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}); fix or delete it.") from None
            yield index, raw, normalise_record(obj, where, str(lineno))
            index += 1


def _items(path: Path) -> Iterator[tuple[int, str, list]]:
    for index, _, rec in iter_lines(path):
        yield index, rec["image"], rec["text"]


def settings(path: Path, opts: CurateOptions, bloom: BloomFilter | None) -> FeatureSettings:
    bands, rows = optimal_params(opts.caption_threshold, opts.num_perm)
    return FeatureSettings(
        str(path.parent), opts.seed, opts.shingle_n, opts.num_perm, opts.leak_n, bands, rows, bloom
    )


class Decider:
    """Streaming decisions over features in input order (the indexes hold kept records only)."""

    def __init__(self, opts: CurateOptions, bands: int, rows: int, prefix: str = "dup") -> None:
        self.o, self.prefix = opts, prefix
        self.content: dict[bytes, int] = {}
        self.captions: dict[int, int] = {}
        self.phash = HammingIndex(opts.phash_radius)
        self.dhash: dict[int, int] = {}
        self.thumbs: dict[int, bytes] = {}
        self.crop_whole = HammingIndex(opts.crop_radius)  # id -> whole-thumbnail pHash
        self.crop_windows = HammingIndex(opts.crop_radius)  # 16 * id + k -> window k's pHash
        self.small: dict[int, bytes] = {}
        self.lsh = LSHIndex(bands, rows)
        self.shingles: dict[int, np.ndarray] = {}

    def match(self, f: Features) -> Decision:
        """The first duplicate rule that fires against the indexed records (no insertion)."""
        p, o = self.prefix, self.o
        if f.image is not None:
            w = self.content.get(f.image.content)
            if w is not None:
                return Decision(f"{p}_exact_image", w, 1.0)
            near = self._near_image(f.image)
            if near is not None:
                return Decision(f"{p}_near_image", near[0], near[1])
            crop = self._crop_image(f.image) if o.crop_radius > 0 else None
            if crop is not None:
                return Decision(f"{p}_near_image", crop[0], crop[1], detail=crop[2])
        w = self.captions.get(f.caption_key)
        if w is not None and self._text_counts():
            return Decision(f"{p}_exact_caption", w, 1.0)
        if self._text_counts():
            best = None
            for j in self.lsh.query(f.band_keys):
                s = jaccard(f.shingles, self.shingles[j])
                if s >= o.caption_threshold and (best is None or s > best[1]):
                    best = (j, s)
            if best is not None:
                return Decision(f"{p}_near_caption", best[0], best[1])
        return Decision()

    def _near_image(self, h: ImageHashes) -> tuple[int, float] | None:
        """(kept id, thumbnail correlation) of the best verified pHash/dHash candidate."""
        best = None
        for code in (h.phash, h.phash_mirror):
            for _, j in self.phash.query(code):
                dd = min((self.dhash[j] ^ d).bit_count() for d in (h.dhash, h.dhash_mirror))
                if dd > self.o.dhash_radius:
                    continue
                c = thumb_similarity(h.thumb, self.thumbs[j])
                if c >= self.o.thumb_min_corr and (best is None or c > best[1]):
                    best = (j, c)
        return best

    def _crop_image(self, h: ImageHashes) -> tuple[int, float, str] | None:
        """(kept id, grey correlation, which way) of the best verified crop match: a window of
        this picture is the kept one, or this picture is a window of the kept one."""
        best = None
        thr = self.o.crop_min_corr
        for k in range(1, len(h.crops)):  # this one is the larger picture
            for _, j in self.crop_whole.query(h.crops[k]):
                c = crop_similarity(h.small, self.small[j], k)
                if c >= thr and (best is None or c > best[1]):
                    best = (j, c, f"kept record is window {k} of this one")
        for _, code in self.crop_windows.query(h.crops[0]) if h.crops else ():
            j, k = divmod(code, 16)  # this one is a window of the kept picture
            c = crop_similarity(self.small[j], h.small, k)
            if c >= thr and (best is None or c > best[1]):
                best = (j, c, f"this record is window {k} of the kept one")
        return best

    def _text_counts(self) -> bool:
        return self.prefix == "leak" or self.o.caption_dups == "drop"

    def insert(self, f: Features) -> None:
        if f.image is not None:
            self.content.setdefault(f.image.content, f.index)
            self.phash.insert(f.index, f.image.phash)
            self.dhash[f.index] = f.image.dhash
            self.thumbs[f.index] = f.image.thumb
            if self.o.crop_radius > 0 and f.image.crops:
                self.crop_whole.insert(f.index, f.image.crops[0])
                for k in range(1, len(f.image.crops)):
                    self.crop_windows.insert(16 * f.index + k, f.image.crops[k])
                self.small[f.index] = f.image.small
        self.captions.setdefault(f.caption_key, f.index)
        self.lsh.insert(f.index, f.band_keys)
        self.shingles[f.index] = f.shingles


class EvalSets:
    """The --against files: a Bloom filter of their caption n-grams, exact n-gram set for
    verification, normalised captions, and a Decider (prefix 'leak') over their records."""

    def __init__(self, paths: list[Path], opts: CurateOptions, bands: int, rows: int) -> None:
        self.paths = paths
        grams: dict[str, int] = {}  # n-gram -> the first eval record holding it
        row = 0
        for path in paths:
            for _, _, rec in iter_lines(path):
                for t in rec["text"]:
                    toks = words(t) if isinstance(t, str) else []
                    for i in range(len(toks) - opts.leak_n + 1):
                        grams.setdefault(" ".join(toks[i : i + opts.leak_n]), row)
                row += 1
        self.grams = grams
        self.bloom = BloomFilter(max(1, len(grams)), opts.bloom_fp_rate, opts.seed)
        self.bloom.update(sorted(grams))
        self.decider = Decider(opts, bands, rows, prefix="leak")
        self.normalized: dict[str, int] = {}
        self.ids: list[str] = []  # decider key -> "file:record id"
        for path in paths:
            base = len(self.ids)
            self.ids += [f"{path.name}:{rec['id']}" for _, _, rec in iter_lines(path)]
            for f in iter_features(_items(path), settings(path, opts, None), opts.workers):
                f.index += base
                self.decider.insert(f)
                for t in f.normalized:
                    self.normalized.setdefault(t, f.index)

    def match(self, f: Features) -> Decision:
        verified = [g for g in f.bloom_hits if g in self.grams]  # exact check of every hit
        if verified:
            gram = verified[0]
            return Decision("leak_caption_ngram", self.grams[gram], 1.0, "eval", detail=gram)
        for t in f.normalized:
            if t in self.normalized:
                return Decision("leak_caption_exact", self.normalized[t], 1.0, "eval")
        d = self.decider.match(f)
        d.witness_source = "eval"
        return d

    def measured_fp_rate(self, n_probe: int = 20_000, seed: int = 12345) -> float:
        """Share of random strings that are certainly not members yet hit the filter."""
        probes = [f"\x00probe {seed} {i}" for i in range(n_probe)]
        return sum(p in self.bloom for p in probes) / n_probe
