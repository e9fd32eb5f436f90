"""Caption metrics: BLEU-1..n and CIDEr-D, numerically identical to pycocoevalcap, vectorised.

Inputs follow pycocoevalcap: ``gts`` maps an image id to its reference captions, ``res`` maps the
same ids to a one-element list holding the candidate; every caption is already tokenized
(space-separated, see :func:`vltrain.eval.ptb_tokenize.ptb_tokenize`).

All n-grams of a call are interned to integer ids once (one id space per order, each k-gram
id built from its (k-1)-gram prefix id and its last word), then counting, clipping and tf-idf
cosines are numpy array operations instead of per-n-gram Python dictionaries.

pycocoevalcap's ``Cider`` *is* CIDEr-D (gaussian length penalty with sigma=6, clipped tf-idf,
scores x10), so :class:`CiderD` is also exported as ``Cider``. Its quirks are reproduced on
purpose: the "length" in the penalty is the number of bigrams (``max(len - 1, 0)``), idf uses
``log(max(1, df))``, and ``ref_len = log(number of reference images)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from vltrain.eval.ngram_counts import clipped_matches, split_word_ids, word_ids
from vltrain.eval.ptb_tokenize import ptb_tokenize

__all__ = ["Bleu", "Cider", "CiderD", "ptb_tokenize", "sentence_bleu"]

_TINY = 1e-15  # pycocoevalcap's numerator epsilon: a zero match count still gives ~0, not 0
_SMALL = 1e-9  # pycocoevalcap's denominator epsilon: avoids 0 / 0
_BLEU_OPTIONS = ("closest", "shortest", "average")


_PACK_LIMIT = 2**62  # (key, position) pairs pack into one int64 below this; else lexsort


@dataclass
class _Ngrams:
    """N-grams of S sentences, interned: one integer id space per order k = 1..n.

    ``gram[k-1]``, ``sent[k-1]``, ``count[k-1]`` list every distinct (k-gram, sentence) pair,
    sorted by gram id then sentence. Gram ids follow the sorted order of their keys
    ``prefix * n_words + last``, where ``prefix[k-1]`` / ``last[k-1]`` give, for each distinct
    k-gram (k >= 2), the id of its (k-1)-gram prefix and of its last word.
    """

    lengths: np.ndarray  # (S,) tokens per sentence
    words: list[str]  # word id -> word
    gram: list[np.ndarray]  # per order: (E_k,)
    sent: list[np.ndarray]  # per order: (E_k,)
    count: list[np.ndarray]  # per order: (E_k,)
    n_grams: list[int]  # per order: number of distinct k-grams G_k
    prefix: list[np.ndarray]  # per order: (G_k,)
    last: list[np.ndarray]  # per order: (G_k,)


def _intern(sentences: Sequence[str], n: int) -> _Ngrams:
    """Split sentences on whitespace and intern their 1..n-grams (see :class:`_Ngrams`)."""
    lengths, words, ids = split_word_ids(sentences)
    n_words, n_tok = max(len(words), 1), len(ids)
    sent_of_tok = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)  # (T,)
    # tokens from position i to the end of its sentence, i included
    left = np.cumsum(lengths)[sent_of_tok] - np.arange(n_tok, dtype=np.int64)  # (T,)
    out = _Ngrams(lengths, words, [], [], [], [], [], [])
    pos = np.arange(n_tok, dtype=np.int64)  # start positions of the current order's n-grams
    key = ids  # (P,) k-gram key at each start position: prefix id * n_words + last word id
    gram_at = ids  # (T,) dense (k-1)-gram id at each start position
    for k in range(1, n + 1):
        if k > 1:
            keep = left[pos] >= k
            pos = pos[keep]
            key = gram_at[pos] * n_words + ids[pos + k - 1]
        # sort by (key, position); positions ascend within a key, so do sentences
        if len(key) == 0 or (int(key.max()) + 1) * (n_tok + 1) < _PACK_LIMIT:
            packed = np.sort(key * n_tok + pos)
            key_s, pos_s = packed // max(n_tok, 1), packed % max(n_tok, 1)
        else:  # keys too large to pack with the position into one int64
            order = np.lexsort((pos, key))
            key_s, pos_s = key[order], pos[order]
        new_gram = np.r_[True, key_s[1:] != key_s[:-1]] if len(key_s) else key_s > 0
        gid = np.cumsum(new_gram) - 1  # (P,) dense k-gram id, in sorted key order
        gram_at = np.empty(n_tok, dtype=np.int64)
        gram_at[pos_s] = gid
        sent_s = sent_of_tok[pos_s]
        new_pair = new_gram.copy()
        new_pair[1:] |= sent_s[1:] != sent_s[:-1]
        starts = np.flatnonzero(new_pair)
        out.gram.append(gid[starts])
        out.sent.append(sent_s[starts])
        out.count.append(np.diff(np.r_[starts, len(pos_s)]))
        ukey = key_s[new_gram]  # (G_k,)
        out.n_grams.append(len(ukey))
        out.prefix.append(ukey // n_words if k > 1 else np.zeros(0, dtype=np.int64))
        out.last.append(ukey % n_words)
    return out


def _gather(
    gts: Mapping[Any, Sequence[str]], res: Mapping[Any, Sequence[str]]
) -> tuple[list[str], list[Sequence[str]]]:
    """Candidates and reference lists in ``gts`` key order, checked where pycocoevalcap asserts."""
    if gts.keys() != res.keys():
        missing = [k for k in gts if k not in res][:5]
        extra = [k for k in res if k not in gts][:5]
        raise ValueError(
            f"gts and res must have the same image ids; ids only in gts (first 5): {missing}, "
            f"only in res (first 5): {extra}. Score a candidate for every reference image."
        )
    keys = list(gts)
    hyps, refs_list = [res[k] for k in keys], [gts[k] for k in keys]
    if not (set(map(type, hyps)) <= {list} and set(map(len, hyps)) <= {1}):  # C-level loops
        key = next(k for k, h in zip(keys, hyps, strict=True) if type(h) is not list or len(h) != 1)
        raise ValueError(
            f"res[{key!r}] must be a list holding exactly one caption string, got {res[key]!r}"
        )
    if not (set(map(type, refs_list)) <= {list} and all(refs_list)):
        key = next(k for k, r in zip(keys, refs_list, strict=True) if type(r) is not list or not r)
        raise ValueError(
            f"gts[{key!r}] must be a non-empty list of caption strings, got {gts[key]!r}"
        )
    return [h[0] for h in hyps], refs_list


def _flatten(
    cands: Sequence[str], refs_list: Sequence[Sequence[str]]
) -> tuple[list[str], np.ndarray]:
    """Candidates first, then all references; returns (sentences, image index of each ref)."""
    if len(cands) != len(refs_list):
        raise ValueError(
            f"got {len(cands)} candidates but {len(refs_list)} reference lists; "
            "pass one list of references per candidate"
        )
    n_refs = np.fromiter(map(len, refs_list), dtype=np.int64, count=len(refs_list))
    if len(n_refs) and n_refs.min() == 0:
        bad = int(np.argmin(n_refs))
        raise ValueError(f"refs_list[{bad}] is empty; every candidate needs >= 1 reference")
    sentences = list(cands) + list(chain.from_iterable(refs_list))
    ref_img = np.repeat(np.arange(len(cands), dtype=np.int64), n_refs)  # (R,)
    return sentences, ref_img


# ----------------------------------------------------------------------------------------- BLEU


_Parts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _split_entries(ng: _Ngrams, k: int, n_img: int, ref_img: np.ndarray) -> _Parts:
    """Order-(k+1) entries as candidate / reference parts, each keyed by gram * N + image.

    Both key arrays come out sorted (entries are sorted by gram then sentence, and references
    are stored image after image), so matching is a searchsorted, never a sort. Returns
    (is_cand (E,), cand key (E_c,), cand image (E_c,), ref key (E_r,), ref index (E_r,)).
    """
    gram, sent = ng.gram[k], ng.sent[k]
    is_c = sent < n_img  # candidates are sentences [0, n_img), references follow
    r_sent = sent[~is_c] - n_img
    ckey = gram[is_c] * n_img + sent[is_c]
    rkey = gram[~is_c] * n_img + ref_img[r_sent]
    return is_c, ckey, sent[is_c], rkey, r_sent


def _interned_matches(ng: _Ngrams, n_img: int, ref_img: np.ndarray, n: int) -> np.ndarray:
    """Clipped matches per image and order, (N, n), from interned n-grams (general path)."""
    correct = np.zeros((n_img, n), dtype=np.int64)
    for k in range(n):
        is_c, ckey, c_img, rkey, _ = _split_entries(ng, k, n_img, ref_img)
        if len(rkey) == 0:  # no reference has a k-gram: nothing can match
            continue
        run = np.flatnonzero(np.r_[True, rkey[1:] != rkey[:-1]])  # one run per (gram, image)
        rmax = np.maximum.reduceat(ng.count[k][~is_c], run)  # max count over the references
        rkey = rkey[run]
        idx = np.minimum(np.searchsorted(rkey, ckey), len(rkey) - 1)
        clipped = np.where(rkey[idx] == ckey, np.minimum(ng.count[k][is_c], rmax[idx]), 0)
        correct[:, k] = np.bincount(c_img, clipped, minlength=n_img)
    return correct


def _bleu_stats(
    sentences: list[str], n_img: int, ref_img: np.ndarray, n: int, option: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per image: clipped matches (N, n), guesses (N, n), test length (N,), ref length (N,).

    Matches come from :func:`clipped_matches` (one sort of the corpus) unless its int64 keys
    would overflow (huge vocabulary per image or large ``n``); then from :func:`_intern`.
    """
    lengths, n_words, ids = word_ids(sentences)
    correct = clipped_matches(lengths, ids, n_words, ref_img, n)
    if correct is None:
        correct = _interned_matches(_intern(sentences, n), n_img, ref_img, n)
    test_len = lengths[:n_img]  # (N,)
    ref_len_all = lengths[n_img:]  # (R,)
    guess = np.maximum(0, test_len[:, None] - np.arange(n)[None, :])  # (N, n)
    n_refs = np.bincount(ref_img, minlength=n_img)
    first = np.cumsum(n_refs) - n_refs  # (N,) each image's first reference (refs are grouped)
    if option == "closest":
        # pycocoevalcap: min over (|l - testlen|, l), so ties go to the shorter reference
        big = int(ref_len_all.max(initial=0)) + 1
        key = np.abs(ref_len_all - test_len[ref_img]) * big + ref_len_all  # (R,)
        reflen = (np.minimum.reduceat(key, first) % big).astype(np.float64)
    elif option == "shortest":
        reflen = np.minimum.reduceat(ref_len_all, first).astype(np.float64)
    else:
        reflen = np.bincount(ref_img, ref_len_all, minlength=n_img) / n_refs
    return correct, guess, test_len, reflen


