"""Multi-index hashing (Norouzi et al.): radius-t Hamming search over 64-bit codes.

The code is cut into m chunks. If two codes differ in at most t bits, some chunk differs in at
most floor(t / m) bits (pigeonhole), so probing every chunk's table at that radius finds every
true neighbour; candidates are then checked with the full 64-bit distance. m is chosen so each
chunk probes at radius 0 or 1 (a few dozen lookups per query).
"""

from __future__ import annotations

from itertools import combinations

import numpy as np


def _chunk_bounds(m: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, 64, m + 1).round().astype(int)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(m)]


class HammingIndex:
    """Insert 64-bit codes with ids; `query(code)` returns ids within `radius` bits."""

    def __init__(self, radius: int) -> None:
        if not 0 <= radius < 64:
            raise ValueError(f"Hamming radius must be in [0, 63], got {radius}")
        self.radius = radius
        self.m = max(1, min(16, (radius + 2) // 2))  # sub-radius floor(t/m) is 0 or 1
        self.sub = radius // self.m
        self.bounds = _chunk_bounds(self.m)
        self.tables: list[dict[int, list[int]]] = [{} for _ in range(self.m)]
        self.codes: dict[int, int] = {}
        self._probes = [self._flips(hi - lo) for lo, hi in self.bounds]

    def _flips(self, width: int) -> list[int]:
        masks = [0]
        for r in range(1, self.sub + 1):
            for bits in combinations(range(width), r):
                masks.append(sum(1 << b for b in bits))
        return masks

    def _chunk(self, code: int, i: int) -> int:
        lo, hi = self.bounds[i]
        return (code >> (64 - hi)) & ((1 << (hi - lo)) - 1)

    def insert(self, item: int, code: int) -> None:
        self.codes[item] = code
        for i, table in enumerate(self.tables):
            table.setdefault(self._chunk(code, i), []).append(item)

    def query(self, code: int) -> list[tuple[int, int]]:
        """(distance, id) of every inserted code within the radius, nearest first then by id."""
        seen: set[int] = set()
        for i, table in enumerate(self.tables):
            c = self._chunk(code, i)
            for mask in self._probes[i]:
                hit = table.get(c ^ mask)
                if hit:
                    seen.update(hit)
        out = [((self.codes[j] ^ code).bit_count(), j) for j in seen]
        return sorted(d for d in out if d[0] <= self.radius)

    def __len__(self) -> int:
        return len(self.codes)
