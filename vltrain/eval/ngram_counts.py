"""Fast word ids and BLEU clipped n-gram matches for :mod:`vltrain.eval.caption_metrics`.

:func:`word_ids` turns sentences into integer word ids without a Python-level loop over tokens
when the text is ASCII (bytes, whitespace table, 8-byte packed words, one ``np.unique``), and
:func:`clipped_matches` counts BLEU's clipped matches of every order with one ``np.sort`` of
the whole corpus: each token start becomes an int64 key (image, w1..wn, sentence role), so the
sorted keys group every k-gram of an image for all k at once, candidate and references alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

_SEP = "\x00\x01\x02"  # joins sentences for one fast split(); contains no whitespace
_INT64_LIMIT = 2**63 - 1  # (image, n-gram, role) keys must stay below this to pack into int64
_MAX_CELLS = 2**26  # cap on the (roles x k-gram groups) count table; above it: None (fallback)
# what str.split() treats as whitespace among ASCII bytes, plus NUL (our sentence separator)
_WS = np.zeros(256, dtype=bool)
_WS[[0, 9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True


def split_word_ids(sentences: Sequence[str]) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Whitespace-split all sentences: (lengths (S,), words, word id of every token (T,)).

    Word ids follow first appearance, so ``words[i]`` is the word with id ``i``.
    """
    try:
        flat = f" {_SEP} ".join(sentences).split()  # one C-level split instead of S of them
    except TypeError:
        bad = next(x for x in sentences if not isinstance(x, str))
        raise TypeError(
            f"captions must be str (tokenized, space-separated); got {type(bad).__name__} {bad!r}"
        ) from None
    w2i: dict[str, int] = dict.fromkeys(flat, 0)
    for i, w in enumerate(w2i):  # ids in order of first appearance
        w2i[w] = i
    words = list(w2i)
    ids = np.fromiter(map(w2i.__getitem__, flat), dtype=np.int64, count=len(flat))  # (T + S-1,)
    sep_id = w2i.get(_SEP, -1)
    is_sep = ids == sep_id
    if int(is_sep.sum()) != max(len(sentences) - 1, 0):
        # a caption holds the separator token itself: split sentence by sentence instead
        toks = [s.split() for s in sentences]
        lengths = np.fromiter(map(len, toks), dtype=np.int64, count=len(toks))
        flat = list(chain.from_iterable(toks))
        words = list(dict.fromkeys(flat))
        w2i = dict(zip(words, range(len(words)), strict=True))
        return lengths, words, np.fromiter(map(w2i.__getitem__, flat), np.int64, len(flat))
    edges = np.concatenate([[-1], np.flatnonzero(is_sep), [len(ids)]])
    lengths = np.diff(edges) - 1  # (S,)
    if sep_id >= 0:
        words.pop(sep_id)
        ids = ids[~is_sep]
        ids[ids > sep_id] -= 1
    return lengths[: len(sentences)], words, ids