def _bleu_per_item(
    correct: np.ndarray, guess: np.ndarray, test_len: np.ndarray, reflen: np.ndarray
) -> np.ndarray:
    """pycocoevalcap's per-image BLEU-1..n, (n, N), same float operations in the same order."""
    n = correct.shape[1]
    out = np.empty((n, correct.shape[0]))
    bleu = np.ones(correct.shape[0])
    for k in range(n):
        bleu = bleu * ((correct[:, k] + _TINY) / (guess[:, k] + _SMALL))
        out[k] = bleu ** (1.0 / (k + 1))
    ratio = (test_len + _TINY) / (reflen + _SMALL)  # (N,)
    with np.errstate(divide="ignore", over="ignore"):
        penalty = np.where(ratio < 1, np.exp(1 - 1 / ratio), 1.0)
    return out * penalty[None, :]


class Bleu:
    """BLEU-1..n with pycocoevalcap's interface and results (``Bleu(4).compute_score``).

    ``option`` picks the effective reference length for the brevity penalty: ``"closest"``
    (what pycocoevalcap's ``Bleu`` uses), ``"shortest"`` or ``"average"``.
    """

    def __init__(self, n: int = 4, option: str = "closest") -> None:
        if n < 1:
            raise ValueError(f"Bleu n must be >= 1 (highest n-gram order), got {n}")
        if option not in _BLEU_OPTIONS:
            raise ValueError(f"Bleu option must be one of {_BLEU_OPTIONS}, got {option!r}")
        self._n = n
        self._option = option

    def compute_score(
        self, gts: Mapping[Any, list[str]], res: Mapping[Any, list[str]], verbose: int = 0
    ) -> tuple[list[float], list[list[float]]]:
        """Corpus BLEU-1..n and per-image BLEU-1..n (lists, in ``gts`` key order).

        ``verbose`` exists for signature compatibility with pycocoevalcap and prints nothing.
        """
        cands, refs_list = _gather(gts, res)
        if not cands:
            raise ValueError("Bleu.compute_score got no images; gts and res are empty")
        sentences, ref_img = _flatten(cands, refs_list)
        correct, guess, test_len, reflen = _bleu_stats(
            sentences, len(cands), ref_img, self._n, self._option
        )
        per_item = _bleu_per_item(correct, guess, test_len, reflen)
        # corpus score: python floats, exactly as pycocoevalcap accumulates them
        tot_correct = correct.sum(axis=0).tolist()
        tot_guess = guess.sum(axis=0).tolist()
        tot_test = int(test_len.sum())
        tot_ref = sum(reflen.tolist()) if self._option == "average" else int(reflen.sum())
        bleus, bleu = [], 1.0
        for k in range(self._n):
            bleu *= float(tot_correct[k] + _TINY) / (tot_guess[k] + _SMALL)
            bleus.append(bleu ** (1.0 / (k + 1)))
        ratio = (tot_test + _TINY) / (tot_ref + _SMALL)
        if ratio < 1:
            bleus = [b * math.exp(1 - 1 / ratio) for b in bleus]
        return bleus, per_item.tolist()

    def method(self) -> str:
        """Metric name, as pycocoevalcap reports it."""
        return "Bleu"


