"""MinHash signatures over word n-gram shingles and an LSH index with optimised bands/rows.

Permutation i maps a 64-bit shingle hash h to fmix64(h * a_i + b_i) (a_i odd): a bijection on
64-bit values, so the signature is a true 64-bit MinHash. Signatures are computed for a batch of
captions at once (one (S, P) array, reduced per caption), which is what makes it fast in numpy.

LSH splits the P values into b bands of r rows; two captions with Jaccard s share a band with
probability 1 - (1 - s^r)^b (the S-curve). `optimal_params` picks (b, r) for a threshold by
minimising the false-positive area below the threshold plus the false-negative area above it
(weights configurable), as text-dedup and datasketch do. Every candidate is then verified by
exact Jaccard, so LSH only decides what is compared, never what is removed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from vltrain.curation.text import fmix64

_MAX = np.uint64(0xFFFFFFFFFFFFFFFF)


class MinHasher:
    """`num_perm` seeded 64-bit permutations; `signatures` hashes many shingle sets at once."""

    def __init__(self, num_perm: int = 128, seed: int = 1) -> None:
        if num_perm < 1:
            raise ValueError(f"num_perm must be >= 1, got {num_perm}")
        rng = np.random.Generator(np.random.PCG64(seed))
        self.num_perm = num_perm
        self.a = rng.integers(0, 2**63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)

    def signatures(self, shingle_sets: Sequence[np.ndarray]) -> np.ndarray:
        """(N, P) uint64 signatures; an empty set gets all-max values (matches only itself)."""
        lens = np.array([len(x) for x in shingle_sets], dtype=np.int64)
        offsets = np.zeros(len(shingle_sets) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        flat = np.concatenate(list(shingle_sets)) if len(shingle_sets) else np.zeros(0, np.uint64)
        return self.signatures_flat(flat.astype(np.uint64, copy=False), offsets)

    def signatures_flat(self, flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """(N, P) signatures of sets given as flat[offsets[d]:offsets[d + 1]] (N = len - 1).

        Documents are taken in order of size, as many at a time as fill about `_BLOCK`
        shingles, each padded to the block's longest by repeating its first shingle (a minimum
        does not change when a value repeats, and neighbours in size order are nearly equally
        long, so padding costs ~nothing). The block's values then sit in one (L, D, P) array,
        hashed with in-place arithmetic and reduced over its first axis: contiguous
        element-wise minima instead of a segmented `reduceat`, which costs several times more.
        """
        n_docs, p = len(offsets) - 1, self.num_perm
        out = np.full((n_docs, p), _MAX, dtype=np.uint64)
        lens = np.diff(offsets)
        order = np.argsort(lens, kind="stable")
        order = order[lens[order] > 0]  # an empty set keeps all-max values
        size = lens[order].tolist()
        buf, tmp = np.empty(_BLOCK * p, dtype=np.uint64), np.empty(_BLOCK * p, dtype=np.uint64)
        i = 0
        while i < len(order):
            if size[i] > _BLOCK:  # one long document, its shingles in slices
                self._long(flat[offsets[order[i]] : offsets[order[i] + 1]], out[order[i]], buf, tmp)
                i += 1
                continue
            j = min(len(order), i + _BLOCK // size[i])
            while (j - i) * size[j - 1] > _BLOCK:  # the block's longest sets its size
                j = i + max(1, _BLOCK // size[j - 1])
            docs, longest = order[i:j], size[j - 1]
            pos = np.minimum(np.arange(longest)[:, None], lens[docs][None, :] - 1)  # (L, D)
            x = buf[: longest * len(docs) * p].reshape(longest, len(docs), p)  # (L, D, P)
            np.multiply(flat[offsets[docs][None, :] + pos][:, :, None], self.a, out=x)
            self._permute_inplace(x, tmp[: x.size].reshape(x.shape))
            out[docs] = x.min(axis=0)
            i = j
        return out

    def _long(self, values: np.ndarray, out: np.ndarray, buf: np.ndarray, tmp: np.ndarray) -> None:
        """out (P,) = the signature of one set of more than `_BLOCK` values, in slices."""
        p = self.num_perm
        for s0 in range(0, len(values), _BLOCK):
            v = values[s0 : s0 + _BLOCK]
            x = buf[: len(v) * p].reshape(len(v), p)  # (s, P)
            np.multiply(v[:, None], self.a, out=x)
            self._permute_inplace(x, tmp[: x.size].reshape(x.shape))
            np.minimum(out, x.min(axis=0), out=out)

    def _permute_inplace(self, x: np.ndarray, tmp: np.ndarray) -> None:
        """x (..., P) holding h * a: x = fmix64(h * a + b), per permutation, in place."""
        x += self.b
        _fmix64_inplace(x, tmp)


_BLOCK = 512  # shingles per block: (512, 128) uint64 = 512 KiB, two buffers fit in L2
_S33 = np.uint64(33)
_C1, _C2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_ROLL = np.uint64(0x9E3779B97F4A7C15)  # odd: combines a band's rows into one key


def _fmix64_inplace(x: np.ndarray, tmp: np.ndarray) -> None:
    """x = fmix64(x) in place (the same values as `text.fmix64`), tmp: a scratch buffer."""
    for c in (_C1, _C2, None):
        np.right_shift(x, _S33, out=tmp)
        x ^= tmp
        if c is not None:
            x *= c


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(N, bands) uint64: one 64-bit key per band of each signature (N, P).

    Equal band rows give equal keys; unequal rows collide with probability ~2^-64, and a
    collision can only add a candidate, which exact Jaccard then rejects.
    """
    if bands * rows > sigs.shape[1]:
        raise ValueError(f"bands x rows = {bands * rows} exceeds num_perm {sigs.shape[1]}")
    cols = sigs[:, : bands * rows].reshape(len(sigs), bands, rows)  # (N, b, r)
    k = np.zeros(cols.shape[:2], dtype=np.uint64)  # (N, b)
    for r in range(rows):
        np.multiply(k, _ROLL, out=k)
        np.add(k, cols[:, :, r], out=k)
    return fmix64(k ^ np.uint64(rows))


