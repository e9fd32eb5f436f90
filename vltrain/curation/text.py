"""Caption normalisation, word n-grams and seeded, process-independent 64-bit hashes.

Python's `hash()` of a str is salted per process (PYTHONHASHSEED), so nothing here uses it:
words are hashed with keyed BLAKE2b and n-grams are combined from word hashes with fixed
64-bit arithmetic, so a hash written by one process means the same in every other.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np

# scripts written without spaces between words: each character (with its marks) is a word of
# its own (Han, kana, Thai, Lao, Khmer, Myanmar), so a Chinese caption is not one "word" (every
# one was caption_short) and its n-grams are of characters
_UNSPACED = (
    "\u0e00-\u0e7f\u0e80-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf"
    "\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
)
_MARKS = (  # the combining vowel and tone marks of those scripts stay with their letter
    "\u0e31\u0e34-\u0e3a\u0e47-\u0e4e\u0eb1\u0eb4-\u0ebc\u0ec8-\u0ecd\u102b-\u103e"
    "\u1056-\u1059\u105e-\u1060\u1062-\u1064\u1067-\u106d\u1071-\u1074\u1082-\u108d"
    "\u17b4-\u17d3"
)
_WORD = re.compile(f"[{_UNSPACED}][{_MARKS}]*|[^\\W{_UNSPACED}]+", re.UNICODE)
_SEP = "\x1e"  # record separator: not a word character
_ASCII_NONWORD = {  # every ASCII non-word character but the separator -> a space
    c: " " for c in range(128) if not (chr(c).isalnum() or chr(c) == "_" or chr(c) == _SEP)
}
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_C1, _C2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_ROLL = np.uint64(0x100000001B3)  # odd multiplier combining word hashes into an n-gram hash
_CACHE_MAX = 1_000_000  # word hashes cached per hasher


def normalize(text: str) -> str:
    """NFKC, case-folded, punctuation dropped, whitespace collapsed: 'A  Dog!' -> 'a dog'."""
    return " ".join(words(text))


def words(text: str) -> list[str]:
    """The caption's word tokens after NFKC and case folding (punctuation is not a word)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def words_batch(texts: Sequence[str]) -> list[list[str]]:
    """`[words(t) for t in texts]` with one normalisation pass over the batch.

    NFKC and case folding act within a caption (the separator, a control character, neither
    composes nor folds), so joining first gives the same tokens; a caption that contains the
    separator itself takes the one-by-one path. ASCII batches skip the regex: word runs are
    what `split()` leaves once every non-word character is a space.
    """
    joined = _SEP.join(texts)
    if joined.count(_SEP) != max(len(texts) - 1, 0):
        return [words(t) for t in texts]
    if not texts:
        return []
    if joined.isascii():  # NFKC is the identity and casefold is lower(); \w is [A-Za-z0-9_]
        return [x.split() for x in joined.lower().translate(_ASCII_NONWORD).split(_SEP)]
    findall = _WORD.findall
    return [findall(x) for x in unicodedata.normalize("NFKC", joined).casefold().split(_SEP)]


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


class _Vocab(dict):
    """word -> row of a hash table; a word not seen before takes the next row and waits in
    `new` to be hashed (so a lookup of a known word is one C-level dict access)."""

    def __init__(self) -> None:
        super().__init__()
        self.new: list[str] = []

    def __missing__(self, word: str) -> int:
        row = self[word] = len(self)
        self.new.append(word)
        return row


