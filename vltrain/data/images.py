"""Robust image decoding and text validation: every undecodable input becomes a `BadSample`.

A training run must never crash on one bad file and never train on garbage silently. So
`load_image` either returns a clean (3, S, S) float tensor in [0, 1] or raises `BadSample` with
one of the fixed `REASONS`; the dataset turns that into a marker dict that collate drops and the
`BadSampleTracker` counts.

Decoding rules:

- The decompression-bomb check reads width x height from the header (``Image.open`` decodes no
  pixels) and rejects images above ``max_pixels`` before any decoding. Pillow's own hard limit
  (``2 * Image.MAX_IMAGE_PIXELS``) still applies on top and is reported the same way.
- Truncated files are detected by fully loading the pixels. This relies on Pillow's global
  ``ImageFile.LOAD_TRUNCATED_IMAGES`` being False (its default); if some other code switched it
  on, truncated files would decode as grey padding, so `load_image` refuses to run.
- EXIF orientation is applied. Alpha (RGBA, LA, PA, P with transparency) is composited over
  white. CMYK, palette, 1-bit and grayscale become RGB. 16-bit grayscale (``I;16*``) is scaled
  by its true range (65535 -> 1.0, 32768 -> ~0.5), never clipped at 255.
- `load_image` resizes with Pillow BICUBIC straight to ``size x size`` (a square resize that
  does not keep the aspect ratio; the synthetic and COCO-style data this library trains on is
  fine with that). Callers with their own resize rules use `load_image_native`.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import numpy as np
import torch
from PIL import ExifTags, Image, ImageFile, ImageOps

from vltrain.core.files import file_version

# Fixed, ordered list of bad-sample reasons; ranks all-reduce counts in this order.
REASONS: tuple[str, ...] = (
    "missing",
    "empty_file",
    "not_image",
    "truncated",
    "corrupt",
    "decompression_bomb",
    "bad_text",
    "path_escape",
)

DEFAULT_MAX_PIXELS = 64_000_000

# Magic numbers of formats Pillow decodes: a file that starts like an image but does not open is
# `corrupt`; one that does not even start like an image is `not_image`.
_MAGIC: tuple[bytes, ...] = (
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",
    b"GIF87a",
    b"GIF89a",
    b"BM",
    b"II*\x00",
    b"MM\x00*",
    b"RIFF",
    b"\x00\x00\x01\x00",
)


class BadSample(Exception):
    """A sample that cannot be used; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, path: str | os.PathLike[str] = "", detail: str = "") -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown bad-sample reason {reason!r}; use one of {REASONS}")
        self.reason = reason
        self.path = str(path)
        self.detail = detail
        super().__init__(f"{reason}: {self.path}" + (f" ({detail})" if detail else ""))


