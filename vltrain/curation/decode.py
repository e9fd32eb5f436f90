"""Decoding for the image-hashing stage: exactly the pixels `load_image_native` gives, faster.

Pillow decodes an 8-bit PNG at ~4.7 ns per byte of raw pixels (half zlib inflate, half its
scalar un-filtering); libspng (the optional `pyspng` package) does the same work in ~65% of the
time. PNG is lossless, so any correct decoder returns the same bytes; what can differ is
everything around the pixels. The fast path therefore takes only the plain case, checked from
the chunk list before anything is decoded: non-interlaced 8-bit grey or RGB, and no chunk that
changes what `load_image_native` returns (transparency, palette, EXIF or XMP orientation,
animation, compressed text Pillow would size-check, an unknown chunk). A bad CRC, a missing
IEND, a too-large picture, a decoder error or an unexpected shape all fall back to the Pillow
path, which gives its usual result or `BadSample`; the file is read once either way.
`tests/curation/test_decode.py` checks both paths give the same pixels, and
`test_image_features_pinned.py` that the hashes did not change.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from vltrain.data.images import DEFAULT_MAX_PIXELS, load_image_native

try:
    import pyspng
except ImportError:  # optional: `pip install vltrain[curate]`; Pillow decodes everything then
    pyspng = None

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: chunks that leave the decoded pixels and `load_image_native`'s result alone
_PLAIN_CHUNKS = frozenset(
    (b"IHDR", b"IDAT", b"IEND", b"sRGB", b"gAMA", b"cHRM", b"pHYs", b"tIME", b"iCCP", b"tEXt")
)
#: text keywords Pillow reads an orientation from (`Image.getexif`)
_ORIENTATION_TEXT = (b"Raw profile type exif", b"XML:com.adobe.xmp", b"xmp")
_COLOUR_TYPES = {0: 1, 2: 3}  # PNG colour type -> channels: grey, RGB
_MAX_TEXT = 1 << 16  # longer tEXt chunks go the Pillow way (it caps text sizes)


@dataclass(frozen=True)
class Decoded:
    """An RGB picture, and its pixels as a C-contiguous (H, W, 3) uint8 array when the fast
    path made them (`image.tobytes()` equals `pixels.tobytes()`; saves the copy)."""

    image: Image.Image
    pixels: np.ndarray | None = None


def plain_png_shape(
    data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[int, int, int] | None:
    """(height, width, channels) when `data` is a PNG the fast path may decode, else None."""
    if not data.startswith(_SIGNATURE) or len(data) < 33:
        return None
    pos, shape, end = 8, None, len(data)
    while pos + 12 <= end:
        n, kind = struct.unpack_from(">I4s", data, pos)
        body_end = pos + 8 + n
        if kind not in _PLAIN_CHUNKS or body_end + 4 > end:
            return None
        if kind != b"IDAT":  # Pillow checks these CRCs (a mismatch is a broken file)
            crc = zlib.crc32(data[pos + 4 : body_end])
            if crc != struct.unpack_from(">I", data, body_end)[0]:
                return None
        if kind == b"IHDR":
            if pos != 8 or n != 13:
                return None
            w, h, depth, colour, comp, filt, interlace = struct.unpack_from(">IIBBBBB", data, 16)
            if depth != 8 or colour not in _COLOUR_TYPES or comp or filt or interlace:
                return None
            if not 0 < w * h <= min(max_pixels, Image.MAX_IMAGE_PIXELS or max_pixels):
                return None
            shape = (h, w, _COLOUR_TYPES[colour])
        elif kind == b"tEXt":
            if n > _MAX_TEXT or data[pos + 8 : body_end].split(b"\0", 1)[0] in _ORIENTATION_TEXT:
                return None
        elif kind == b"IEND":
            return shape
        pos = body_end + 4
    return None  # no IEND: truncated, let Pillow name it


def decode_rgb(path: Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> Decoded:
    """`load_image_native(path)` (same pixels, same `BadSample`s), decoding plain PNGs with
    libspng when it is installed."""
    if pyspng is None:
        return Decoded(load_image_native(path, max_pixels))
    try:
        data = path.read_bytes()
    except OSError:
        return Decoded(load_image_native(path, max_pixels))  # names the reason
    shape = plain_png_shape(data, max_pixels)
    pixels = _spng(data, shape) if shape is not None else None
    if pixels is None:  # not a plain PNG: Pillow decodes the bytes already read
        return Decoded(load_image_native(path, max_pixels, data=data))
    size = (shape[1], shape[0])
    if shape[2] == 1:  # grey: Pillow's own L -> RGB conversion, as the slow path does
        grey = Image.frombuffer("L", size, pixels, "raw", "L", 0, 1)
        return Decoded(grey.convert("RGB"))
    return Decoded(Image.frombuffer("RGB", size, pixels, "raw", "RGB", 0, 1), pixels)


def _spng(data: bytes, shape: tuple[int, int, int]) -> np.ndarray | None:
    """(H, W, C) uint8 pixels from libspng, or None on any decoder complaint."""
    try:
        arr = pyspng.load(data)
    except Exception:  # spng's own errors: the Pillow path decides what the file is
        return None
    arr = arr.reshape(arr.shape[0], arr.shape[1], -1)
    if arr.dtype != np.uint8 or arr.shape != shape or not arr.flags.c_contiguous:
        return None
    return arr