class NgramHasher:
    """Word n-gram hashes of captions, caching the hash of each word it has seen."""

    def __init__(self, n: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError(f"n-gram size must be >= 1, got {n}")
        self.n, self.seed = n, seed
        self._key = key_bytes(seed)
        self._vocab = _Vocab()
        self._table = np.zeros(0, dtype=np.uint64)  # (V,) hash of each vocabulary row

    def word_hashes(self, toks: Iterable[str], count: int | None = None) -> np.ndarray:
        """(W,) uint64 hash of each word (each distinct word is hashed once per hasher);
        `count` = the number of words, needed when `toks` is an iterator."""
        if len(self._vocab) > _CACHE_MAX:  # bounded memory on an open vocabulary
            self._vocab, self._table = _Vocab(), np.zeros(0, dtype=np.uint64)
        vocab = self._vocab
        count = len(toks) if count is None else count  # type: ignore[arg-type]
        rows = np.fromiter(map(vocab.__getitem__, toks), dtype=np.int64, count=count)
        if vocab.new:
            key, blake = self._key, hashlib.blake2b
            new = np.fromiter(
                (
                    int.from_bytes(blake(w.encode("utf-8", "surrogatepass"), digest_size=8,
                                         key=key).digest(), "little")
                    for w in vocab.new
                ),
                dtype=np.uint64,
                count=len(vocab.new),
            )  # fmt: skip
            self._table = np.concatenate([self._table, new])
            vocab.new.clear()
        return self._table[rows]

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

    def shingle_sets(
        self, docs: Sequence[Sequence[Sequence[str]]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The shingle set of many documents at once, each the union over its captions' tokens.

        `docs[d]` is a list of token lists (one per caption). Returns (flat, offsets): document
        d's sorted unique n-gram hashes are flat[offsets[d]:offsets[d + 1]], the same values as
        `np.unique(concat(ngrams(toks) for toks in docs[d]))`, computed in a few numpy passes
        over the whole batch instead of dozens of small calls per caption.
        """
        caps = list(chain.from_iterable(docs))
        cap_doc = np.repeat(np.arange(len(docs)), [len(doc) for doc in docs])  # (C,)
        lens = np.fromiter(map(len, caps), dtype=np.int64, count=len(caps))  # (C,)
        wh = self.word_hashes(chain.from_iterable(caps), int(lens.sum()))  # (T,)
        n_eff = np.minimum(lens, self.n)  # (C,) fewer words than n: one n-gram of all
        grams = np.where(lens > 0, lens - n_eff + 1, 0)  # (C,) n-grams per caption
        gram_cap = np.repeat(np.arange(len(caps)), grams)  # (G,)
        first = np.concatenate([[0], np.cumsum(grams)[:-1]]).astype(np.int64)  # (C,)
        tok0 = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)  # (C,)
        pos = tok0[gram_cap] + np.arange(len(gram_cap)) - first[gram_cap]  # (G,) first token
        ng = n_eff[gram_cap]  # (G,)
        h = np.zeros(len(pos), dtype=np.uint64)
        last = max(len(wh) - 1, 0)
        for j in range(self.n):  # the same polynomial combine as `ngrams`, masked per n-gram
            term = fmix64(wh[np.minimum(pos + j, last)] + np.uint64(j + 1)) if len(wh) else h
            h = np.where(j < ng, h * _ROLL + term, h)
        h = fmix64(h ^ ng.astype(np.uint64))
        doc = cap_doc[gram_cap]  # (G,) non-decreasing
        order = sort_within(doc, h)
        h, doc = h[order], doc[order]
        new = np.ones(len(h), dtype=bool)
        new[1:] = (h[1:] != h[:-1]) | (doc[1:] != doc[:-1])
        flat, doc = h[new], doc[new]
        offsets = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(np.bincount(doc, minlength=len(docs)), out=offsets[1:])
        return flat, offsets


def sort_within(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`np.lexsort((values, group))` for group ids in [0, 2**32): one argsort of the values,
    then two stable radix passes over 16-bit halves of the group ids (several times faster
    than lexsort, which compares 64-bit pairs)."""
    if len(group) and int(group.max()) >= 2**32:
        return np.lexsort((values, group))
    order = np.argsort(values)
    for shift in (0, 16):  # least significant half first: a radix sort over both halves
        half = ((group[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(half, kind="stable")]
    return order


def caption_key(texts: Sequence[str], seed: int = 0) -> int:
    """Hash of a record's normalised captions (order kept): the exact-caption duplicate key."""
    return normalized_key([normalize(t) for t in texts], seed)


def normalized_key(normalized: Sequence[str], seed: int = 0) -> int:
    """`caption_key` of captions that are already normalised."""
    return hash64("\x1f".join(normalized).encode("utf-8", "surrogatepass"), seed)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted unique uint64 arrays (two empty sets: 1.0)."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)