def word_ids(sentences: Sequence[str]) -> tuple[np.ndarray, int, np.ndarray]:
    """Like :func:`split_word_ids` but returns the vocabulary size instead of the words.

    ASCII text without NUL bytes is split with numpy on its bytes: words of at most 8 bytes are
    packed into one uint64 (zero-padded; no word holds a zero byte) and numbered by
    ``np.unique``, longer words by a dict. Ids are then in no particular order. Any other text
    goes through :func:`split_word_ids`; both give the tokens ``str.split()`` gives.
    """
    try:
        joined = "\x00".join(sentences)
        fast = bool(sentences) and joined.isascii() and joined.count("\x00") == len(sentences) - 1
    except TypeError:
        fast = False  # split_word_ids raises its readable error
    if not fast:
        lengths, words, ids = split_word_ids(sentences)
        return lengths, len(words), ids
    b = np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
    edge = np.diff((~_WS[b]).view(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)  # (T,) token spans
    cut = np.searchsorted(starts, np.flatnonzero(b == 0))  # tokens before each separator
    lengths = np.diff(np.concatenate([[0], cut, [len(starts)]]))  # (S,)
    size = ends - starts  # (T,) bytes per token
    # an unaligned uint64 view starting at every byte: one gather reads 8 bytes per token
    padded = np.concatenate([b, np.zeros(8, np.uint8)])
    every8 = np.ndarray((len(b),), dtype="<u8", buffer=padded, strides=(1,))
    bits = np.minimum(size, 7).astype(np.uint64) * np.uint64(8)
    mask = np.where(size >= 8, np.uint64(2**64 - 1), (np.uint64(1) << bits) - np.uint64(1))
    packed = every8[starts] & mask  # (T,) exact key of every token of <= 8 bytes
    ids = np.empty(len(starts), dtype=np.int64)
    short = size <= 8
    uniq, ids[short] = np.unique(packed[short], return_inverse=True)
    long_at = np.flatnonzero(~short)
    if len(long_at) == 0:
        return lengths, len(uniq), ids
    longs = [
        joined[s:e] for s, e in zip(starts[long_at].tolist(), ends[long_at].tolist(), strict=True)
    ]
    w2i = {w: i for i, w in enumerate(dict.fromkeys(longs), start=len(uniq))}
    ids[long_at] = np.fromiter(map(w2i.__getitem__, longs), dtype=np.int64, count=len(longs))
    return lengths, len(uniq) + len(w2i), ids


def _starts(x: np.ndarray) -> np.ndarray:
    """Indices where a sorted array's value changes (run starts), 0 included; (runs,)."""
    new = np.empty(len(x), dtype=bool)
    new[:1] = True
    np.not_equal(x[1:], x[:-1], out=new[1:])
    return np.flatnonzero(new)


def clipped_matches(
    lengths: np.ndarray, ids: np.ndarray, n_words: int, ref_img: np.ndarray, n: int
) -> np.ndarray | None:
    """BLEU's clipped matches of orders 1..n per image, (N, n); None if keys would overflow.

    Sentences are the N candidates, then the references grouped by image (``ref_img`` (R,),
    non-decreasing). A candidate k-gram counts ``min(its count, max count in one reference)``.

    Every token start gets the key (image, c1..cn, role), ``c_i`` = word code (0 past the
    sentence end), role 0 for the candidate, 1.. for its references. After one sort, the
    k-grams of an image are runs of equal key prefix for every k, and per-role counts of any
    run are differences of one cumulative (role x group) table.
    """
    n_img, n_tok = len(lengths) - len(ref_img), len(ids)
    if n_tok == 0:
        return np.zeros((n_img, n), dtype=np.int64)
    n_refs = np.bincount(ref_img, minlength=n_img)
    roles = int(n_refs.max(initial=0)) + 1
    first = np.cumsum(n_refs) - n_refs  # (N,) each image's first reference
    img_s = np.concatenate([np.arange(n_img), ref_img])  # (S,)
    role_s = np.concatenate([np.zeros(n_img, np.int64), np.arange(len(ref_img)) - first[ref_img]])
    role_s[n_img:] += 1
    sent_tok = np.repeat(np.arange(len(lengths)), lengths)  # (T,)
    img_tok = img_s[sent_tok]
    codes, base = ids + 1, n_words + 1
    if n_img * roles * base**n > _INT64_LIMIT:  # renumber words per image: codes stay small
        uniq, inv = np.unique(img_tok * n_words + ids, return_inverse=True)
        first_id = np.searchsorted(uniq, np.arange(n_img) * n_words)  # (N,)
        codes = inv - first_id[img_tok] + 1
        base = int(codes.max()) + 1
        if n_img * roles * base**n > _INT64_LIMIT:
            return None
    # codes with n-1 zeros after each sentence, so c_k of a token start is a shifted slice
    at = np.arange(n_tok) + np.repeat(np.arange(len(lengths)) * (n - 1), lengths)  # (T,)
    size = n_tok + len(lengths) * (n - 1)
    pad = np.zeros(size + n, dtype=np.int64)
    pad[at] = codes
    key = pad[:size].copy()
    for k in range(1, n):
        key *= base
        key += pad[k : size + k]
    key = (key[at] + img_tok * base**n) * roles + role_s[sent_tok]
    key.sort()
    run = _starts(key)  # one run per (image, n-gram, role)
    value = key[run]
    group = value // roles  # (image, n-gram) of each run
    run_group = np.cumsum(np.r_[True, group[1:] != group[:-1]]) - 1
    gkey = group[_starts(group)]  # (G,)
    if roles * (len(gkey) + 1) > _MAX_CELLS:
        return None
    cum = np.zeros((roles, len(gkey) + 1), dtype=np.int64)  # cum[r, g]: role-r count before g
    flat = (value - group * roles) * len(cum[0]) + run_group + 1
    cum.ravel()[flat] = np.diff(np.r_[run, n_tok])
    np.cumsum(cum, axis=1, out=cum)
    correct = np.zeros((n_img, n), dtype=np.int64)
    lo = np.arange(len(gkey))  # first order-n group of each current k-gram group
    for k in range(n, 0, -1):
        if k < n:
            gkey = gkey // base
            keep = _starts(gkey)
            gkey, lo = gkey[keep], lo[keep]
        hi = np.r_[lo[1:], len(cum[0]) - 1]
        cand = cum[0].take(hi) - cum[0].take(lo)
        sel = np.flatnonzero((cand > 0) & (gkey % base != 0))  # candidate has this k-gram
        a, b = lo.take(sel), hi.take(sel)
        clipped = np.zeros(len(sel), dtype=np.int64)  # becomes max count over the references
        for r in range(1, roles):
            np.maximum(clipped, cum[r].take(b) - cum[r].take(a), out=clipped)
        np.minimum(clipped, cand.take(sel), out=clipped)
        correct[:, k - 1] = np.bincount(gkey[sel] // base**k, clipped, minlength=n_img)
    return correct
