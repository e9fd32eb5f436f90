"""Per-record features computed in worker processes: image hashes, caption keys and signatures.

`iter_features(items, settings, workers)` yields features in input order whatever the worker
count, keeping at most a few chunks in flight (bounded memory on any input size).
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vltrain.curation.bloom import BloomFilter
from vltrain.curation.decode import decode_rgb
from vltrain.curation.hashing import ImageHashes, image_hashes
from vltrain.curation.minhash import MinHasher, band_keys
from vltrain.curation.text import NgramHasher, normalized_key, words_batch
from vltrain.data.images import BadSample
from vltrain.data.readers import resolve_image_path

_CHUNK = 64


@dataclass(frozen=True)
class FeatureSettings:
    """What the workers compute (picklable; the Bloom filter is the eval set's, or None)."""

    root: str
    seed: int
    shingle_n: int
    num_perm: int
    leak_n: int
    bands: int
    rows: int
    bloom: BloomFilter | None = None


@dataclass
class Features:
    """One record's features (`image` is None when the image could not be decoded)."""

    index: int
    image: ImageHashes | None
    bad: str | None
    caption_key: int
    shingles: np.ndarray
    signature: np.ndarray
    band_keys: np.ndarray
    """(bands,) LSH band keys of the signature"""
    first_caption: str
    normalized: tuple[str, ...]
    bloom_hits: tuple[str, ...]


class _Worker:
    def __init__(self, s: FeatureSettings) -> None:
        self.s = s
        self.ngrams = NgramHasher(s.shingle_n, s.seed)
        self.minhash = MinHasher(s.num_perm, s.seed + 1)

    def chunk(self, items: list[tuple[int, str, list]]) -> list[Features]:
        images = [self._image(rel) for _, rel, _ in items]
        texts = [[t for t in caps if isinstance(t, str)] for _, _, caps in items]
        toks = words_batch([t for caps in texts for t in caps])  # one pass over the chunk
        docs, k = [], 0
        for caps in texts:
            docs.append(toks[k : k + len(caps)])
            k += len(caps)
        flat, offsets = self.ngrams.shingle_sets(docs)  # all captions of the chunk at once
        sigs = self.minhash.signatures_flat(flat, offsets)  # (N, P)
        keys = band_keys(sigs, self.s.bands, self.s.rows)  # (N, bands)
        out = []
        for i, ((index, _, _), (hashes, bad), caps, doc) in enumerate(
            zip(items, images, texts, docs, strict=True)
        ):
            norm = {t: " ".join(w) for t, w in zip(caps, doc, strict=True)}
            out.append(
                Features(
                    index,
                    hashes,
                    bad,
                    normalized_key([norm[t] for t in sorted(caps)], self.s.seed),
                    flat[offsets[i] : offsets[i + 1]].copy(),
                    sigs[i],
                    keys[i],
                    caps[0] if caps else "",
                    tuple(norm[t] for t in caps),
                    self._bloom_hits(doc),
                )
            )
        return out

    def _image(self, rel: str) -> tuple[ImageHashes | None, str | None]:
        try:
            img = decode_rgb(resolve_image_path(Path(self.s.root) / "x", rel))
            return image_hashes(img.image, self.s.seed, img.pixels), None
        except BadSample as e:
            return None, e.reason

    def _bloom_hits(self, doc: list[list[str]]) -> tuple[str, ...]:
        if self.s.bloom is None:
            return ()
        n, hits = self.s.leak_n, []
        for toks in doc:
            for i in range(len(toks) - n + 1):
                gram = " ".join(toks[i : i + n])
                if gram in self.s.bloom:
                    hits.append(gram)
        return tuple(hits)


_WORKER: _Worker | None = None


def _init(s: FeatureSettings) -> None:
    global _WORKER
    _WORKER = _Worker(s)


def _run(items: list[tuple[int, str, list]]) -> list[Features]:
    assert _WORKER is not None
    return _WORKER.chunk(items)


def _chunks(items: Iterable[tuple[int, str, list]]) -> Iterator[list[tuple[int, str, list]]]:
    buf: list[tuple[int, str, list]] = []
    for item in items:
        buf.append(item)
        if len(buf) == _CHUNK:
            yield buf
            buf = []
    if buf:
        yield buf


def iter_features(
    items: Iterable[tuple[int, str, list]], s: FeatureSettings, workers: int = 1
) -> Iterator[Features]:
    """Features of (index, image path relative to s.root, captions) items, in input order."""
    if workers <= 1:
        w = _Worker(s)
        for chunk in _chunks(items):
            yield from w.chunk(chunk)
        return
    ctx = multiprocessing.get_context("spawn")  # no inherited torch/BLAS thread state
    with ctx.Pool(workers, initializer=_init, initargs=(s,)) as pool:
        pending: deque = deque()
        for chunk in _chunks(items):
            pending.append(pool.apply_async(_run, (chunk,)))
            if len(pending) >= 2 * workers:  # bounded: a few chunks in flight
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
