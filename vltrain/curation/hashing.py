"""Image hashes: a content hash of the decoded pixels, and 64-bit pHash / dHash.

`content_hash` hashes the decoded RGB pixels and the size, not the file bytes, so the same
picture saved as PNG and as lossless WebP, or with other metadata, has one hash.

pHash and dHash follow imagehash's definitions bit for bit (the benchmark checks it): pHash is
the sign of the 8x8 lowest DCT-II frequencies of the 32x32 LANCZOS grey thumbnail against their
median; dHash compares horizontally adjacent pixels of the 9x8 grey thumbnail. Bits are packed
row-major, the first bit most significant, as imagehash's hex strings are. The hashes of the
horizontally mirrored picture come for free (pHash: odd horizontal frequencies change sign;
dHash: the mirrored thumbnail), so a flipped copy is found by one more lookup.

Crops: a 90% crop moves every DCT frequency, so its pHash is far from the original's. Each
picture therefore also gets *crop hashes*: the pHash of 9 windows of `CROP_SCALE` of its width
and height on a 3 x 3 grid of offsets (any crop of that scale is within 2.5% of one of them),
and the pHash of the whole picture computed the same way, all from one 64 x 64 thumbnail
(cheap: no second pass over the full picture). A crop of A matches B when one of A's window
hashes is near B's whole hash (or the other way round); 16 x 16 colour thumbnails of the windows
then verify it by correlation (the best of 25 finer offsets around the window), as the
colour thumbnail verifies the plain hashes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vltrain.curation.text import key_bytes


def _dct_matrix(n: int) -> np.ndarray:
    """Unnormalised DCT-II as a matrix: (C @ x)[k] = 2 sum_j x[j] cos(pi k (2j + 1) / 2n)."""
    k = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    return 2.0 * np.cos(np.pi * k * (2 * j + 1) / (2 * n))


_DCT8 = _dct_matrix(32)[:8]  # (8, 32): only the 8 lowest frequencies are used
_FLIP_SIGN = np.where(np.arange(8) % 2 == 1, -1.0, 1.0)[None, :]  # odd horizontal freqs


def pack_bits(bits: np.ndarray) -> int:
    """64 booleans (row-major) -> int, first bit most significant."""
    return int(np.packbits(bits.reshape(64)).view(">u8")[0])


def pack_rows(bits: np.ndarray) -> tuple[int, ...]:
    """(N, 64) booleans -> N ints, as `pack_bits` of each row (one packing call)."""
    return tuple(int(x) for x in np.packbits(bits, axis=1).view(">u8").reshape(-1))


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


def content_hash(img: Image.Image, seed: int = 0, pixels: np.ndarray | None = None) -> bytes:
    """16 bytes of SHA-1 over the seed, the size and the RGB pixels (SHA-1 is about twice as
    fast as BLAKE2b here; an exact-duplicate key needs no more than accidental-collision
    resistance). `pixels`: `img`'s RGB bytes as a contiguous (H, W, 3) array, when the decoder
    made them (hashed in place, no `tobytes` copy)."""
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    h = hashlib.sha1(key_bytes(seed))
    h.update(f"{rgb.width}x{rgb.height}".encode())
    h.update(rgb.tobytes() if pixels is None else pixels)
    return h.digest()[:16]


#: crop hashes: window size as a share of width and height, and the window offsets (shares)
CROP_SCALE = 0.9
_GRID = (0.0, (1.0 - CROP_SCALE) / 2, 1.0 - CROP_SCALE)
_BASE = 64  # side of the thumbnail the crop hashes come from


def _windows(side: int) -> list[tuple[float, float, float, float]]:
    """The whole picture, then the 9 crop windows, as PIL boxes on a side x side thumbnail."""
    c = CROP_SCALE * side
    boxes = [(0.0, 0.0, float(side), float(side))]
    boxes += [(x * side, y * side, x * side + c, y * side + c) for y in _GRID for x in _GRID]
    return boxes


_BOXES = _windows(_BASE)


def _area_matrix(lo: float, hi: float, n_out: int, n_in: int) -> np.ndarray:
    """(n_out, n_in) weights averaging [lo, hi) of n_in source pixels into n_out (BOX filter
    with fractional edges: weight = overlap of output cell and source pixel, rows sum to 1)."""
    edges = np.linspace(lo, hi, n_out + 1)
    src = np.arange(n_in)
    w = np.clip(
        np.minimum(edges[1:, None], src[None, :] + 1) - np.maximum(edges[:-1, None], src), 0, None
    )
    return w / w.sum(1, keepdims=True)


_ROWS = np.stack([_area_matrix(b[1], b[3], 32, _BASE) for b in _BOXES])  # (10, 32, 64)
_COLS_T = np.stack([_area_matrix(b[0], b[2], 32, _BASE).T for b in _BOXES])  # (10, 64, 32)


def base_thumbnail(rgb: Image.Image) -> Image.Image:
    """64 x 64 RGB BOX thumbnail (aspect not kept), via an integer `reduce` first."""
    k = max(1, min(rgb.width, rgb.height) // (2 * _BASE))
    small = rgb.reduce(k) if k > 1 else rgb
    return small.resize((_BASE, _BASE), Image.Resampling.BOX)


def crop_hashes(base: Image.Image) -> tuple[tuple[int, ...], bytes]:
    """pHashes of the whole thumbnail and its 9 crop windows (10 ints), and a 32 x 32 colour
    thumbnail (3,072 bytes, for `crop_similarity`), from a `base_thumbnail`."""
    grey = np.asarray(base.convert("L"), dtype=np.float64)  # (64, 64)
    g32 = _ROWS @ grey @ _COLS_T  # (10, 32, 32): each window area-averaged to 32 x 32
    low = (_DCT8 @ g32 @ _DCT8.T).reshape(len(_BOXES), 64)  # (10, 8, 8) -> (10, 64)
    bits = low > np.median(low, axis=1)[:, None]
    small = base.resize((_SMALL, _SMALL), Image.Resampling.BOX).tobytes()
    return pack_rows(bits), small


_SMALL = 32  # side of the colour thumbnail kept for crop verification


def crop_similarity(larger: bytes, smaller: bytes, k: int) -> float:
    """Best colour correlation of the smaller picture's 16 x 16 thumbnail with a crop window
    of the larger one, searched on a 5 x 5 grid of offsets (step 1.25%) around window k's
    (both given as their 32 x 32 colour thumbnails)."""
    big = Image.frombytes("RGB", (_SMALL, _SMALL), larger)
    small = Image.frombytes("RGB", (_SMALL, _SMALL), smaller).resize((16, 16), Image.Resampling.BOX)
    y = np.frombuffer(small.tobytes(), np.uint8).astype(np.float32)
    y -= y.mean()
    x0, y0 = _BOXES[k][0] / _BASE, _BOXES[k][1] / _BASE
    side, best = CROP_SCALE * _SMALL, -1.0
    steps = (-0.025, -0.0125, 0.0, 0.0125, 0.025)
    for dy in steps:
        for dx in steps:
            ox = min(max(x0 + dx, 0.0), 1.0 - CROP_SCALE) * _SMALL
            oy = min(max(y0 + dy, 0.0), 1.0 - CROP_SCALE) * _SMALL
            win = big.resize((16, 16), Image.Resampling.BOX, box=(ox, oy, ox + side, oy + side))
            x = np.frombuffer(win.tobytes(), np.uint8).astype(np.float32)
            x -= x.mean()
            den = float(np.sqrt((x @ x) * (y @ y)))
            best = max(best, float(x @ y) / den if den > 0 else float(np.array_equal(x, y)))
    return best


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
    crops: tuple[int, ...] = ()
    """pHash of the whole 64x64 thumbnail, then of its 9 crop windows (`crop_hashes`)"""
    small: bytes = b""
    """32x32 RGB thumbnail (3,072 bytes): verifies crop candidates (`crop_similarity`)"""


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


def image_hashes(img: Image.Image, seed: int = 0, pixels: np.ndarray | None = None) -> ImageHashes:
    """Hashes of a decoded image (imagehash's grey conversion: PIL mode 'L' of the picture).
    `pixels`: the RGB image's bytes as an (H, W, 3) array when the decoder has them."""
    grey = img.convert("L")
    p, pm = phash_bits(np.asarray(grey.resize((32, 32), Image.Resampling.LANCZOS)))
    d, dm = dhash_bits(np.asarray(grey.resize((9, 8), Image.Resampling.LANCZOS)))
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    base = base_thumbnail(rgb)  # (64, 64) RGB: the colour thumbnail and the crop hashes
    thumb = base.resize((16, 16), Image.Resampling.BOX).tobytes()
    crops, small = crop_hashes(base)
    return ImageHashes(
        content_hash(rgb, seed, pixels), p, pm, d, dm, img.width, img.height, thumb, crops, small
    )