def sentence_bleu(
    cands: Sequence[str], refs_list: Sequence[Sequence[str]], n: int = 4, option: str = "closest"
) -> np.ndarray:
    """Per-sentence BLEU-n, (N,), identical to pycocoevalcap's per-image scores.

    Smoothing is pycocoevalcap's: each precision is ``(matches + 1e-15) / (guesses + 1e-9)``,
    i.e. effectively none. A candidate with no matching n-gram of some order scores ~1e-4
    instead of 0 (for n=4), and a candidate shorter than n words is scored on the orders it has.
    """
    if option not in _BLEU_OPTIONS:
        raise ValueError(f"sentence_bleu option must be one of {_BLEU_OPTIONS}, got {option!r}")
    sentences, ref_img = _flatten(cands, refs_list)
    correct, guess, test_len, reflen = _bleu_stats(sentences, len(cands), ref_img, n, option)
    return _bleu_per_item(correct, guess, test_len, reflen)[n - 1]


# -------------------------------------------------------------------------------------- CIDEr-D


def _doc_freq(ng: _Ngrams, n_img: int, parts: list[_Parts]) -> list[np.ndarray]:
    """Per order: (G_k,) number of images whose references contain each k-gram."""
    out = []
    for k, (_, _, _, rkey, _) in enumerate(parts):
        pairs = rkey[np.r_[True, rkey[1:] != rkey[:-1]]] if len(rkey) else rkey  # (gram, image)
        out.append(np.bincount(pairs // n_img, minlength=ng.n_grams[k]).astype(np.float64))
    return out


@dataclass
class _CorpusDocFreq:
    """Document frequencies of a reference corpus, keyed so new n-grams can be looked up."""

    vocab: dict[str, int]  # word -> corpus word id
    keys: list[np.ndarray]  # per order k >= 2: sorted (prefix id * n_words + word id), (G_k,)
    df: list[np.ndarray]  # per order: (G_k,) images whose references contain the k-gram
    n_words: int
    ref_len: float  # log(number of images in the corpus)

    @classmethod
    def build(cls, refs_corpus: Mapping[Any, Sequence[str]], n: int) -> _CorpusDocFreq:
        """Intern every reference n-gram of the corpus once and count document frequencies."""
        refs_list = list(refs_corpus.values())
        if not refs_list:
            raise ValueError("refs_corpus is empty; pass {image_id: [reference captions]}")
        sentences, ref_img = _flatten([""] * len(refs_list), refs_list)
        ng = _intern(sentences, n)
        n_words = max(len(ng.words), 1)
        keys = [np.zeros(0, dtype=np.int64)]
        # ids follow key order, so these tables are sorted for searchsorted
        keys += [ng.prefix[k] * n_words + ng.last[k] for k in range(1, n)]
        vocab = dict(zip(ng.words, range(len(ng.words)), strict=True))
        n_img = len(refs_list)
        df = _doc_freq(ng, n_img, [_split_entries(ng, k, n_img, ref_img) for k in range(n)])
        return cls(vocab, keys, df, n_words, float(np.log(float(len(refs_list)))))

    def lookup(self, ng: _Ngrams) -> list[np.ndarray]:
        """Per order: corpus document frequency of each of ``ng``'s k-grams (0 if unseen)."""
        word_cid = np.fromiter(
            (self.vocab.get(w, -1) for w in ng.words), dtype=np.int64, count=len(ng.words)
        )  # (V_local,) corpus id of each local word, -1 if the corpus never saw it
        out, cid = [], word_cid
        for k in range(len(ng.gram)):
            if k > 0:
                prefix, last = cid[ng.prefix[k]], word_cid[ng.last[k]]  # (G_k,)
                key = prefix * self.n_words + last
                table = self.keys[k]
                idx = np.minimum(np.searchsorted(table, key), max(len(table) - 1, 0))
                found = (prefix >= 0) & (last >= 0) & (table[idx] == key if len(table) else False)
                cid = np.where(found, idx, -1)
            if len(self.df[k]) == 0:  # the corpus has no k-gram at all
                cid = np.full(ng.n_grams[k], -1, dtype=np.int64)
                out.append(np.zeros(ng.n_grams[k]))
                continue
            out.append(np.where(cid >= 0, self.df[k][np.maximum(cid, 0)], 0.0))
        return out


def _cider_d(
    ng: _Ngrams,
    n_img: int,
    ref_img: np.ndarray,
    parts: list[_Parts],
    df: list[np.ndarray],
    ref_len: float,
    sigma: float,
) -> np.ndarray:
    """pycocoevalcap's CIDEr-D of each candidate, (N,), given per-order document frequencies."""
    n, n_ref = len(ng.gram), len(ref_img)
    # pycocoevalcap's "length" counts bigrams, not words: max(len - 1, 0)
    blen = np.maximum(ng.lengths - 1, 0)  # (S,)
    delta = (blen[:n_img][ref_img] - blen[n_img:]).astype(np.float64)  # (R,)
    penalty = np.e ** (-(delta**2) / (2 * sigma**2))  # (R,)
    score = np.zeros((n_img, n))  # (N, n)
    for k in range(n):
        w = ng.count[k] * (ref_len - np.log(np.maximum(1.0, df[k][ng.gram[k]])))  # (E,) tf-idf
        norm = np.sqrt(np.bincount(ng.sent[k], w * w, minlength=len(ng.lengths)))  # (S,)
        is_c, ckey, _, rkey, r_sent = parts[k]
        w_c, w_r = w[is_c], w[~is_c]
        lo = np.searchsorted(rkey, ckey, side="left")
        m = np.searchsorted(rkey, ckey, side="right") - lo  # references sharing each entry
        ci = np.repeat(np.arange(len(ckey)), m)  # (M,) candidate entry of each match
        ri = np.repeat(lo - np.cumsum(m) + m, m) + np.arange(int(m.sum()))  # (M,) ref entry
        acc = np.bincount(r_sent[ri], np.minimum(w_c[ci], w_r[ri]) * w_r[ri], minlength=n_ref)
        nh, nr = norm[:n_img][ref_img], norm[n_img:]  # (R,)
        both = (nh != 0) & (nr != 0)
        val = np.where(both, acc / np.where(both, nh * nr, 1.0), acc) * penalty  # (R,)
        score[:, k] = np.bincount(ref_img, val, minlength=n_img)
    n_refs = np.bincount(ref_img, minlength=n_img)
    return score.mean(axis=1) / n_refs * 10.0


class CiderD:
    """CIDEr-D with pycocoevalcap's interface and results; optional fixed document frequencies.

    Without ``refs_corpus``, ``compute_score`` takes document frequencies from ``gts`` exactly as
    pycocoevalcap does. With it, df and ``ref_len = log(#images in refs_corpus)`` are computed
    once and reused by ``compute_score`` and ``score_many`` (per-caption RL rewards: one image
    scored alone is then not 0, as it is when df comes from that single image).

    Only ``n=4`` can be compared with pycocoevalcap (its ``Cider`` fails for other n); other
    values average orders 1..n with the same weights and length penalty.
    """

    def __init__(
        self,
        refs_corpus: Mapping[Any, Sequence[str]] | None = None,
        n: int = 4,
        sigma: float = 6.0,
    ) -> None:
        if n < 1:
            raise ValueError(f"CiderD n must be >= 1 (highest n-gram order), got {n}")
        self._n = n
        self._sigma = sigma
        self._corpus = None if refs_corpus is None else _CorpusDocFreq.build(refs_corpus, n)

    def compute_score(
        self, gts: Mapping[Any, list[str]], res: Mapping[Any, list[str]]
    ) -> tuple[np.float64, np.ndarray]:
        """Corpus CIDEr-D (mean) and per-image scores, (N,), in ``gts`` key order."""
        cands, refs_list = _gather(gts, res)
        if not cands:
            raise ValueError("CiderD.compute_score got no images; gts and res are empty")
        sentences, ref_img = _flatten(cands, refs_list)
        ng = _intern(sentences, self._n)
        parts = [_split_entries(ng, k, len(cands), ref_img) for k in range(self._n)]
        if self._corpus is None:
            df, ref_len = _doc_freq(ng, len(cands), parts), float(np.log(float(len(cands))))
        else:
            df, ref_len = self._corpus.lookup(ng), self._corpus.ref_len
        scores = _cider_d(ng, len(cands), ref_img, parts, df, ref_len, self._sigma)
        return np.mean(scores), scores

    def score_many(self, cands: Sequence[str], refs_list: Sequence[Sequence[str]]) -> np.ndarray:
        """CIDEr-D of each candidate against its references, (N,), with the stored df."""
        if self._corpus is None:
            raise ValueError(
                "CiderD.score_many needs document frequencies from a reference corpus; build "
                "it with CiderD(refs_corpus={image_id: [captions]}) (e.g. the training refs)"
            )
        if not cands:
            return np.zeros(0)
        sentences, ref_img = _flatten(cands, refs_list)
        ng = _intern(sentences, self._n)
        parts = [_split_entries(ng, k, len(cands), ref_img) for k in range(self._n)]
        df, ref_len = self._corpus.lookup(ng), self._corpus.ref_len
        return _cider_d(ng, len(cands), ref_img, parts, df, ref_len, self._sigma)

    def method(self) -> str:
        """Metric name, as pycocoevalcap reports it."""
        return "CIDEr"


Cider = CiderD  # pycocoevalcap's Cider computes CIDEr-D


def caption_scores(
    hyps: Mapping[Any, str] | Sequence[str],
    refs: Mapping[Any, Sequence[str] | str] | Sequence[Sequence[str] | str],
) -> dict[str, float]:
    """BLEU-1/4 and CIDEr-D (pycocoevalcap numbers) after PTB tokenization.

    ``hyps``: one caption per image, ``refs``: each image's reference captions (a list, or one
    string), either both keyed by image id (dicts) or both in the same order (lists). Raises
    ValueError when they do not pair up.
    """
    if not isinstance(hyps, Mapping) and not isinstance(refs, Mapping):
        if len(hyps) != len(refs):
            raise ValueError(
                f"caption_scores: {len(hyps)} captions for {len(refs)} reference lists"
            )
        hyps, refs = dict(enumerate(hyps)), dict(enumerate(refs))
    elif not (isinstance(hyps, Mapping) and isinstance(refs, Mapping)):
        raise ValueError("caption_scores: hyps and refs both dicts (by id) or both lists")
    if not refs:
        return {}
    keys = sorted(refs)
    lost = [k for k in keys if k not in hyps]
    if lost:
        raise ValueError(f"caption_scores: no caption for {len(lost)} id(s), e.g. {lost[:3]}")
    gts = ptb_tokenize({k: [refs[k]] if isinstance(refs[k], str) else list(refs[k]) for k in keys})
    res = ptb_tokenize({k: [hyps[k]] for k in keys})
    bleu, _ = Bleu(4).compute_score(gts, res)
    cider, _ = CiderD().compute_score(gts, res)
    return {"BLEU-1": float(bleu[0]), "BLEU-4": float(bleu[3]), "CIDEr-D": float(cider)}
