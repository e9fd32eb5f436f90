"""Caption normalisation, word n-grams and seeded, process-independent 64-bit hashes.

Python's `hash()` of a str is salted per process (PYTHONHASHSEED), so nothing here uses it:
words are hashed with keyed BLAKE2b and n-grams are combined from word hashes with fixed
64-bit arithmetic, so a hash written by one process means the same in every other.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Sequence

import numpy as np

_WORD = re.compile(r"\w+", re.UNICODE)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_C1, _C2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_ROLL = np.uint64(0x100000001B3)  # odd multiplier combining word hashes into an n-gram hash


def normalize(text: str) -> str:
    """NFKC, case-folded, punctuation dropped, whitespace collapsed: 'A  Dog!' -> 'a dog'."""
    return " ".join(words(text))


def words(text: str) -> list[str]:
    """The caption's word tokens after NFKC and case folding (punctuation is not a word)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def key_bytes(seed: int) -> bytes:
    """The BLAKE2b key for a seed (8 little-endian bytes)."""
    return int(seed).to_bytes(8, "little", signed=False)


def hash64(data: bytes, seed: int = 0) -> int:
    """Keyed BLAKE2b-64 of `data`: the same value in every process and on every machine."""
    return int.from_bytes(
        hashlib.blake2b(data, digest_size=8, key=key_bytes(seed)).digest(), "little"
    )


def fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, a bijection on uint64 (vectorised, wraps mod 2**64)."""
    x = x ^ (x >> np.uint64(33))
    x = x * _C1
    x = x ^ (x >> np.uint64(33))
    x = x * _C2
    return x ^ (x >> np.uint64(33))


class NgramHasher:
    """Word n-gram hashes of captions, caching the hash of each word it has seen."""

    def __init__(self, n: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError(f"n-gram size must be >= 1, got {n}")
        self.n, self.seed = n, seed
        self._key = key_bytes(seed)
        self._cache: dict[str, int] = {}

    def word_hashes(self, toks: Sequence[str]) -> np.ndarray:
        """(W,) uint64 hash of each word."""
        cache, key = self._cache, self._key
        out = np.empty(len(toks), dtype=np.uint64)
        for i, w in enumerate(toks):
            h = cache.get(w)
            if h is None:
                d = hashlib.blake2b(w.encode("utf-8", "surrogatepass"), digest_size=8, key=key)
                h = cache[w] = int.from_bytes(d.digest(), "little")
            out[i] = h
        return out

    def ngrams(self, toks: Sequence[str], n: int | None = None) -> np.ndarray:
        """(G,) uint64 hashes of the word n-grams (one n-gram of all words if fewer than n)."""
        n = n or self.n
        wh = self.word_hashes(toks)
        if len(wh) == 0:
            return wh
        n = min(n, len(wh))
        g = len(wh) - n + 1
        h = np.zeros(g, dtype=np.uint64)
        for j in range(n):  # polynomial combine, position-sensitive: "a b" != "b a"
            h = h * _ROLL + fmix64(wh[j : j + g] + np.uint64(j + 1))
        return fmix64(h ^ np.uint64(n))

    def shingles(self, text: str) -> np.ndarray:
        """Sorted unique n-gram hashes of one caption (the set whose Jaccard MinHash estimates)."""
        return np.unique(self.ngrams(words(text)))


def caption_key(texts: Sequence[str], seed: int = 0) -> int:
    """Hash of a record's normalised captions (order kept): the exact-caption duplicate key."""
    joined = "\x1f".join(normalize(t) for t in texts)
    return hash64(joined.encode("utf-8", "surrogatepass"), seed)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted unique uint64 arrays (two empty sets: 1.0)."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)
