"""A Bloom filter with a seeded, process-independent hash, saved as plain bytes + JSON.

Sizing: for n items at false-positive rate p, m = ceil(-n ln p / ln(2)^2) bits and
k = round(m / n ln 2) probes. Probe positions use Kirsch-Mitzenmacher double hashing of one
keyed BLAKE2b-128 digest of the item (h1 + i h2 mod m), so they depend only on (seed, item):
a filter saved by one process answers the same in the next (Python's salted `hash()` does not).
The file holds a small JSON header then the bit array; loading reads no pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from vltrain.curation.text import key_bytes

_MAGIC = b"VLTBLOOM1\n"


class BloomFilter:
    """`add(item)`, `item in f`; items are bytes or str (UTF-8)."""

    def __init__(self, capacity: int, fp_rate: float = 1e-4, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"Bloom capacity must be >= 1, got {capacity}")
        if not 0.0 < fp_rate < 1.0:
            raise ValueError(f"Bloom fp_rate must be in (0, 1), got {fp_rate}")
        self.capacity, self.fp_rate, self.seed = capacity, fp_rate, seed
        self.n_bits = max(64, math.ceil(-capacity * math.log(fp_rate) / math.log(2) ** 2))
        self.n_hashes = max(1, round(self.n_bits / capacity * math.log(2)))
        self.bits = np.zeros((self.n_bits + 7) // 8, dtype=np.uint8)
        self.count = 0
        self._key = key_bytes(seed)

    def _positions(self, item: bytes | str) -> np.ndarray:
        data = item.encode("utf-8", "surrogatepass") if isinstance(item, str) else item
        d = hashlib.blake2b(data, digest_size=16, key=self._key).digest()
        h1, h2 = int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little") | 1
        return np.array([(h1 + i * h2) % self.n_bits for i in range(self.n_hashes)], np.int64)

    def add(self, item: bytes | str) -> None:
        pos = self._positions(item)
        np.bitwise_or.at(self.bits, pos >> 3, (1 << (pos & 7)).astype(np.uint8))
        self.count += 1

    def update(self, items: Iterable[bytes | str]) -> None:
        for item in items:
            self.add(item)

    def __contains__(self, item: bytes | str) -> bool:
        pos = self._positions(item)
        return bool(np.all(self.bits[pos >> 3] & (1 << (pos & 7)).astype(np.uint8)))

    def expected_fp_rate(self) -> float:
        """(1 - e^{-k n / m})^k for the items actually added."""
        k, m = self.n_hashes, self.n_bits
        return (1.0 - math.exp(-k * self.count / m)) ** k

    def save(self, path: str | os.PathLike[str]) -> None:
        header = {
            "capacity": self.capacity,
            "fp_rate": self.fp_rate,
            "seed": self.seed,
            "n_bits": self.n_bits,
            "n_hashes": self.n_hashes,
            "count": self.count,
            "hash": "blake2b-128 keyed by seed, double hashing",
        }
        tmp = Path(str(path) + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + json.dumps(header).encode() + b"\n")
            f.write(self.bits.tobytes())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BloomFilter:
        raw = Path(path).read_bytes()
        if not raw.startswith(_MAGIC):
            raise ValueError(f"{path} is not a vltrain Bloom filter file (bad magic header)")
        head_end = raw.index(b"\n", len(_MAGIC))
        header = json.loads(raw[len(_MAGIC) : head_end])
        f = cls(header["capacity"], header["fp_rate"], header["seed"])
        if (f.n_bits, f.n_hashes) != (header["n_bits"], header["n_hashes"]):
            raise ValueError(f"{path}: header sizes do not match its capacity and fp_rate")
        f.bits = np.frombuffer(raw[head_end + 1 :], dtype=np.uint8).copy()
        if len(f.bits) != (f.n_bits + 7) // 8:
            raise ValueError(f"{path}: bit array is truncated ({len(f.bits)} bytes)")
        f.count = header["count"]
        return f