def check_text(text: object, path: str | os.PathLike[str] = "") -> str:
    """Return `text` stripped of surrounding whitespace, or raise BadSample("bad_text").

    Accepts str, or bytes that decode as UTF-8. Rejects other types, empty or whitespace-only
    text, and strings holding lone surrogates (what invalid UTF-8 read with surrogateescape
    becomes). `path` only labels the error.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadSample("bad_text", path, f"bytes are not valid UTF-8: {e}") from None
    if not isinstance(text, str):
        raise BadSample("bad_text", path, f"text must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadSample("bad_text", path, "text holds invalid UTF-8 (lone surrogates)") from None
    stripped = text.strip()
    if not stripped:
        raise BadSample("bad_text", path, f"text is empty or whitespace only: {text!r}")
    return stripped


def _open_checked(
    path: str | os.PathLike[str],
    max_pixels: int,
    draft_size: int | None = None,
    data: bytes | None = None,
) -> Image.Image:
    """Open, bomb-check, fully decode, EXIF-orient and mode-normalise an image.

    `data`, when given, holds the encoded image (e.g. a tar member) and `path` only labels it.
    Returns 8-bit "RGB", or "F" in [0, 1] for high-bit-depth grayscale; raises BadSample.
    """
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True, so truncated images would decode as "
            "grey padding and train silently. Find the code that sets it and remove that line."
        )
    p = str(path)
    if data is not None:
        return _decode_checked(io.BytesIO(data), p, len(data), data[:16], max_pixels, draft_size)
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
            # opening a FIFO blocks until a writer comes: training would hang forever
            raise BadSample("not_image", p, "not a regular file (a FIFO, device or socket)")
        size = st.st_size
        with open(p, "rb") as f:
            head = f.read(16)
    except (FileNotFoundError, NotADirectoryError):
        raise BadSample("missing", p, "file does not exist") from None
    except IsADirectoryError:
        raise BadSample("not_image", p, "path is a directory") from None
    except (OSError, ValueError) as e:
        raise BadSample("missing", p, f"cannot read: {e}") from None
    return _decode_checked(p, p, size, head, max_pixels, draft_size)


def _decode_checked(
    source: str | io.BytesIO,
    p: str,
    size: int,
    head: bytes,
    max_pixels: int,
    draft_size: int | None,
) -> Image.Image:
    """`_open_checked` after the bytes are known to exist: `size` and the first bytes `head`."""
    if size == 0:
        raise BadSample("empty_file", p, "file has 0 bytes")
    try:
        img = Image.open(source)
    except Image.DecompressionBombError as e:
        raise BadSample("decompression_bomb", p, str(e)) from None
    except Exception as e:  # UnidentifiedImageError, SyntaxError, struct.error, ...
        reason = "corrupt" if head.startswith(_MAGIC) else "not_image"
        raise BadSample(reason, p, f"cannot identify image: {type(e).__name__}: {e}") from None
    try:
        _decode(img, p, max_pixels, draft_size)
        try:  # exif_transpose copies the whole picture even when there is nothing to turn
            turned = img.getexif().get(ExifTags.Base.Orientation, 1) != 1
            oriented = ImageOps.exif_transpose(img) if turned else img
        except Exception:
            oriented = img  # malformed EXIF: keep the pixels, skip the rotation
        return _to_rgb_or_float(oriented)
    except BadSample:
        img.close()
        raise
    except Exception as e:  # e.g. a mode Pillow cannot convert to RGB
        img.close()
        raise BadSample("corrupt", p, f"cannot convert {img.mode} image: {e}") from None


def _decode(img: Image.Image, p: str, max_pixels: int, draft_size: int | None) -> None:
    """Bomb check from the header, then decode every pixel (this is what detects truncation)."""
    w, h = img.size
    if w * h > max_pixels:
        raise BadSample(
            "decompression_bomb", p, f"{w}x{h} = {w * h} pixels > max_pixels={max_pixels}"
        )
    if w == 0 or h == 0:
        raise BadSample("corrupt", p, f"image has zero size {w}x{h}")
    if draft_size is not None and img.format == "JPEG":
        # DCT-domain downscale (by 2, 4 or 8) while keeping both sides >= draft_size.
        img.draft(img.mode, (draft_size, draft_size))
    try:
        img.load()
    except Image.DecompressionBombError as e:
        raise BadSample("decompression_bomb", p, str(e)) from None
    except Exception as e:  # decoders raise OSError, SyntaxError, ValueError, EOFError, ...
        msg = str(e)
        reason = "truncated" if "truncated" in msg or isinstance(e, EOFError) else "corrupt"
        raise BadSample(reason, p, f"{type(e).__name__}: {msg}") from None


def _to_rgb_or_float(img: Image.Image) -> Image.Image:
    """Normalise any mode to 8-bit "RGB", or to "F" in [0, 1] for >8-bit grayscale."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        arr = np.asarray(img, dtype=np.float64)  # (H, W)
        scale = _high_bit_scale(img, arr)
        arr = np.clip(arr / scale, 0.0, 1.0).astype(np.float32)
        return Image.fromarray(arr, mode="F")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    elif mode in ("LA", "La", "PA", "RGBa"):
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, img).convert("RGB")
    return img.convert("RGB")


def _high_bit_scale(img: Image.Image, arr: np.ndarray) -> float:
    """The value that means "full white" for a high-bit-depth grayscale image."""
    if img.mode.startswith("I;16"):
        return 65535.0
    if img.mode == "F":
        peak = float(arr.max()) if arr.size else 1.0
        return max(peak, 1.0)
    tags = getattr(img, "tag_v2", None)  # TIFF: BitsPerSample
    bits = tags.get(258) if tags is not None else None
    if isinstance(bits, tuple) and bits:
        bits = bits[0]
    if isinstance(bits, int) and 1 <= bits <= 32:
        return float(2**bits - 1)
    peak = float(arr.max()) if arr.size else 0.0
    if peak <= 255:
        return 255.0
    return 65535.0 if peak <= 65535 else float(2**32 - 1)