def collision_probability(s: float | np.ndarray, bands: int, rows: int) -> np.ndarray:
    """P(two sets with Jaccard s share at least one band): 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** rows) ** bands


@lru_cache(maxsize=64)
def optimal_params(
    threshold: float, num_perm: int, fp_weight: float = 0.5, fn_weight: float = 0.5
) -> tuple[int, int]:
    """(bands, rows), bands * rows <= num_perm, minimising weighted FP + FN areas."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    lo = np.linspace(0.0, threshold, 201)
    hi = np.linspace(threshold, 1.0, 201)
    best, best_err = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = np.trapezoid(collision_probability(lo, b, r), lo)
            fn = np.trapezoid(1.0 - collision_probability(hi, b, r), hi)
            err = fp_weight * fp + fn_weight * fn
            if err < best_err - 1e-15:
                best, best_err = (b, r), err
    return best


def s_curve(
    bands: int, rows: int, points: Iterable[float] = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
) -> str:
    """The S-curve as text: 'J=0.50 p=0.012 | J=0.80 p=0.97 | ...'."""
    return " | ".join(
        f"J={s:.2f} p={float(collision_probability(s, bands, rows)):.3f}" for s in points
    )


@dataclass
class LSHIndex:
    """Band buckets over the band keys of inserted items (ids are caller-chosen ints)."""

    bands: int
    rows: int
    _buckets: list[dict[int, list[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._buckets = [{} for _ in range(self.bands)]

    def keys(self, sig: np.ndarray) -> np.ndarray:
        """(bands,) keys of one signature (P,); workers compute them in batch (`band_keys`)."""
        return band_keys(sig[None, :], self.bands, self.rows)[0]

    def query(self, keys: np.ndarray) -> list[int]:
        """Ids sharing at least one band key with `keys` (bands,), ascending, no repeats."""
        found: set[int] = set()
        for bucket, key in zip(self._buckets, keys.tolist(), strict=True):
            hit = bucket.get(key)
            if hit:
                found.update(hit)
        return sorted(found)

    def insert(self, item: int, keys: np.ndarray) -> None:
        for bucket, key in zip(self._buckets, keys.tolist(), strict=True):
            bucket.setdefault(key, []).append(item)


def candidate_pairs(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(K, 2) int64 pairs (i, j), i < j, sharing a band: the unverified LSH candidates of a
    whole set, sorted and without repeats."""
    return key_pairs(band_keys(sigs, bands, rows))


def key_pairs(keys: np.ndarray) -> np.ndarray:
    """`candidate_pairs` from band keys (N, bands), e.g. computed by workers chunk by chunk
    and concatenated: one sort per band, every pair inside a run of equal keys (no Python
    loop over runs)."""
    n = len(keys)
    found = [np.zeros((0, 2), dtype=np.int64)]
    for b in range(keys.shape[1]):
        col = np.ascontiguousarray(keys[:, b])
        order = np.argsort(col)  # unstable is fine: pairs are normalised below
        found.append(_run_pairs(order, col[order]))
    pairs = np.sort(np.concatenate(found), axis=1)  # (K', 2) i < j
    codes = np.unique(pairs[:, 0] * n + pairs[:, 1])
    return np.stack([codes // n, codes % n], 1) if n else pairs


def _run_pairs(order: np.ndarray, k: np.ndarray) -> np.ndarray:
    """(K, 2) every pair (order[s], order[t]), s < t, inside each run of equal sorted keys k."""
    start = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))  # (R,) run starts
    length = np.diff(np.append(start, len(k)))  # (R,)
    start, length = start[length > 1], length[length > 1]
    if len(start) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    run = np.repeat(np.arange(len(start)), length)  # (M,) run of each member
    t = np.arange(len(run)) - np.repeat(np.cumsum(length) - length, length)  # rank in run
    after = length[run] - 1 - t  # (M,) members after this one in its run
    left = np.repeat(start[run] + t, after)  # (K,)
    right = left + 1 + np.arange(len(left)) - np.repeat(np.cumsum(after) - after, after)
    return np.stack([order[left], order[right]], 1).astype(np.int64)


def pair_jaccard(flat: np.ndarray, offsets: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """(K,) exact Jaccard of each pair (i, j) of sets flat[offsets[i]:offsets[i + 1]] (sorted,
    unique), vectorised: the intersection is the number of values a pair's two sets share."""
    if len(pairs) == 0:
        return np.zeros(0)
    lens = np.diff(offsets)
    li, lj = lens[pairs[:, 0]], lens[pairs[:, 1]]  # (K,)
    seg_len = np.stack([li, lj], 1).reshape(-1)  # (2K,)
    seg_start = offsets[pairs.reshape(-1)]  # (2K,)
    total = int(seg_len.sum())
    seg = np.repeat(np.arange(len(seg_len)), seg_len)  # (T,)
    first = np.concatenate([[0], np.cumsum(seg_len)[:-1]])
    vals = flat[seg_start[seg] + np.arange(total) - first[seg]]  # (T,)
    pair = seg // 2
    order = np.lexsort((vals, pair))
    v, pr = vals[order], pair[order]
    dup = (v[1:] == v[:-1]) & (pr[1:] == pr[:-1])  # within a pair: one value in both sets
    inter = np.bincount(pr[1:][dup], minlength=len(pairs))
    union = li + lj - inter
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def verified_pairs(
    shingles: Sequence[np.ndarray], sigs: np.ndarray, bands: int, rows: int, threshold: float
) -> dict[tuple[int, int], float]:
    """LSH candidates whose exact Jaccard is >= threshold, with that Jaccard."""
    lens = np.array([len(x) for x in shingles], dtype=np.int64)
    offsets = np.zeros(len(shingles) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.concatenate(list(shingles)) if len(shingles) else np.zeros(0, np.uint64)
    return verified_pairs_flat(flat, offsets, sigs, bands, rows, threshold)


def verified_pairs_flat(
    flat: np.ndarray,
    offsets: np.ndarray,
    sigs: np.ndarray,
    bands: int,
    rows: int,
    threshold: float,
) -> dict[tuple[int, int], float]:
    """`verified_pairs` on sets in flat/offsets form (see `NgramHasher.shingle_sets`)."""
    pairs = candidate_pairs(sigs, bands, rows)
    sim = pair_jaccard(flat, offsets, pairs)
    ok = sim >= threshold
    return {(i, j): s for (i, j), s in zip(pairs[ok].tolist(), sim[ok].tolist(), strict=True)}
