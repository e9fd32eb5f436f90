"""Image hashes: a content hash of the decoded pixels, and 64-bit pHash / dHash.

`content_hash` hashes the decoded RGB pixels and the size, not the file bytes, so the same
picture saved as PNG and as lossless WebP, or with other metadata, has one hash.

pHash and dHash follow imagehash's definitions bit for bit (the benchmark checks it): pHash is
the sign of the 8x8 lowest DCT-II frequencies of the 32x32 LANCZOS grey thumbnail against their
median; dHash compares horizontally adjacent pixels of the 9x8 grey thumbnail. Bits are packed
row-major, the first bit most significant, as imagehash's hex strings are. The hashes of the
horizontally mirrored picture come for free (pHash: odd horizontal frequencies change sign;
dHash: the mirrored thumbnail), so a flipped copy is found by one more lookup.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vltrain.data.curation.text import key_bytes


def _dct_matrix(n: int) -> np.ndarray:
    """Unnormalised DCT-II as a matrix: (C @ x)[k] = 2 sum_j x[j] cos(pi k (2j + 1) / 2n)."""
    k = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    return 2.0 * np.cos(np.pi * k * (2 * j + 1) / (2 * n))


_DCT8 = _dct_matrix(32)[:8]  # (8, 32): only the 8 lowest frequencies are used
_FLIP_SIGN = np.where(np.arange(8) % 2 == 1, -1.0, 1.0)[None, :]  # odd horizontal freqs
_WEIGHTS = (np.uint64(1) << np.arange(63, -1, -1, dtype=np.uint64)).astype(np.uint64)


def pack_bits(bits: np.ndarray) -> int:
    """64 booleans (row-major) -> int, first bit most significant."""
    return int(np.sum(_WEIGHTS[bits.reshape(64)], dtype=np.uint64))


def phash_bits(grey32: np.ndarray) -> tuple[int, int]:
    """(pHash, pHash of the mirror) of a (32, 32) grey thumbnail."""
    low = _DCT8 @ grey32.astype(np.float64) @ _DCT8.T  # (8, 8): rows vertical, cols horizontal
    flipped = low * _FLIP_SIGN
    return pack_bits(low > np.median(low)), pack_bits(flipped > np.median(flipped))


def dhash_bits(grey9x8: np.ndarray) -> tuple[int, int]:
    """(dHash, dHash of the mirror) of an (8, 9) grey thumbnail."""
    g = grey9x8.astype(np.int16)
    m = g[:, ::-1]
    return pack_bits(g[:, 1:] > g[:, :-1]), pack_bits(m[:, 1:] > m[:, :-1])


def content_hash(img: Image.Image, seed: int = 0) -> bytes:
    """16-byte keyed BLAKE2b of the RGB pixels and the size."""
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    h = hashlib.blake2b(digest_size=16, key=key_bytes(seed))
    h.update(f"{rgb.width}x{rgb.height}".encode())
    h.update(rgb.tobytes())
    return h.digest()


@dataclass(frozen=True)
class ImageHashes:
    """Everything the image stages need from one decoded picture."""

    content: bytes
    phash: int
    phash_mirror: int
    dhash: int
    dhash_mirror: int
    width: int
    height: int
    thumb: bytes
    """16x16 RGB BOX thumbnail (768 bytes): verifies hash candidates (`thumb_similarity`)"""


def thumb_similarity(a: bytes, b: bytes) -> float:
    """Best Pearson correlation of thumbnail a with b or b mirrored (1.0: same picture)."""
    x = np.frombuffer(a, np.uint8).astype(np.float32)
    x -= x.mean()
    best = -1.0
    tb = np.frombuffer(b, np.uint8).reshape(16, 16, 3)
    for y in (tb, tb[:, ::-1]):
        yc = y.reshape(-1).astype(np.float32)
        yc -= yc.mean()
        den = float(np.sqrt((x @ x) * (yc @ yc)))
        best = max(best, float(x @ yc) / den if den > 0 else float(np.array_equal(x, yc)))
    return best


def image_hashes(img: Image.Image, seed: int = 0) -> ImageHashes:
    """Hashes of a decoded image (imagehash's grey conversion: PIL mode 'L' of the picture)."""
    grey = img.convert("L")
    p, pm = phash_bits(np.asarray(grey.resize((32, 32), Image.Resampling.LANCZOS)))
    d, dm = dhash_bits(np.asarray(grey.resize((9, 8), Image.Resampling.LANCZOS)))
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    thumb = rgb.resize((16, 16), Image.Resampling.BOX).tobytes()
    return ImageHashes(content_hash(img, seed), p, pm, d, dm, img.width, img.height, thumb)


def hamming(a: int, b: int) -> int:
    """Bits that differ between two 64-bit hashes."""
    return (a ^ b).bit_count()