def load_image_native(
    path: str | os.PathLike[str],
    max_pixels: int = DEFAULT_MAX_PIXELS,
    data: bytes | None = None,
) -> Image.Image:
    """Decode an image at its native size as an 8-bit RGB PIL image, or raise BadSample.

    For callers that resize themselves (HF processors, image-token budgets). High-bit-depth
    grayscale is scaled to 8 bits by its true range. `data`: encoded bytes (`path` labels them).
    """
    img = _open_checked(path, max_pixels, data=data)
    if img.mode == "F":
        arr = np.asarray(img, dtype=np.float32)  # (H, W) in [0, 1]
        img = Image.fromarray(np.round(arr * 255.0).astype(np.uint8), mode="L").convert("RGB")
    return img


def decode_image_array(
    path: str | Path,
    size: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    data: bytes | None = None,
) -> np.ndarray:
    """Decode and resize (square BICUBIC) to a (3, size, size) array: uint8 for 8-bit images,
    float32 in [0, 1] for high-bit-depth grayscale. `image_tensor` turns it into the float
    tensor `load_image` returns; `DecodedImages` keeps these arrays (4x smaller than floats).

    Raises BadSample with a reason from `REASONS` for any input that cannot be used.
    """
    if size <= 0:
        raise ValueError(f"image size must be positive, got {size}")
    img = _open_checked(path, max_pixels, draft_size=size, data=data)
    if img.mode == "F":
        small = img.resize((size, size), Image.Resampling.BICUBIC)
        arr = np.clip(np.asarray(small, dtype=np.float32), 0.0, 1.0)  # (S, S)
        return np.repeat(arr[None], 3, axis=0)  # (3, S, S)
    if img.size != (size, size):
        img = img.resize((size, size), Image.Resampling.BICUBIC)
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))  # (3, S, S)


def image_tensor(arr: np.ndarray) -> torch.Tensor:
    """A `decode_image_array` result as a (3, S, S) float32 tensor in [0, 1] (a new array)."""
    if arr.dtype != np.uint8:
        return torch.from_numpy(arr.copy())
    # numpy, not torch ops: a strided torch cast spins up intra-op threads in every loader
    # worker and was ~10x slower than this on a busy 2-core machine.
    return torch.from_numpy(np.divide(arr, np.float32(255.0), dtype=np.float32, order="C"))


def load_image(
    path: str | Path,
    size: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    data: bytes | None = None,
) -> torch.Tensor:
    """Decode, resize (square BICUBIC) and return a (3, size, size) float32 tensor in [0, 1].

    Raises BadSample with a reason from `REASONS` for any input that cannot be used. `data`:
    the encoded bytes (a tar member), in which case `path` only labels errors.
    """
    return image_tensor(decode_image_array(path, size, max_pixels, data))


class DecodedImages:
    """Decoded images kept in memory up to a byte budget, so later epochs skip decoding.

    One per record file and process (`shared`: the stages of one pipeline process reuse it;
    each DataLoader worker fills its own copy). Keys are the record's image value and size;
    only images that decoded cleanly are kept, so a bad file is checked and counted again
    every time it is drawn. Once the budget is full, further images are decoded every time as
    usual. Image files are assumed unchanged while the process runs.
    """

    #: (resolved record file, size, mtime_ns) -> its cache; the newest few record files
    _registry: dict[tuple[str, int | None, int | None], DecodedImages] = {}
    KEEP = 4

    @classmethod
    def shared(cls, records: str | os.PathLike[str], budget_mb: float) -> DecodedImages:
        """The process's cache for the record file `records` (a new one once the file
        changes); its budget grows to the largest asked for."""
        key = file_version(records)
        if key[1] is None:  # no such file: nothing to share
            return cls(budget_mb)
        cache = cls._registry.pop(key, None)
        if cache is None:
            for old in [k for k in cls._registry if k[0] == key[0]]:  # an older version
                del cls._registry[old]
            cache = cls(budget_mb)
        cache.budget = max(cache.budget, int(budget_mb * 2**20))
        cls._registry[key] = cache  # newest last
        while len(cls._registry) > cls.KEEP:
            del cls._registry[next(iter(cls._registry))]
        return cache

    def __init__(self, budget_mb: float) -> None:
        self.budget = int(budget_mb * 2**20)
        self.used = 0
        self.arrays: dict[object, np.ndarray] = {}

    def get(self, key: object) -> np.ndarray | None:
        """The stored array of `key`, or None."""
        return self.arrays.get(key)

    def put(self, key: object, arr: np.ndarray) -> None:
        """Keep `arr` (read-only) while it fits the budget."""
        if key in self.arrays or self.used + arr.nbytes > self.budget:
            return
        arr.flags.writeable = False
        self.arrays[key] = arr
        self.used += arr.nbytes
