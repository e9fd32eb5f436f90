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

import numpy as np

from vltrain.data.curation.text import fmix64, jaccard

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
        out = np.full((len(shingle_sets), self.num_perm), _MAX, dtype=np.uint64)
        lens = np.array([len(s) for s in shingle_sets], dtype=np.int64)
        nonempty = np.flatnonzero(lens)
        if len(nonempty) == 0:
            return out
        flat = np.concatenate([shingle_sets[i] for i in nonempty])  # (S,)
        starts = np.concatenate([[0], np.cumsum(lens[nonempty])[:-1]])
        step = max(1, (1 << 21) // self.num_perm)  # bound the (S, P) block to ~16 MiB
        parts = []
        for s0 in range(0, len(flat), step):
            vals = fmix64(flat[s0 : s0 + step, None] * self.a[None, :] + self.b[None, :])  # (s, P)
            parts.append(vals)
        allv = np.concatenate(parts) if len(parts) > 1 else parts[0]  # (S, P)
        out[nonempty] = np.minimum.reduceat(allv, starts, axis=0)
        return out


def collision_probability(s: float | np.ndarray, bands: int, rows: int) -> np.ndarray:
    """P(two sets with Jaccard s share at least one band): 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** rows) ** bands


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
    """Band buckets over the signatures of inserted items (ids are caller-chosen ints)."""

    bands: int
    rows: int
    _buckets: list[dict[bytes, list[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._buckets = [{} for _ in range(self.bands)]

    def _keys(self, sig: np.ndarray) -> list[bytes]:
        r = self.rows
        return [sig[i * r : (i + 1) * r].tobytes() for i in range(self.bands)]

    def query(self, sig: np.ndarray) -> list[int]:
        """Ids sharing at least one band with `sig`, ascending, without repeats."""
        found: set[int] = set()
        for bucket, key in zip(self._buckets, self._keys(sig), strict=True):
            hit = bucket.get(key)
            if hit:
                found.update(hit)
        return sorted(found)

    def insert(self, item: int, sig: np.ndarray) -> None:
        for bucket, key in zip(self._buckets, self._keys(sig), strict=True):
            bucket.setdefault(key, []).append(item)


def candidate_pairs(sigs: np.ndarray, bands: int, rows: int) -> set[tuple[int, int]]:
    """All (i, j), i < j, sharing a band (the unverified LSH candidates of a whole set)."""
    pairs: set[tuple[int, int]] = set()
    for band in range(bands):
        cols = sigs[:, band * rows : (band + 1) * rows]
        buckets: dict[bytes, list[int]] = {}
        for i, row in enumerate(cols):
            buckets.setdefault(row.tobytes(), []).append(i)
        for ids in buckets.values():
            for x in range(len(ids)):
                for y in range(x + 1, len(ids)):
                    pairs.add((ids[x], ids[y]))
    return pairs


def verified_pairs(
    shingles: Sequence[np.ndarray], sigs: np.ndarray, bands: int, rows: int, threshold: float
) -> dict[tuple[int, int], float]:
    """LSH candidates whose exact Jaccard is >= threshold, with that Jaccard."""
    out = {}
    for i, j in candidate_pairs(sigs, bands, rows):
        s = jaccard(shingles[i], shingles[j])
        if s >= threshold:
            out[(i, j)] = s
    return out
